"""A re-planned lever is offered as a fix only if it does not overfill another phase.

slime's DeepSeek-R1 run on 128 H100 needs Megatron's CPU Adam for its train step. With its refit buffer
squeezed (ratio 0.18, a half just under the 1.73 GiB embedding), turning the CPU optimizer off frees
3.1 GiB at the refit, but the train step would then need more than the GPU: it must not be listed as a
fix that passes.
"""
from __future__ import annotations

from pathlib import Path

from rlc.compiler import api

ROOT = Path(__file__).resolve().parents[2]
SLIME_DSR1 = str(ROOT / "tests" / "validation" / "recipes" / "slime-grpo-deepseek-r1-16n8g.yaml")


def _fixes(*overrides):
    result = api.check(SLIME_DSR1, list(overrides))
    assert result.plan is not None
    return {f.key: f for f in result.plan.fixes}, result


def test_a_lever_that_breaks_the_train_step_is_not_a_fix():
    fixes, result = _fixes("refit.buffer_memory_ratio=0.18")
    assert "RLC210" in {d.rule for d in result.errors}
    cpu = fixes["training.optimizer_cpu_offload"]
    assert not cpu.sufficient
    assert "the train step then needs" in cpu.text and "of 79.11 GiB" in cpu.text
    # the levers that leave the train step alone still pass, and the first fix is the free one
    assert fixes["refit.buffer_memory_ratio"].sufficient and fixes["generation.enforce_eager"].sufficient
    assert result.plan.fixes[0].key == "refit.buffer_memory_ratio"
    hints = " ".join(d.hint or "" for d in result.errors if d.rule == "RLC210")
    assert "optimizer_cpu_offload: false: frees ≈ 3.1 GiB; then" not in hints


def test_the_same_lever_is_a_fix_where_the_train_step_has_room():
    """slime's Qwen3-30B-A3B on one node: with slime's fp32 grad buffers the train step needs CPU Adam, as
    slime's example page says ("we need to enable Megatron's CPU Adam"); with bf16 grad buffers
    (``training.grad_reduce_in_fp32: false``), a packed micro batch of 4096 tokens (the loss's fp32 logits: 1.2
    instead of 5.8 GiB), NCCL's NVLS buffers off and the IPC halves allocated per refit (at this small ratio
    ``refit.keep_buffers_gb`` would keep them, 0.9 GiB) it has room, and there the lever stays a fix."""
    recipe = str(ROOT / "tests" / "validation" / "recipes" / "slime-grpo-qwen3-30ba3b-1n8g.yaml")
    squeezed = ["refit.buffer_memory_ratio=0.02", "refit.keep_buffers_gb=0"]
    as_published = {f.key: f for f in api.check(recipe, squeezed).plan.fixes}["training.optimizer_cpu_offload"]
    assert not as_published.sufficient and "the train step then needs" in as_published.text
    roomy = ["training.grad_reduce_in_fp32=false", "training.sequence_packing.train_mb_tokens=4096",
             "cluster.env.NCCL_NVLS_ENABLE='0'"]
    result = api.check(recipe, [*squeezed, *roomy])
    cpu = {f.key: f for f in result.plan.fixes}["training.optimizer_cpu_offload"]
    assert cpu.sufficient and "but" not in cpu.text
    off = api.check(recipe, [*squeezed, *roomy, "training.optimizer_cpu_offload=false"])
    assert off.plan.checks["train_fit"].ok
