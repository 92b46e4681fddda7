"""A hand-run bundle starts its own Ray cluster even when an earlier, killed run left its address behind.

Ray's ``ray.init()`` without an address joins the cluster named in ``<tmp>/ray/ray_current_cluster``; a run
killed by a timeout leaves that file pointing at a head that no longer exists, and the next run retries it
until its own timeout. The runtime's local mode must never read that file.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray")

SCRIPT = """
from rlc.contract.runtime_config import RayConfig
from rlc.runtime.workers import connect
import ray
print("CONNECTED", connect(RayConfig(address="{address}", namespace="rlc-test", join_timeout_s=5), {{}}), flush=True)
ray.shutdown()
"""


@pytest.mark.parametrize("address", ["local", "auto"])
def test_local_cluster_ignores_a_stale_cluster_file(address):
    # a short temp dir: Ray's socket paths must stay under the 107-byte UNIX socket limit
    tmp = tempfile.mkdtemp(prefix="rlc-ray-", dir="/tmp")
    try:
        (Path(tmp) / "ray").mkdir()
        (Path(tmp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n", encoding="utf-8")  # nothing listens
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(TMPDIR=tmp, RAY_TMPDIR=tmp)
        try:
            proc = subprocess.run([sys.executable, "-c", SCRIPT.format(address=address)], env=env, cwd=tmp,
                                  capture_output=True, text=True, timeout=150, check=False)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"connect() did not start a local cluster within 150 s: {str(exc.stderr)[-800:]}")
        assert proc.returncode == 0 and "CONNECTED ray" in proc.stdout, proc.stderr[-2000:]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
