"""Packed (``thd``) micro batches for the trainer's logprob and train passes (torch, CPU-testable).

Instead of padding every rollout of a micro batch to the longest one, the sequences of a data-
parallel rank are bin-packed by a token budget (:mod:`rlc.runtime.policy.bin_packing`) and each bin
is concatenated into one row ``[1, T]``. Megatron's packed-sequence path keeps them apart:
``PackedSeqParams(qkv_format="thd", cu_seqlens_*)`` makes Transformer Engine's attention causal
within each sequence and nowhere across, and RoPE restarts its positions at every boundary.

Layout of one bin of sequences ``s_0 … s_{k-1}`` of lengths ``n_i``::

    tokens     [ s_0 (n_0) | pad | s_1 (n_1) | pad | ... | s_{k-1} | pad ]      one row of T tokens
    cu_seqlens [0, P_0, P_0 + P_1, ..., T]         P_i = n_i rounded up to the sequence multiple;
                                                   the last one also absorbs the row padding
    positions  0 .. P_i - 1 within each sequence
    labels     tokens shifted left by one *within* each sequence (the last token of a sequence
               predicts nothing: its label is 0 and it is never read)

The padding tokens sit after their sequence and are part of it for attention, so causal
attention never lets a real token see one. Logprobs come back in the rollout batch's
``[N, L-1]`` layout (position ``j`` of row ``i`` is the logprob of ``tokens[i, j+1]``), so the
loss, the gen-KL check and the driver are unchanged: :func:`unpack_index` maps each
``(row, j)`` to its packed position.

Context parallelism (CP > 1): each padded sequence is cut into ``2 × CP`` equal chunks and CP rank
``r`` keeps chunks ``r`` and ``2·CP − 1 − r`` of every sequence, in sequence order
(:func:`cp_partition_indices`; Transformer Engine's ``get_batch_on_this_cp_rank`` for ``thd``,
NeMo-RL's ``_get_tokens_on_this_cp_rank``), which balances causal attention work over the ranks.
The per-token logprobs of the ranks are all-gathered and put back in packed order
(:func:`cp_restore_index`) before they are unpacked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlc.contract.sequence_packing import PadMultiples, round_up
from rlc.runtime.policy import bin_packing

# Per-token tensors of a rollout batch ([N, L-1]); a dummy bin has them zero
PER_TOKEN_LOSS_KEYS = ("mask", "advantages")


@dataclass(frozen=True)
class PackedBin:
    """One packed micro batch: which rows of the (DP-local) batch, and how the row is laid out.

    ``rows`` index the batch the bin was planned for; a *filler* bin (``filler=True``) repeats
    row ``rows[0]`` with nothing counted, so that every data-parallel rank runs as many micro
    batches as the others (expert-parallel all-to-alls run once per micro batch on every rank).
    """

    rows: tuple[int, ...]
    lengths: tuple[int, ...]  # real tokens of each sequence
    cu_seqlens: tuple[int, ...]  # padded boundaries, len(rows) + 1 entries, last = total
    filler: bool = False

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def max_seqlen(self) -> int:
        return max(b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]))

    @property
    def real_tokens(self) -> int:
        return 0 if self.filler else sum(self.lengths)


def layout_bin(rows: Sequence[int], lengths: Sequence[int], pad: PadMultiples, total: int | None = None,
               filler: bool = False) -> PackedBin:
    """Boundaries of a bin: each sequence padded to ``pad.sequence``, the row to ``pad.row`` (or to
    ``total``, a common length for pipeline parallelism); the last sequence takes the row padding."""
    if not rows:
        raise ValueError("layout_bin: a bin needs at least one sequence")
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + round_up(n, pad.sequence))
    end = round_up(cu[-1], pad.row)
    if total is not None:
        if total < end or total % pad.row:
            raise ValueError(f"layout_bin: common length {total} is shorter than the bin ({end}) or not a multiple "
                             f"of {pad.row}")
        end = total
    cu[-1] = end
    return PackedBin(tuple(int(r) for r in rows), tuple(int(n) for n in lengths), tuple(cu), filler)


def plan_bins(shard_lengths: Sequence[Sequence[int]], rank: int, budget: int, algorithm: str, pad: PadMultiples, *,
              seed: int = 0, common_length: bool = False, count_multiple: int = 1,
              budget_key: str = "the packing budget") -> list[PackedBin]:
    """Packed micro batches of data-parallel rank ``rank``.

    ``shard_lengths[d]`` are the sequence lengths of rank ``d``'s rows (every rank knows the whole
    batch, so each plans every rank's bins and all agree on the count without communicating). Each
    rank's sequences are bin-packed by ``budget`` tokens (lengths padded to ``pad.sequence``); a rank
    with fewer bins than the most splits bins, then adds filler bins. ``common_length`` pads every
    bin to the longest (pipeline schedules send tensors of one shape between stages);
    ``count_multiple`` rounds the number of bins up (the interleaved pipeline schedule runs micro
    batches in groups of PP).
    """
    planned = []
    for lengths in shard_lengths:
        padded = [round_up(n, pad.sequence) for n in lengths]
        planned.append(bin_packing.pack(padded, budget, algorithm, seed=seed, budget_key=budget_key))
    count = round_up(max((len(b) for b in planned), default=0), count_multiple)
    mine = bin_packing.split_to(planned[rank], count)
    lengths = list(shard_lengths[rank])
    fillers = count - len(mine)
    total = None
    if common_length:
        total = max(layout_bin(b, [shard[i] for i in b], pad).total
                    for shard, bins in zip(shard_lengths, planned) for b in bins)
    out = [layout_bin(b, [lengths[i] for i in b], pad, total) for b in mine]
    if fillers:
        filler = layout_bin([0], [lengths[0]], pad, total, filler=True)
        out.extend([filler] * fillers)
    return out


# --------------------------------------------------------------------------- the packed row


def _cat_ranges(starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    parts = [torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, sizes) if n > 0]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def pack_tokens(tokens: torch.Tensor, b: PackedBin, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """``tokens`` ``[N, L]`` (right padded) → the bin's packed ``tokens``, ``positions`` and ``labels``, each
    ``[T]`` (see the module docstring)."""
    T = b.total
    out_tokens = torch.full((T,), int(pad_id), dtype=torch.int64)
    labels = torch.zeros(T, dtype=torch.int64)
    positions = torch.empty(T, dtype=torch.int64)
    for k, (row, n) in enumerate(zip(b.rows, b.lengths)):
        a, e = b.cu_seqlens[k], b.cu_seqlens[k + 1]
        seq = tokens[row, :n]
        out_tokens[a : a + n] = seq
        labels[a : a + n - 1] = seq[1:]
        positions[a:e] = torch.arange(e - a)
    return {"tokens": out_tokens, "positions": positions, "labels": labels}


def unpack_index(b: PackedBin, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, valid)``, each ``[len(rows), width]``: ``index[k, j]`` is the packed position whose logits
    predict ``tokens[rows[k], j+1]`` (``a_k + j``), valid for ``j < n_k - 1``; elsewhere 0 and invalid."""
    k = len(b.rows)
    j = torch.arange(width, dtype=torch.int64).expand(k, width)
    starts = torch.tensor(b.cu_seqlens[:-1], dtype=torch.int64).unsqueeze(1)
    lens = torch.tensor(b.lengths, dtype=torch.int64).unsqueeze(1)
    valid = j < (lens - 1)
    index = torch.where(valid, starts + j, torch.zeros_like(j))
    return index, valid


def unpack(packed: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-position values of the packed row ``[T]`` → ``[rows, width]`` (0 where invalid); differentiable."""
    return torch.where(valid, packed[index], torch.zeros((), dtype=packed.dtype, device=packed.device))


def pack_per_token(values: torch.Tensor, b: PackedBin) -> torch.Tensor:
    """The inverse of :func:`unpack`: ``[N, L-1]`` values of the bin's rows → ``[T]`` (0 elsewhere)."""
    index, valid = unpack_index(b, values.shape[1])
    rows = values[list(b.rows)]
    out = torch.zeros(b.total, dtype=values.dtype)
    out[index[valid]] = rows[valid]
    return out


# --------------------------------------------------------------------------- context parallelism


def cp_partition_indices(cu_seqlens: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Packed positions CP rank ``cp_rank`` holds, in its local order: chunks ``r`` and ``2·CP−1−r`` of each
    sequence cut into ``2·CP`` equal chunks (every padded sequence length must divide by ``2·CP``)."""
    if cp_size == 1:
        return torch.arange(int(cu_seqlens[-1]), dtype=torch.int64)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside a context-parallel group of {cp_size}")
    starts, sizes = [], []
    for a, e in zip(cu_seqlens, cu_seqlens[1:]):
        n = int(e) - int(a)
        if n % (2 * cp_size):
            raise ValueError(f"a packed sequence of {n} tokens does not split into 2 × CP = {2 * cp_size} chunks")
        c = n // (2 * cp_size)
        starts += [int(a) + cp_rank * c, int(a) + (2 * cp_size - 1 - cp_rank) * c]
        sizes += [c, c]
    return _cat_ranges(starts, sizes)


def cp_restore_index(cu_seqlens: Sequence[int], cp_size: int) -> torch.Tensor:
    """Index into the ranks' local rows concatenated in rank order (``[CP × T/CP]``) that gives the packed
    order ``[T]``: ``packed = gathered[cp_restore_index(...)]``."""
    order = torch.cat([cp_partition_indices(cu_seqlens, cp_size, r) for r in range(cp_size)])
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), dtype=torch.int64)
    return restore


class _GatherContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist  # noqa: PLC0415

        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        n = grad.numel() // ctx.size
        return grad[ctx.rank * n : (ctx.rank + 1) * n].contiguous(), None


def gather_context_parallel(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The 1-D per-position values of every CP rank, concatenated in rank order (``[CP × n]``).

    Every CP rank then evaluates the same loss on the same gathered values, so the gradient of the
    gathered tensor is the same on every rank and each rank keeps its own slice of it in the
    backward: summed over the ranks (DDP's gradient reduction spans DP × CP), each position's
    gradient is counted once, as with a loss over each rank's own positions.
    """
    return _GatherContextParallel.apply(x, group)


# --------------------------------------------------------------------------- a micro batch for the worker


def packed_microbatch(batch: dict[str, Any], b: PackedBin, *, cp_size: int = 1, cp_rank: int = 0,
                      pad_id: int = 0) -> dict[str, Any]:
    """The micro batch dict the policy worker runs for bin ``b`` of the (DP-local) ``batch``.

    Model inputs (this CP rank's share, ``[1, T/CP]``): ``tokens``, ``position_ids``, ``labels``;
    ``cu_seqlens`` (int32, whole-row boundaries, as Megatron and Transformer Engine take them with
    CP) and ``max_seqlen``; ``cp_restore`` with CP. For the loss: ``unpack_index`` / ``unpack_valid``
    and the bin's rows of every per-row tensor of ``batch`` (``[k, ...]``), with ``mask`` and
    ``advantages`` zero in a filler bin; ``rows`` and ``num_real`` (0 for a filler).
    """
    tokens = batch["tokens"]
    packed = pack_tokens(tokens, b, pad_id)
    local = cp_partition_indices(b.cu_seqlens, cp_size, cp_rank)
    index, valid = unpack_index(b, tokens.shape[1] - 1)
    mb: dict[str, Any] = {
        "tokens": packed["tokens"][local].unsqueeze(0),
        "position_ids": packed["positions"][local].unsqueeze(0),
        "labels": packed["labels"][local].unsqueeze(0),
        "cu_seqlens": torch.tensor(b.cu_seqlens, dtype=torch.int32),
        "max_seqlen": b.max_seqlen,
        "unpack_index": index,
        "unpack_valid": valid,
        "rows": torch.tensor(b.rows, dtype=torch.int64),
        "num_real": 0 if b.filler else len(b.rows),
    }
    if cp_size > 1:
        mb["cp_restore"] = cp_restore_index(b.cu_seqlens, cp_size)
    rows = list(b.rows)
    for key, value in batch.items():
        if key in mb or not isinstance(value, torch.Tensor) or key == "tokens":
            continue
        part = value[rows]
        if b.filler and key in PER_TOKEN_LOSS_KEYS:
            part = torch.zeros_like(part)
        mb[key] = part
    return mb


def sequence_lengths(batch: dict[str, Any]) -> list[int]:
    """Real tokens (prompt + response) of each row of a rollout batch."""
    if "lengths" not in batch:
        raise KeyError("the rollout batch has no 'lengths' (packing needs each sequence's length; "
                       "batches.pack_rollouts records them)")
    return [int(n) for n in batch["lengths"].tolist()]


__all__ = ["PackedBin", "cp_partition_indices", "cp_restore_index", "gather_context_parallel", "layout_bin",
           "pack_per_token", "pack_tokens", "packed_microbatch", "plan_bins", "sequence_lengths", "unpack",
           "unpack_index"]
