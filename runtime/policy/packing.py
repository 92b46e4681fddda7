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

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlc.contract.sequence_packing import PadMultiples, round_up
from rlc.runtime.policy import bin_packing

# Per-token tensors of a rollout batch ([N, L-1]); a dummy bin has them zero
PER_TOKEN_LOSS_KEYS = ("mask", "advantages")
# The keys a packed micro batch sets itself (a batch tensor of the same name is not copied in)
MB_KEYS = ("tokens", "position_ids", "labels", "cu_seqlens", "max_seqlen", "unpack_index", "unpack_valid", "rows",
           "num_real", "cp_restore")


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

    A plan depends only on these arguments (``seed`` only for ``first_fit_shuffle``), so the last
    few are kept: a step's logprob passes (the policy's and the reference's) and, with one optimizer
    step and equal budgets, its train pass pack the batch once.
    """
    shards = tuple(tuple(int(n) for n in lengths) for lengths in shard_lengths)
    if bin_packing.ALGORITHMS.get(algorithm) is not bin_packing.first_fit_shuffle:
        seed = 0  # the other algorithms are deterministic: one plan for every seed
    return list(_plan_bins(shards, int(rank), int(budget), algorithm, pad, int(seed), bool(common_length),
                           int(count_multiple), budget_key))


@functools.lru_cache(maxsize=8)
def _plan_bins(shard_lengths: tuple[tuple[int, ...], ...], rank: int, budget: int, algorithm: str, pad: PadMultiples,
               seed: int, common_length: bool, count_multiple: int, budget_key: str) -> tuple[PackedBin, ...]:
    planned = []
    for lengths in shard_lengths:
        padded = [round_up(n, pad.sequence) for n in lengths] if pad.sequence > 1 else list(lengths)
        planned.append(bin_packing.pack(padded, budget, algorithm, seed=seed, budget_key=budget_key))
    count = round_up(max((len(b) for b in planned), default=0), count_multiple)
    mine = bin_packing.split_to(planned[rank], count)
    lengths = shard_lengths[rank]
    fillers = count - len(mine)
    total = None
    if common_length:
        total = max(layout_bin(b, [shard[i] for i in b], pad).total
                    for shard, bins in zip(shard_lengths, planned) for b in bins)
    out = [layout_bin(b, [lengths[i] for i in b], pad, total) for b in mine]
    if fillers:
        filler = layout_bin([0], [lengths[0]], pad, total, filler=True)
        out.extend([filler] * fillers)
    return tuple(out)


# --------------------------------------------------------------------------- the packed row


def concat_ranges(starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, sizes)])`` without a Python loop (int64).

    A running sum of steps of 1 that jumps to each range's start where it begins (no
    ``repeat_interleave``, whose CPU kernel starts a thread pool that a forked process inherits locked)."""
    starts, sizes = starts.to(torch.int64), sizes.to(torch.int64)
    if bool((sizes <= 0).any()):
        keep = sizes > 0
        starts, sizes = starts[keep], sizes[keep]
    if sizes.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    steps = torch.ones(int(sizes.sum()), dtype=torch.int64)
    begin = torch.cumsum(sizes, 0) - sizes  # where each range starts in the output
    steps[begin[1:]] = starts[1:] - (starts[:-1] + sizes[:-1] - 1)
    steps[0] = starts[0]
    return torch.cumsum(steps, 0)


def _pack_rows(tokens: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor,
               sizes: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """Sequences ``rows`` of ``tokens`` (``lengths`` real tokens each) laid out at ``starts`` of one row of
    ``sizes.sum()`` positions, sequence ``k`` owning ``sizes[k]`` of them: ``tokens``, ``positions``, ``labels``."""
    total = int(sizes.sum())
    width = tokens.shape[1]
    flat = tokens.reshape(-1)
    # every real token once: sequence k's token t goes to packed position starts[k] + t
    out_tokens = torch.full((total,), int(pad_id), dtype=torch.int64)
    out_tokens[concat_ranges(starts, lengths)] = flat[concat_ranges(rows * width, lengths)].to(torch.int64)
    # labels: the next token of the same sequence (tokens 1 .. n-1 of each, at positions 0 .. n-2)
    labels = torch.zeros(total, dtype=torch.int64)
    shorter = (lengths - 1).clamp(min=0)
    labels[concat_ranges(starts, shorter)] = flat[concat_ranges(rows * width + 1, shorter)].to(torch.int64)
    # positions restart at every (padded) sequence boundary; the boundaries cover the whole row
    positions = concat_ranges(torch.zeros_like(sizes), sizes)
    return {"tokens": out_tokens, "positions": positions, "labels": labels}


def _unpack_index(starts: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    j = torch.arange(width, dtype=torch.int64).unsqueeze(0)
    valid = j < (lengths.unsqueeze(1) - 1)
    return (starts.unsqueeze(1) + j) * valid, valid


def pack_tokens(tokens: torch.Tensor, b: PackedBin, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """``tokens`` ``[N, L]`` (right padded) → the bin's packed ``tokens``, ``positions`` and ``labels``, each
    ``[T]`` (see the module docstring)."""
    cu = torch.tensor(b.cu_seqlens, dtype=torch.int64)
    return _pack_rows(tokens, torch.tensor(b.rows, dtype=torch.int64), torch.tensor(b.lengths, dtype=torch.int64),
                      cu[:-1], cu[1:] - cu[:-1], pad_id)


def unpack_index(b: PackedBin, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, valid)``, each ``[len(rows), width]``: ``index[k, j]`` is the packed position whose logits
    predict ``tokens[rows[k], j+1]`` (``a_k + j``), valid for ``j < n_k - 1``; elsewhere 0 and invalid."""
    return _unpack_index(torch.tensor(b.cu_seqlens[:-1], dtype=torch.int64),
                         torch.tensor(b.lengths, dtype=torch.int64), width)


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


def cp_partition_indices(cu_seqlens: Sequence[int] | torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Packed positions CP rank ``cp_rank`` holds, in its local order: chunks ``r`` and ``2·CP−1−r`` of each
    sequence cut into ``2·CP`` equal chunks (every padded sequence length must divide by ``2·CP``)."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).reshape(-1)
    if cp_size == 1:
        return torch.arange(int(cu[-1]), dtype=torch.int64)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside a context-parallel group of {cp_size}")
    sizes = cu[1:] - cu[:-1]
    uneven = sizes % (2 * cp_size) != 0
    if bool(uneven.any()):
        n = int(sizes[uneven][0])
        raise ValueError(f"a packed sequence of {n} tokens does not split into 2 × CP = {2 * cp_size} chunks")
    c = sizes // (2 * cp_size)
    # per sequence: chunk r, then chunk 2·CP−1−r
    starts = torch.stack([cu[:-1] + cp_rank * c, cu[:-1] + (2 * cp_size - 1 - cp_rank) * c], dim=1).reshape(-1)
    return concat_ranges(starts, torch.stack([c, c], dim=1).reshape(-1))


def cp_restore_index(cu_seqlens: Sequence[int] | torch.Tensor, cp_size: int) -> torch.Tensor:
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
    return packed_microbatches(batch, [b], cp_size=cp_size, cp_rank=cp_rank, pad_id=pad_id)[0]


def packed_microbatches(batch: dict[str, Any], bins: Sequence[PackedBin], *, cp_size: int = 1, cp_rank: int = 0,
                        pad_id: int = 0) -> list[dict[str, Any]]:
    """:func:`packed_microbatch` of every bin of a pass, built together: the bins' rows are laid end to end
    and each tensor is gathered once for all of them, then split per bin (views), so the host work grows
    with the tokens, not with the number of bins or sequences."""
    if not bins:
        return []
    tokens = batch["tokens"]
    counts = [len(b.rows) for b in bins]
    totals = [b.total for b in bins]
    rows = torch.tensor([r for b in bins for r in b.rows], dtype=torch.int64)
    lengths = torch.tensor([n for b in bins for n in b.lengths], dtype=torch.int64)
    starts = torch.tensor([a for b in bins for a in b.cu_seqlens[:-1]], dtype=torch.int64)  # within each bin
    sizes = torch.tensor([e - a for b in bins for a, e in zip(b.cu_seqlens, b.cu_seqlens[1:])], dtype=torch.int64)
    offsets, offset = [], 0  # where each sequence's bin starts in the bins' rows laid end to end
    for count, total in zip(counts, totals):
        offsets += [offset] * count
        offset += total
    packed = _pack_rows(tokens, rows, lengths, starts + torch.tensor(offsets, dtype=torch.int64), sizes, pad_id)
    if cp_size > 1:
        # each sequence's chunks, in sequence order: the same as every bin's share, one bin after another
        local = cp_partition_indices(torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)]),
                                     cp_size, cp_rank)
        packed = {k: v[local] for k, v in packed.items()}
    shares = [t // cp_size for t in totals]
    parts = {k: torch.split(v, shares) for k, v in packed.items()}
    index, valid = _unpack_index(starts, lengths, tokens.shape[1] - 1)
    per_bin = {"unpack_index": torch.split(index, counts), "unpack_valid": torch.split(valid, counts),
               "rows": torch.split(rows, counts)}
    own = MB_KEYS if cp_size > 1 else MB_KEYS[:-1]
    row_keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "tokens" and k not in own]
    for key in row_keys:
        per_bin[key] = torch.split(batch[key].index_select(0, rows), counts)
    out = []
    for i, b in enumerate(bins):
        mb: dict[str, Any] = {
            "tokens": parts["tokens"][i].unsqueeze(0),
            "position_ids": parts["positions"][i].unsqueeze(0),
            "labels": parts["labels"][i].unsqueeze(0),
            "cu_seqlens": torch.tensor(b.cu_seqlens, dtype=torch.int32),
            "max_seqlen": b.max_seqlen,
            "unpack_index": per_bin["unpack_index"][i],
            "unpack_valid": per_bin["unpack_valid"][i],
            "rows": per_bin["rows"][i],
            "num_real": 0 if b.filler else len(b.rows),
        }
        if cp_size > 1:
            mb["cp_restore"] = cp_restore_index(b.cu_seqlens, cp_size)
        for key in row_keys:
            part = per_bin[key][i]
            mb[key] = torch.zeros_like(part) if b.filler and key in PER_TOKEN_LOSS_KEYS else part
        out.append(mb)
    return out


def sequence_lengths(batch: dict[str, Any]) -> list[int]:
    """Real tokens (prompt + response) of each row of a rollout batch."""
    if "lengths" not in batch:
        raise KeyError("the rollout batch has no 'lengths' (packing needs each sequence's length; "
                       "batches.pack_rollouts records them)")
    return [int(n) for n in batch["lengths"].tolist()]


__all__ = ["PackedBin", "concat_ranges", "cp_partition_indices", "cp_restore_index", "gather_context_parallel",
           "layout_bin", "pack_per_token", "pack_tokens", "packed_microbatch", "packed_microbatches", "plan_bins",
           "sequence_lengths", "unpack", "unpack_index"]
