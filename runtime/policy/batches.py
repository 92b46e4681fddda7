"""Rollout batches for the trainer: pack generations into padded tensors, shard, micro-batch.

:func:`pack_rollouts` builds a :class:`~rlc.runtime.worker_api.TrainBatch` of CPU tensors (it travels through
Ray's object store once and every trainer rank takes its data-parallel shard); the trainer splits its mapping
(``TrainBatch.tensors()``, the *rollout batch* of the functions below)::

    tokens        int64   [N, L]    prompt + response, right-padded with pad_id
    mask          float32 [N, L-1]  1 where tokens[:, j+1] is a generated token (the loss counts it)
    gen_logprobs  float32 [N, L-1]  vLLM's logprob of tokens[:, j+1] (0 elsewhere)
    advantages    float32 [N]
    lengths       int64   [N]       prompt + response tokens of each row (sequence packing reads them)
    old_logprobs  float32 [N, L-1]  (added after the trainer's logprob pass)
    ref_logprobs  float32 [N, L-1]  (only with a KL penalty)
    routed_experts uint8 | int16 [N, L-1, M, K]  (only with training.router_replay)

Position ``j`` of a ``[N, L-1]`` tensor is the prediction of token ``j+1`` from the logits at ``j``,
so right padding never changes a real token's logprob under causal attention. Per-token tensors
(``PER_TOKEN_KEYS``) may carry trailing dimensions: ``routed_experts[i, j]`` holds the experts vLLM
routed input token ``j`` to in each of the model's ``M`` MoE layers (ascending layer order, ``K``
experts per token; uint8 with up to 256 experts), i.e. the routes behind the logits at ``j``.
Positions vLLM reports no route for (the last token, padding) hold a filler route that no counted
logit depends on; a response token whose logits depend on a missing route has ``mask`` 0.
``rlc.runtime.policy.routes`` builds and documents the layout.
"""
from __future__ import annotations

import math
from itertools import chain
from typing import Any, Sequence

import numpy as np
import torch

from rlc.runtime.policy.packing import concat_ranges
from rlc.runtime.policy.routes import pack_routes, unrouted_mask
from rlc.runtime.worker_api import TrainBatch

PER_TOKEN_KEYS = ("mask", "gen_logprobs", "old_logprobs", "ref_logprobs", "routed_experts")


def padded_length(max_len: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``max_len`` (and >= 2)."""
    multiple = max(1, int(multiple))
    return max(2, int(math.ceil(max_len / multiple)) * multiple)


def pack_rollouts(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    gen_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float],
    *,
    pad_id: int,
    pad_to_multiple: int = 16,
    max_length: int | None = None,
    routes: Sequence[Any] | None = None,
    num_experts: int = 0,
) -> TrainBatch:
    """Pack aligned per-sample lists into a rollout batch (see the module docstring).

    ``max_length`` (``training.max_sequence_length``) truncates longer samples' responses and is
    reported by the caller; here it only bounds the padded length. ``routes`` (routing replay): each
    sample's vLLM routes ``[rows, M, K]`` reduced to the MoE layers, or None where vLLM returned none;
    ``num_experts``: the model's routed experts.
    """
    n = len(prompt_ids)
    if not (len(response_ids) == len(gen_logprobs) == len(advantages) == n):
        raise ValueError(
            f"pack_rollouts: {n} prompts, {len(response_ids)} responses, {len(gen_logprobs)} logprob lists, "
            f"{len(advantages)} advantages; they must be aligned"
        )
    if n == 0:
        raise ValueError("pack_rollouts: empty batch")
    prompt_lens, response_lens = [], []
    for i, (p, r, lp) in enumerate(zip(prompt_ids, response_ids, gen_logprobs)):
        if len(p) == 0:
            raise ValueError(f"pack_rollouts: sample {i} has an empty prompt")
        if len(lp) != len(r):
            raise ValueError(f"pack_rollouts: sample {i} has {len(r)} response tokens but {len(lp)} logprobs")
        prompt_lens.append(len(p))
        response_lens.append(len(r))
    lengths = [a + b for a, b in zip(prompt_lens, response_lens)]
    longest = max(lengths)
    if max_length is not None and longest > max_length:
        raise ValueError(
            f"pack_rollouts: a sample has {longest} tokens (prompt + response) but training.max_sequence_length is "
            f"{max_length}; lower generation.sampling.max_tokens or data.max_prompt_length"
        )
    L = padded_length(longest, pad_to_multiple)
    tokens = torch.full((n, L), int(pad_id), dtype=torch.int64)
    mask = torch.zeros((n, L - 1), dtype=torch.float32)
    glp = torch.zeros((n, L - 1), dtype=torch.float32)
    # one conversion of all samples' lists and one scatter each, not a few small tensors per sample
    rows = torch.arange(n, dtype=torch.int64)
    plen = torch.tensor(prompt_lens, dtype=torch.int64)
    rlen = torch.tensor(response_lens, dtype=torch.int64)
    every_token = chain.from_iterable(chain.from_iterable(zip(prompt_ids, response_ids)))
    flat_tokens = np.fromiter(every_token, dtype=np.int64, count=sum(lengths))
    tokens.view(-1)[concat_ranges(rows * L, plen + rlen)] = torch.from_numpy(flat_tokens)
    # response token j of row i is predicted at position P_i - 1 + j
    predicted = concat_ranges(rows * (L - 1) + plen - 1, rlen)
    flat_lps = np.fromiter(chain.from_iterable(gen_logprobs), dtype=np.float64, count=sum(response_lens))
    mask.view(-1)[predicted] = 1.0
    glp.view(-1)[predicted] = torch.from_numpy(flat_lps).to(torch.float32)
    return TrainBatch(
        tokens=tokens, mask=mask, gen_logprobs=glp,
        advantages=torch.as_tensor(list(advantages), dtype=torch.float32),
        lengths=torch.as_tensor(lengths, dtype=torch.int64),
        routes=None if routes is None else _routes_of(routes, prompt_ids, response_ids, L, mask, num_experts))


def _routes_of(routes: Sequence[Any], prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
               length: int, mask: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The batch's ``routed_experts``; zeroes ``mask`` where a logit depends on a route vLLM did not record."""
    if len(routes) != len(prompt_ids):
        raise ValueError(f"pack_rollouts: {len(routes)} route arrays for {len(prompt_ids)} samples")
    shapes = {tuple(np.shape(r)[1:]) for r in routes if r is not None}
    if not shapes:
        raise ValueError("routing replay is on but vLLM returned no routed experts for any sample of the step "
                         "(was the engine started with enable_return_routed_experts?)")
    if len(shapes) > 1:
        raise ValueError(f"pack_rollouts: the samples' routes disagree on [MoE layers, experts per token]: {shapes}")
    (layers, topk), = shapes
    packed, routed_until = pack_routes(routes, [len(p) for p in prompt_ids], [len(r) for r in response_ids],
                                       length, num_layers=layers, topk=topk, num_experts=num_experts)
    mask *= unrouted_mask(routed_until, length)
    return packed


def batch_size(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["tokens"].shape[0])


def take(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows ``[start, stop)`` of every tensor of the batch."""
    return {k: (v[start:stop] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def dp_shard(batch: dict[str, torch.Tensor], dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
    """The contiguous shard of data-parallel rank ``dp_rank``; the batch must divide evenly."""
    n = batch_size(batch)
    if n % dp_size:
        raise ValueError(
            f"the step's batch has {n} samples, which the {dp_size} data-parallel ranks cannot split evenly; "
            "make grpo.prompts_per_step * grpo.generations_per_prompt a multiple of train_parallel.dp"
        )
    per = n // dp_size
    return take(batch, dp_rank * per, (dp_rank + 1) * per)


def microbatches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Split into micro-batches of exactly ``micro_batch_size`` rows; the last one is filled with
    copies of row 0 whose ``mask`` is zero (pipeline schedules need equal shapes; masked rows add
    nothing to the loss). Each micro-batch records ``num_real`` rows."""
    n = batch_size(batch)
    mbs = max(1, int(micro_batch_size))
    out = []
    for start in range(0, n, mbs):
        mb = take(batch, start, min(start + mbs, n))
        real = batch_size(mb)
        if real < mbs:
            fill = mbs - real
            padded = {}
            for k, v in mb.items():
                if not isinstance(v, torch.Tensor):
                    padded[k] = v
                    continue
                extra = v[:1].expand(fill, *v.shape[1:]).clone()
                if k == "mask" or k == "advantages":
                    extra = torch.zeros_like(extra)
                padded[k] = torch.cat([v, extra], dim=0)
            mb = padded
        mb["num_real"] = real
        out.append(mb)
    return out


def optimizer_step_slices(n: int, global_batch_size: int, dp_size: int) -> list[tuple[int, int]]:
    """Row ranges of the (DP-local) batch for each optimizer step of one GRPO step.

    ``n`` samples of the step are split into ``ceil(n / global_batch_size)`` optimizer steps; each
    rank takes the same share of every step. Returns ranges into the *DP-local* shard.
    """
    if n % dp_size:
        raise ValueError(f"{n} samples do not split over {dp_size} data-parallel ranks")
    gbs = max(int(global_batch_size), dp_size)
    steps = max(1, int(math.ceil(n / gbs)))
    local = n // dp_size
    per = int(math.ceil(local / steps))
    return [(s, min(s + per, local)) for s in range(0, local, per)]


def response_values(per_token: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Per-sample lists of the masked positions of a ``[N, L-1]`` tensor (e.g. trainer logprobs)."""
    keep = mask > 0
    values = per_token[keep].tolist()
    out, start = [], 0
    for count in keep.sum(-1).tolist():
        out.append(values[start : start + count])
        start += count
    return out
