"""Bad input never ends in exit 3: key paths, values and files beyond rlc's limits, a full or closed
output, a full disk while compiling; and a shipped parent's relative paths from any folder.

Each case here crashed rlc (an internal error, exit 3) or ran for minutes before the limits."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

import pytest
from compiler_testing import REPO, run_rlc

TINY = "tiny-qwen3-1gpu"


def rlc_process(*argv: str, cwd: str | os.PathLike[str] | None = None, timeout: float = 120,
                **kwargs) -> subprocess.CompletedProcess:
    """``rlc`` in its own process (for what in-process capture cannot show: closed or full outputs,
    file-size limits), run with this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    kwargs.setdefault("capture_output", True)
    return subprocess.run([sys.executable, "-m", "rlc.compiler.cli", *argv], text=True, env=env, cwd=cwd,
                          timeout=timeout, check=False, **kwargs)


# ------------------------------------------------------------------ --set key paths and values

@pytest.mark.parametrize("levels", [70, 600, 30_000])
def test_a_set_key_path_beyond_the_limits_is_a_usage_error_at_once(levels):
    """500 levels used to end in a RecursionError (exit 3); 30,000 ran 544 s and took 4.4 GB first."""
    key = ".".join(["extensions"] + ["a"] * levels)
    start = time.monotonic()
    run = run_rlc("validate", TINY, "--set", f"{key}=1")
    assert time.monotonic() - start < 10
    assert run.code == 2, run.both
    assert "internal error" not in run.both
    assert ("levels deep; recipes nest at most 64 levels" in run.err
            or "rlc reads key paths of at most 1024" in run.err), run.err
    assert len(run.err) < 2000, "the message quotes the key path shortened"


def test_a_set_key_path_within_the_limits_still_works():
    key = ".".join(["extensions"] + ["a"] * 50)
    run = run_rlc("show", TINY, "--set", f"{key}=7")
    assert run.code == 0, run.both
    assert "a: 7" in run.out


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "{a: " * 3000 + "1" + "}" * 3000,
                                   "&a [" + ",".join(["*a"] * 3) + "]"])
def test_a_set_value_nested_too_deep_or_recursive_is_a_recipe_error(value):
    run = run_rlc("validate", TINY, "--set", f"extensions.x={value}")
    assert run.code in (1, 2), run.both
    assert "internal error" not in run.both and "Traceback" not in run.both


# ------------------------------------------------------------------ model.config content

@pytest.mark.parametrize("content, says", [
    ("[" * 100_000 + "]" * 100_000, "nested more deeply than rlc reads"),
    ('{"num_hidden_layers": ' + "9" * 5000 + "}", "a number too long to read"),
])
def test_a_deeply_nested_or_5000_digit_model_config_is_a_recipe_error(tmp_path, content, says):
    config = tmp_path / "config.json"
    config.write_text(content)
    run = run_rlc("validate", TINY, "--set", f"model.config={config}")
    assert run.code == 1, run.both
    assert f"model.config {config}: JSON" in run.err and says in run.err, run.err


def test_pipeline_and_virtual_stages_are_planned_without_a_chunk_per_pair():
    """PP 65536 × VPP 1024 used to build 67 million stage chunks (MemoryError, exit 3)."""
    start = time.monotonic()
    run = run_rlc("validate", TINY, "--set", "parallelism.train.pp=65536", "--set", "parallelism.train.vpp=1024")
    assert run.code == 1 and "internal error" not in run.both, run.both
    assert time.monotonic() - start < 60


# ------------------------------------------------------------------ a shipped parent from another folder

def test_extending_a_shipped_recipe_from_a_users_folder_reads_its_model_config_beside_it(tmp_path):
    """The shipped recipe's `model.config: models/tiny-qwen3/config.json` is relative to the shipped
    recipe's folder, not to the child's."""
    (tmp_path / "mine.yaml").write_text("version: 1\nextends: tiny-qwen3-1gpu\nname: mine\ngrpo: {max_steps: 3}\n")
    run = run_rlc("validate", "mine.yaml", cwd=tmp_path)
    assert run.code == 0, run.both
    # a relative model.config the child sets is still the child's
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "c.json").write_text((REPO / "rlc" / "recipes" / "models" / "tiny-qwen3" /
                                                 "config.json").read_text().replace('"hidden_size": 128',
                                                                                    '"hidden_size": 256'))
    (tmp_path / "own.yaml").write_text("version: 1\nextends: tiny-qwen3-1gpu\nname: own\n"
                                       "model: {config: models/c.json}\n")
    from rlc.compiler.api import check

    result = check(tmp_path / "own.yaml")
    assert result.ok and result.facts is not None, result.errors
    assert result.facts.source == f"local config {tmp_path / 'models' / 'c.json'}" and result.facts.hidden == 256


def test_compiling_a_child_of_a_shipped_recipe_in_another_folder_writes_a_bundle(tmp_path):
    (tmp_path / "mine.yaml").write_text("version: 1\nextends: tiny-qwen3-1gpu\nname: mine\n")
    run = run_rlc("compile", "mine.yaml", "-o", str(tmp_path / "b"), cwd=tmp_path)
    assert run.code == 0, run.both
    assert (tmp_path / "b" / "runtime.yaml").is_file()


# ------------------------------------------------------------------ outputs and disks

@pytest.mark.parametrize("argv", [["schema"], ["show", TINY], ["plan", TINY], ["lint", str(REPO / "rlc" / "recipes")],
                                  ["explain", "RLC210"]])
def test_a_full_output_is_an_io_error_not_a_bug(argv):
    with open("/dev/full", "w") as full:
        run = rlc_process(*argv, stdout=full, stderr=subprocess.PIPE, capture_output=False)
    assert run.returncode == 2, run.stderr
    assert "I/O error: No space left on device" in run.stderr and "internal error" not in run.stderr


@pytest.mark.parametrize("argv", [["schema"], ["lint", "--format", "json", str(REPO / "rlc" / "recipes")]])
def test_a_closed_output_is_an_io_error_not_a_bug(argv):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = f"import sys; sys.argv = ['rlc', *{argv!r}]; from rlc.compiler.cli import main; sys.exit(main())"
    run = subprocess.run(["bash", "-c", 'exec "$0" -c "$1" >&-', sys.executable, code], capture_output=False,
                         stderr=subprocess.PIPE, text=True, env=env, timeout=120, check=False)
    assert run.returncode == 2, run.stderr
    assert "standard output is closed" in run.stderr and "internal error" not in run.stderr


def _small_file_limit() -> None:  # in the child: files past 20 kB fail with EFBIG (not a signal)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))


def test_a_full_disk_while_compiling_is_an_io_error_and_the_old_bundle_stays(tmp_path):
    out = tmp_path / "b"
    assert run_rlc("compile", TINY, "-o", str(out)).code == 0
    before = (out / "runtime.yaml").read_bytes()
    run = rlc_process("compile", TINY, "-o", str(out), "--force", "--set", "grpo.max_steps=3",
                      preexec_fn=_small_file_limit)
    assert run.returncode == 2, run.stderr
    assert f"cannot write the bundle beside {out}: " in run.stderr and "File too large" in run.stderr
    assert "internal error" not in run.stderr
    assert (out / "runtime.yaml").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".b.")]  # no staging left behind
