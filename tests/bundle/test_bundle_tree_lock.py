"""The job trusts only what it hashed: the whole bundle tree (entries added or removed, files replaced
by links, FIFOs or devices, hard links, permissions) is checked by the job script's own check (real
bash, the function launch.sbatch runs first) and by `rlc submit` against the lock; the check reads
regular files only and ends in bounded time. Secrets from `cluster.env` are never world-readable.

Before: an added `rlc_pkg/sitecustomize.py` passed the job's check (and then ran in every Python of
the job), a FIFO or `/dev/zero` in place of a bundle file hung it for the whole allocation, a link to
a writable file outside the bundle passed, permissions were never checked, and an inline
`cluster.env` token landed in three world-readable files, `bundle.lock.json` included."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from bundle_helpers import compile_recipe
from rlc.compiler.bundle.lock import LOCK_NAME, lock_mismatches, read_lock

TOKEN = "hf_SECRETtoken0123456789abcdef"


@pytest.fixture
def bundle(tmp_path, e2e_recipe) -> Path:
    return compile_recipe(e2e_recipe, tmp_path / "b", [f"cluster.log_dir={tmp_path}/logs"]).path


def job_check(bundle: Path) -> tuple[int, float]:
    """Run the bundle check of ``launch.sbatch`` (its hashes and ``bundle_intact``) in real bash."""
    text = (bundle / "launch.sbatch").read_text()
    start = text.index("readonly RLC_MANIFEST_SHA256=")
    body = text.index("bundle_intact() (")
    end = text.index("\n)\n", body) + 3
    script = "set -euo pipefail\n" + text[start:end] + "bundle_intact\n"
    began = time.monotonic()
    proc = subprocess.run(["bash", "-c", script], env={**os.environ, "RLC_BUNDLE": str(bundle)},
                          capture_output=True, timeout=120, check=False)
    return proc.returncode, time.monotonic() - began


def test_an_untouched_bundle_passes_both_checks(bundle):
    assert job_check(bundle)[0] == 0
    lock = read_lock(bundle)
    assert lock is not None and lock_mismatches(bundle, lock) == []


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _link(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def _outside_copy(path: Path) -> None:
    outside = path.parent.parent / f"outside-{path.name}"
    shutil.copy2(path, outside)
    outside.chmod(0o666)  # writable by anyone, same bytes
    _link(path, str(outside))


def _hard_link(path: Path) -> None:
    os.link(path, path.parent.parent / f"hard-{path.name}")


def _dir_link(path: Path) -> None:
    outside = path.parent.parent.parent.parent / "outside-runtime"
    shutil.copytree(path, outside)
    shutil.rmtree(path)
    path.symlink_to(outside)


#: case -> (the entry changed, how, what rlc submit says about it)
TAMPERS = {
    "added sitecustomize.py": ("rlc_pkg/sitecustomize.py", lambda p: p.write_text("import os\n"), "was added"),
    "added folder": ("rlc_pkg/extra", lambda p: p.mkdir(), "was added"),
    "removed file": ("plan.txt", lambda p: p.unlink(), "is missing"),
    "file replaced by a FIFO": ("node.sh", _fifo, "is now a FIFO (compiled: a file)"),
    "file replaced by a link to /dev/zero": ("env.sh", lambda p: _link(p, "/dev/zero"),
                                             "is now a symbolic link (compiled: a file)"),
    "file replaced by a link outside": ("runtime.yaml", _outside_copy, "is now a symbolic link (compiled: a file)"),
    "folder replaced by a link outside": ("rlc_pkg/rlc/runtime", _dir_link,
                                          "is now a symbolic link (compiled: a folder)"),
    "hard link from outside": ("node.sh", _hard_link, "has 2 hard links (compiled: 1)"),
    "permissions opened": ("node.sh", lambda p: p.chmod(0o777), "has mode 777 (compiled: 755)"),
    "secret made world-readable": ("env.sh", lambda p: p.chmod(0o644), "has mode 644 (compiled: 600)"),
    "setuid bit": ("node.sh", lambda p: p.chmod(0o4755), "has mode 4755 (compiled: 755)"),
    "file edited": ("runtime.yaml", lambda p: p.write_text(p.read_text().replace("max_steps:", "max_steps: 9 #")),
                    "was changed"),
    "manifest replaced by a FIFO": ("files.sha256", _fifo, "is now a FIFO (compiled: a file)"),
    "tree listing edited": ("files.tree", lambda p: p.write_text(p.read_text() + "f 644 1 rlc_pkg/sitecustomize.py\n"),
                            "was changed"),
}


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_a_changed_tree_fails_the_job_check_quickly_and_submit_names_it(bundle, case):
    rel, change, says = TAMPERS[case]
    change(bundle / rel)
    code, seconds = job_check(bundle)
    assert code != 0, f"{case}: the job's check passed"
    assert seconds < 20, f"{case}: the job's check took {seconds:.1f} s"
    lock = read_lock(bundle)
    assert lock is not None
    problems = lock_mismatches(bundle, lock)
    assert any(p.startswith(f"{rel} {says}") for p in problems), (case, problems)


def test_submit_refuses_a_changed_tree_before_sbatch(bundle):
    from rlc.compiler.submit import SubmitError, submit

    (bundle / "rlc_pkg" / "sitecustomize.py").write_text("import os\n")
    with pytest.raises(SubmitError, match=r"rlc_pkg/sitecustomize.py was added"):
        submit(bundle, env={"PATH": "/nonexistent"})


def test_submit_takes_the_log_folder_from_the_hashed_script_not_an_edited_lock(bundle, tmp_path):
    from rlc.compiler.submit import SubmitError, submit

    with pytest.raises(SubmitError, match="sbatch not found"):  # intact: only sbatch is missing here
        submit(bundle, env={"PATH": "/nonexistent"})
    lock = json.loads((bundle / LOCK_NAME).read_text())
    lock["log_dir"] = str(tmp_path / "elsewhere")
    (bundle / LOCK_NAME).write_text(json.dumps(lock))
    with pytest.raises(SubmitError, match="the lock was edited"):
        submit(bundle, env={"PATH": "/nonexistent"})
    assert not (tmp_path / "elsewhere").exists()


# ------------------------------------------------------------------ secrets


@pytest.mark.parametrize("how", ["file", "set-key", "set-mapping"])
def test_a_cluster_env_token_is_only_in_files_its_owner_alone_reads(tmp_path, e2e_recipe, how):
    overrides = [f"cluster.log_dir={tmp_path}/logs"]
    recipe = e2e_recipe
    if how == "file":
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"version: 1\nextends: {e2e_recipe}\ncluster:\n  env: {{HF_TOKEN: {TOKEN}}}\n")
    elif how == "set-key":
        overrides.append(f"cluster.env.HF_TOKEN={TOKEN}")
    else:
        overrides.append(f"cluster.env={{HF_TOKEN: {TOKEN}, OTHER: x}}")
    out = compile_recipe(recipe, tmp_path / "b", overrides).path
    holders = []
    for path in sorted(out.rglob("*")):
        if path.is_file() and TOKEN.encode() in path.read_bytes():
            holders.append(path.name)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert sorted(holders) == ["env.sh", "runtime.yaml"]
    lock = json.loads((out / LOCK_NAME).read_text())
    assert TOKEN not in json.dumps(lock)
    if how != "file":
        assert any("(value not recorded: cluster.env may hold secrets)" in o for o in lock["recipe"]["overrides"])
    assert job_check(out)[0] == 0 and lock_mismatches(out, lock) == []


def test_every_bundle_entry_has_the_compilers_permissions_whatever_the_umask(tmp_path, e2e_recipe):
    old = os.umask(0o002)
    try:
        out = compile_recipe(e2e_recipe, tmp_path / "b", [f"cluster.log_dir={tmp_path}/logs"]).path
    finally:
        os.umask(old)
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.lstat().st_mode) for p in out.rglob("*")}
    assert not [p for p, m in modes.items() if m & 0o022], "nothing in a bundle is writable by others"
    assert modes["env.sh"] == modes["runtime.yaml"] == 0o600
    assert modes["launch.sbatch"] == modes["node.sh"] == 0o755
    assert modes["rlc_pkg/rlc"] == 0o755 and modes["rlc_pkg/rlc/__init__.py"] == 0o644
