"""build_bundle: files, lock, atomic writing, --force, the bundle's own rlc, recipe checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bundle_helpers import REPO, compile_recipe
from rlc.compiler.bundle import BUNDLE_FILES, BundleError
from rlc.compiler.bundle.lock import sha256_file


def _set(tmp_path, *extra):
    return [f"cluster.log_dir={tmp_path}/logs", *extra]


def test_bundle_files_and_lock(tmp_path, e2e_recipe):
    out = tmp_path / "b"
    res = compile_recipe(e2e_recipe, out, _set(tmp_path, "grpo.max_steps=2"))
    assert res.path == out
    assert set(BUNDLE_FILES) <= {p.name for p in out.iterdir()}
    assert (out / "rlc_pkg" / "rlc" / "__init__.py").is_file()
    assert os.access(out / "launch.sbatch", os.X_OK) and os.access(out / "node.sh", os.X_OK)
    lock = json.loads((out / "bundle.lock.json").read_text())
    assert lock["rlc_bundle"] == 1 and lock["recipe"]["overrides"] == _set(tmp_path, "grpo.max_steps=2")
    assert lock["recipe"]["files"] == [{"path": str(e2e_recipe), "sha256": sha256_file(e2e_recipe)}]
    assert lock["container"] == {"runtime": "none", "image": None}
    assert lock["log_dir"] == f"{tmp_path}/logs" and (tmp_path / "logs").is_dir()
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"bundle.lock.json"}
    assert set(lock["files"]) == on_disk
    for rel, digest in lock["files"].items():
        assert sha256_file(out / rel) == digest, rel
    assert sorted(res.files) == sorted([*on_disk, "bundle.lock.json"])
    assert (out / "mounts.txt").read_text() == ""  # no container: nothing is mounted
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".b.")]  # no staging leftovers


def test_runtime_yaml_is_the_resolved_config(tmp_path, e2e_recipe):
    from rlc.contract.runtime_config import load_runtime_config

    compile_recipe(e2e_recipe, tmp_path / "b", _set(tmp_path))
    cfg = load_runtime_config(tmp_path / "b" / "runtime.yaml")
    assert cfg.cluster.nodes == 2 and cfg.cluster.world_size == 4 and cfg.name == "rlc-e2e-2node"


def test_bundled_rlc_is_self_contained(tmp_path, e2e_recipe):
    compile_recipe(e2e_recipe, tmp_path / "b", _set(tmp_path))
    pkg = tmp_path / "b" / "rlc_pkg"
    code = ("import rlc, rlc.compiler.api, rlc.compiler.bundle, rlc.contract.runtime_config, rlc.runtime.probe\n"
            "from importlib import resources\n"
            "print(rlc.__file__)\n"
            "print(resources.files('rlc.templates').joinpath('bundle', 'launch.sbatch.j2').is_file())\n"
            "print(resources.files('rlc.schemas').joinpath('recipe.schema.json').is_file())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env={**os.environ, "PYTHONPATH": str(pkg)},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(pkg / "rlc" / "__init__.py"), "True", "True"]


def test_non_bundle_folder_is_never_overwritten(tmp_path, e2e_recipe):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "data.txt").write_text("keep me")
    with pytest.raises(BundleError, match="is not an rlc bundle") as err:
        compile_recipe(e2e_recipe, out, _set(tmp_path), force=True)
    assert err.value.kind == "io" and err.value.exit_code == 2
    assert [p.name for p in out.iterdir()] == ["data.txt"]
    file_target = tmp_path / "afile"
    file_target.write_text("x")
    with pytest.raises(BundleError, match="exists and is not a folder"):
        compile_recipe(e2e_recipe, file_target, _set(tmp_path))


def test_existing_bundle_needs_force_and_is_replaced_whole(tmp_path, e2e_recipe):
    out = tmp_path / "b"
    compile_recipe(e2e_recipe, out, _set(tmp_path))
    (out / "stale.txt").write_text("from an older bundle")
    with pytest.raises(BundleError, match="pass --force") as err:
        compile_recipe(e2e_recipe, out, _set(tmp_path, "grpo.max_steps=3"))
    assert err.value.exit_code == 2
    compile_recipe(e2e_recipe, out, _set(tmp_path, "grpo.max_steps=3"), force=True)
    assert not (out / "stale.txt").exists()
    assert "max_steps: 3" in (out / "runtime.yaml").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "logs"]


def test_empty_folder_is_filled(tmp_path, e2e_recipe):
    (tmp_path / "b").mkdir()
    compile_recipe(e2e_recipe, tmp_path / "b", _set(tmp_path))
    assert (tmp_path / "b" / "launch.sbatch").is_file()


def test_recipe_problem_leaves_nothing_behind(tmp_path, e2e_recipe, capsys):
    from rlc.compiler.cli import main

    code = main(["compile", str(e2e_recipe), "-o", str(tmp_path / "b"),
                 *(f"--set={s}" for s in _set(tmp_path, "cluster.container.runtime=pyxis"))])
    assert code == 1
    assert "cluster.container.image: required with cluster.container.runtime: pyxis" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_build_bundle_refuses_a_bad_cluster_section_it_is_handed(tmp_path, e2e_recipe):
    """build_bundle checks again (a caller may skip rlc.compiler.api.check or change the recipe)."""
    from rlc.compiler.api import check
    from rlc.compiler.bundle import build_bundle
    from rlc.compiler.recipe_types import with_value

    result = check(e2e_recipe, _set(tmp_path))
    result.recipe = with_value(result.recipe, "cluster.container.runtime", "pyxis")
    with pytest.raises(BundleError) as err:
        build_bundle(result, tmp_path / "b")
    assert str(err.value).startswith("cluster.container.image: required with cluster.container.runtime: pyxis")
    assert err.value.key == "cluster.container.image" and err.value.exit_code == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_pyxis_bundle_mounts_user_paths_bundle_and_logs(tmp_path, e2e_recipe):
    out = tmp_path / "b"
    res = compile_recipe(e2e_recipe, out, _set(
        tmp_path, "cluster.container.runtime=pyxis", "cluster.container.image=nvcr.io/nvidia/nemo-rl:v0.6.0",
        'cluster.container.mounts=["/lustre/data:/data:ro", "/scratch/x:/x"]',
        'cluster.shared_fs_roots=["/lustre"]', "data.train=/data/train.jsonl", "model.checkpoint=/x/tiny-qwen3"))
    assert (out / "mounts.txt").read_text().splitlines() == [
        "/lustre/data:/data:ro", "/scratch/x:/x", f"{out}:/opt/rlc-bundle:ro", f"{tmp_path}/logs:{tmp_path}/logs"]
    script = (out / "launch.sbatch").read_text()
    assert f"readonly RLC_MOUNTS=/lustre/data:/data:ro,/scratch/x:/x,{out}:/opt/rlc-bundle:ro," in script
    assert "readonly RLC_IMAGE=nvcr.io/nvidia/nemo-rl:v0.6.0" in script
    assert "export RLC_BUNDLE_MNT=/opt/rlc-bundle" in script
    assert any("cluster.container.mounts[1]: source /scratch/x is outside" in w for w in res.warnings)


def test_sbatch_header(tmp_path, e2e_recipe):
    compile_recipe(e2e_recipe, tmp_path / "b", _set(
        tmp_path, "cluster.gpu_type_gres=h100", "cluster.mem_per_node=500G", "cluster.slurm.partition=batch",
        "cluster.slurm.account=proj", "cluster.slurm.qos=high", "cluster.slurm.reservation=res1",
        "cluster.slurm.exclusive=true", "cluster.slurm.requeue=true", "cluster.slurm.job_name=my job",
        'cluster.slurm.extra_flags=["--constraint=ib&nvlink", "--comment=two words", "--hint=nomultithread"]'))
    header = [line for line in (tmp_path / "b" / "launch.sbatch").read_text().splitlines()
              if line.startswith("#SBATCH")]
    assert header == [
        '#SBATCH --job-name="my job"',
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=h100:2",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --mem=500G",
        "#SBATCH --time=00:10:00",
        "#SBATCH --partition=batch",
        "#SBATCH --account=proj",
        "#SBATCH --qos=high",
        "#SBATCH --reservation=res1",
        "#SBATCH --exclusive",
        f"#SBATCH --output={tmp_path}/logs/slurm-%j.out",
        f"#SBATCH --error={tmp_path}/logs/slurm-%j.out",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        '#SBATCH --constraint="ib&nvlink"',
        '#SBATCH --comment="two words"',
        "#SBATCH --hint=nomultithread",
    ]


@pytest.mark.parametrize("override,message", [
    ('cluster.slurm.extra_flags=["--nodes=4"]',
     "cluster.slurm.extra_flags[0]: --nodes is set by the bundle from cluster.nodes"),
    ('cluster.slurm.extra_flags=["--comment=a\\nb"]',
     "cluster.slurm.extra_flags[0]: '--comment=a\\nb' does not match the required pattern"),  # the schema's
    ('cluster.slurm.job_name="a\\nrm -rf /"', "cluster.slurm.job_name: contains a newline"),
    ("cluster.ray.node_manager_port=23379", "cluster.ray.node_manager_port: port 23379 is also cluster.ray.port"),
    ("cluster.ray.port=23600", "cluster.ray.port: port 23600 lies inside the worker port range 23500-23999"),
    ("cluster.ray.min_worker_port=24000", "cluster.ray.min_worker_port: larger than cluster.ray.max_worker_port"),
    ('cluster.env={"RAY_AUTH_MODE": "disabled"}', "cluster.env.RAY_AUTH_MODE: RAY_AUTH_MODE cannot be set"),
    ("cluster.container.python=python3 -u", "cluster.container.python: must be one word"),
])
def test_unsafe_or_conflicting_values_are_rejected_naming_the_key(tmp_path, e2e_recipe, override, message):
    """Every command's check reports what would stop the bundle writer (not only rlc compile)."""
    from rlc.compiler.api import check

    result = check(e2e_recipe, _set(tmp_path, override))
    key = message.split(":")[0]
    assert not result.ok
    assert [f"{d.path}: {d.message}" for d in result.errors if d.path == key][0].startswith(message), result.errors


def test_relative_log_dir_is_taken_from_the_current_folder(tmp_path, e2e_recipe, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = compile_recipe(e2e_recipe, tmp_path / "b", ["cluster.log_dir=out/logs"])
    assert f"readonly RLC_LOG_ROOT={tmp_path}/out/logs" in (tmp_path / "b" / "launch.sbatch").read_text()
    assert (tmp_path / "out" / "logs").is_dir()
    runtime = (tmp_path / "b" / "runtime.yaml").read_text()
    assert f"log_dir: {tmp_path}/out/logs\n" in runtime
    assert f"dir: {tmp_path}/out/logs/checkpoints/rlc-e2e-2node\n" in runtime
    assert any("relative path 'out/logs' resolved against the current folder" in w for w in res.warnings)


def test_ray_ports_in_the_range_linux_gives_outgoing_connections_warn(tmp_path, e2e_recipe):
    """Any outgoing connection on a node may hold such a port when Ray starts (its raylet then
    aborts with "Address already in use"): every command warns, naming the key."""
    from rlc.compiler.api import check

    quiet = check(e2e_recipe, _set(tmp_path))
    assert not [d for d in quiet.diagnostics if d.path.startswith("cluster.ray")]
    result = check(e2e_recipe, _set(tmp_path, "cluster.ray.node_manager_port=46400",
                                    "cluster.ray.min_worker_port=32000", "cluster.ray.max_worker_port=33000"))
    assert result.ok
    warned = {d.path: d.message for d in result.diagnostics if d.severity == "warning"}
    assert warned["cluster.ray.node_manager_port"].startswith(
        "port 46400 lies in Linux's default range for outgoing connections (32768-60999")
    assert warned["cluster.ray.min_worker_port"].startswith("worker ports 32000-33000 reach into")
    assert "cluster.ray.port" not in warned


def test_submit_refuses_a_bundle_that_no_longer_matches_its_lock(tmp_path, e2e_recipe, capsys):
    """An edited runtime.yaml (or an added or removed file) is refused before sbatch is asked."""
    from rlc.compiler.submit import main

    out = tmp_path / "b"
    compile_recipe(e2e_recipe, out, _set(tmp_path))
    with open(out / "runtime.yaml", "a", encoding="utf-8") as f:
        f.write("# tuned by hand\n")
    (out / "notes.txt").write_text("x")
    (out / "plan.svg").unlink()
    assert main(out) == 2
    err = capsys.readouterr().err
    assert f"{out} does not match its bundle.lock.json (" in err
    assert "plan.svg is missing" in err and "notes.txt was added" in err and "runtime.yaml was changed" in err


def test_the_job_checks_its_files_against_the_hashes_in_its_own_script(tmp_path, e2e_recipe):
    """SLURM runs its own copy of launch.sbatch: a bundle recompiled or edited after submitting
    fails the job before it starts anything (no job folder, no Ray)."""
    from bundle_helpers import bash

    out = tmp_path / "b"
    compile_recipe(e2e_recipe, out, _set(tmp_path))
    submitted = (out / "launch.sbatch").read_text()
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7"}
    compile_recipe(e2e_recipe, out, _set(tmp_path, "grpo.max_steps=9"), force=True)  # recompiled meanwhile
    run = bash(submitted, env=env)
    assert run.returncode == 1
    assert f"the bundle {out} is not the one this job was submitted with" in run.stdout + run.stderr
    assert not (tmp_path / "logs" / "7").exists()
    # the unchanged bundle passes the check (and goes on until it needs SLURM)
    same = bash((out / "launch.sbatch").read_text(), env=env)
    assert "is not the one this job was submitted with" not in same.stdout + same.stderr
    assert (tmp_path / "logs" / "7").is_dir()


def test_compile_without_an_output_folder_writes_bundles_name(tmp_path, e2e_recipe, monkeypatch, capsys):
    from rlc.compiler.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(e2e_recipe), f"--set=cluster.log_dir={tmp_path}/logs"]) == 0
    out = tmp_path / "bundles" / "rlc-e2e-2node"
    assert (out / "launch.sbatch").is_file()
    assert f"submit with: rlc submit {out}\n" in capsys.readouterr().out


def test_the_printed_commands_quote_the_bundle_path(tmp_path, e2e_recipe, capsys):
    """A folder with a space: the "submit with" line and README.txt are commands a user pastes."""
    import shlex

    from rlc.compiler.cli import main

    out = tmp_path / "my bundle"
    assert main(["compile", str(e2e_recipe), "-o", str(out), f"--set=cluster.log_dir={tmp_path}/logs"]) == 0
    line = capsys.readouterr().out.strip()
    assert shlex.split(line.split("submit with: ", 1)[1]) == ["rlc", "submit", str(out)]
    readme = (out / "README.txt").read_text()
    assert f"  or: rlc submit {shlex.quote(str(out))} " in readme
    assert f"  sbatch {shlex.quote(str(out))}/launch.sbatch\n" in readme


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_next_compile_cleans_up_after_a_killed_one_and_restores_a_bundle_it_moved_aside(tmp_path, e2e_recipe):
    out = tmp_path / "b"
    compile_recipe(e2e_recipe, out, _set(tmp_path))
    dead = _dead_pid()
    # a compile killed between its two renames: the old bundle aside, nothing at the target
    aside = tmp_path / f".b.old-{dead}-x1"
    aside.mkdir()
    os.rename(out, aside / "b")
    (tmp_path / f".b.tmp-{dead}-x2").mkdir()  # and one killed while writing
    running = tmp_path / f".b.tmp-{os.getpid()}-x3"  # a compile still running: left alone
    running.mkdir()
    res = compile_recipe(e2e_recipe, out, _set(tmp_path, "grpo.max_steps=4"), force=True)
    assert "max_steps: 4" in (out / "runtime.yaml").read_text()
    assert any("restored the bundle" in w for w in res.warnings)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".b.")) == [running.name]


def test_without_force_the_restored_bundle_is_kept(tmp_path, e2e_recipe):
    out = tmp_path / "b"
    compile_recipe(e2e_recipe, out, _set(tmp_path, "grpo.max_steps=2"))
    aside = tmp_path / f".b.old-{_dead_pid()}-x1"
    aside.mkdir()
    os.rename(out, aside / "b")
    with pytest.raises(BundleError, match="pass --force"):
        compile_recipe(e2e_recipe, out, _set(tmp_path))
    assert "max_steps: 2" in (out / "runtime.yaml").read_text() and not aside.exists()


@pytest.mark.slow
def test_a_compile_killed_at_any_moment_leaves_the_old_or_the_new_bundle(tmp_path, e2e_recipe):
    """SIGKILL `rlc compile --force` at spread-out moments: the target is always a whole bundle
    (its files match its lock), old or new."""
    import signal
    import time

    from rlc.compiler.bundle.lock import lock_mismatches, read_lock

    out = tmp_path / "b"
    compile_recipe(e2e_recipe, out, _set(tmp_path, "grpo.max_steps=1"))
    argv = [sys.executable, "-m", "rlc.compiler.cli", "compile", str(e2e_recipe), "-o", str(out), "--force",
            f"--set=cluster.log_dir={tmp_path}/logs"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    subprocess.run([*argv, "--set=grpo.max_steps=2"], env=env, check=True, capture_output=True)
    full = time.monotonic() - t0
    for i in range(12):
        proc = subprocess.Popen([*argv, f"--set=grpo.max_steps={3 + i}"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=full * (i + 1) / 12)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        lock = read_lock(out)
        assert lock is not None and lock_mismatches(out, lock) == [], f"kill {i}: no whole bundle at {out}"


def test_a_moved_bundle_is_refused_by_submit_and_says_why(tmp_path, e2e_recipe, capsys):
    """A bundle names its folder (scripts, mounts): moved, it cannot run, and rlc submit says so."""
    from rlc.compiler.submit import main

    compile_recipe(e2e_recipe, tmp_path / "b", _set(tmp_path))
    os.rename(tmp_path / "b", tmp_path / "moved")
    assert main(tmp_path / "moved") == 2
    err = capsys.readouterr().err
    assert f"was compiled into {tmp_path / 'b'} and moved or copied since" in err
    readme = (tmp_path / "moved" / "README.txt").read_text()
    assert f"This bundle belongs in {tmp_path / 'b'}: launch.sbatch names that folder" in readme


def test_plan_files_without_a_memory_plan_summarise_the_resolved_resources(tmp_path):
    """Without model facts there is no memory plan: plan.txt/json/svg state the resources instead,
    read from the resolved runtime config."""
    from rlc.compiler.api import check
    from rlc.compiler.bundle.planfiles import plan_files
    from rlc.compiler.resolve import resolve_runtime_config

    result = check(REPO / "rlc" / "recipes" / "tiny-moe-mtp-4gpu.yaml", _set(tmp_path))
    config = resolve_runtime_config(result)
    files = plan_files(None, result.recipe, config)
    resources = json.loads(files["plan.json"])["resources"]
    assert json.loads(files["plan.json"])["plan"] is None
    assert (resources["model"], resources["world_size"], resources["gpu"]) == \
        (result.recipe.model.id, 4, result.recipe.cluster.gpu)
    assert resources["train_parallel"]["dp"] == config.train_parallel.dp
    assert resources["generation_parallel"] == {
        "tp": config.generation_parallel.tp,
        "pp": config.generation_parallel.pp,
        "ep": config.generation_parallel.ep,
        "dp": config.generation_parallel.dp,
    }
    assert files["plan.txt"].startswith("No memory plan") and "world_size: 4" in files["plan.txt"]
    assert files["plan.svg"].startswith("<svg")
