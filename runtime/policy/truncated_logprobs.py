"""The trainer's logprob of each sampled token under the truncated distribution the rollout engine sampled from
(``generation.sampling`` min-p, top-k, top-p: :class:`rlc.contract.sampling_truncation.Truncation`).

The cuts need a token's whole vocabulary row, which tensor parallelism splits over the TP ranks. One all-to-all gives
each TP rank ``1/TP`` of the rows with the whole vocabulary (the same bytes as its vocabulary slice of every row); the
rank cuts them, takes the log-softmax of what is left and the sampled token's logprob, and an all-gather returns every
row's logprob to every TP rank, as megatron-core's ``vocab_parallel_cross_entropy`` does. The backward runs the
all-to-all the other way. Rows are cut in chunks of :data:`CHUNK_ROWS`: sorting a row for top-p allocates several
copies of it.

A sampled token the trainer's cuts leave out (its logits differ from the engine's in the last bits, and the token sat
at the edge of the nucleus) gets ``-inf``; the loss leaves such tokens out of the policy term
(``rlc.runtime.grpo.loss``) and counts them.

Semantics, as vLLM 0.22 (``Sampler.sample``, ``MinPLogitsProcessor``, ``apply_top_k_top_p_pytorch``) and
megatron-core 0.19's torch sampler: after the temperature, min-p drops tokens whose probability is below ``min_p``
times the largest; top-k keeps the logits at or above the k-th largest; top-p keeps, in the distribution left, the
most likely tokens whose cumulative probability before them is below ``top_p`` (at least one).
"""
from __future__ import annotations

from typing import Any

import torch

from rlc.contract.sampling_truncation import Truncation

#: Rows cut at a time (the sort of top-p holds a few fp32 and int64 copies of this many vocabulary rows).
CHUNK_ROWS = 256


@torch.no_grad()
def keep_mask(logits: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """``[rows, vocab]`` bool: the tokens each row's cuts keep (``logits`` already divided by the temperature)."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if truncation.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        keep &= probs >= probs.amax(dim=-1, keepdim=True) * truncation.min_p
    vocab = logits.shape[-1]
    top_k = truncation.top_k if 0 < truncation.top_k < vocab else 0
    if not top_k and truncation.top_p >= 1.0:
        return keep
    cut = logits.masked_fill(~keep, float("-inf"))
    if truncation.top_p >= 1.0:
        kth = cut.topk(top_k, dim=-1).values[:, -1:]
        return keep & (cut >= kth)
    ascending, order = cut.sort(dim=-1)
    if top_k:
        ascending.masked_fill_(ascending < ascending[:, vocab - top_k:vocab - top_k + 1], float("-inf"))
    mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)
    dropped = mass_up_to <= 1.0 - truncation.top_p
    dropped[:, -1] = False  # the most likely token always stays
    ascending.masked_fill_(dropped, float("-inf"))
    kept_sorted = ascending > float("-inf")
    return keep & torch.empty_like(kept_sorted).scatter_(-1, order, kept_sorted)


def _tp(group: Any) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _rows_to_ranks(vocab_slices: torch.Tensor, tp: int, group: Any) -> torch.Tensor:
    """``[tp * n, V/tp]`` (every row, this rank's vocabulary slice) -> ``[n, V]`` (this rank's rows, every slice)."""
    if tp == 1:
        return vocab_slices
    received = torch.empty_like(vocab_slices)
    torch.distributed.all_to_all_single(received, vocab_slices.contiguous(), group=group)
    n, v = vocab_slices.shape[0] // tp, vocab_slices.shape[1]
    return received.view(tp, n, v).permute(1, 0, 2).reshape(n, tp * v)


def _ranks_to_rows(rows: torch.Tensor, tp: int, group: Any) -> torch.Tensor:
    """The inverse of :func:`_rows_to_ranks`: ``[n, V]`` -> ``[tp * n, V/tp]``."""
    if tp == 1:
        return rows
    n, v = rows.shape[0], rows.shape[1] // tp
    sent = rows.view(n, tp, v).permute(1, 0, 2).reshape(tp * n, v).contiguous()
    received = torch.empty_like(sent)
    torch.distributed.all_to_all_single(received, sent, group=group)
    return received


class _TruncatedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, truncation: Truncation,
                group: Any) -> torch.Tensor:
        tp, rank = _tp(group)
        rows = logits.shape[0]
        padded = -(-rows // tp) * tp
        if padded != rows:
            logits = torch.cat([logits, logits.new_zeros(padded - rows, logits.shape[1])])
            target = torch.cat([target, target.new_zeros(padded - rows)])
        mine = _rows_to_ranks(logits, tp, group)
        n = mine.shape[0]
        my_target = target[rank * n:(rank + 1) * n].long().unsqueeze(-1)
        probs = torch.empty_like(mine)
        logprob = mine.new_empty(n)
        for lo in range(0, n, CHUNK_ROWS):
            x = mine[lo:lo + CHUNK_ROWS]
            logp = torch.log_softmax(x.masked_fill(~keep_mask(x, truncation), float("-inf")), dim=-1)
            logprob[lo:lo + CHUNK_ROWS] = logp.gather(-1, my_target[lo:lo + CHUNK_ROWS]).squeeze(-1)
            probs[lo:lo + CHUNK_ROWS] = logp.exp_()
        del mine
        ctx.save_for_backward(probs, my_target, torch.isfinite(logprob))
        ctx.tp, ctx.rank, ctx.group, ctx.rows = tp, rank, group, rows
        if tp == 1:
            return logprob[:rows]
        gathered = logprob.new_empty(tp * n)
        torch.distributed.all_gather_into_tensor(gathered, logprob, group=group)
        return gathered[:rows]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        probs, my_target, kept = ctx.saved_tensors
        tp, rank, group, rows = ctx.tp, ctx.rank, ctx.group, ctx.rows
        n = probs.shape[0]
        g = torch.zeros(tp * n, dtype=probs.dtype, device=probs.device)
        g[:rows] = grad
        g = g[rank * n:(rank + 1) * n]
        # d logprob / d logits = onehot(target) - softmax of the kept tokens (zero elsewhere): in place on the probs
        d = probs.mul_(-g.unsqueeze(-1))
        d.scatter_add_(-1, my_target, torch.where(kept, g, torch.zeros_like(g)).unsqueeze(-1))
        return _ranks_to_rows(d, tp, group)[:rows], None, None, None


def truncated_logprobs(logits: torch.Tensor, target: torch.Tensor, truncation: Truncation,
                       group: Any = None) -> torch.Tensor:
    """Logprob of ``target[i]`` under the cuts of row ``i`` of ``logits``.

    ``logits`` ``[rows, V/TP]`` fp32, already divided by the temperature: this rank's vocabulary slice (megatron-core's
    vocab-parallel layout, slice ``r`` on TP rank ``r``); ``target`` ``[rows]`` token ids; ``group`` the TP group (None:
    one rank). Returns ``[rows]`` on every TP rank, ``-inf`` where the cuts leave the target out; differentiable with
    respect to ``logits``."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"truncated_logprobs: logits {tuple(logits.shape)} must be [rows, vocab slice] and target "
                         f"{tuple(target.shape)} [rows]")
    result: torch.Tensor = _TruncatedLogprob.apply(logits, target, truncation, group)
    return result


__all__ = ["CHUNK_ROWS", "keep_mask", "truncated_logprobs"]
