"""A real, throw-away SLURM for the bundle tests (``tests/harness/local_slurm.sh``).

The session fixture ``slurm`` installs (if needed) and starts the cluster once; each test asks for
the shape it needs with ``slurm.shape(nodes=..., gpus=...)`` (a restart only when the shape
changes, ~1-2 s). Tests skip, with the reason, only when the harness cannot run here: not root,
or no apt-get. Everything talks to the cluster through ``SLURM_CONF`` in :attr:`LocalSlurm.env`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "harness" / "local_slurm.sh"
LAB = Path(os.environ.get("RLC_SLURM_DIR", "/tmp/rlc-slurm"))


@dataclass(frozen=True)
class JobEnd:
    """A finished job as ``scontrol show job`` reports it."""

    job_id: str
    state: str
    exit_code: str  # "rc:signal", e.g. "0:0"
    name: str
    raw: dict[str, str]


class LocalSlurm:
    """Drive the harness and the cluster it runs."""

    def __init__(self) -> None:
        self.env = {**os.environ, "SLURM_CONF": str(LAB / "etc" / "slurm.conf")}
        self.env.pop("SLURM_JOB_ID", None)
        self.current: tuple | None = None

    def _harness(self, *args: str, **shape: str) -> str:
        env = {**self.env, "RLC_SLURM_DIR": str(LAB), **shape}
        proc = subprocess.run(["bash", str(HARNESS), *args], env=env, capture_output=True, text=True,
                              timeout=600, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"local_slurm.sh {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def shape(self, nodes: int, gpus: int, gpu_type: str = "", cpus: int = 4, mem_mb: int = 64000,
              partitions: str = "debug") -> None:
        """Make the cluster ``nodes`` x ``gpus`` (fake GRES) with these CPUs/memory per node."""
        want = (nodes, gpus, gpu_type, cpus, mem_mb, partitions)
        if want == self.current:
            return
        self._harness("start", NODES=str(nodes), GPUS_PER_NODE=str(gpus), GPU_TYPE=gpu_type,
                      CPUS_PER_NODE=str(cpus), MEM_PER_NODE_MB=str(mem_mb), PARTITIONS=partitions)
        self.current = want

    def run(self, *cmd: str, env: dict[str, str] | None = None, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster."""
        proc = subprocess.run(list(cmd), env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def sbatch(self, script: Path, *args: str, env: dict[str, str] | None = None) -> str:
        """Submit; returns the job id."""
        out = self.run("sbatch", "--parsable", *args, str(script), env=env).stdout.strip()
        return out.split(";", 1)[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (values may hold spaces; JobName is parsed exactly)."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout.strip()
        fields = {}
        for m in re.finditer(r"(\w+)=(.*?)(?= \w+=|$)", line):
            fields[m.group(1)] = m.group(2)
        return fields

    def job_name(self, job_id: str) -> str:
        """The job name exactly (``squeue``/``scontrol`` cannot split names with spaces reliably)."""
        return self.run("squeue", "-h", "-t", "all", "-j", job_id, "-O", "Name:1000").stdout.rstrip("\n").rstrip()

    def wait(self, job_id: str, timeout: float = 180) -> JobEnd:
        """Wait until the job leaves PENDING/RUNNING/COMPLETING; returns how it ended."""
        end = time.time() + timeout
        while True:
            info = self.job(job_id)
            state = info.get("JobState", "")
            if state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", ""):
                return JobEnd(job_id, state, info.get("ExitCode", ""), info.get("JobName", ""), info)
            if time.time() > end:
                self.run("scancel", job_id, check=False)
                raise AssertionError(f"job {job_id} still {state} after {timeout}s")
            time.sleep(0.5)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the SLURM harness needs root (it installs packages and starts slurmctld/slurmd)"
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        return "the SLURM harness needs apt-get (Debian/Ubuntu) to install SLURM"
    return None


@pytest.fixture(scope="session")
def slurm():
    """The local SLURM; stopped at the end of the session."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm()
    cluster._harness("install")
    yield cluster
    try:
        cluster._harness("stop")
    except RuntimeError:
        pass


@pytest.fixture(scope="session")
def ray_python() -> str:
    """A Python with ray installed (the e2e jobs run Ray on the host: container runtime none)."""
    import sys

    probe = subprocess.run([sys.executable, "-c", "import ray; print(ray.__version__)"], capture_output=True,
                           text=True, check=False)
    if probe.returncode != 0:
        reason = "ray is not installed in this Python: pip install 'ray[default]==2.60.0'"
        if os.environ.get("CI"):
            pytest.fail(reason)  # CI must run the end-to-end jobs, not skip them
        pytest.skip(reason)
    return sys.executable
