"""On the CPU: the GPU proofs' own Ray head (``start_ray``) is protected by a token of its own, and a process
joining it with what ``start_ray`` returns connects, whatever an earlier run left in ``~/.ray`` (a stray
``auth_token`` makes ``ray start`` turn token auth on with that file otherwise)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.gpu.test_four_gpu_grpo import _env, start_ray, stop
from tests.gpu.test_moe_two_gpu import REPO

pytestmark = pytest.mark.slow


def test_a_joining_process_connects_despite_a_stray_default_token(tmp_path):
    pytest.importorskip("ray")
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(os.urandom(32).hex())  # an earlier run's token
    env = {k: v for k, v in _env(REPO).items() if not k.startswith("RAY_")}
    # a Ray temp dir of its own (short: Ray's socket paths have a length limit): the head's
    # ray_current_cluster file must not name a dead cluster to later tests' ray.init()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rlc-rt-"))
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(ray_tmp))
    head, join = start_ray(0, env, tmp_path / "ray-head.log")
    try:
        assert join["RAY_AUTH_MODE"] == "token" and join["RAY_ADDRESS"]
        code = ("import types\nfrom rlc.runtime.workers import connect\n"
                "print(connect(types.SimpleNamespace(address='auto', namespace='rlc', join_timeout_s=60), {}))\n")
        out = subprocess.run([sys.executable, "-c", code], env={**env, **join}, capture_output=True, text=True,
                             timeout=180, check=False)
        assert out.returncode == 0 and "1 nodes" in out.stdout, out.stdout + out.stderr
        # the head takes its own token only: the stray default token is refused
        stray = {**env, **join, "RAY_AUTH_TOKEN_PATH": str(home / ".ray" / "auth_token")}
        code = ("from rlc.runtime.ray_auth import token_refused\n"
                f"print('REFUSED:', token_refused({join['RAY_ADDRESS']!r}))\n")
        out = subprocess.run([sys.executable, "-c", code], env=stray, capture_output=True, text=True, timeout=60,
                             check=False)
        assert "REFUSED: InvalidAuthToken" in out.stdout, out.stdout + out.stderr
    finally:
        stop(head)
        shutil.rmtree(ray_tmp, ignore_errors=True)
