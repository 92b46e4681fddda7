"""Files rlc reads because a user named them: regular files only, size-capped, never blocking; and
nothing of a file that did not parse as a recipe mapping is ever echoed (it may be a secret)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from compiler_testing import REPO, run_rlc

from rlc.compiler.files import FileTooLarge, read_capped

TINY = str(REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml")
SECRET = "ghp_0123456789SECRETabcdefXYZ"


def rlc_subprocess(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """rlc in its own process, so a read that blocks fails the test by timeout instead of hanging it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "rlc.compiler.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False, stdin=subprocess.DEVNULL)


def test_a_fifo_as_the_recipe_is_refused_at_once(tmp_path):
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    for argv in (["validate", str(fifo)], ["lint", str(tmp_path)], ["lint", str(fifo)]):
        run = rlc_subprocess(*argv)
        assert run.returncode == 2, run
        assert "a FIFO, not a regular file" in run.stdout + run.stderr


def test_a_fifo_as_a_parent_recipe_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "parent.yaml")
    (tmp_path / "child.yaml").write_text("version: 1\nextends: parent.yaml\n")
    run = rlc_subprocess("validate", str(tmp_path / "child.yaml"))
    assert run.returncode == 1 and "extends: cannot read" in run.stderr, run
    assert "parent.yaml: a FIFO, not a regular file" in run.stderr, run


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_as_model_config_is_refused_without_reading_it(device):
    run = rlc_subprocess("validate", TINY, "--set", f"model.config={device}")
    assert run.returncode == 1
    assert f"cannot read model.config {device}: a character device, not a regular file" in run.stderr


def test_a_device_as_the_calibration_table_is_refused():
    run = rlc_subprocess("validate", TINY, "--set", "cluster.calibration=/dev/zero")
    assert run.returncode == 1 and "cluster.calibration: calibration file '/dev/zero'" in run.stderr, run.stderr


def test_read_capped_refuses_a_file_over_the_cap_and_reads_one_at_it(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert read_capped(path, 100) == b"x" * 100
    with pytest.raises(FileTooLarge) as err:
        read_capped(path, 99)
    assert err.value.size == 100 and "more than the 99 bytes" in str(err.value)


def test_an_oversized_model_config_is_refused(tmp_path):
    big = tmp_path / "config.json"
    big.write_text('{"pad": "' + "x" * (17 << 20) + '"}')
    run = run_rlc("validate", TINY, "--set", f"model.config={big}")
    assert run.code == 1 and "more than the 16777216 bytes rlc reads" in run.err


# ------------------------------------------------------------------ secrets


def _secret_files(tmp_path):
    """Files a user might name by mistake, each holding the secret: none is a recipe mapping."""
    files = {
        "token": f"{SECRET}\n",
        "quoted-token": f'"{SECRET}"\n',
        "list": f"- {SECRET}\n",
        "alias": f"*{SECRET}\n",
        "directive": f"%{SECRET} x\n---\na: 1\n",
        "unclosed": f"[{SECRET}\n",
        "bad-escape": f'"{SECRET}\\q"\n',
        "tagged": f"!{SECRET} value\n",
        # YAML mappings that are not recipes: every `name:hash:...:::` line of /etc/shadow reads as a
        # key, and a secrets file is a mapping of names to secrets (neither has `version:`)
        "shadow": f"root:{SECRET}:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",
        "secret-keys": f"{SECRET}: 1\nother: 2\n",
        "secret-values": f"api_key: {SECRET}\npassword: hunter2\n",
        "secret-duplicates": f"password: {SECRET}\npassword: {SECRET}\n",
        "secret-tags": f"token: !!binary {SECRET}\nport: !!int {SECRET}\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return list(files)


@pytest.mark.parametrize("fmt", ["text", "github", "json"])
def test_a_secret_named_in_extends_is_never_echoed(tmp_path, fmt):
    for name in _secret_files(tmp_path):
        child = tmp_path / f"child-{name}.yaml"
        child.write_text(f"version: 1\nextends: {tmp_path / name}\n")
        for argv in (["validate", str(child)], ["lint", "--format", fmt, str(child)], ["show", str(child)],
                     ["plan", str(child)]):
            run = run_rlc(*argv)
            assert run.code in (1, 2), (name, argv, run.both)
            assert SECRET not in run.both, (name, argv, run.both)


def test_a_secret_named_as_the_recipe_or_as_a_config_is_never_echoed(tmp_path):
    for name in _secret_files(tmp_path):
        for argv in (["validate", str(tmp_path / name)],
                     ["validate", TINY, "--set", f"model.config={tmp_path / name}"],
                     ["validate", TINY, "--set", f"cluster.calibration={tmp_path / name}"]):
            run = run_rlc(*argv)
            assert run.code in (1, 2), (name, argv, run.both)
            assert SECRET not in run.both, (name, argv, run.both)


def test_a_recipe_mapping_still_shows_its_values_in_messages(tmp_path):
    """Values of a file that is a recipe mapping are fair to show (they are what to fix)."""
    (tmp_path / "r.yaml").write_text("version: 1\nmodel: {id: x, dtype: bf16}\n")
    assert "'bf16' is not allowed" in run_rlc("validate", str(tmp_path / "r.yaml")).err
