"""Sequence packing: the padding multiples a packed micro batch needs, and the token budgets.

Shared by the planner (how many tokens a packed micro batch holds on one GPU) and the runtime
(how it pads the packed rows), so both use one formula. Pure Python.

A packed micro batch is one row of concatenated sequences (Megatron's ``thd`` layout). Each
sequence is padded to ``sequence`` tokens so that context parallelism can cut it into ``2 × CP``
equal chunks (two per rank, for causal load balance) and sequence parallelism can split each
rank's share over TP; the whole row is padded to ``row`` tokens, which FP8 GEMMs also need
(16 tokens, 32 for MXFP8, 128 for blockwise scaling, per rank). These are NeMo-RL's factors
(``_get_pack_sequence_parameters_for_megatron`` in ``nemo_rl/models/megatron/data.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

FP8_ROW_MULTIPLE = {"blockwise": 128, "mxfp8": 32, "tensorwise": 16, "delayed": 16}


@dataclass(frozen=True)
class PadMultiples:
    """Token multiples of a packed micro batch: each sequence, and the whole row (before CP)."""

    sequence: int
    row: int


def pad_multiples(*, tp: int, sequence_parallel: bool, cp: int, fp8_recipe: str | None = None) -> PadMultiples:
    """Padding for the trainer's layout (``fp8_recipe``: ``training.fp8.recipe`` when FP8 training is on)."""
    sequence = 1
    if cp > 1:
        sequence *= 2 * cp
    if sequence_parallel and tp > 1:
        sequence *= tp
    row = sequence
    if fp8_recipe is not None:
        row = sequence * FP8_ROW_MULTIPLE.get(fp8_recipe, 16)
    return PadMultiples(sequence=sequence, row=row)


#: Without packing, the trainer's batch is padded to its longest sequence rounded up to this many tokens per TP × CP
#: rank (``padded_row_multiple``; the driver's ``pack_rollouts``).
PADDED_ROW_MULTIPLE = 16


def padded_row_multiple(tp: int, cp: int) -> int:
    """The token multiple a padded (unpacked) batch's rows are rounded up to."""
    return PADDED_ROW_MULTIPLE * int(tp) * int(cp)


def round_up(n: int, multiple: int) -> int:
    multiple = max(1, int(multiple))
    return -(-int(n) // multiple) * multiple


def default_mb_tokens(max_sequence_length: int, micro_batch_size: int) -> int:
    """A packed micro batch's token budget when the recipe states none: as many tokens as a padded
    micro batch of full-length sequences holds (NeMo-RL's ``train_mb_tokens`` default,
    ``max_total_sequence_length × train_micro_batch_size``)."""
    return int(max_sequence_length) * int(micro_batch_size)


__all__ = ["FP8_ROW_MULTIPLE", "PADDED_ROW_MULTIPLE", "PadMultiples", "default_mb_tokens", "pad_multiples",
           "padded_row_multiple", "round_up"]
