"""The bit-for-bit check of a swap into an inference model of another layout (``refit.verify_every`` with a
dedicated Megatron inference model whose TP / EP differ from the trainer's).

Independent of megatron-core's reshard plan: every rank gathers the trainer's tensors over the trainer's own
groups (tensor-parallel pieces joined along their partition dimension, expert-parallel experts under their
global index), then cuts from each gathered tensor the slice its inference tensor should hold
(``rlc.runtime.generation.reshard_plan`` says which) and compares the two bit for bit and in dtype with
``rlc.runtime.refit.verify.compare_parameters``. Collective over all trainer ranks (every rank calls it in the
same step); the slice arithmetic is CPU-tested on plain tensors.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from rlc.runtime.generation.reshard_plan import expert_index, global_expert_name, segments


def join_tp(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from each TP rank's piece (rank order), honouring ``partition_stride``."""
    world = len(parts)
    local = parts[0].shape[dim]
    full_len = local * world
    out = torch.empty((*parts[0].shape[:dim], full_len, *parts[0].shape[dim + 1:]), dtype=parts[0].dtype,
                      device=parts[0].device)
    for rank, segs in enumerate(segments(full_len, world, stride)):
        offset = 0
        for seg in segs:
            out.narrow(dim, seg.start, seg.length).copy_(parts[rank].narrow(dim, offset, seg.length))
            offset += seg.length
    return out


def tp_slice(full: torch.Tensor, dim: int, stride: int, world: int, rank: int) -> torch.Tensor:
    """The piece TP rank ``rank`` of ``world`` holds of ``full`` (inverse of :func:`join_tp`)."""
    if world == 1:
        return full
    segs = segments(full.shape[dim], world, stride)[rank]
    return torch.cat([full.narrow(dim, s.start, s.length) for s in segs], dim=dim)


def _is_tp(t: torch.Tensor, expert: bool, group_size: int) -> bool:
    """megatron-core's rule (``extract_param_metadata``): marked ``tensor_model_parallel``, or an expert tensor
    whose expert-TP group has more than one rank (Transformer Engine leaves the mark off there)."""
    return group_size > 1 and (bool(getattr(t, "tensor_model_parallel", False)) or expert)


def _group_size(group: Any) -> int:
    return 1 if group is None else int(torch.distributed.get_world_size(group))


def _group_rank(group: Any) -> int:
    return 0 if group is None else int(torch.distributed.get_rank(group))


def _layout_of(t: torch.Tensor) -> tuple[int, int]:
    if getattr(t, "partition_sizes", None) is not None:
        raise NotImplementedError("a tensor packing several independently split blocks (partition_sizes, Mamba's "
                                  "in_proj) is not checked by the reshard verification")
    return int(getattr(t, "partition_dim", 0)), int(getattr(t, "partition_stride", 1))


def gathered_training_tensors(core: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every trainer tensor whole: TP pieces joined over the trainer's (expert) TP group, each expert under its
    global name (gathered over the EP group). Collective: every trainer rank calls it with the same names."""
    pg = core.pg_collection
    num_experts = int(getattr(core.config, "num_moe_experts", None) or 0)
    out: dict[str, torch.Tensor] = {}
    ep_group = getattr(pg, "ep", None)
    ep = _group_size(ep_group)
    for name in sorted(tensors):
        param = tensors[name]  # megatron-core's attributes live on the parameter, not on a detached view
        t = param.detach()
        expert = bool(num_experts) and expert_index(name) is not None
        tp_group = (getattr(pg, "expt_tp", None) or pg.tp) if expert else pg.tp
        size = _group_size(tp_group)
        full = t
        if _is_tp(param, expert, size):
            dim, stride = _layout_of(param)
            parts = [torch.empty_like(t) for _ in range(size)]
            torch.distributed.all_gather(parts, t.contiguous(), group=tp_group)
            full = join_tp(parts, dim, stride)
        if expert and not getattr(param, "allreduce", True) and ep > 1:
            parts = [torch.empty_like(full) for _ in range(ep)]
            torch.distributed.all_gather(parts, full.contiguous(), group=ep_group)
            for e, part in enumerate(parts):
                out[global_expert_name(name, e, num_experts, ep)] = part
        elif expert and not getattr(param, "allreduce", True):
            out[global_expert_name(name, _group_rank(ep_group), num_experts, ep)] = full
        else:
            out[name] = full
    return out


def expected_inference_tensors(core: Any, tensors: Mapping[str, torch.Tensor],
                               whole: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """What each inference tensor should hold: its slice of the whole trainer tensor (by global name). Returns
    the expected tensors and the inference names no trainer tensor matches."""
    pg = core.pg_collection
    num_experts = int(getattr(core.config, "num_moe_experts", None) or 0)
    ep_group = getattr(pg, "ep", None)
    ep, ep_rank = _group_size(ep_group), _group_rank(ep_group)
    expected: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for name, t in tensors.items():
        expert = bool(num_experts) and expert_index(name) is not None
        key = (global_expert_name(name, ep_rank, num_experts, ep)
               if expert and not getattr(t, "allreduce", True) else name)
        ref = whole.get(key)
        if ref is None:
            missing.append(name)
            continue
        tp_group = (getattr(pg, "expt_tp", None) or pg.tp) if expert else pg.tp
        size = _group_size(tp_group)
        if _is_tp(t, expert, size):
            dim, stride = _layout_of(t)
            ref = tp_slice(ref, dim, stride, size, _group_rank(tp_group))
        expected[name] = ref
    return expected, missing


__all__ = ["expected_inference_tensors", "gathered_training_tensors", "join_tp", "tp_slice"]
