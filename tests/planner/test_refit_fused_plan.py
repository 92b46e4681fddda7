"""The refit buffer math with ``refit.fused_transfer``: the largest tensor on the wire is a stacked expert tensor."""
from __future__ import annotations

import dataclasses

from rlc.compiler import catalog
from rlc.compiler.planner import plan_memory
from rlc.compiler.planner.refit_math import refit_facts
from rlc.contract.refit_buffer import exported_experts, fused_transfer_applies

from planner_helpers import with_changes


def test_fused_transfer_plans_the_stacked_expert_tensor(base_recipe, qwen397):
    per_expert = dataclasses.replace(qwen397, expert_export="per_expert")
    gpu = catalog.gpu_spec(base_recipe.cluster.gpu)
    off = plan_memory(with_changes(base_recipe, refit__fused_transfer="off"), per_expert, gpu).refit
    on = plan_memory(with_changes(base_recipe, refit__fused_transfer="on"), per_expert, gpu).refit
    stacked = plan_memory(base_recipe, qwen397, gpu).refit  # a model whose export is stacked anyway
    assert off is not None and on is not None and stacked is not None
    assert ".experts.0." in off.largest_name or "experts" not in off.largest_name
    assert on.largest_name.endswith("mlp.experts.gate_up_proj") and on.largest > off.largest
    assert (on.largest_name, on.largest, on.gathered) == (stacked.largest_name, stacked.largest, stacked.gathered)
    assert on.gathered == on.largest  # experts gathered over expert parallelism before the stack goes out


def test_fp8_rollouts_and_stacked_models_keep_their_export(base_recipe, qwen397):
    per_expert = dataclasses.replace(qwen397, expert_export="per_expert")
    fp8 = with_changes(base_recipe, refit__fused_transfer="on", generation__precision="fp8")
    assert refit_facts(fp8, per_expert).expert_export == "per_expert"
    assert refit_facts(with_changes(base_recipe, refit__fused_transfer="on"), qwen397) is qwen397
    assert exported_experts(None, fused=True) is None
    assert fused_transfer_applies(True, "fp8")[0] is False and fused_transfer_applies(True, "bf16")[0] is True
