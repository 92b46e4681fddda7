"""The planner counts vLLM's MTP speculative-decoding drafter in vLLM's weight pool.

NeMo-RL's DeepSeek-V3 performance recipe (32 x 8 H100, vLLM TP32) added ``speculative_config: {method:
deepseek_mtp, num_speculative_tokens: 1}`` and that run asserted at the first refit (NeMo-RL PR #3356), while
the v0.6 recipe without it ran. The trainer is built without MTP (``num_nextn_predict_layers: 0``), but vLLM's
drafter loads the checkpoint's MTP block, and at the refit it is on the GPU with the rest of vLLM's weights.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlc.compiler import api
from rlc.compiler.catalog.gpus import gpu_spec
from rlc.compiler.planner.memory import DRAFTER_LABEL, _levers, vllm_weights

ROOT = Path(__file__).resolve().parents[2]
DEEPSEEK = ROOT / "tests/validation/recipes/nemo-rl-grpo-deepseek-v3-32n8g.yaml"
TINY_MTP = ROOT / "rlc/recipes/tiny-moe-mtp-2gpu-pp2.yaml"
SPEC = "generation.speculative_decoding"
MTP = (f"{SPEC}.method=mtp", f"{SPEC}.num_speculative_tokens=1")
GIB = 1 << 30


def check(path, *sets):
    result = api.check(str(path), list(sets))
    assert result.plan is not None and result.facts is not None, [d.message for d in result.errors]
    return result


def mtp_block_per_gpu(f, tp: int, expert_shards: int) -> int:
    """One DeepSeek-V3 MTP block's parameters on one GPU, as vLLM's deepseek_mtp.py builds it: an MLA + MoE decoder
    layer (q_a / kv_a projections and their norms, router and its bias whole; q_b, kv_b, o_proj and the shared
    expert split by TP; routed experts by the expert-sharding degree), enorm, hnorm, shared_head.norm and eh_proj
    (a plain nn.Linear 2H -> H, whole on every GPU). embed_tokens and shared_head.head are the model's."""
    h = f.hidden
    whole = (h * f.q_lora_rank + f.q_lora_rank + h * (f.kv_lora_rank + f.qk_rope_head_dim) + f.kv_lora_rank
             + h * f.num_experts + f.num_experts + 2 * h + 3 * h + 2 * h * h)
    split = (f.q_lora_rank * f.heads * (f.qk_nope_head_dim + f.qk_rope_head_dim)
             + f.kv_lora_rank * f.heads * (f.qk_nope_head_dim + f.v_head_dim) + f.heads * f.v_head_dim * h
             + 3 * h * f.shared_expert_intermediate)
    experts = f.num_experts * 3 * f.moe_intermediate * h
    return whole + split // tp + experts // expert_shards


def test_the_drafter_lowers_the_free_memory_at_the_refit_by_its_shard():
    base, spec = check(DEEPSEEK), check(DEEPSEEK, *MTP)
    f = spec.facts
    assert (f.mtp_num_layers, f.checkpoint_mtp_num_layers) == (0, 1)  # trainer without MTP, checkpoint with
    drafter = mtp_block_per_gpu(f, tp=32, expert_shards=32) * 2  # bf16
    assert 0.85 * GIB < drafter < 0.95 * GIB
    assert base.plan.refit.free_at_refit - spec.plan.refit.free_at_refit == pytest.approx(drafter, abs=64)
    assert spec.plan.item_gib("refit", DRAFTER_LABEL) == pytest.approx(drafter / GIB, abs=1e-9)
    assert spec.plan.item_gib("refit", "vLLM weight shard") == base.plan.item_gib("refit", "vLLM weight shard")
    assert spec.plan.vllm_weights_gib == pytest.approx(base.plan.vllm_weights_gib + drafter / GIB, abs=1e-9)
    assert spec.plan.vllm_drafter_gib == pytest.approx(drafter / GIB, abs=1e-9)
    assert "of which MTP drafter 0.89" in spec.plan.to_text()


def test_without_mtp_drafting_the_plan_is_unchanged():
    base = check(DEEPSEEK)
    ngram = check(DEEPSEEK, f"{SPEC}.method=ngram", f"{SPEC}.num_speculative_tokens=3")
    assert base.plan.vllm_drafter_gib is None and ngram.plan.vllm_drafter_gib is None
    assert base.plan.to_json() == ngram.plan.to_json()
    assert all(i.label != DRAFTER_LABEL for p in base.plan.phases.values() for i in p.items)


def test_the_drafter_splits_its_experts_like_the_model_and_is_in_the_host_copy():
    """Generation EP 64 splits the drafter's routed experts 64 ways too; at sleep level 1 vLLM backs the
    drafter's weights up to host memory with the model's (8 GPUs per node)."""
    ep = check(DEEPSEEK, "parallelism.generation.ep=64", *MTP)
    f = ep.facts
    assert ep.plan.vllm_drafter_gib * GIB == pytest.approx(mtp_block_per_gpu(f, tp=32, expert_shards=64) * 2, abs=1)
    base, spec = check(DEEPSEEK), check(DEEPSEEK, *MTP)
    copy = "vLLM weight copy (sleep level 1)"
    assert spec.plan.host.item_gib(copy) - base.plan.host.item_gib(copy) == \
        pytest.approx(8 * spec.plan.vllm_drafter_gib, abs=1e-6)


def test_with_vllm_pipeline_stages_the_drafter_sits_on_the_last_with_its_own_embedding():
    """vLLM shares the model's embedding with an MTP drafter only when PP == 1: with PP 2 the drafter's own
    embedding (vocab x hidden / TP) is on the last stage next to its MTP block."""
    sets = ("refit.sleep_level=1", "parallelism.generation.tp=1", "parallelism.generation.pp=2", *MTP)
    result = check(TINY_MTP, *sets)
    f = result.facts
    weights, unknown = vllm_weights(result.recipe, f)
    assert unknown is None and weights.drafter_blocks == 1
    block = f.vllm_mtp_block_split()
    assert weights.drafter == (block.total + f.vocab * f.hidden) * 2
    one_stage, _ = vllm_weights(check(TINY_MTP, "refit.sleep_level=1", "parallelism.generation.tp=1",
                                      "parallelism.generation.dp=2", *MTP).recipe, f)
    assert one_stage.drafter == block.total * 2  # PP 1: embedding and lm_head shared


def test_with_an_mtp_drafter_no_fix_suggests_sleep_level_2(tmp_path):
    """Sleep level 2 discards the drafter's weights (RLC314): the host-memory error then names the node's memory,
    not level 2, and the refit fixes leave level 2 out. GLM-4.5-Air on 16 GB200 (4 per node, 882 GiB host) is the
    host-memory case of the planner's tests; GLM-4.5's MTP layer drafts."""
    recipe = {
        "version": 1, "model": {"id": "zai-org/GLM-4.5-Air"},
        "cluster": {"nodes": 4, "gpus_per_node": 4, "gpu": "gb200-186gb"},
        "parallelism": {"train": {"tp": 1, "ep": 16}, "generation": {"tp": 2}},
        "generation": {"enforce_eager": True, "speculative_decoding": {"method": "mtp", "num_speculative_tokens": 1}},
        "data": {"train": "/data/train.jsonl"}, "training": {"use_precision_aware_optimizer": True},
    }
    path = tmp_path / "glm-air-mtp.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    result = api.check(str(path))
    [host] = [d for d in result.diagnostics if d.rule == "RLC219"]
    assert host.path == "cluster.host_memory_gib" and "sleep level 2 would discard the MTP drafter" in host.hint
    assert result.plan.vllm_drafter_gib > 0 and "RLC314" not in {d.rule for d in result.diagnostics}
    # the candidate levers the refit fixes are re-planned from (DeepSeek-V3 at sleep level 1)
    h100 = gpu_spec("h100-80gb")
    levers = {key for key, *_ in _levers(check(DEEPSEEK).recipe, check(DEEPSEEK).facts, h100)}
    spec = check(DEEPSEEK, *MTP)
    assert "refit.sleep_level" in levers
    assert levers - {key for key, *_ in _levers(spec.recipe, spec.facts, h100)} == {"refit.sleep_level"}
