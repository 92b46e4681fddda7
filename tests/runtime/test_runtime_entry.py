"""`python -m rlc.runtime` keeps the README's exit-code promise: 1 for a runtime.yaml (or an override)
it refuses, 2 for a file it cannot read, never a traceback for bad input, never a hang.

Before: a FIFO as runtime.yaml hung it, a YAML syntax error, non-UTF-8 bytes or a `!!python` tag
printed raw tracebacks, and `grpo.max_steps: -5` started a run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml"


@pytest.fixture(scope="module")
def runtime_yaml(tmp_path_factory) -> Path:
    from rlc.compiler.api import check
    from rlc.compiler.bundle.build import runtime_yaml as render
    from rlc.compiler.resolve import resolve_runtime_config
    from rlc.contract.runtime_config import runtime_config_to_dict

    result = check(TINY)
    assert result.ok
    path = tmp_path_factory.mktemp("rt") / "runtime.yaml"
    path.write_text(render(runtime_config_to_dict(resolve_runtime_config(result))))
    return path


def runtime(*argv: str, module: str = "rlc.runtime") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env,
                          timeout=120, check=False, stdin=subprocess.DEVNULL)


def _clean(run: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr, run.stderr


def test_a_fifo_as_runtime_yaml_is_refused_at_once(tmp_path):
    fifo = tmp_path / "runtime.yaml"
    os.mkfifo(fifo)
    for argv in ([str(fifo)], ["--probe", str(fifo)]):
        run = runtime(*argv)
        assert run.returncode == 2 and "a FIFO, not a regular file" in run.stderr, run.stderr
        _clean(run)


@pytest.mark.parametrize("content, says", [
    (b"grpo: [\n", "a YAML syntax error at line 2"),
    (b"grpo:\n  max_steps: \xff\xfe\n", "not UTF-8 text (byte 0xff on line 2)"),
    (b"grpo: !!python/object/apply:os.system [echo hi]\n", "a tag that is not plain data"),
    (b"- a list\n", "not a mapping of runtime keys"),
])
def test_a_runtime_yaml_that_is_not_one_is_a_clean_error(tmp_path, content, says):
    path = tmp_path / "runtime.yaml"
    path.write_bytes(content)
    for argv in ([str(path)], ["--probe", str(path)]):
        run = runtime(*argv)
        assert run.returncode == 1 and says in run.stderr, run.stderr
        _clean(run)
    probe = runtime("--wait", str(path), module="rlc.runtime.probe")
    assert probe.returncode == 1 and says in probe.stdout, probe.stdout + probe.stderr


def test_a_missing_runtime_yaml_is_an_io_error(tmp_path):
    run = runtime(str(tmp_path / "nope.yaml"))
    assert run.returncode == 2 and "No such file or directory" in run.stderr
    _clean(run)


def test_out_of_range_numbers_are_refused_in_the_file_and_in_overrides(runtime_yaml, tmp_path):
    edited = tmp_path / "runtime.yaml"
    edited.write_text(runtime_yaml.read_text().replace("max_steps: 150", "max_steps: -5"))
    run = runtime(str(edited))
    assert run.returncode == 1 and "grpo.max_steps: -5 is out of range: allowed >= 1" in run.stderr, run.stderr
    run = runtime(str(runtime_yaml), "grpo.max_steps=-5")
    assert run.returncode == 1 and "grpo.max_steps: -5 is out of range" in run.stderr, run.stderr
    run = runtime(str(runtime_yaml), "generation.sampling.temperature=0", "train_parallel.tp=0")
    assert run.returncode == 1 and "generation.sampling.temperature: 0 is out of range" in run.stderr
    assert "train_parallel.tp: 0 is out of range" in run.stderr
    _clean(run)


def test_overrides_beyond_the_limits_are_refused(runtime_yaml):
    run = runtime(str(runtime_yaml), ".".join(["grpo"] + ["x"] * 200) + "=1")
    assert run.returncode == 1 and "levels deep" in run.stderr and len(run.stderr) < 2000
    run = runtime(str(runtime_yaml), "grpo.max_steps=" + "[" * 3000 + "]" * 3000)
    assert run.returncode == 1, run.stderr
    _clean(run)


def test_usage_errors_exit_2():
    run = runtime()
    assert run.returncode == 2 and "usage:" in run.stderr
