"""The bundle's mount list in real containers: a 2-node job whose steps (Ray head, worker, join wait,
driver) each run in a podman container through the harness's `apptainer` stand-in
(tests/harness/bin/apptainer), given exactly the bundle's `--bind` list.

A data file the bundle does not mount is missing inside the containers, as on a cluster: the job
fails, its probe naming the key, the path and each node. `rlc validate` names the mount line that
fixes it; with that line added as it is, the same job passes, reading the file in the containers.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_jobs import JOB_ENV, RECIPE, leftovers

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LAB = Path(os.environ.get("RLC_SLURM_DIR", "/tmp/rlc-slurm"))
IMAGE = LAB / "image" / "rootfs"
STAND_IN = REPO / "tests" / "harness" / "bin"
PODMAN_ENV = {"CONTAINERS_STORAGE_CONF": str(LAB / "podman" / "storage.conf"),
              "CONTAINERS_CONF": str(LAB / "podman" / "containers.conf")}


def python_mounts() -> list[str]:
    """The test's own Python (its virtual environment, and the installation it was made from unless
    that is the image's /usr), mounted read-only: the stand-in image holds only Debian's python3."""
    roots = {sys.prefix, sys.base_prefix}
    return [f"{r}:{r}:ro" for r in sorted(roots) if not (r == "/usr" or r.startswith("/usr/"))]


def rlc(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlc.compiler.cli", *argv], capture_output=True, text=True,
                          timeout=120, check=False, cwd=REPO)


def compile_in_containers(tmp_path: Path, name: str, sets: list[str]) -> Path:
    r = rlc("compile", str(RECIPE), "-o", str(tmp_path / name), *(x for s in sets for x in ("--set", s)))
    assert r.returncode == 0, r.stdout + r.stderr
    return tmp_path / name


def containers_of(job_id: str) -> list[str]:
    out = subprocess.run(["podman", "ps", "-a", "--filter", f"label=rlc-job={job_id}", "--format", "{{.Names}}"],
                         env={**os.environ, **PODMAN_ENV}, capture_output=True, text=True, timeout=60, check=False)
    return out.stdout.split()


def run_probe_job(slurm, bundle: Path, logs: Path) -> tuple[str, str, str, str]:
    env = {**JOB_ENV, "RLC_DRIVER_MODE": "probe", "PATH": f"{STAND_IN}:{os.environ['PATH']}"}
    job_id = slurm.sbatch(bundle / "launch.sbatch", env=env)
    end = slurm.wait(job_id, timeout=300)
    batch = (logs / f"slurm-{job_id}.out").read_text()
    driver_log = logs / job_id / "driver.log"
    driver = driver_log.read_text() if driver_log.exists() else ""
    deadline = time.time() + 30  # each step removes its container as it ends
    while containers_of(job_id) and time.time() < deadline:
        time.sleep(1)
    assert containers_of(job_id) == [], f"containers of job {job_id} left running"
    assert leftovers(job_id) == []
    return job_id, f"{end.state} {end.exit_code}", batch, driver


def test_a_missing_mount_fails_the_job_in_real_containers_and_the_named_mount_fixes_it(slurm, ray_python, tmp_path):
    assert IMAGE.is_dir(), f"no stand-in image at {IMAGE}: run `bash tests/harness/local_slurm.sh install`"
    assert not Path("/opt/rlc-bundle").exists()  # the bundle's mount point exists only inside the containers
    slurm.shape(nodes=2, gpus=2, cpus=4)
    data = tmp_path / "sets" / "math"  # on the host, under /tmp: the containers get a /tmp of their own
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    logs = tmp_path / "logs"
    base = [f"cluster.log_dir={logs}", "cluster.container.runtime=apptainer", f"cluster.container.image={IMAGE}",
            f"cluster.container.python={ray_python}", f"data.train={data}/train.jsonl",
            "model.checkpoint=Qwen/Qwen3-0.6B"]  # a Hub id: nothing to mount (the probe loads no model)
    mounts = python_mounts()

    # 1. rlc validate: the data's folder is not mounted; the error names the key and the mount line
    r = rlc("validate", str(RECIPE), *(x for s in [*base, f"cluster.container.mounts={mounts}".replace("'", '"')]
                                       for x in ("--set", s)))
    assert r.returncode == 1, r.stdout + r.stderr
    m = re.search(r"data\.train: the job reads (\S+), which no mount puts in the container, .*?add `([^`]+)` to "
                  r"cluster\.container\.mounts", r.stderr)
    assert m and m.group(1) == f"{data}/train.jsonl", r.stderr
    fix = m.group(2)
    assert fix == f"{data}:{data}:ro"

    # 2. the same bundle, told the data is in the image (it is not), compiles; in the containers the
    #    file is missing on both nodes and the job fails, naming it, as it would on a cluster
    unmounted = compile_in_containers(tmp_path, "unmounted", [
        *base, f"cluster.container.mounts={mounts}".replace("'", '"'),
        f'cluster.container.image_paths=["{data}"]'])
    job_id, end, batch, driver = run_probe_job(slurm, unmounted, logs)
    assert end.startswith("FAILED"), batch + driver
    for node in ("node1", "node2"):
        assert (f"[rlc] probe FAILED: on {node}: data.train: {data}/train.jsonl does not exist here "
                "(a missing mount?)") in driver, batch + driver
    assert (data / "train.jsonl").exists()  # it is there on the host: only the container lacks it

    # 3. the mount line from step 1, added as it is: the job passes, reading the file in the containers
    fixed = compile_in_containers(tmp_path, "fixed", [
        *base, f"cluster.container.mounts={[*mounts, fix]}".replace("'", '"')])
    assert fix in (fixed / "mounts.txt").read_text().splitlines()
    job_id, end, batch, driver = run_probe_job(slurm, fixed, logs)
    assert end == "COMPLETED 0:0", batch + driver
    # data.train, and the checkpoint and metrics folders it writes (in cluster.log_dir, which the bundle mounts)
    assert "[rlc] probe OK: 2/2 nodes, 4/4 GPUs, 3 job paths on every node" in driver, driver
    for node in ("node1", "node2"):  # each task ran in a container: the bundle is at its mount point there
        assert re.search(rf"^  {node} .* /opt/rlc-bundle/rlc_pkg/rlc/__init__\.py$", driver, re.M), driver
