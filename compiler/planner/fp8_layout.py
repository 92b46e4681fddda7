"""FP8 rollouts in the compiler: which scales a recipe's FP8 engine gets (``generation.fp8.scales``,
``auto`` resolved here) and why block scales may not fit a layout. Read by the planner (the bytes on the
refit's wire) and the rules (RLC330), so both see the same answer."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from rlc.compiler.planner.fp8_keep import component_fully_kept
from rlc.compiler.planner.layout import generation_layout
from rlc.contract.fp8 import BLOCK

if TYPE_CHECKING:
    from rlc.compiler.recipe_types import Recipe

BLOCK_N, BLOCK_K = BLOCK


def _shard(width: int, tp: int) -> Optional[int]:
    """``width`` split over ``tp`` ranks (None when it does not split evenly: RLC105 reports that)."""
    return width // tp if width % tp == 0 else None


def _kv_rows(kv_heads: int, head_dim: int, tp: int) -> int:
    """Rows of k_proj (or v_proj) on one vLLM rank: KV heads split over TP, or one replicated head."""
    return (kv_heads // tp if kv_heads >= tp else 1) * head_dim


def block_alignment_problems(facts: Any, tp: int, ep: int, keep: tuple[str, ...] = ()) -> list[str]:
    """Why 128×128 block scales quantized per HF tensor would not be what vLLM holds on a ``tp``-way engine
    (``ep`` > 1: vLLM's expert parallelism, experts not split by TP); empty when every quantized projection's
    shard on a vLLM rank starts and ends on a block boundary (the last block of a tensor may be ragged).

    These are vLLM's own conditions for a block-quantized checkpoint (``validate_fp8_block_shape``, and
    ``Fp8MoEMethod.create_weights`` for experts): a fused q/k/v or gate/up parameter, or a tensor-parallel
    slice, that starts inside a block would mix two tensors' blocks under one scale.

    ``keep`` (``generation.fp8.keep_bf16``): components whose modules it names stay in the model dtype on both sides
    (:func:`rlc.compiler.planner.fp8_keep.component_fully_kept`), so their shapes do not matter.
    """
    out: list[str] = []
    kinds = facts.layer_kinds or ()
    mixers = {m for m, _ in kinds if m and not component_fully_kept("attention" if m == "full_attention" else m, keep)}
    experts_kept = component_fully_kept("routed_experts", keep)
    other = sorted(mixers - {"full_attention", "mla"})
    if other:
        out.append(f"the model has {', '.join(other)} layers, whose projections the trainer does not quantize")
    if facts.is_moe and facts.expert_export == "stacked" and not experts_kept:
        out.append("Megatron-Bridge exports the routed experts as one stacked tensor per projection; block "
                   "scales are sent per expert")

    def need(what: str, rows: Optional[int], multiple: int = BLOCK_N) -> None:
        if rows is not None and rows % multiple:
            out.append(f"{what} = {rows}, not a multiple of {multiple}")

    split = tp > 1
    if "full_attention" in mixers and None not in (facts.heads, facts.head_dim, facts.kv_heads):
        q = _shard(facts.heads * facts.head_dim * (2 if facts.attn_output_gate else 1), tp)
        kv = _kv_rows(facts.kv_heads, facts.head_dim, tp)
        need(f"q_proj rows per vLLM rank (fused q/k/v, TP {tp})", q)
        need(f"k_proj rows per vLLM rank (fused q/k/v, TP {tp})", kv)
        if split:
            need(f"v_proj rows per vLLM rank (TP {tp})", kv)
            need(f"o_proj columns per vLLM rank (TP {tp})", _shard(facts.heads * facts.head_dim, tp), BLOCK_K)
    if "mla" in mixers and facts.heads is not None:
        if facts.q_lora_rank:
            need("q_a_proj rows (fused with kv_a_proj_with_mqa)", facts.q_lora_rank)
        if split and None not in (facts.qk_nope_head_dim, facts.qk_rope_head_dim, facts.v_head_dim):
            q_name = "q_b_proj" if facts.q_lora_rank else "q_proj"
            need(f"{q_name} rows per vLLM rank (TP {tp})",
                 _shard(facts.heads * (facts.qk_nope_head_dim + facts.qk_rope_head_dim), tp))
            need(f"kv_b_proj rows per vLLM rank (TP {tp})",
                 _shard(facts.heads * (facts.qk_nope_head_dim + facts.v_head_dim), tp))
            need(f"o_proj columns per vLLM rank (TP {tp})", _shard(facts.heads * facts.v_head_dim, tp), BLOCK_K)
    mlps = {m for _, m in kinds if m}
    dense_kept, shared_kept = component_fully_kept("dense_mlp", keep), component_fully_kept("shared_experts", keep)
    for width, what in ((facts.dense_intermediate if "dense" in mlps and not dense_kept else None, "MLP"),
                        (None if shared_kept else facts.shared_expert_intermediate or None, "shared expert")):
        if width:
            per = _shard(width, tp)
            need(f"{what} gate_proj rows per vLLM rank (fused gate/up, TP {tp})", per)
            if split:
                need(f"{what} down_proj columns per vLLM rank (TP {tp})", per, BLOCK_K)
    if "moe" in mlps and facts.moe_intermediate and not experts_kept:
        experts_tp = 1 if ep > 1 else tp
        per = _shard(facts.moe_intermediate, experts_tp)
        need(f"expert intermediate width per vLLM rank ({'EP' if ep > 1 else f'TP {tp}'})", per)
    return out


def fp8_scales(recipe: "Recipe", facts: Any) -> tuple[Optional[str], str]:
    """``(scales, reason)`` of the FP8 engine: the recipe's ``block`` / ``tensor``, or for ``auto`` block scales
    where every quantized projection is 128-aligned on each vLLM rank (the trainer quantizes; the wire carries
    1 byte a weight), else tensor scales (vLLM quantizes as it loads). ``(None, ...)`` for bf16 rollouts."""
    gen = recipe.generation
    if gen.precision != "fp8":
        return None, "bf16 rollouts"
    if gen.fp8.scales != "auto":
        return gen.fp8.scales, "set in recipe"
    if facts is None:
        return "tensor", "auto: the model's shapes are unknown, so vLLM quantizes as it loads"
    gl = generation_layout(recipe)
    problems = block_alignment_problems(facts, gl.tp, gl.ep, tuple(gen.fp8.keep_bf16))
    if problems:
        return "tensor", ("auto: block scales do not fit this layout (" + problems[0] + "), so vLLM quantizes "
                          "per tensor as it loads")
    return "block", ("auto: every quantized projection is 128-aligned on each vLLM rank, so the trainer "
                     "quantizes 128x128 blocks and the refit moves 1 byte a weight")


__all__ = ["block_alignment_problems", "fp8_scales"]
