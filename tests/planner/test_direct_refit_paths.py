"""``refit.direct_export``, ``refit.zero_copy_views``, ``refit.zero_copy_experts`` and ``refit.replay_load`` in the
compiler: bf16 rollouts only (RLC224), zero-copy views only with the direct export (RLC225), experts read in place
only with zero-copy views and fused transfer (RLC228), vLLM only."""
from __future__ import annotations

import pytest

from tests.planner.test_planner_model import DSV3, check, rules


KEYS = ["direct_export", "zero_copy_views", "zero_copy_experts", "replay_load"]
#: What each switch needs besides itself to be valid in bf16 (zero-copy views are the direct export's).
WITH = {"zero_copy_views": ["refit.direct_export=true"],
        "zero_copy_experts": ["refit.direct_export=true", "refit.zero_copy_views=true"]}


@pytest.mark.parametrize("key", KEYS)
def test_fp8_rollouts_refuse_the_bf16_paths_naming_the_key(tmp_path, key):
    result = check(tmp_path, DSV3, "generation.precision=fp8", f"refit.{key}=true")
    errors = [d for d in result.diagnostics if d.rule == "RLC224"]
    assert [(d.severity, d.path) for d in errors] == [("error", f"refit.{key}")]
    assert f"refit.{key}: false" in errors[0].hint
    assert "RLC224" not in rules(check(tmp_path, DSV3, f"refit.{key}=true", *WITH.get(key, [])))
    assert "RLC224" not in rules(check(tmp_path, DSV3, "generation.precision=fp8"))


def test_zero_copy_views_need_the_direct_export(tmp_path):
    errors = [d for d in check(tmp_path, DSV3, "refit.zero_copy_views=true").diagnostics if d.rule == "RLC225"]
    assert [(d.severity, d.path) for d in errors] == [("error", "refit.zero_copy_views")]
    assert "refit.direct_export: true" in errors[0].hint
    assert "RLC225" not in rules(check(tmp_path, DSV3, "refit.zero_copy_views=true", "refit.direct_export=true"))


def test_experts_are_read_in_place_only_with_zero_copy_views_and_fused_transfer(tmp_path):
    experts = "refit.zero_copy_experts=true"
    alone = [d for d in check(tmp_path, DSV3, experts).diagnostics if d.rule == "RLC228"]
    assert [(d.severity, d.path) for d in alone] == [("error", "refit.zero_copy_experts")]
    assert "refit.zero_copy_views is off" in alone[0].message and "refit.zero_copy_views: true" in alone[0].hint
    views = ("refit.direct_export=true", "refit.zero_copy_views=true")
    assert "RLC228" not in rules(check(tmp_path, DSV3, experts, *views))  # fused transfer: auto
    off = [d for d in check(tmp_path, DSV3, experts, *views, "refit.fused_transfer=off").diagnostics
           if d.rule == "RLC228"]
    assert len(off) == 1 and "refit.fused_transfer is off" in off[0].message


@pytest.mark.parametrize("key", KEYS)
def test_the_megatron_backend_refuses_them(tmp_path, key):
    megatron = {**DSV3, "generation": {**DSV3["generation"], "backend": "megatron", "kv_cache_memory_bytes": 1 << 30}}
    result = check(tmp_path, megatron, f"refit.{key}=true")
    assert any(d.path == f"refit.{key}" and d.severity == "error" for d in result.diagnostics)
    assert not any(d.path == f"refit.{key}" for d in check(tmp_path, megatron).diagnostics)
