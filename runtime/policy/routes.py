"""The routes of routing replay (``training.router_replay``) as rollout-batch data: pure torch/numpy, CPU-tested.

vLLM 0.22 returns, per completion, ``routed_experts`` of shape ``[P + R - 1, num_hidden_layers, K]`` (uint8 with
up to 256 experts, else uint16): one row per token it ran through the model, prompt tokens first, then every
response token but the last (the last sampled token is never fed back). Row ``j`` holds the experts that input
token ``j`` went to in each decoder layer (zeros for dense layers). The generation worker keeps only the MoE layers
(:func:`compact`); :func:`pack_routes` lays them out like the batch's per-token tensors::

    routed_experts  uint8 | int16  [N, L-1, M, K]

Position ``j`` is input token ``j``: its routes decide the hidden state at ``j``, hence the logits that predict
token ``j+1`` — the same position as ``mask`` / ``gen_logprobs``. ``M`` = the model's MoE decoder layers in
ascending layer order (vLLM's and the trainer's lists are checked equal at start); ``K`` = experts per token.
Positions vLLM does not report — the sample's last token and the padding — never influence a counted logit under
causal attention, so they get a *filler* route (distinct experts, spread round-robin so they load every expert
alike). A completion with fewer rows than ``P + R - 1`` (none at all: vLLM returned no routes) leaves the rest
without a route: those positions get the filler too, and every position from the first missing one on is
*unrouted* — its prediction depends on a route nobody recorded — so the caller takes it out of the loss.

:func:`micro_batch_routes` lays a micro batch's routes out like its tokens — a packed (``thd``) micro batch's
at their packed positions, this context-parallel rank's share (:func:`packed_routes`) — and
:func:`replay_targets` turns them into the index tensors Megatron's ``RouterReplay`` expects:
one ``[tokens, K]`` int64 tensor per MoE layer, tokens in the order the router sees them (sequence-major:
``s * batch + b``, Megatron's ``[s, b, h]`` activations flattened), the sequence-parallel rank's share only.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from rlc.runtime.worker_api import ROUTES_KEY


def routes_dtype(num_experts: int) -> torch.dtype:
    """The smallest dtype that holds expert ids ``0 .. num_experts-1`` (vLLM's own choice, signed for torch)."""
    if num_experts <= 0:
        raise ValueError(f"routing replay needs a MoE model; num_experts is {num_experts}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"{num_experts} experts do not fit the routes' int16 layout")


def filler(positions: torch.Tensor, topk: int, num_experts: int) -> torch.Tensor:
    """Distinct expert ids for positions no route was recorded for: ``[(p * K + i) % E for i < K]`` (``[..., K]``,
    int64). Distinct because ``K <= E``; round-robin so filler positions do not pile onto a few experts."""
    if not 0 < topk <= num_experts:
        raise ValueError(f"experts per token {topk} must be in 1..{num_experts}")
    return (positions.long().unsqueeze(-1) * topk + torch.arange(topk)) % num_experts


def compact(routed: Optional[np.ndarray], moe_layers: Sequence[int]) -> Optional[np.ndarray]:
    """One completion's ``routed_experts`` from vLLM, reduced to the MoE layers (uint16 ids as int16)."""
    if routed is None:
        return None
    arr = np.asarray(routed)
    if arr.ndim != 3:
        raise ValueError(f"vLLM's routed_experts has shape {arr.shape}; expected [tokens, layers, experts per token]")
    if moe_layers and max(moe_layers) >= arr.shape[1]:
        raise ValueError(f"vLLM's routed_experts covers {arr.shape[1]} layers; the MoE layers are {list(moe_layers)}")
    out = np.ascontiguousarray(arr[:, list(moe_layers), :])
    if out.dtype == np.uint16:
        out = out.astype(np.int16)
    return out


def pack_routes(routes: Sequence[Optional[Any]], prompt_lens: Sequence[int], response_lens: Sequence[int],
                length: int, *, num_layers: int, topk: int, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """``routed_experts [N, length-1, M, K]`` of a rollout batch padded to ``length`` tokens, and for each sample
    the first position without a recorded route (``P + R - 1`` when vLLM reported every row; positions from there
    on must leave the loss). ``routes[i]``: sample ``i``'s compacted routes ``[rows, M, K]`` or None."""
    n = len(routes)
    if not (len(prompt_lens) == len(response_lens) == n):
        raise ValueError(f"pack_routes: {n} route arrays for {len(prompt_lens)} prompts and {len(response_lens)} "
                         "responses")
    dtype = routes_dtype(num_experts)
    positions = torch.arange(length - 1)
    out = filler(positions, topk, num_experts).to(dtype).view(1, length - 1, 1, topk)
    out = out.expand(n, length - 1, num_layers, topk).clone()
    routed_until = []
    for i, (r, p, rl) in enumerate(zip(routes, prompt_lens, response_lens)):
        expected = int(p) + int(rl) - 1
        if expected > length - 1:
            raise ValueError(f"pack_routes: sample {i} has {p + rl} tokens, more than the batch's {length}")
        rows = 0
        if r is not None:
            t = torch.as_tensor(np.asarray(r))
            if t.ndim != 3 or t.shape[1:] != (num_layers, topk):
                raise ValueError(f"pack_routes: sample {i}'s routes have shape {tuple(t.shape)}; expected "
                                 f"[rows, {num_layers}, {topk}]")
            rows = min(int(t.shape[0]), expected)
            if rows:
                if int(t[:rows].min()) < 0 or int(t[:rows].max()) >= num_experts:
                    raise ValueError(f"pack_routes: sample {i} routes a token to an expert outside "
                                     f"0..{num_experts - 1}")
                out[i, :rows] = t[:rows].to(dtype)
        routed_until.append(rows)
    return out, routed_until


def unrouted_mask(routed_until: Sequence[int], length: int) -> torch.Tensor:
    """``[N, length-1]`` float: 1 where position ``j``'s logits depend only on recorded routes
    (``j < routed_until``)."""
    until = torch.as_tensor(list(routed_until), dtype=torch.long).unsqueeze(1)
    return (torch.arange(length - 1).unsqueeze(0) < until).float()


def replay_targets(routes: torch.Tensor, seq_len: int, *, num_experts: int, sp_rank: int = 0,
                   sp_size: int = 1) -> torch.Tensor:
    """A micro batch's routes ``[b, s', M, K]`` (``s'`` = ``seq_len - 1`` or ``seq_len``, laid out like its tokens)
    as ``[M, tokens, K]`` int64 for Megatron: the missing last position filled, tokens sequence-major
    (``s * b + batch row``), and with sequence parallelism only rank ``sp_rank``'s ``seq_len / sp_size`` positions."""
    if routes.ndim != 4:
        raise ValueError(f"routes of a micro batch must be [batch, positions, layers, K]; got {tuple(routes.shape)}")
    b, s, m, k = routes.shape
    if s not in (seq_len - 1, seq_len):
        raise ValueError(f"routes cover {s} positions; the micro batch has {seq_len} tokens")
    full = routes.long()
    if s == seq_len - 1:
        last = filler(torch.tensor([seq_len - 1]), k, num_experts).to(full.device)
        full = torch.cat([full, last.view(1, 1, 1, k).expand(b, 1, m, k)], dim=1)
    if seq_len % sp_size:
        raise ValueError(f"{seq_len} tokens do not split over {sp_size} sequence-parallel ranks")
    share = seq_len // sp_size
    full = full[:, sp_rank * share:(sp_rank + 1) * share]  # [b, share, M, K]
    return full.permute(2, 1, 0, 3).reshape(m, share * b, k).contiguous()


def packed_routes(routes: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, total: int, *, num_experts: int,
                  local: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A packed micro batch's routes laid out like its tokens, ``[1, T, M, K]`` (``rlc.runtime.policy.packing``):
    the bin's rows ``routes [k, L-1, M, K]`` moved to their packed positions (``index`` / ``valid``: the micro
    batch's ``unpack_index`` / ``unpack_valid``, position ``j`` of row ``k`` at ``cu_seqlens[k] + j``), filler
    routes at each sequence's last token and padding; with context parallelism only this rank's ``local``
    positions (``packing.cp_partition_indices``), in its order."""
    k, width, m, topk = routes.shape
    if index.shape != (k, width) or valid.shape != (k, width):
        raise ValueError(f"packed routes: {tuple(routes.shape)} routes for an unpack index of {tuple(index.shape)}")
    out = filler(torch.arange(total), topk, num_experts).to(routes.dtype).view(total, 1, topk)
    out = out.expand(total, m, topk).clone()
    out[index[valid]] = routes[valid]
    if local is not None:
        out = out[local]
    return out.unsqueeze(0)


def micro_batch_routes(mb: dict[str, Any], *, num_experts: int, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """The routes of a micro batch laid out like its ``tokens``: a padded micro batch's ``[b, L-1, M, K]`` as they
    are, a packed one's (``cu_seqlens`` in it) through :func:`packed_routes`."""
    if ROUTES_KEY not in mb:
        raise RuntimeError("training.router_replay is on but the micro batch carries no routed_experts")
    routes = mb[ROUTES_KEY]
    if "cu_seqlens" not in mb:
        return routes
    from rlc.runtime.policy.packing import cp_partition_indices  # noqa: PLC0415

    cu = [int(x) for x in mb["cu_seqlens"].tolist()]
    local = cp_partition_indices(cu, cp_size, cp_rank) if cp_size > 1 else None
    return packed_routes(routes, mb["unpack_index"], mb["unpack_valid"], cu[-1], num_experts=num_experts,
                         local=local)


__all__ = ["ROUTES_KEY", "compact", "filler", "micro_batch_routes", "pack_routes", "packed_routes", "replay_targets",
           "routes_dtype", "unrouted_mask"]
