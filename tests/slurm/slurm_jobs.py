"""Helpers for the SLURM job tests: compile the 2-node test recipe, wait for log text, find what a
job left behind."""
from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "tests" / "slurm" / "recipes" / "e2e-2node.yaml"
JOB_ENV = {"RLC_RAY_OBJECT_STORE_BYTES": "100000000"}  # lean Ray on a 2-core machine


def job_files(root: Path) -> list[str]:
    """A prompt file and a (placeholder) checkpoint folder under ``root``, as ``--set`` overrides:
    the probe checks on every node that the job's paths are there."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (root / "model").mkdir(exist_ok=True)
    return [f"data.train={root}/data/train.jsonl", f"model.checkpoint={root}/model"]


def compile_e2e(tmp_path: Path, python: str, *extra: str) -> Path:
    """Compile the 2-node recipe into ``tmp_path/bundle`` with logs in ``tmp_path/logs`` and the job's
    files (:func:`job_files`) in ``tmp_path``."""
    from rlc.compiler.api import check
    from rlc.compiler.bundle import build_bundle

    result = check(RECIPE, [f"cluster.log_dir={tmp_path}/logs", f"cluster.container.python={python}",
                            *job_files(tmp_path), *extra])
    assert result.ok, result.errors
    return build_bundle(result, tmp_path / "bundle").path


def reseal(bundle: Path) -> None:
    """After a test changed the bundle's own code on purpose (a driver that fails, or reports its
    environment): record the new file hashes, as a compile would, so the job's check passes."""
    import re

    from rlc.compiler.bundle.lock import write_manifests

    hashes = write_manifests(bundle)
    script = bundle / "launch.sbatch"
    text = script.read_text()
    for name, key in (("RLC_MANIFEST_SHA256", "manifest_sha256"), ("RLC_TREE_SHA256", "tree_sha256")):
        text = re.sub(rf"^readonly {name}=[0-9a-f]{{64}}$", f"readonly {name}={hashes[key]}", text, count=1, flags=re.M)
    script.write_text(text)


def wait_for_text(path: Path, text: str, slurm, job_id: str, timeout: float = 150) -> None:
    """Wait until ``text`` appears in ``path``; fail with the job's logs if the job ends first."""
    end = time.time() + timeout
    while time.time() < end:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if slurm.job(job_id).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        time.sleep(0.5)
    logs = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(path.parent.parent.rglob("*"))
                     if p.is_file() and p.suffix in (".out", ".log"))
    raise AssertionError(f"{text!r} never appeared in {path}\n{logs}")


def leftovers(job_id: str) -> list[str]:
    """Processes or temp dirs of this job still around (Ray's per-node temp dirs carry the job id)."""
    mark = f"/tmp/rlc-{job_id}-"
    found = [str(p) for p in Path("/tmp").glob(f"rlc-{job_id}-*")]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if mark in cmd:
                found.append(f"pid {proc.name}: {cmd[:120]}")
    return found
