"""The CI skip guard: GPU-host tests and negative fixtures may skip, nothing else."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.skip_guard import disallowed, skip_reason

ROOT = Path(__file__).resolve().parents[2]


def test_allowed_and_disallowed_skips():
    skips = [("tests/gpu/test_two_gpu.py::test_two_gpu_proof[calibration]",
              "needs CUDA GPUs with vLLM, Ray and Megatron-Bridge (GPU host only)"),
             ("tests/bundle/test_bundle_golden.py::test_x[seed-1]", "x is a negative fixture (errors by design)"),
             ("tests/runtime/test_grpo_loss.py", "could not import 'torch': No module named 'torch'"),
             ("tests/runtime/test_runtime_metrics.py::test_tensorboard", "tensorboard not installed"),
             ("tests/bundle/test_bundle_golden.py::test_shellcheck", "shellcheck is not installed"),
             ("tests/runtime/test_x.py::test_y", "GPU host only")]  # the words alone, outside tests/gpu/
    assert [node for node, _ in disallowed(skips)] == [
        "tests/runtime/test_grpo_loss.py", "tests/runtime/test_runtime_metrics.py::test_tensorboard",
        "tests/bundle/test_bundle_golden.py::test_shellcheck", "tests/runtime/test_x.py::test_y"]
    assert skip_reason(("f.py", 3, "Skipped: tqdm not installed")) == "tqdm not installed"


def test_strict_run_fails_on_an_unexpected_skip(tmp_path):
    case = tmp_path / "test_probe.py"
    case.write_text("import pytest\n\ndef test_probe():\n    pytest.skip('optional dependency missing')\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.skip_guard", str(case)]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RLC_STRICT_SKIPS": "1"}
    strict = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    lenient = subprocess.run(cmd, cwd=tmp_path, env={**env, "RLC_STRICT_SKIPS": "0"}, capture_output=True, text=True)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "test_probe.py::test_probe: optional dependency missing" in strict.stdout
    assert lenient.returncode == 0, lenient.stdout
