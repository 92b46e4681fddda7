"""A KL penalty keeps a frozen reference policy on the GPU; the plan counts its parameters.

The runtime (``rlc.runtime.policy.megatron_setup``) builds the reference policy with the trainer's
parallel layout when ``loss.kl_penalty > 0`` and never offloads it, so every phase the planner stacks
Megatron's parameters in (train, refit, the staging site) holds a second bf16 copy of the stage.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "tests" / "validation" / "recipes" / "verl-grpo-qwen3-30ba3b-4n8g-h20.yaml")
LABEL = "reference policy params (bf16)"


def _plan(kl: float):
    result = api.check(RECIPE, [f"loss.kl_penalty={kl}"])
    assert result.plan is not None
    return result.plan


def _item(phase, label):
    return next((i.gib for i in phase.items if i.label == label), None)


def test_no_reference_policy_without_a_kl_penalty():
    plan = _plan(0.0)
    assert all(_item(plan.phases[p], LABEL) is None for p in ("train", "refit", "stack"))


@pytest.mark.parametrize("phase", ["train", "refit", "stack"])
def test_the_reference_policy_is_the_stage_bf16_params(phase):
    plan = _plan(0.001)
    ref = _item(plan.phases[phase], LABEL)
    params = _item(plan.phases[phase], "Megatron params") or _item(plan.phases[phase], "Megatron params (bf16)")
    assert ref is not None and ref == pytest.approx(params) and ref > 1.0


def test_the_reference_policy_takes_its_size_from_the_refit_free_memory():
    without, with_ref = _plan(0.0), _plan(0.001)
    ref = _item(with_ref.phases["refit"], LABEL)
    assert (without.refit.free_at_refit - with_ref.refit.free_at_refit) / 2**30 == pytest.approx(ref, abs=1e-6)


def test_an_offloaded_reference_policy_is_in_host_memory_and_the_runtime_gap_is_named():
    """verl's ref.megatron.param_offload: the copy leaves the GPU phases and lands in host memory per node."""
    on_gpu = _plan(0.001)
    result = api.check(RECIPE, ["loss.kl_penalty=0.001", "training.offload_reference_policy=true"])
    plan = result.plan
    assert all(_item(plan.phases[p], LABEL) is None for p in ("train", "refit", "stack"))
    ref = _item(on_gpu.phases["refit"], LABEL)
    assert plan.host.item_gib("reference policy params (offloaded)") == pytest.approx(ref * 8)  # 8 GPUs per node
    assert plan.refit.free_at_refit > on_gpu.refit.free_at_refit
    gaps = [d for d in result.diagnostics if d.rule == "RLC311"]
    assert [d.path for d in gaps] == ["training.offload_reference_policy"] and result.ok


def test_offloading_without_a_kl_penalty_changes_nothing():
    plain = _plan(0.0)
    result = api.check(RECIPE, ["loss.kl_penalty=0", "training.offload_reference_policy=true"])
    assert result.plan.host.item_gib("reference policy params (offloaded)") == 0.0
    assert result.plan.refit.free_at_refit == plain.refit.free_at_refit
    assert "RLC311" not in {d.rule for d in result.diagnostics}
