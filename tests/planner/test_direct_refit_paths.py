"""``refit.direct_export`` and ``refit.replay_load`` in the compiler: bf16 rollouts only (RLC224), vLLM only."""
from __future__ import annotations

import pytest

from tests.planner.test_planner_model import DSV3, check, rules


@pytest.mark.parametrize("key", ["direct_export", "replay_load"])
def test_fp8_rollouts_refuse_the_bf16_paths_naming_the_key(tmp_path, key):
    result = check(tmp_path, DSV3, "generation.precision=fp8", f"refit.{key}=true")
    errors = [d for d in result.diagnostics if d.rule == "RLC224"]
    assert [(d.severity, d.path) for d in errors] == [("error", f"refit.{key}")]
    assert f"refit.{key}: false" in errors[0].hint
    assert "RLC224" not in rules(check(tmp_path, DSV3, f"refit.{key}=true"))
    assert "RLC224" not in rules(check(tmp_path, DSV3, "generation.precision=fp8"))


@pytest.mark.parametrize("key", ["direct_export", "replay_load"])
def test_the_megatron_backend_refuses_them(tmp_path, key):
    megatron = {**DSV3, "generation": {**DSV3["generation"], "backend": "megatron", "kv_cache_memory_bytes": 1 << 30}}
    result = check(tmp_path, megatron, f"refit.{key}=true")
    assert any(d.path == f"refit.{key}" and d.severity == "error" for d in result.diagnostics)
    assert not any(d.path == f"refit.{key}" for d in check(tmp_path, megatron).diagnostics)
