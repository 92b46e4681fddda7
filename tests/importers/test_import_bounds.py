"""`rlc import nemo-rl` within bounds: interpolation cycles, long chains, exponential references,
oversized resolver results and deep overrides end in a clean usage error (exit 2) quickly; the caller's
environment and files that are not NeMo-RL configs are never copied into the output or the recipe."""
from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path

import pytest

from rlc.compiler.cli import main
from rlc.compiler.importers.nemo_rl import NemoRlConfigError, load_nemo_rl_config
from rlc.contract import bounds

SECRET = "ghp_0123456789SECRETabcdefXYZ"
GRPO = "grpo: {num_prompts_per_step: 8}\n"


def rlc(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(argv))
    return code, out.getvalue()


def _import(tmp_path: Path, text: str, *extra: str) -> tuple[int, str, Path]:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    out = tmp_path / "recipe.yaml"
    start = time.monotonic()
    code, said = rlc("import", "nemo-rl", str(config), "-o", str(out), "--force", *extra)
    assert time.monotonic() - start < 30, "bounded in time"
    assert "internal error" not in said and "Traceback" not in said and "full_key" not in said, said
    return code, said, out


def test_an_interpolation_cycle_is_a_clean_error(tmp_path):
    code, said, _ = _import(tmp_path, "policy:\n  a: ${policy.b}\n  b: ${policy.a}\n")
    assert code == 2 and "cannot resolve the interpolation of policy.a: Recursive interpolation detected" in said


def test_a_long_interpolation_chain_is_a_clean_error(tmp_path):
    lines = ["policy:"] + [f"  k{i}: ${{policy.k{i + 1}}}" for i in range(3000)] + ["  k3000: 1"]
    code, said, _ = _import(tmp_path, "\n".join(lines) + "\n")
    assert code == 2 and "interpolations refer to each other more deeply than rlc follows" in said, said


def test_references_that_multiply_a_section_stop_at_the_value_limit(tmp_path):
    lines = ["policy:", "  a0: [1, 2]"] + [f'  a{i}: ["${{policy.a{i - 1}}}", "${{policy.a{i - 1}}}"]'
                                            for i in range(1, 40)]
    code, said, _ = _import(tmp_path, "\n".join(lines) + "\n")
    assert code == 2 and f"the resolved config has more than {bounds.MAX_NODES} values" in said, said


def test_references_that_double_a_string_stop_at_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(bounds, "RESOLVE_SECONDS", 1.0)
    lines = ["policy:", "  a0: xy"] + [f"  a{i}: ${{policy.a{i - 1}}}${{policy.a{i - 1}}}" for i in range(1, 40)]
    (tmp_path / "c.yaml").write_text("\n".join(lines) + "\n")
    start = time.monotonic()
    with pytest.raises(NemoRlConfigError, match="took longer than 1 s"):
        load_nemo_rl_config(tmp_path / "c.yaml")
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("expr", ["${mul:'A',300000000}", "${mul:300000000,'AB'}",
                                  "${mul:${policy.big},${policy.big}}"])
def test_a_resolver_result_beyond_the_size_limit_is_refused_before_it_is_built(tmp_path, expr):
    """`${mul:'A…',3e8}` took 2.95 GB."""
    code, said, _ = _import(tmp_path, f"policy:\n  big: {10**70}\n  x: \"{expr}\"\n")
    assert code == 2 and ("more than the 1048576 rlc resolves" in said or "more than 256 bits" in said), said


@pytest.mark.parametrize("levels, says", [(3000, "rlc reads key paths of at most 1024"), (200, "levels deep")])
def test_a_deep_override_is_a_clean_error(tmp_path, levels, says):
    key = ".".join(["policy"] + ["x"] * levels)
    code, said, _ = _import(tmp_path, "policy:\n  a: 1\n", f"++{key}=1")
    assert code == 2 and says in said and len(said) < 3000, said


def test_an_alias_bomb_in_a_config_is_refused_before_omegaconf_expands_it(tmp_path):
    lines = ["policy:", "  a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9]"] + [
        f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    code, said, _ = _import(tmp_path, "\n".join(lines) + "\n")
    assert code == 2 and "expands to more than" in said, said


# ------------------------------------------------------------------ the caller's environment and secrets

def test_the_environment_is_not_read_unless_allowed(tmp_path, monkeypatch):
    monkeypatch.setenv("RLC_TEST_SECRET", SECRET)
    text = "policy:\n  model_name: ${oc.env:RLC_TEST_SECRET}\n" + GRPO
    code, said, out = _import(tmp_path, text)
    assert code == 2 and "reads an environment variable; rlc import resolves it only with --allow-env" in said
    assert SECRET not in said and not out.exists()
    code, said, out = _import(tmp_path, text, "--allow-env")
    assert SECRET in out.read_text()  # on purpose: the user allowed it


@pytest.mark.parametrize("content", [
    f"root:{SECRET}:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",  # /etc/shadow lines read as keys
    f"api_key: {SECRET}\npassword: hunter2\n",
    f"{SECRET}: 1\n",
    f"- {SECRET}\n",
    f"{SECRET}\n",
    f"key: [{SECRET}\n",  # a YAML error: its text is not quoted
    f"a: *{SECRET}\n",
])
def test_a_defaults_file_that_is_not_a_nemo_rl_config_is_never_echoed(tmp_path, content):
    (tmp_path / "secrets").write_text(content)
    code, said, out = _import(tmp_path, "defaults: secrets\n" + GRPO)
    assert code == 2, said
    assert SECRET not in said and not out.exists()


def test_a_nemo_rl_config_still_lists_its_unmapped_keys(tmp_path):
    """A config with NeMo-RL sections is the user's: its unmapped keys are worth listing."""
    (tmp_path / "parent.yaml").write_text("policy:\n  my_custom_knob: 7\n")
    code, said, out = _import(tmp_path, "defaults: parent.yaml\n" + GRPO, "--set", "cluster.gpu=h100-80gb")
    assert "policy.my_custom_knob: 7" in said
