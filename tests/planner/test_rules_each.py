"""Each rule fires on a recipe that breaks it, with its numbers, and stays quiet on the shipped recipe."""
from __future__ import annotations

import pytest

from rlc.compiler import catalog
from rlc.compiler.planner import plan_memory
from rlc.compiler.rules import run_rules
from rlc.compiler.recipe_types import recipe_from_data
from rlc.compiler.schema import with_defaults

from planner_helpers import RECIPES, with_changes


def run(recipe, facts, gpu="h100-80gb", raw=None):
    plan = plan_memory(recipe, facts, catalog.gpu_spec(gpu)) if facts is not None else None
    return run_rules(recipe, facts, plan, raw=raw)


def fired(result, rule_id, severity=None):
    return [d for d in result.diagnostics if d.rule == rule_id and (severity is None or d.severity == severity)]


def test_shipped_recipe_has_no_errors_or_warnings(base_recipe, qwen397):
    result = run(base_recipe, qwen397)
    assert [d for d in result.diagnostics if d.severity != "info"] == []
    assert set(result.decisions) == {"refit.sync_params_before_refit", "refit.dedupe_mtp_embedding",
                                     "refit.per_rank_ipc_metadata", "refit.fp32_params", "refit.fused_transfer"}
    for _value, reason in result.decisions.values():
        assert reason.startswith("RLC2")


@pytest.mark.parametrize("changes,rule_id,path,words", [
    (dict(cluster__nodes=25), "RLC101", "parallelism.train.tp", ["64", "200 GPUs"]),
    (dict(parallelism__train__ep=24), "RLC103", "parallelism.train.ep", ["512 experts", "EP24"]),
    (dict(parallelism__train__ep=48, cluster__nodes=30), "RLC102", "parallelism.train.ep", ["EP48"]),
    (dict(parallelism__train__num_layers_in_first_pipeline_stage=5), "RLC104",
     "parallelism.train.num_layers_in_first_pipeline_stage", ["49 remaining layers"]),
    (dict(parallelism__train__vpp=4), "RLC104", "parallelism.train.vpp", ["6 layers", "VPP4"]),
    (dict(parallelism__generation__tp=64, parallelism__generation__ep=64), "RLC105", "parallelism.generation.tp",
     ["32 attention heads", "TP64"]),
    (dict(parallelism__train__sequence_parallel=False), "RLC108", "parallelism.train.sequence_parallel", ["TP8"]),
    (dict(parallelism__generation__dp=8), "RLC109", "parallelism.generation.dp", ["128 GPUs", "256"]),
    (dict(parallelism__generation__ep=24), "RLC110", "parallelism.generation.ep", ["not a multiple of vLLM TP16"]),
    (dict(parallelism__generation__ep=48), "RLC110", "parallelism.generation.ep", ["512 experts"]),
    (dict(refit__dedupe_mtp_embedding="off"), "RLC201", "refit.dedupe_mtp_embedding", ["[0, 7]"]),
    (dict(training__overlap_param_gather=True, refit__sync_params_before_refit="off"), "RLC202",
     "refit.sync_params_before_refit", ["stale"]),
    (dict(refit__per_rank_ipc_metadata="off"), "RLC203", "refit.per_rank_ipc_metadata", ["EP32 / PP8"]),
    (dict(refit__buffer_gb=20, refit__buffer_memory_ratio=0.45), "RLC206", "refit.buffer_gb", ["20", "0.45"]),
    (dict(colocated=False), "RLC207", "colocated", ["colocated with the trainer only", "NCCL"]),
    (dict(training__use_distributed_optimizer=False, training__overlap_param_gather=True), "RLC208",
     "training.overlap_param_gather", []),
    (dict(cluster__env={"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6,expandable_segments:True"}),
     "RLC301", "cluster.env.PYTORCH_CUDA_ALLOC_CONF", ["pytorch#147851"]),
    (dict(grpo__dynamic_sampling={"enabled": False, "max_gen_batches": 10, "batch_multiplier": 2}), "RLC302",
     "grpo.dynamic_sampling.batch_multiplier", ["2"]),
    (dict(generation__max_model_len=1000), "RLC305", "generation.max_model_len", ["1024", "1000"]),
    (dict(training__global_batch_size=250), "RLC107", "training.global_batch_size", ["250", "DP 4"]),
    (dict(generation__gpu_memory_utilization=0.02), "RLC214", "generation.gpu_memory_utilization", ["4.17 GiB"]),
])
def test_error_rules(base_recipe, qwen397, changes, rule_id, path, words):
    result = run(with_changes(base_recipe, **changes), qwen397)
    hits = fired(result, rule_id, "error")
    assert hits, [(d.rule, d.message) for d in result.diagnostics]
    assert hits[0].path == path
    for w in words:
        assert w in hits[0].message, hits[0].message
    assert not fired(run(base_recipe, qwen397), rule_id, "error")


@pytest.mark.parametrize("gbs,micro,hint", [(250, 1, "use 248 or 252"), (2, 1, "use 4"), (2048, 2048, "use 8192")])
def test_batch_hint_offers_distinct_multiples(base_recipe, qwen397, gbs, micro, hint):
    """A global batch below one micro batch × DP has one fix to offer, not "use 512 or 512"."""
    result = run(with_changes(base_recipe, training__global_batch_size=gbs, training__micro_batch_size=micro), qwen397)
    assert [d.hint for d in fired(result, "RLC107", "error")] == [hint]


@pytest.mark.parametrize("changes,rule_id", [
    (dict(training__optimizer_cpu_offload=True), "RLC205"),
    (dict(generation__sampling__temperature=0.2), "RLC304"),
    (dict(refit__transport="shm"), "RLC207"),
    (dict(training__max_sequence_length=4096), "RLC305"),
])
def test_warning_rules(base_recipe, qwen397, changes, rule_id):
    assert fired(run(with_changes(base_recipe, **changes), qwen397), rule_id, "warning")


@pytest.mark.parametrize("changes,severity,path,words", [
    (dict(grpo__reward_shaping__overlong_buffer_length=4096, generation__sampling__max_tokens=4096), "error",
     "grpo.reward_shaping.overlong_buffer_length", ["every response is penalised"]),
    (dict(grpo__reward_shaping__max_response_length=8192, grpo__reward_shaping__overlong_buffer_length=1024,
          generation__sampling__max_tokens=6144), "warning", "grpo.reward_shaping.max_response_length",
     ["starts at 7168 tokens", "max_tokens 6144", "never applies"]),
])
def test_overlong_penalty_that_cannot_work_is_named(base_recipe, qwen397, changes, severity, path, words):
    result = run(with_changes(base_recipe, grpo__reward_shaping__enabled=True, **changes), qwen397)
    (d,) = fired(result, "RLC307")
    assert d.severity == severity and d.path == path and all(w in d.message for w in words)
    fine = with_changes(base_recipe, grpo__reward_shaping__enabled=True, generation__sampling__max_tokens=4096,
                        grpo__reward_shaping__overlong_buffer_length=1024)
    assert not fired(run(fine, qwen397), "RLC307")


@pytest.mark.parametrize("changes,path", [(dict(data__system_prompt="Be brief."), "data.system_prompt"),
                                          (dict(data__chat_template_kwargs={"enable_thinking": False}),
                                           "data.chat_template_kwargs")])
def test_chat_settings_without_a_chat_template_are_refused(base_recipe, qwen397, changes, path):
    (d,) = fired(run(with_changes(base_recipe, **changes), qwen397), "RLC308", "error")
    assert d.path == path and d.hint == "data.chat_template: default"
    assert not fired(run(with_changes(base_recipe, data__chat_template="default", **changes), qwen397), "RLC308")


def test_a_forced_ratio_needs_one_optimizer_step_per_grpo_step(base_recipe, qwen397):
    samples = base_recipe.grpo.prompts_per_step * base_recipe.grpo.generations_per_prompt
    one_step = with_changes(base_recipe, loss__force_on_policy_ratio=True, training__global_batch_size=samples)
    assert not fired(run(one_step, qwen397), "RLC309")
    several = with_changes(base_recipe, loss__force_on_policy_ratio=True, training__global_batch_size=samples // 2)
    (d,) = fired(run(several, qwen397), "RLC309", "error")
    assert d.hint == f"training.global_batch_size: {samples}"


def test_truncated_sampling_is_told_not_warned(base_recipe, qwen397):
    """The trainer scores the sampled tokens under the engine's cuts: an info naming them, no warning."""
    result = run(with_changes(base_recipe, generation__sampling__top_p=0.9, generation__sampling__top_k=50), qwen397)
    (info,) = fired(result, "RLC303")
    assert info.severity == "info" and info.path == "generation.sampling.top_k"
    assert "top_k 50, top_p 0.9" in info.message and "same cuts" in info.message
    assert not fired(run(base_recipe, qwen397), "RLC303")


def test_cpu_offload_warning_quotes_the_planned_extra(base_recipe, qwen397):
    hit = fired(run(with_changes(base_recipe, training__optimizer_cpu_offload=True), qwen397), "RLC205")[0]
    assert "12.72 → 15.86" in hit.message and "+3.14 GiB" in hit.message


def test_auto_switches_decide_and_explain(base_recipe, qwen397):
    result = run(with_changes(base_recipe, training__overlap_param_gather=True), qwen397)
    assert result.decisions["refit.sync_params_before_refit"][0] is True
    assert fired(result, "RLC202", "info")
    single = with_changes(base_recipe, parallelism__train__pp=1, parallelism__train__ep=1,
                          parallelism__train__num_layers_in_first_pipeline_stage=None,
                          parallelism__train__num_layers_in_last_pipeline_stage=None)
    decisions = run_rules(single, qwen397, None).decisions
    assert decisions["refit.dedupe_mtp_embedding"][0] is False
    assert decisions["refit.per_rank_ipc_metadata"][0] is True  # auto = on, by contract


def test_dedupe_not_needed_without_mtp(base_recipe):
    dense = catalog.model_facts("Qwen/Qwen3-8B", RECIPES)
    decisions = run_rules(base_recipe, dense, None).decisions
    assert decisions["refit.dedupe_mtp_embedding"] == (False, "RLC201: off: the model has no MTP layers")


def test_fp32_params_auto_and_explicit_lists():
    nano = catalog.model_facts("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B", RECIPES)
    recipe = recipe_from_data(with_defaults({
        "version": 1, "model": {"id": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B"}, "data": {"train": "/d.jsonl"},
        "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb"},
        "parallelism": {"train": {"tp": 1, "pp": 1, "ep": 8}, "generation": {"tp": 1}},
        "refit": {"fp32_params": "auto"}}))
    auto = run_rules(recipe, nano, None)
    assert auto.decisions["refit.fp32_params"][0] == ["*e_score_correction_bias*", "*expert_bias*"]
    missing = run_rules(with_changes(recipe, refit__fp32_params=["*expert_bias*"]), nano, None)
    err = fired(missing, "RLC204", "error")
    assert err and "e_score_correction_bias" in err[0].message and "bf16" in err[0].message
    covered = run_rules(with_changes(recipe, refit__fp32_params=["*.gate.e_score_correction_bias"]), nano, None)
    assert not fired(covered, "RLC204", "error")


def test_buffer_exclusivity_uses_the_raw_recipe_when_given(base_recipe, qwen397):
    both_default = with_changes(base_recipe, refit__buffer_gb=20, refit__buffer_memory_ratio=0.3)
    assert not fired(run(both_default, qwen397), "RLC206")  # 0.3 may be the schema default
    raw = {"refit": {"buffer_gb": 20, "buffer_memory_ratio": 0.3}}
    assert fired(run(both_default, qwen397, raw=raw), "RLC206", "error")


def test_kv_heads_replication_is_info_and_uneven_is_error(base_recipe, qwen397):
    assert fired(run(base_recipe, qwen397), "RLC106", "info")
    llama = catalog.model_facts("meta-llama/Llama-3.1-8B", RECIPES)  # 8 KV heads
    recipe = with_changes(base_recipe, parallelism__generation__tp=16, parallelism__generation__ep=1)
    assert not fired(run_rules(recipe, llama, None), "RLC106", "error")
    recipe = with_changes(base_recipe, parallelism__train__tp=3, cluster__nodes=3, parallelism__train__pp=1)
    assert fired(run_rules(recipe, llama, None), "RLC106", "error")


def test_pipeline_split_suggests_edge_stages(base_recipe, qwen397):
    recipe = with_changes(base_recipe, parallelism__train__num_layers_in_first_pipeline_stage=None,
                          parallelism__train__num_layers_in_last_pipeline_stage=None)
    hit = fired(run(recipe, qwen397), "RLC104", "error")[0]
    assert "60 layers" in hit.message and "num_layers_in_first_pipeline_stage: 6" in hit.hint


def test_rules_without_facts_or_plan_skip_quietly(base_recipe):
    result = run_rules(base_recipe, None, None)
    assert not [d for d in result.diagnostics if d.rule and d.rule.startswith(("RLC21", "RLC10"))
                and d.rule not in ("RLC101", "RLC102", "RLC107", "RLC108", "RLC109")]
    assert result.decisions["refit.fp32_params"][0] == []


@pytest.mark.parametrize("alignment", [1, 256])
def test_buffer_half_boundary_matches_the_runtime_packer(base_recipe, qwen397, alignment):
    """RLC210 and the runtime's bucket packer share one boundary: a tensor exactly the half's size fits."""
    from rlc.compiler.planner.plan import GIB
    from rlc.runtime.refit.bucket_planner import BucketPacker
    from rlc.runtime.refit.specs import TensorSpec

    largest = plan_memory(base_recipe, qwen397, catalog.gpu_spec("h100-80gb")).refit.largest
    assert largest % alignment == 0
    for half, fits in ((largest, True), (largest - alignment, False)):
        recipe = with_changes(base_recipe, refit__buffer_gb=2 * half / GIB, refit__alignment_bytes=alignment)
        plan = plan_memory(recipe, qwen397, catalog.gpu_spec("h100-80gb"))
        assert plan.refit.per_side == half and plan.refit.largest == largest
        assert bool(fired(run(recipe, qwen397), "RLC210")) is not fits, half
        # the runtime sends the same tensor in a regular half when it fits, in a one-off buffer when not
        spec = TensorSpec("experts.gate_up_proj", (largest // 2,), "bfloat16")
        assert BucketPacker(half, alignment).is_oneoff(spec) is not fits
