"""The trainer side of ``refit.fused_transfer``: each MoE layer's routed experts as two stacked tensors.

Megatron-core holds a layer's experts as the grouped GEMM's weights (``TEGroupedMLP``: one ``weight<i>``
per local expert, or a single ``[experts, out, in]`` weight) or as separate MLPs (``SequentialMLP``). With
expert tensor parallelism 1 a gated ``linear_fc1`` weight is ``[gate; up]`` of one expert and ``linear_fc2`` is
its ``down_proj``: exactly the rows vLLM's ``w13_weight`` and ``w2_weight`` hold per expert. So the export of a
layer is its local weights stacked (straight into the IPC buffer by the producer, or the single grouped
weight as it is) and, with expert parallelism, gathered over the expert-parallel group in one collective
(local expert ``i`` of EP rank ``r`` is global expert ``r × local + i``, megatron-core's placement). Every
other tensor still comes from Megatron-Bridge's export, whose expert tasks are left out for the fused layers.

Where a layer's experts cannot be exported this way (expert tensor parallelism, pipeline parallelism, biases,
no gated unit, FP8 primary weights), the layer stays on Bridge's per-expert export and the reason is
reported. At ``prepare`` the fused export of one layer is compared bit for bit with Bridge's per-expert export
of the same layer; a difference stops before any refit, naming the tensor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from rlc.runtime.refit.sources import StackedParts, is_plain_tensor, materialize
from rlc.runtime.refit.fused_layout import W2, W13, ExpertGroup, expert_groups, layer_of, parse_per_expert
from rlc.runtime.refit.specs import TensorSpec
from rlc.runtime.refit.zero_copy import why_not_zero_copy

_TASK_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.mlp\.experts\.")


class FusedExportError(RuntimeError):
    """The stacked expert export differs from Megatron-Bridge's per-expert export."""


def _unwrap(chunk: Any) -> Any:
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def expert_modules(model: list) -> dict[int, Any]:
    """Global decoder layer index (0-based) -> the layer's routed experts module, for every MoE layer."""
    out: dict[int, Any] = {}
    for chunk in model:
        decoder = getattr(_unwrap(chunk), "decoder", None)
        for layer in getattr(decoder, "layers", []) or []:
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is not None:
                out[int(layer.layer_number) - 1] = experts
    return out


def _local_weights(experts: Any, linear: str) -> torch.Tensor | list[torch.Tensor]:
    """The local experts' weights of ``linear_fc1`` / ``linear_fc2``: one 3-D tensor or a list of 2-D ones."""
    if hasattr(experts, "local_experts"):  # SequentialMLP
        return [getattr(e, linear).weight for e in experts.local_experts]
    lin = getattr(experts, linear)
    if getattr(lin, "single_grouped_weight", False):
        return lin.weight
    return [getattr(lin, f"weight{i}") for i in range(int(experts.num_local_experts))]


def why_not_fusable(experts: Any, *, etp: int, pp: int) -> str | None:
    """Why this experts module stays on the per-expert export (None: it can be stacked)."""
    cfg = experts.config
    if pp > 1:
        return "pipeline parallelism: Bridge broadcasts every stage's tensors, the stacked export does not"
    if etp != 1:
        return f"expert tensor parallelism {etp} splits each expert's rows over ranks"
    if not getattr(cfg, "gated_linear_unit", False):
        return "experts without a gated linear unit"
    if getattr(cfg, "add_bias_linear", False):
        return "experts with biases"
    if not (hasattr(experts, "local_experts") or hasattr(experts, "linear_fc1")):
        return f"unknown experts module {type(experts).__name__}"
    for linear in ("linear_fc1", "linear_fc2"):
        w = _local_weights(experts, linear)
        for t in [w] if isinstance(w, torch.Tensor) else w:
            if not is_plain_tensor(t) or not t.dtype.is_floating_point:
                return f"{type(t).__name__} weights (FP8 primary weights are dequantized by Bridge's export)"
    return None


def stacked(experts: Any) -> Iterator[tuple[str, Any]]:
    """``(fused_w13 | fused_w2, tensor)`` of one layer, every expert: a ``StackedParts`` the producer stacks into
    its buffer, a zero-copy grouped weight, or (expert parallelism) the gather over the EP group."""
    group = experts.ep_group
    ep = group.size() if group is not None else 1
    for kind, linear in ((W13, "linear_fc1"), (W2, "linear_fc2")):
        w = _local_weights(experts, linear)
        if ep == 1:
            yield kind, (w.detach() if isinstance(w, torch.Tensor) else StackedParts(w))
            continue
        local = (w.detach() if isinstance(w, torch.Tensor) else torch.stack([p.detach() for p in w])).contiguous()
        out = torch.empty((ep * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
        torch.distributed.all_gather_into_tensor(out, local, group=group)
        yield kind, out


@dataclass
class FusedExport:
    """Which layers travel stacked, and the Bridge tasks left for everything else."""

    modules: dict[int, Any]  # decoder layer -> experts module, for the layers exported stacked
    groups: dict[int, ExpertGroup]  # decoder layer -> its HF names and shapes
    bridge_tasks: list
    refused: dict[str, str] = field(default_factory=dict)  # layer / prefix -> why it stays per expert

    def wire_specs(self, bridge_specs: list[TensorSpec]) -> list[TensorSpec]:
        """The export list in stream order: Bridge's tensors without the stacked layers' experts, then the
        stacked tensors layer by layer."""
        replaced = {n for g in self.groups.values() for n in g.per_expert_names()}
        out = [s for s in bridge_specs if s.name not in replaced]
        for layer in sorted(self.groups):
            out += [self.groups[layer].w13, self.groups[layer].w2]
        return out

    def stream(self, bridge_export: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        yield from bridge_export
        for layer in sorted(self.groups):
            prefix = self.groups[layer].prefix
            for kind, tensor in stacked(self.modules[layer]):
                yield f"{prefix}.{kind}", tensor
                del tensor

    def in_place_stacks(self) -> list[str]:
        """The stacked tensors a consumer can read where the trainer holds them (``refit.zero_copy_experts``): a layer's
        experts held on this rank alone (no expert parallelism, so no gather) as contiguous parameters, or one
        grouped weight, in the dtype they travel in."""
        out = []
        for layer in sorted(self.groups):
            experts, group = self.modules[layer], self.groups[layer]
            if experts.ep_group is not None and experts.ep_group.size() > 1:
                continue
            for spec, linear in ((group.w13, "linear_fc1"), (group.w2, "linear_fc2")):
                w = _local_weights(experts, linear)
                parts = [w] if isinstance(w, torch.Tensor) else w
                if all(why_not_zero_copy(p.detach(), spec.dtype, p.device) is None for p in parts):
                    out.append(spec.name)
        return out

    def summary(self) -> dict[str, Any]:
        return {"layers": len(self.groups), "refused": dict(sorted(self.refused.items())[:8])}


def plan_fused_export(model: list, tasks: list, bridge_specs: list[TensorSpec], candidates: dict[int, Any],
                      refused: dict[str, str]) -> FusedExport:
    """The fused export of the ``candidates`` (layer -> experts module) whose HF groups are complete in
    ``bridge_specs``; Bridge's tasks for their experts are dropped from ``tasks``."""
    groups, not_fusable = expert_groups(bridge_specs)
    refused = {**refused, **not_fusable}
    by_layer = {g.layer: g for g in groups.values() if g.layer is not None}
    chosen = {layer: by_layer[layer] for layer in candidates if layer in by_layer}
    for layer in candidates:
        if layer not in by_layer:
            refused.setdefault(f"layer {layer}", "its per-expert HF tensors are not all in the export")
    keep = []
    for t in tasks:
        m = _TASK_LAYER.search(getattr(t, "global_param_name", "") or "") if t is not None else None
        if m is None or int(m.group(1)) not in chosen:
            keep.append(t)
    return FusedExport({layer: candidates[layer] for layer in chosen}, chosen, keep, refused)


class FusedDiscovery:
    """The fused transfer's part of the pass that lists Bridge's export: which layers can travel stacked, and the
    bit-for-bit comparison of the first one's stacked tensors with Bridge's per-expert tensors (``observe``)."""

    def __init__(self, model: list, *, etp: int, pp: int) -> None:
        self.model = model
        self.candidates: dict[int, Any] = {}
        self.refused: dict[str, str] = {}
        for layer, experts in expert_modules(model).items():
            why = why_not_fusable(experts, etp=etp, pp=pp)
            if why is None:
                self.candidates[layer] = experts
            else:
                self.refused[f"layer {layer}"] = why
        self.check = min(self.candidates) if self.candidates else None
        # collective with expert parallelism: every rank builds it
        self.reference = reference_layer(self.candidates[self.check]) if self.check is not None else None
        self.diffs: list[str] = []

    def observe(self, name: str, tensor: torch.Tensor) -> None:
        if self.reference is not None and self.check is not None:
            diff = compare_with_bridge(self.reference, self.check, name, tensor)
            if diff is not None:
                self.diffs.append(diff)

    def finish(self, tasks: list, bridge_specs: list[TensorSpec], reason: str) -> tuple["FusedExport | None", str]:
        """The fused export (None when no layer can travel stacked) and the reason to report."""
        self.reference = None
        torch.cuda.empty_cache()
        if self.diffs:
            raise FusedExportError(
                f"refit.fused_transfer: the stacked experts of layer {self.check} differ from Megatron-Bridge's "
                f"per-expert export ({len(self.diffs)} tensors, e.g. {self.diffs[0]}); set refit.fused_transfer: off")
        fused = plan_fused_export(self.model, tasks, bridge_specs, self.candidates, self.refused)
        if fused.groups:
            return fused, reason
        return None, "off: no MoE layer can travel stacked (" + (
            "; ".join(f"{k}: {v}" for k, v in sorted(fused.refused.items())[:3]) or "no MoE layers") + ")"


def compare_with_bridge(reference: dict[str, torch.Tensor], layer: int, name: str, tensor: torch.Tensor) -> str | None:
    """Compare one of Bridge's per-expert tensors with the stacked ``reference`` (kind -> tensor) of decoder
    layer ``layer``: a description of the difference, or None when the bits agree (or it is another tensor)."""
    parsed = parse_per_expert(name)
    if parsed is None or layer_of(parsed[0]) != layer:
        return None
    _, e, proj = parsed
    inter = reference[W13].shape[1] // 2
    if proj == "down_proj":
        ref = reference[W2][e]
    else:
        ref = reference[W13][e].narrow(0, 0 if proj == "gate_proj" else inter, inter)
    got = tensor.detach().to(device=ref.device, dtype=ref.dtype)
    if got.shape != ref.shape or not torch.equal(got, ref):
        return f"{name}: the stacked export's slice differs from Bridge's tensor"
    return None


def reference_layer(experts: Any) -> dict[str, torch.Tensor]:
    """The stacked tensors of one layer, materialized (the self-check's reference)."""
    return {kind: materialize(t).clone() for kind, t in stacked(experts)}


__all__ = ["FusedDiscovery", "FusedExport", "FusedExportError", "compare_with_bridge", "expert_modules",
           "plan_fused_export", "reference_layer", "stacked", "why_not_fusable"]
