"""``refit.verify_every``'s host memory in the plan (RLC219): the streamed check's few shards per GPU, and the FP8
check that gathers the whole export on every GPU, which a 397B model cannot afford."""
from __future__ import annotations

from rlc.compiler import api, catalog
from rlc.compiler.planner.verify_host import LABEL, largest_uncut_params
from rlc.contract.verify_check import SHARD_BYTES, gathered_check_host_bytes, shard_bound, streamed_check_host_bytes

from planner_helpers import BASE, GIB, RECIPES


def _check_item(result: api.CheckResult) -> float:
    assert result.plan is not None and result.plan.host is not None
    return result.plan.host.item_gib(LABEL)


def test_the_check_is_planned_only_when_asked_for_and_in_the_refit_phase():
    off = api.check(str(BASE))
    on = api.check(str(BASE), ["refit.verify_every=10"])
    assert _check_item(off) == 0.0
    assert off.plan.host.phase == on.plan.host.phase == "refit" and _check_item(on) > 0
    assert abs(on.plan.host.used_gib - off.plan.host.used_gib - _check_item(on)) < 1e-9
    assert "RLC219" not in {d.rule for d in on.errors}  # bf16: a few shards per GPU fit a DGX node


def test_the_streamed_check_is_a_few_shards_of_the_largest_layer_per_gpu():
    result = api.check(str(BASE), ["refit.verify_every=10"])
    facts, recipe = result.facts, result.recipe
    unit = largest_uncut_params(facts) * 2
    export = facts.param_counts()["total"] * 2
    # the MTP block (a 512-expert layer and its projections) is the largest piece, above the 1 GiB a shard is cut at
    moe_layer = max(facts.layer_split(k).total for k in set(facts.layer_kinds)) * 2
    assert unit == facts.mtp_block_split().total * 2 > moe_layer > SHARD_BYTES
    per_node = _check_item(result) * GIB / recipe.cluster.gpus_per_node
    assert 2 * shard_bound(unit, export) <= per_node <= 4 * shard_bound(unit, export)
    assert per_node < export / 10  # the check before streaming held the export and two weight copies per GPU


def test_fp8_rollouts_gather_the_whole_export_and_a_397b_model_is_refused_naming_the_check():
    bf16 = api.check(str(BASE), ["refit.verify_every=10"])
    fp8 = api.check(str(BASE), ["refit.verify_every=10", "generation.precision=fp8"])
    assert "RLC219" not in {d.rule for d in api.check(str(BASE), ["generation.precision=fp8"]).errors}
    (err,) = [d for d in fp8.errors if d.rule == "RLC219"]
    assert err.path == "refit.verify_every" and "refit.verify_every check" in err.message
    assert "FP8 rollouts gather the whole export" in err.hint and "refit.verify_every: 0" in err.hint
    export = fp8.facts.param_counts()["total"] * 2
    assert _check_item(fp8) * GIB >= 8 * export > _check_item(bf16) * GIB


def test_small_models_plan_at_most_the_export():
    facts = catalog.model_facts("Qwen/Qwen3-8B", RECIPES)
    export = facts.param_counts()["total"] * 2
    unit = largest_uncut_params(facts) * 2
    assert unit == (facts.vocab_matrix_params() + facts.hidden) * 2  # the LM head with the final norm
    assert shard_bound(unit, export) == SHARD_BYTES + unit
    assert shard_bound(unit, 10 << 20) == 10 << 20
    assert streamed_check_host_bytes(unit, export, vllm_share=0.5) == 3 * (SHARD_BYTES + unit)
    assert gathered_check_host_bytes(export, export // 2, unit) == 2 * export + SHARD_BYTES + unit
