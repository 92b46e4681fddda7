"""A SIGTERM (``scancel``, the job's time limit) stops the driver cleanly, on a real local Ray cluster (CPU).

The driver's entry point (``rlc.runtime.driver.main``) runs in a child process whose GRPO loop is replaced by what
the loop does first and then most of the time: connect to Ray, take over SIGTERM, and wait on a Ray task (the GPU
phases are not needed to wait). The parent sends SIGTERM. Without the driver's handler Ray's own prints a native
stack dump and exits with status 1, the code of a refused ``runtime.yaml``; with it the driver stops its workers,
says why in its last lines and exits with 143.
"""
from __future__ import annotations

import os
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import sys, time
import ray
from rlc.contract.runtime_config import load_runtime_config
from rlc.runtime import driver, workers as W

def waits_on_ray(self):
    W.connect(self.cfg.cluster.ray, {})
    if sys.argv[1] == "handled":
        self.termination.install()

    @ray.remote(num_cpus=0)
    def step():
        time.sleep(300)

    ref = step.remote()
    print("waiting", flush=True)
    ray.get(ref)
    return 0

driver.GrpoRun.run = waits_on_ray
cfg = sys.argv[2]
sys.exit(driver.main(cfg, ["cluster.ray.address=local"]))
"""


def _run(tmp_path: Path, mode: str) -> tuple[int, str, float]:
    # a short folder of its own: Ray's unix sockets have a 107-byte limit, and no earlier session is joined
    ray_tmp = tempfile.mkdtemp(prefix="rlc-sig-", dir="/tmp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_TMPDIR": ray_tmp, "RAY_DISABLE_USAGE_STATS": "1"}
    try:
        return _signal_child(tmp_path, mode, env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _signal_child(tmp_path: Path, mode: str, env: dict[str, str]) -> tuple[int, str, float]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(ROOT / "tests" / "gpu" / "tiny_runtime.yaml")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    watchdog = threading.Timer(180, proc.kill)  # a child that never gets there must not hang the suite
    watchdog.start()
    try:
        for line in proc.stdout:  # Ray up and the driver blocked in ray.get
            lines.append(line)
            if line.strip() == "waiting":
                break
        else:
            proc.wait()
            pytest.fail("the child never reached its Ray wait:\n" + "".join(lines))
    finally:
        watchdog.cancel()
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail("the driver did not stop within 120 s of SIGTERM:\n" + "".join(lines) + out)
    return proc.returncode, "".join(lines) + out, time.monotonic() - t0


def test_sigterm_stops_the_run_with_its_own_exit_code_and_report(tmp_path):
    rc, out, seconds = _run(tmp_path, "handled")
    assert rc == 143, out[-3000:]
    assert "run stopped by SIGTERM" in out and "resumes from the last checkpoint" in out
    assert "SIGTERM received at time" not in out  # no native stack dump
    assert seconds < 60, seconds


def test_without_the_handler_ray_exits_with_the_code_of_a_refused_config(tmp_path):
    """The failure the handler exists for: the job would report exit 1 (``runtime.yaml`` refused) for a scancel."""
    rc, out, _ = _run(tmp_path, "ray-default")
    assert rc == 1, out[-3000:]
    assert "run stopped by SIGTERM" not in out
