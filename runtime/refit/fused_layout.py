"""Fused expert transfer: which exported tensors are one MoE layer's routed experts (pure Python, no torch).

Megatron-Bridge exports a MoE layer's routed experts as one HF tensor per expert and projection
(``<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight``: 384 tensors per layer of Qwen3-30B-A3B, 18,432
per refit). With ``refit.fused_transfer`` the trainer sends each layer's experts as two stacked tensors
instead, in the layout vLLM's fused MoE parameters already have:

* ``<prefix>.fused_w13`` of shape ``[experts, 2 × intermediate, hidden]``: expert ``e``'s rows are its
  ``gate_proj`` (vLLM's ``w1``) followed by its ``up_proj`` (``w3``), as in vLLM's ``w13_weight`` and in
  Megatron's gated ``linear_fc1``;
* ``<prefix>.fused_w2`` of shape ``[experts, hidden, intermediate]``: the ``down_proj`` of every expert,
  as in vLLM's ``w2_weight``.

``<prefix>`` is the HF module of the layer's experts (``model.layers.3.mlp.experts``). The names end in
``fused_*`` so that no HF loader can mistake them for checkpoint tensors: only the fused loader
(:mod:`rlc.runtime.refit.fused`) reads them, and its fallback splits them back into the per-expert names
(:func:`unfused_names`). This module finds the groups in an export list and rewrites the list.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from rlc.runtime.refit.errors import RefitPlanError
from rlc.runtime.refit.specs import TensorSpec

W13 = "fused_w13"
W2 = "fused_w2"
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>fused_w13|fused_w2)$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertGroup:
    """One MoE layer's routed experts as exported per expert: every expert has gate, up and down."""

    prefix: str  # HF module of the experts, e.g. "model.layers.3.mlp.experts"
    num_experts: int
    intermediate: int  # rows of gate_proj / up_proj, columns of down_proj
    hidden: int
    dtype: str

    @property
    def layer(self) -> int | None:
        """The decoder layer index in the prefix (``.layers.<i>.``), None when there is none."""
        return layer_of(self.prefix)

    @property
    def w13(self) -> TensorSpec:
        return TensorSpec(f"{self.prefix}.{W13}", (self.num_experts, 2 * self.intermediate, self.hidden), self.dtype)

    @property
    def w2(self) -> TensorSpec:
        return TensorSpec(f"{self.prefix}.{W2}", (self.num_experts, self.hidden, self.intermediate), self.dtype)

    def per_expert_names(self) -> list[str]:
        """The HF names the two fused tensors replace, expert by expert (gate, up, down)."""
        return [f"{self.prefix}.{e}.{p}.weight" for e in range(self.num_experts)
                for p in ("gate_proj", "up_proj", "down_proj")]


def parse_per_expert(name: str) -> tuple[str, int, str] | None:
    """``(experts prefix, expert, "gate_proj" | "up_proj" | "down_proj")`` of a per-expert HF name, else None."""
    m = _PER_EXPERT.match(name)
    return (m.group("prefix"), int(m.group("expert")), m.group("proj")) if m else None


def layer_of(prefix: str) -> int | None:
    """The decoder layer index in an experts prefix (``.layers.<i>.``), None when there is none."""
    m = _LAYER.search(prefix + ".")
    return int(m.group(1)) if m else None


def parse_fused(name: str) -> tuple[str, str] | None:
    """``(experts prefix, "fused_w13" | "fused_w2")`` of a fused name, None for any other name."""
    m = _FUSED.match(name)
    return (m.group("prefix"), m.group("kind")) if m else None


def expert_groups(specs: Sequence[TensorSpec]) -> tuple[dict[str, ExpertGroup], dict[str, str]]:
    """The export list's fusable expert groups (prefix -> group) and, for groups that are not fusable,
    why (prefix -> reason). A group is fusable when experts ``0 .. E-1`` each export a ``gate_proj`` and an
    ``up_proj`` of one shape ``[I, H]`` and a ``down_proj`` of shape ``[H, I]``, all of one dtype."""
    found: dict[str, dict[tuple[int, str], TensorSpec]] = {}
    for s in specs:
        parsed = parse_per_expert(s.name)
        if parsed:
            prefix, expert, proj = parsed
            found.setdefault(prefix, {})[(expert, proj)] = s
    groups: dict[str, ExpertGroup] = {}
    refused: dict[str, str] = {}
    for prefix, parts in found.items():
        experts = sorted({e for e, _ in parts})
        if experts != list(range(len(experts))):
            refused[prefix] = f"experts {experts[0]}..{experts[-1]} are not numbered 0..{len(experts) - 1}"
            continue
        missing = [f"{e}.{p}" for e in experts for p in ("gate_proj", "up_proj", "down_proj") if (e, p) not in parts]
        if missing:
            refused[prefix] = f"missing {', '.join(missing[:4])}"
            continue
        gate = parts[(0, "gate_proj")]
        if len(gate.shape) != 2:
            refused[prefix] = f"gate_proj has shape {list(gate.shape)}, not [intermediate, hidden]"
            continue
        inter, hidden = gate.shape
        want = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        odd = [f"{e}.{p} {list(s.shape)} {s.dtype}" for (e, p), s in sorted(parts.items())
               if s.shape != want[p] or s.dtype != gate.dtype]
        if odd:
            refused[prefix] = f"shapes or dtypes differ between experts: {', '.join(odd[:3])}"
            continue
        groups[prefix] = ExpertGroup(prefix, len(experts), inter, hidden, gate.dtype)
    return groups, refused


def fuse_specs(specs: Sequence[TensorSpec], groups: Iterable[ExpertGroup]) -> list[TensorSpec]:
    """``specs`` with every listed group's per-expert tensors replaced by its two fused tensors, placed where
    the group's first per-expert tensor was (the rest of the order is kept)."""
    by_name: dict[str, ExpertGroup] = {}
    for g in groups:
        for n in g.per_expert_names():
            by_name[n] = g
    out: list[TensorSpec] = []
    placed: set[str] = set()
    for s in specs:
        found = by_name.get(s.name)
        if found is None:
            out.append(s)
        elif found.prefix not in placed:
            placed.add(found.prefix)
            out.extend((found.w13, found.w2))
    return out


def check_fused_spec(spec: TensorSpec) -> tuple[str, str, int, int, int]:
    """``(prefix, kind, experts, intermediate, hidden)`` of a fused wire spec; raises on another shape."""
    parsed = parse_fused(spec.name)
    if parsed is None or len(spec.shape) != 3:
        raise RefitPlanError(f"{spec.name!r} {list(spec.shape)} is not a fused expert tensor "
                             f"(<experts prefix>.{W13} [E, 2I, H] or .{W2} [E, H, I])")
    prefix, kind = parsed
    e, a, b = spec.shape
    if kind == W13:
        if a % 2:
            raise RefitPlanError(f"{spec.name!r}: {a} rows are not gate and up of equal size")
        return prefix, kind, e, a // 2, b
    return prefix, kind, e, b, a


def unfused_names(spec: TensorSpec) -> list[tuple[str, int, int, int]]:
    """How a fused tensor splits into HF per-expert tensors: ``(name, expert, first row, rows)`` along dim 1."""
    prefix, kind, experts, inter, hidden = check_fused_spec(spec)
    if kind == W13:
        return [item for e in range(experts) for item in (
            (f"{prefix}.{e}.gate_proj.weight", e, 0, inter), (f"{prefix}.{e}.up_proj.weight", e, inter, inter))]
    return [(f"{prefix}.{e}.down_proj.weight", e, 0, hidden) for e in range(experts)]


__all__ = ["ExpertGroup", "W13", "W2", "check_fused_spec", "expert_groups", "fuse_specs", "layer_of", "parse_fused",
           "parse_per_expert", "unfused_names"]
