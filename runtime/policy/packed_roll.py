"""The one-token left shift of a packed (``thd``) row, done for the whole row at once.

A model with multi-token prediction (MTP) shifts its inputs left by one token before every MTP layer, and its
labels and loss mask once more for the MTP loss (megatron-core's ``roll_tensor``). On a packed row the shift must
not cross a sequence boundary: megatron-core 0.19 does it at context parallelism 1 one sequence at a time
(``_roll_tensor_packed_seq``), slicing the row with device-side boundaries, so every sequence of every micro batch
costs a few kernels and host synchronisations, for each of about six tensors, in every forward. On the short
rollouts of a GRPO step (thousands of sequences per step) that loop, not the model, decides the step time.

Rolling the whole row once and zeroing the last position of every sequence gives the same tensor: inside a
sequence, position ``i`` takes ``i + 1`` either way, and the one value that crossed into a sequence's last position
is the one the per-sequence roll zeroes. :func:`roll_packed_left` does that, and keeps whatever lies past the last
boundary as it was, as the per-sequence version does; it never reads a boundary on the host. Megatron-LM later
made the same change upstream (``_roll_tensor_packed_seq_cp1``).

:func:`install` puts it under megatron-core's ``roll_tensor`` for the calls it covers (a left shift by one along
the last dimension at context parallelism 1) and leaves every other call to megatron-core's own function.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

#: megatron-core's module and the name ``roll_tensor`` calls for packed rows
MTP_MODULE = "megatron.core.transformer.multi_token_prediction"
PACKED_ROLL = "_roll_tensor_packed_seq"


def roll_packed_left(tensor: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` (``[..., T]``) shifted left by one token within each sequence of ``cu_seqlens`` (the row's
    boundaries, ``[0, e_0, e_1, ..., e_k]``), the last position of every non-empty sequence zeroed, positions at
    or past ``e_k`` unchanged; and the sum of the result (megatron-core's ``roll_tensor`` returns both)."""
    length = tensor.shape[-1]
    cu = cu_seqlens.to(device=tensor.device, dtype=torch.int64)
    starts, ends = cu[:-1], cu[1:]
    # one flag per position: the last token of a non-empty sequence (an empty one has none)
    last = (ends - 1).clamp(min=0)
    is_last = torch.zeros(length, dtype=torch.int32, device=tensor.device)
    is_last.index_add_(0, last, (ends > starts).to(torch.int32))
    positions = torch.arange(length, device=tensor.device)
    past_end = positions >= cu[-1]
    zero = torch.zeros((), dtype=tensor.dtype, device=tensor.device)
    rolled = torch.where(is_last > 0, zero, torch.roll(tensor, shifts=-1, dims=-1))
    rolled = torch.where(past_end, tensor, rolled)
    return rolled, rolled.sum()


def _covered(tensor: torch.Tensor, shifts: int, dims: int, cp_group: Any) -> bool:
    cp_size = cp_group.size() if cp_group is not None else 1
    return shifts == -1 and dims in (-1, tensor.dim() - 1) and cp_size == 1


def whole_row_roll(original: Callable[..., Any]) -> Callable[..., Any]:
    """A drop-in for megatron-core's ``_roll_tensor_packed_seq`` that takes the calls :func:`roll_packed_left`
    covers and hands every other one to ``original``."""

    def roll(tensor, shifts, dims, packed_seq_params, cp_group=None):  # megatron-core's signature
        cu = getattr(packed_seq_params, "cu_seqlens_q", None)
        if cu is None or not _covered(tensor, shifts, dims, cp_group):
            return original(tensor, shifts, dims, packed_seq_params, cp_group)
        return roll_packed_left(tensor, cu)

    roll.rlc_original = original  # type: ignore[attr-defined]
    return roll


def install(module: Any = None) -> bool:
    """Install :func:`whole_row_roll` in megatron-core's MTP module (once; later calls change nothing).

    Returns whether it is in place; a megatron-core without the function is left alone (with a log line), as the
    shift is then not done the way this replaces."""
    if module is None:
        import importlib  # noqa: PLC0415

        module = importlib.import_module(MTP_MODULE)
    current = getattr(module, PACKED_ROLL, None)
    if current is None:
        log.warning("%s has no %s: the MTP block's packed shift is left as megatron-core does it",
                    getattr(module, "__name__", module), PACKED_ROLL)
        return False
    if getattr(current, "rlc_original", None) is None:
        setattr(module, PACKED_ROLL, whole_row_roll(current))
    return True


__all__ = ["install", "roll_packed_left", "whole_row_roll"]
