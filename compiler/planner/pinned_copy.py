"""Host memory of vLLM's sleep-level-1 weight copy: the pinned blocks PyTorch actually holds for it.

vLLM's ``CuMemAllocator.sleep`` backs every allocation of its weight pool up in a pinned CPU tensor of
its own (``torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=True)``, one per allocation
handle: vllm/device_allocator/cumem.py). PyTorch's pinned-memory allocator rounds every allocation up
to a power of two ("Round up the allocation to the nearest power of two to improve reuse":
``c10::llvm::PowerOf2Ceil`` in aten/src/ATen/core/CachingHostAllocator.h) and keeps freed blocks
cached, so the rounded blocks stay in host memory after wake-up. The pool's allocations are the
segments PyTorch's CUDA caching allocator asks it for (c10/cuda/CUDACachingAllocator.cpp): a tensor
of 10 MiB or more gets a segment of its own, rounded up to 2 MiB; tensors of 1–10 MiB are packed into
20 MiB segments, smaller ones into 2 MiB segments.

So the copy of a 704 MiB expert tensor takes 1 GiB of host memory, and an MoE shard's copy is about
1.4 × its weights. The large tensors vLLM holds are named here per layer (fused QKV and output
projections, MLA projections, fused gate/up and down projections of dense, shared and routed
experts, vocabulary matrices); the rest of the shard (norms, routers, biases, FP8 scales,
linear-attention and Mamba mixers, MTP drafter blocks) is counted at its size.
"""
from __future__ import annotations

from typing import Optional

from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.layout import GenerationLayout

MIB = 1 << 20
SEGMENT_ROUND = 2 * MIB  # kRoundLarge: large segments are rounded up to 2 MiB
OWN_SEGMENT = 10 * MIB  # kMinLargeAlloc: from this size a tensor gets a segment of its own
SHARED_SEGMENT = 20 * MIB  # kLargeBuffer: tensors of 1-10 MiB share segments of this size
SMALL = 1 * MIB  # kSmallSize: tensors up to this size share 2 MiB segments (no rounding loss)


def power_of_two_ceil(n: int) -> int:
    """The pinned block PyTorch's host allocator hands out for ``n`` bytes."""
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


def pinned_copy_bytes(tensors: list[int], total: int) -> int:
    """Host bytes of the level-1 copy of a weight pool of ``total`` bytes whose large tensors are
    ``tensors`` (bytes each); what ``tensors`` does not name is counted at its size."""
    own = [t for t in tensors if t >= OWN_SEGMENT]
    shared = sum(t for t in tensors if SMALL < t < OWN_SEGMENT)
    named = sum(own) + shared
    rounded = sum(power_of_two_ceil(-(-t // SEGMENT_ROUND) * SEGMENT_ROUND) for t in own)
    rounded += -(-shared // SHARED_SEGMENT) * power_of_two_ceil(SHARED_SEGMENT)
    return rounded + max(0, total - named)


def vllm_stage_tensors(facts: ModelFacts, layout: GenerationLayout, layers: list[int], vocab_copies: int,
                       linear_bytes: int, dtype_bytes: int) -> Optional[list[int]]:
    """Bytes of the large tensors one vLLM GPU of a pipeline stage holds (its ``layers`` and
    ``vocab_copies`` vocabulary matrices); ``linear_bytes`` per element of linear layers (1 with FP8),
    ``dtype_bytes`` for the vocabulary matrices and routers. ``None`` when a shape is unknown."""
    h, tp = facts.hidden, layout.tp
    if h is None or facts.layer_kinds is None or facts.vocab is None:
        return None
    out = [facts.vocab // tp * h * dtype_bytes] * vocab_copies
    for index in layers:
        mixer, mlp = facts.layer_kinds[index]
        if mixer == "full_attention":
            attention = _attention(facts, tp, linear_bytes)
            if attention is None:
                return None
            out += attention
        elif mixer == "mla":
            mla = _mla(facts, tp, linear_bytes)
            if mla is None:
                return None
            out += mla
        if mlp == "dense":
            if facts.dense_intermediate is None:
                return None
            out += _mlp(facts, facts.dense_intermediate, tp, linear_bytes)
        elif mlp == "moe":
            moe = _moe(facts, layout, linear_bytes, dtype_bytes)
            if moe is None:
                return None
            out += moe
    return out


def _attention(facts: ModelFacts, tp: int, b: int) -> Optional[list[int]]:
    h, nh, kv, hd = facts.hidden, facts.heads, facts.kv_heads, facts.head_dim
    if h is None or nh is None or kv is None or hd is None:
        return None
    q_out = nh * hd * (2 if facts.attn_output_gate else 1)
    return [(q_out + 2 * kv * hd) // tp * h * b, nh * hd // tp * h * b]  # qkv_proj, o_proj


def _mla(facts: ModelFacts, tp: int, b: int) -> Optional[list[int]]:
    h, nh, qr, kvr = facts.hidden, facts.heads, facts.q_lora_rank, facts.kv_lora_rank
    nope, rope, vh = facts.qk_nope_head_dim, facts.qk_rope_head_dim, facts.v_head_dim
    if h is None or nh is None or kvr is None or nope is None or rope is None or vh is None:
        return None
    heads = nh // tp
    if qr:
        out = [(qr + kvr + rope) * h * b, heads * (nope + rope) * qr * b]  # fused_qkv_a_proj, q_b_proj
    else:
        out = [(kvr + rope) * h * b, heads * (nope + rope) * h * b]  # kv_a_proj_with_mqa, q_proj
    return out + [heads * (nope + vh) * kvr * b, heads * vh * h * b]  # kv_b_proj, o_proj


def _mlp(facts: ModelFacts, width: int, tp: int, b: int) -> list[int]:
    h = facts.hidden or 0
    up = 2 if facts.gated_mlp else 1
    return [up * width // tp * h * b, width // tp * h * b]  # gate_up_proj, down_proj


def _moe(facts: ModelFacts, layout: GenerationLayout, b: int, dtype_bytes: int) -> Optional[list[int]]:
    h, e, i, width = facts.hidden, facts.num_experts, facts.moe_intermediate, facts.expert_input_width
    if h is None or e is None or i is None or width is None or facts.shared_expert_intermediate is None:
        return None
    up = 2 if facts.gated_mlp else 1
    shards = layout.expert_shards
    # FusedMoE's stacked w13 [E, up*I, width] and w2 [E, width, I], split over the expert shards
    # (whole experts with EP, the intermediate width with TP): the same bytes per GPU either way
    out = [e * up * i * width // shards * b, e * i * width // shards * b, e * h * dtype_bytes]
    if facts.shared_expert_intermediate:
        out += _mlp(facts, facts.shared_expert_intermediate, layout.tp, b)
    return out


__all__ = ["pinned_copy_bytes", "power_of_two_ceil", "vllm_stage_tensors"]
