"""The refit buffer sizing formula, used by the planner (prediction) and the runtime (allocation).

The buffer is ``free × refit.buffer_memory_ratio`` (or ``refit.buffer_gb`` GiB) and is split into
two ping-pong halves, each aligned down to the alignment. A tensor must fit one half, not the
whole buffer: ``free × ratio / 2 >= tensor`` (:func:`half_holds`; a tensor exactly the half's size
fits, at offset 0).

With ``refit.fused_transfer`` a MoE layer's routed experts travel stacked, one tensor for every expert's gate
and up projections and one for the down projections, so the largest tensor a buffer half must hold (or a
one-off buffer take) is a stacked one even for models whose checkpoint names each expert
(:func:`exported_experts`); :func:`fused_transfer_applies` is the one decision compiler and runtime share.
"""
from __future__ import annotations

from typing import Any

GIB = 1 << 30


def align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return -(-n // alignment) * alignment


def align_down(n: int, alignment: int) -> int:
    """``n`` rounded down to a multiple of ``alignment``."""
    return (n // alignment) * alignment


def buffer_total_bytes(free_bytes: int, *, buffer_memory_ratio: float | None, buffer_gb: float | None) -> int:
    """Both halves together: ``buffer_gb`` GiB when set, else ``free × buffer_memory_ratio``."""
    if buffer_gb is not None:
        return int(buffer_gb * GIB)
    if buffer_memory_ratio is None:
        raise ValueError("refit buffer: one of buffer_memory_ratio and buffer_gb must be set")
    return int(max(free_bytes, 0) * buffer_memory_ratio)


def half_bytes(free_bytes: int, *, buffer_memory_ratio: float | None, buffer_gb: float | None,
               alignment: int) -> int:
    """One ping-pong half: half of :func:`buffer_total_bytes`, aligned down to ``alignment``."""
    total = buffer_total_bytes(free_bytes, buffer_memory_ratio=buffer_memory_ratio, buffer_gb=buffer_gb)
    return align_down(total // 2, max(1, alignment))


def half_holds(half: int, tensor_bytes: int) -> bool:
    """Whether one ping-pong half of ``half`` bytes holds a tensor of ``tensor_bytes``: equality fits.

    The one boundary shared by the planner's check (RLC210) and the runtime's bucket packer, which
    sends a tensor that does not fit in a one-off buffer of its own.
    """
    return tensor_bytes <= half


def keep_buffers_bytes(keep_buffers_gb: float) -> int:
    """``refit.keep_buffers_gb`` in bytes."""
    return int(float(keep_buffers_gb) * GIB)


def halves_kept(half: int, keep_bytes: int) -> bool:
    """Whether both ping-pong halves of ``half`` bytes stay allocated from one refit to the next
    (``refit.keep_buffers_gb``): they are then resident in every phase, vLLM's generation included.

    The one boundary shared by the runtime's producer (which keeps them) and the planner (which counts them).
    """
    return 2 * half <= keep_bytes


def fused_transfer_applies(requested: bool, precision: str) -> tuple[bool, str]:
    """Whether a refit moves stacked experts (``refit.fused_transfer``, ``generation.precision``) and why."""
    if not requested:
        return False, "off (refit.fused_transfer: off)"
    if precision == "fp8":
        return False, ("off for FP8 rollouts: the experts travel per expert (block scales are computed per "
                       "exported tensor, and vLLM's layerwise reload quantizes what it loads)")
    return True, "on (refit.fused_transfer: on)"


#: Refit switches that move bf16 tensors as they are (views of the trainer's parameters, read in place or not, and
#: vLLM's recorded copies).
BF16_REFIT_SWITCHES = ("direct_export", "zero_copy_views", "zero_copy_experts", "replay_load")


def bf16_switch_applies(key: str, requested: bool, precision: str) -> tuple[bool, str]:
    """Whether ``refit.<key>`` (one of :data:`BF16_REFIT_SWITCHES`) applies at ``generation.precision`` and why: FP8
    rollouts load through vLLM's layerwise reload, which quantizes what it loads, so neither a view of a bf16
    parameter nor a recorded copy is what lands in the engine (the compiler refuses the pair, RLC224)."""
    if not requested:
        return False, "off"
    if precision == "fp8":
        return False, "off: FP8 rollouts load through vLLM's layerwise reload, which quantizes what it loads"
    return True, "on"


def kv_cache_kept_awake(refit: Any) -> bool:
    """Whether vLLM's KV cache stays on the GPU between rollouts: ``refit.keep_kv_cache_awake``, which holds only
    with ``refit.keep_weights_awake`` (vLLM's own sleep releases the KV cache with the weights; RLC227). ``refit``:
    the recipe's or the runtime config's ``refit`` section. The one reading of the pair for the planner, the
    calibration records and the runtime."""
    return bool(refit.keep_weights_awake and refit.keep_kv_cache_awake)


def exported_experts(expert_export: str | None, *, fused: bool) -> str | None:
    """How the refit moves routed experts: ``stacked`` when fused transfer applies, else as the model exports
    them (``per_expert`` / ``stacked`` / None when unknown)."""
    return "stacked" if fused and expert_export is not None else expert_export
