"""The probe's path check (run on every node inside the container): which paths runtime.yaml names,
and what it says about each one that is not there."""
from __future__ import annotations

from pathlib import Path

from rlc.compiler.api import check
from rlc.compiler.bundle import build_bundle
from rlc.runtime.probe import JobPath, job_paths, path_problems

E2E_RECIPE = Path(__file__).resolve().parents[1] / "slurm" / "recipes" / "e2e-2node.yaml"


def test_job_paths_are_the_ones_the_compiler_checks(tmp_path):
    result = check(E2E_RECIPE, [
        f"cluster.log_dir={tmp_path}/logs", "data.train=/d/train.jsonl", "data.val=/d/val.jsonl",
        "model.checkpoint=/m/ckpt", "model.tokenizer=Qwen/Qwen3-0.6B", "checkpointing.dir=/c/run",
        'reward.kwargs={"table": "/r/t.json", "n": 3}'])
    assert result.ok, result.errors
    bundle = build_bundle(result, tmp_path / "b")
    got = [(p.key, p.path, p.writes) for p in job_paths(bundle.path / "runtime.yaml")]
    assert got == [("data.train", "/d/train.jsonl", False), ("data.val", "/d/val.jsonl", False),
                   ("model.checkpoint", "/m/ckpt", False), ("checkpointing.dir", "/c/run", True),
                   ("logging.dir", f"{tmp_path}/logs/metrics/rlc-e2e-2node", True),
                   ("reward.kwargs.table", "/r/t.json", False)]


def test_path_problems_name_the_key_and_what_is_wrong(tmp_path):
    (tmp_path / "t.jsonl").write_text("{}\n")
    (tmp_path / "afile").write_text("")
    paths = [JobPath("data.train", str(tmp_path / "t.jsonl"), False, True),
             JobPath("data.val", str(tmp_path / "missing.jsonl"), False, True),
             JobPath("model.checkpoint", str(tmp_path / "t.jsonl"), False, False),
             JobPath("checkpointing.dir", str(tmp_path / "new" / "deeper"), True, False),
             JobPath("logging.dir", str(tmp_path / "afile" / "metrics"), True, False)]
    assert path_problems(paths) == [
        f"data.val: {tmp_path}/missing.jsonl does not exist here (a missing mount?)",
        f"model.checkpoint: {tmp_path}/t.jsonl is not a readable folder",
        (f"logging.dir: cannot write {tmp_path}/afile/metrics here ({tmp_path}/afile is not a folder this user "
         "can write; a missing or read-only mount?)")]
