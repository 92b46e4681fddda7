"""Every path the job reads or writes inside the container is checked against the container's mounts
(and the image's own folders): an error names the key, the path and the mount line that would cover
it, and that line, added as it is, makes the recipe pass."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from bundle_helpers import E2E_RECIPE, REPO

from rlc.compiler.api import check
from rlc.compiler.bundle import BundleError, build_bundle
from rlc.compiler.recipe import shipped_recipe_names, shipped_recipe_path

CONFIG = REPO / "rlc" / "recipes" / "models" / "tiny-qwen3" / "config.json"
PYXIS = ("cluster.container.runtime=pyxis", "cluster.container.image=nvcr.io/nvidia/nemo-rl:v0.6.0",
         "model.checkpoint=Qwen/Qwen3-0.6B")  # a Hub id: fetched by the job, no mount needed


def errors(tmp_path, *sets: str) -> dict[str, str]:
    result = check(E2E_RECIPE, [f"cluster.log_dir={tmp_path}/logs", *PYXIS, *sets])
    return {d.path: d.message for d in result.errors}


def fix_of(message: str) -> str:
    return re.search(r"add `([^`]+)` to cluster\.container\.mounts", message).group(1)


def rlc(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlc.compiler.cli", *argv], capture_output=True, text=True,
                          timeout=120, check=False, cwd=cwd)


def test_an_unmounted_data_file_fails_validate_naming_the_key_and_the_mount_that_fixes_it(tmp_path):
    (tmp_path / "r.yaml").write_text(
        f"version: 1\nextends: {E2E_RECIPE}\nmodel: {{checkpoint: Qwen/Qwen3-0.6B, config: {CONFIG}}}\n"
        f"cluster: {{log_dir: {tmp_path}/logs, container: {{runtime: pyxis, image: nvcr.io/nvidia/nemo-rl:v0.6.0}}}}\n"
        "data: {train: /lustre/sets/math/train.jsonl}\n")
    r = rlc("validate", "r.yaml", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("r.yaml:5:8: data.train: the job reads /lustre/sets/math/train.jsonl, which no mount puts in the "
            "container, so the job would not find it; add `/lustre/sets/math:/lustre/sets/math:ro` to "
            "cluster.container.mounts") in r.stderr, r.stderr
    assert "or add /lustre/sets/math to cluster.container.image_paths if the image holds it" in r.stderr
    # the line the error names, added as it is, is the fix
    r = rlc("validate", "r.yaml", "--set", 'cluster.container.mounts=["/lustre/sets/math:/lustre/sets/math:ro"]',
            cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    # and compile refuses the unmounted recipe before writing anything
    r = rlc("compile", "r.yaml", "-o", "bundle", cwd=tmp_path)
    assert r.returncode == 1 and "data.train: the job reads" in r.stderr and not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("sets,key,words", [
    (["data.val=/sets/val/v.jsonl"], "data.val", "add `/sets/val:/sets/val:ro`"),
    (["model.checkpoint=/models/qwen3"], "model.checkpoint", "the job reads /models/qwen3,"),
    (["model.tokenizer=/models/tok"], "model.tokenizer", "add `/models/tok:/models/tok:ro`"),
    (["checkpointing.dir=/ckpt/run1"], "checkpointing.dir",
     ("the job writes /ckpt/run1, which no mount puts in the container, so what it writes would stay inside the "
      "container and be lost when the job ends; add `/ckpt/run1:/ckpt/run1` to")),
    (["logging.dir=/metrics/run1"], "logging.dir", "add `/metrics/run1:/metrics/run1` to"),
    (["cluster.env.PYTHONPATH=/code/rewards:$PYTHONPATH", "reward.function=my_rewards:score"],
     "cluster.env.PYTHONPATH", "the job reads /code/rewards,"),
    (['reward.kwargs={"lookup": {"table": "/refs/answers.json"}}'], "reward.kwargs.lookup.table",
     "add `/refs:/refs:ro`"),
])
def test_each_path_the_job_uses_is_checked(tmp_path, sets, key, words):
    found = errors(tmp_path, "data.train=/data/t.jsonl", 'cluster.container.mounts=["/data:/data:ro"]', *sets)
    assert list(found) == [key] and words in found[key], found
    fixed = errors(tmp_path, "data.train=/data/t.jsonl",
                   f'cluster.container.mounts=["/data:/data:ro", "{fix_of(found[key])}"]', *sets)
    assert fixed == {}, fixed


def test_what_the_bundle_mounts_itself_and_hub_ids_need_nothing(tmp_path):
    # default checkpoint and metrics folders live in cluster.log_dir, which the bundle mounts; a Hub id
    # checkpoint, a built-in reward, a relative or $-expanded PYTHONPATH entry name no container path
    ok = ["data.train=/data/t.jsonl", 'cluster.container.mounts=["/data:/data:ro"]', "model.tokenizer=Qwen/Qwen3-0.6B",
          f"logging.dir={tmp_path}/logs/metrics", "cluster.env.PYTHONPATH=$HOME/lib:src", "reward.function=math",
          'reward.kwargs={"sep": "/", "note": "/ not a path"}']
    assert errors(tmp_path, *ok) == {}
    assert errors(tmp_path, *ok, "checkpointing.enabled=false", "checkpointing.dir=/nowhere") == {}
    assert list(errors(tmp_path, *ok, "checkpointing.dir=/nowhere")) == ["checkpointing.dir"]


def test_runtime_none_checks_nothing_and_ignores_image_paths(tmp_path):
    result = check(E2E_RECIPE, [f"cluster.log_dir={tmp_path}/logs", "data.train=/nowhere/t.jsonl",
                                "checkpointing.dir=/nowhere/ckpt", 'cluster.container.image_paths=["/opt"]'])
    assert result.ok, result.errors
    assert any(d.path == "cluster.container.image_paths" and d.severity == "warning" and "ignored" in d.message
               for d in result.diagnostics)


def test_image_paths_cover_reads_but_never_writes(tmp_path):
    assert errors(tmp_path, "data.train=/opt/data/t.jsonl", 'cluster.container.image_paths=["/opt/data"]') == {}
    found = errors(tmp_path, "data.train=/opt/data/t.jsonl", 'cluster.container.image_paths=["/opt"]',
                   "checkpointing.dir=/opt/ckpt")
    assert list(found) == ["checkpointing.dir"], found
    assert (
        "the job writes /opt/ckpt, inside cluster.container.image_paths[0] (/opt, a folder of the image): what "
        "it writes there is lost when the container ends and other nodes never see it"
    ) in found["checkpointing.dir"]


def test_writes_into_a_read_only_mount_fail(tmp_path):
    found = errors(tmp_path, "data.train=/lustre/t.jsonl", 'cluster.container.mounts=["/lustre:/lustre:ro"]',
                   "checkpointing.dir=/lustre/ckpt")
    assert ("checkpointing.dir: the job writes /lustre/ckpt, inside cluster.container.mounts[0] "
            "(`/lustre:/lustre:ro`), which is read-only") in "checkpointing.dir: " + found["checkpointing.dir"]
    # a writable mount nested in the read-only one is what the container shows there
    assert errors(tmp_path, "data.train=/lustre/t.jsonl", "checkpointing.dir=/lustre/ckpt",
                  'cluster.container.mounts=["/lustre:/lustre:ro", "/scratch/ckpt:/lustre/ckpt"]') == {}


def test_a_mount_over_an_image_folder_hides_it(tmp_path):
    found = errors(tmp_path, "data.train=/opt/data/t.jsonl", 'cluster.container.image_paths=["/opt/data"]',
                   'cluster.container.mounts=["/lustre/opt:/opt"]')
    assert "cluster.container.mounts[0]" in found, found
    assert "mounts over /opt, which hides the image's own /opt/data" in found["cluster.container.mounts[0]"]


def test_relative_paths_in_a_container_are_errors(tmp_path):
    found = errors(tmp_path, "data.train=data/train.jsonl", "model.checkpoint=./ckpt")
    assert set(found) == {"data.train", "model.checkpoint"}
    assert ("'data/train.jsonl' is a relative path, and in the container the job runs from the bundle's folder"
            in found["data.train"])


def test_a_folder_no_mount_list_can_name_gets_a_mountable_parent(tmp_path):
    found = errors(tmp_path, "data.train=/lustre/my sets/t.jsonl")
    assert "add `/lustre:/lustre:ro` to cluster.container.mounts" in found["data.train"], found


def test_build_bundle_refuses_an_unmounted_path_itself(tmp_path):
    # the writer checks the paths too (not only `rlc validate`), so no caller can write such a bundle
    result = check(E2E_RECIPE, [f"cluster.log_dir={tmp_path}/logs", *PYXIS])
    assert not result.ok
    result.diagnostics = [d for d in result.diagnostics if d.severity != "error"]  # a caller that ignored them
    with pytest.raises(BundleError, match="data.train: the job reads /nonexistent/train.jsonl"):
        build_bundle(result, tmp_path / "bundle")


def test_every_shipped_recipe_mounts_what_it_uses_and_the_tiny_gpu_recipes_run_without_a_container(tmp_path):
    names = shipped_recipe_names()
    for name in names:
        result = check(shipped_recipe_path(name), [f"cluster.log_dir={tmp_path}/logs"])
        assert not [d for d in result.errors if "mount" in d.message], (name, result.errors)
        runtime = result.recipe.cluster.container.runtime
        assert (runtime == "none") == name.startswith("tiny-"), (name, runtime)
    data = json.loads((REPO / "rlc" / "schemas" / "recipe.schema.json").read_text())
    assert data["properties"]["cluster"]["properties"]["container"]["properties"]["image_paths"]["default"] == []
