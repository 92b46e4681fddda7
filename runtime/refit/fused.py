"""Fused expert transfer on the torch side: the producer's stacked tensors and the consumer's direct copies.

``refit.fused_transfer`` (names and layout: :mod:`rlc.runtime.refit.fused_layout`) sends each MoE layer's
routed experts as two stacked tensors. On the vLLM side a :class:`RouteTable`, built once at the first
refit from the wire export list and the engine's fused MoE layers (:class:`ExpertDestination`), says for
every fused tensor which views of vLLM's ``w13_weight`` / ``w2_weight`` its slices go to: with the whole
layer on one GPU that is one copy per destination; with tensor parallelism vLLM holds a slice of the
intermediate dimension (gate and up slices of ``w13``, a column slice of ``w2``); with expert parallelism
the experts it holds (vLLM's own global-to-local expert map). Every refit the table is checked against
the export list the producer announced and against the destinations as they are now (same tensors, same
places); a difference stops the refit (``RefitManifestError``) instead of writing into stale memory.

:class:`FusedLoader` is the ``load_weights`` the consumer calls per bucket: covered tensors become direct
copies, issued for the whole bucket at once (``torch._foreach_copy_``); everything else goes to vLLM's own
``load_weights``: tensors that are not fused, and fused tensors the table does not cover (an FP8 or other
quantized destination, a layout vLLM re-lays out after loading, a module name vLLM maps differently),
split back into the per-expert HF tensors vLLM's loader expects. ``refit.verify_every`` compares the result
with vLLM's own load of the per-expert export, bit for bit.

:class:`rlc.runtime.refit.sources.StackedParts` is what the trainer yields for a layer whose experts are separate
parameters: the producer stacks them straight into the IPC buffer (one kernel, no intermediate tensor).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from rlc.runtime.refit.copy_tables import CopyStats, DirectCopyLoader, LoadWeights, digest, tensor_signature
from rlc.runtime.refit.errors import RefitManifestError
from rlc.runtime.refit.fused_layout import W13, check_fused_spec, parse_fused, unfused_names
from rlc.runtime.refit.specs import TensorSpec, normalize_dtype
from rlc.runtime.refit.zero_copy import StackedViews


#: vLLM's unquantized MoE backends that compute on ``w13_weight`` / ``w2_weight`` exactly as loaded (others may
#: re-lay the weights out in ``process_weights_after_loading``; they load through vLLM).
DIRECT_BACKENDS = frozenset({"TRITON", "BATCHED_TRITON"})


# --------------------------------------------------------------------------- consumer side


@dataclass(frozen=True)
class ExpertDestination:
    """One fused MoE layer of the generation engine, as the direct copies see it."""

    prefix: str  # the HF experts prefix it loads ("model.layers.3.mlp.experts")
    w13: torch.Tensor  # the parameter's data: [local experts, 2 × intermediate / tp, hidden]
    w2: torch.Tensor  # [local experts, hidden, intermediate / tp]
    global_experts: int
    local_to_global: tuple[int, ...]  # slot j of w13 / w2 holds global expert local_to_global[j]
    tp_rank: int = 0
    tp_size: int = 1
    #: Why this layer takes no direct copies (quantized, a backend that re-lays weights out, ...); None: it can.
    why_not: str | None = None

    def signature(self) -> tuple[Any, ...]:
        """What must stay the same for a route table built against this layer to stay valid."""
        return (self.prefix, *(tensor_signature(t) for t in (self.w13, self.w2)), self.global_experts,
                self.local_to_global, self.tp_rank, self.tp_size, self.why_not)


class CopyOp(NamedTuple):
    """One direct copy: ``source(fused)`` -> ``dst`` (a view of a destination parameter)."""

    dst: torch.Tensor
    expert_start: int  # first global expert (dim 0 of the fused tensor)
    experts: int
    dim: int  # dimension of the fused tensor sliced for tensor parallelism, -1 for none
    start: int
    length: int

    def source(self, fused: torch.Tensor) -> torch.Tensor:
        src = fused.narrow(0, self.expert_start, self.experts)
        return src if self.dim < 0 else src.narrow(self.dim, self.start, self.length)

    def describe(self) -> tuple[int, int, int, int, int, tuple[Any, ...]]:
        return (self.expert_start, self.experts, self.dim, self.start, self.length, tensor_signature(self.dst))


@dataclass(frozen=True)
class Route:
    """Where one fused wire tensor goes."""

    name: str
    spec: TensorSpec
    destination: str  # "<prefix>.w13_weight" / "<prefix>.w2_weight"
    ops: tuple[CopyOp, ...]

    @property
    def nbytes(self) -> int:
        return sum(op.dst.numel() * op.dst.element_size() for op in self.ops)


def specs_fingerprint(specs: Sequence[TensorSpec]) -> str:
    """Fingerprint of the fused part of a wire export list (what a route table was built for)."""
    return digest((s.name, s.shape, s.dtype) for s in specs if parse_fused(s.name) is not None)


@dataclass
class RouteTable:
    """Fused wire tensor -> direct copies, built once and checked every refit."""

    routes: dict[str, Route]
    uncovered: dict[str, str]  # fused wire name -> why it loads through vLLM's load_weights
    specs_key: str
    destination_signatures: dict[str, tuple[Any, ...]]  # experts prefix -> ExpertDestination.signature()

    @property
    def destinations_key(self) -> str:
        return digest(sig for _, sig in sorted(self.destination_signatures.items()))

    @property
    def fingerprint(self) -> str:
        return digest([self.specs_key, self.destinations_key,
                             *((n, r.destination, [op.describe() for op in r.ops]) for n, r in sorted(self.routes.items())),
                             *sorted(self.uncovered.items())])

    def check(self, specs: Sequence[TensorSpec], destinations: Mapping[str, ExpertDestination]) -> None:
        """Raise ``RefitManifestError`` when the export list or a destination changed since the table was built."""
        if specs_fingerprint(specs) != self.specs_key:
            raise RefitManifestError(
                "fused transfer: the producer's export list is not the one the direct-copy table was built for; "
                "the table is rebuilt only when the producer and consumer pair again (prepare)")
        now = {p: d.signature() for p, d in destinations.items()}
        if now == self.destination_signatures:
            return
        changed = sorted(set(now) ^ set(self.destination_signatures)
                         | {p for p in now if p in self.destination_signatures and now[p] != self.destination_signatures[p]})
        raise RefitManifestError(
            f"fused transfer: vLLM's fused expert parameters of {', '.join(changed[:4]) or 'some layer'} are not "
            "where the direct-copy table points (moved, resized or replaced since the first refit); copying would "
            "write memory the engine no longer reads. Turn refit.fused_transfer off if the engine re-allocates "
            "its weights between refits")

    def summary(self) -> dict[str, Any]:
        return {"routes": len(self.routes), "copies": sum(len(r.ops) for r in self.routes.values()),
                "uncovered": len(self.uncovered), "uncovered_examples": dict(sorted(self.uncovered.items())[:4]),
                "fingerprint": self.fingerprint}


def _runs(local_to_global: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(global start, local start, count)`` of the runs where consecutive slots hold consecutive experts."""
    runs: list[tuple[int, int, int]] = []
    for local, g in enumerate(local_to_global):
        if runs and runs[-1][0] + runs[-1][2] == g and runs[-1][1] + runs[-1][2] == local:
            g0, l0, n = runs[-1]
            runs[-1] = (g0, l0, n + 1)
        else:
            runs.append((g, local, 1))
    return runs


def _route(spec: TensorSpec, d: ExpertDestination) -> Route | str:
    """The direct copies of one fused tensor into ``d``, or why there are none."""
    prefix, kind, experts, inter, hidden = check_fused_spec(spec)
    if d.why_not:
        return d.why_not
    dst = d.w13 if kind == W13 else d.w2
    param = f"{prefix}.{'w13_weight' if kind == W13 else 'w2_weight'}"
    if normalize_dtype(dst.dtype) != spec.dtype:
        return (f"{param} holds {normalize_dtype(dst.dtype)}, the wire carries {spec.dtype} (quantized or "
                "converted weights load through vLLM)")
    if experts != d.global_experts:
        return f"{experts} experts on the wire, vLLM's layer has {d.global_experts} (redundant experts?)"
    local = len(d.local_to_global)
    if sorted(set(d.local_to_global)) != sorted(d.local_to_global) or not all(0 <= g < experts for g in d.local_to_global):
        return f"vLLM's local-to-global expert map {list(d.local_to_global)[:8]} is not a set of experts"
    if d.tp_size < 1 or inter % d.tp_size or not 0 <= d.tp_rank < d.tp_size:
        return f"intermediate size {inter} does not split evenly over {d.tp_size} tensor-parallel ranks"
    part = inter // d.tp_size
    want = (local, 2 * part, hidden) if kind == W13 else (local, hidden, part)
    if tuple(dst.shape) != want:
        return f"{param} has shape {list(dst.shape)}, the wire tensor needs {list(want)} (padded weights?)"
    ops: list[CopyOp] = []
    first = d.tp_rank * part
    for g0, l0, n in _runs(d.local_to_global):
        slots = dst.narrow(0, l0, n)
        if d.tp_size == 1:
            ops.append(CopyOp(slots, g0, n, -1, 0, 0))
        elif kind == W13:  # vLLM's w13: this rank's gate rows (w1), then its up rows (w3)
            ops.append(CopyOp(slots.narrow(1, 0, part), g0, n, 1, first, part))
            ops.append(CopyOp(slots.narrow(1, part, part), g0, n, 1, inter + first, part))
        else:  # w2: this rank's columns of down_proj
            ops.append(CopyOp(slots, g0, n, 2, first, part))
    return Route(spec.name, spec, param, tuple(ops))


def build_routes(specs: Sequence[TensorSpec], destinations: Mapping[str, ExpertDestination]) -> RouteTable:
    """The direct-copy table for the fused tensors of the wire ``specs`` (other names are not routed)."""
    routes: dict[str, Route] = {}
    uncovered: dict[str, str] = {}
    for spec in specs:
        parsed = parse_fused(spec.name)
        if parsed is None:
            continue
        d = destinations.get(parsed[0])
        if d is None:
            uncovered[spec.name] = f"vLLM has no fused MoE layer named {parsed[0]!r}"
            continue
        result = _route(spec, d)
        if isinstance(result, str):
            uncovered[spec.name] = result
        else:
            routes[spec.name] = result
    return RouteTable(routes, uncovered, specs_fingerprint(specs), {p: d.signature() for p, d in destinations.items()})


def unfuse(name: str, tensor: torch.Tensor | StackedViews) -> list[tuple[str, torch.Tensor]]:
    """A fused tensor (or its parts read in place) as the per-expert HF tensors vLLM's ``load_weights`` takes
    (views, no copy)."""
    spec = TensorSpec(name, tuple(tensor.shape), normalize_dtype(tensor.dtype))
    return [(n, tensor[e].narrow(0, start, rows)) for n, e, start, rows in unfused_names(spec)]


@dataclass
class FusedLoadStats(CopyStats):
    unfused_tensors: int = 0  # fused wire tensors split back and loaded by vLLM


class FusedLoader(DirectCopyLoader):
    """``load_weights`` for the consumer: direct copies for routed fused tensors, vLLM's loader for the rest (fused
    tensors the table does not cover split back per expert)."""

    stats: FusedLoadStats
    #: its routes slice a fused tensor along its experts first, so a stack read in place part by part will do
    takes_stacked_views = True

    def __init__(self, load_weights: LoadWeights, table: RouteTable) -> None:
        super().__init__(load_weights, table.routes)
        self.table = table
        self.stats = FusedLoadStats()

    def fallback(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if parse_fused(name) is None:
            return [(name, tensor)]
        self.stats.unfused_tensors += 1
        return unfuse(name, tensor)


# --------------------------------------------------------------------------- vLLM's layers


def why_not_direct(module: Any) -> str | None:
    """Why a vLLM ``FusedMoE`` layer takes no direct copies (None: it can). vLLM 0.22: an unquantized layer on
    the Triton backends computes on ``w13_weight`` / ``w2_weight`` exactly as its ``weight_loader`` writes them."""
    method = getattr(module, "quant_method", None)
    kind = type(method).__name__
    if kind != "UnquantizedFusedMoEMethod":
        return f"quantized experts ({kind}): vLLM processes them as they load"
    backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
    if backend not in DIRECT_BACKENDS:
        return f"vLLM's {backend} MoE backend may re-lay the weights out after loading"
    if getattr(module, "w13_bias", None) is not None or getattr(module, "w2_bias", None) is not None:
        return "experts with biases load through vLLM"
    if getattr(getattr(module, "moe_config", None), "is_act_and_mul", True) is False:
        return "w13 without a gate/up pair"
    if getattr(module, "enable_eplb", False):
        return "expert load balancing moves experts between refits"
    return None


def vllm_expert_destinations(model: Any) -> dict[str, ExpertDestination]:
    """Every fused MoE layer of a vLLM model (anything with ``w13_weight`` / ``w2_weight`` and an expert map),
    keyed by its module name, which is the HF experts prefix it loads for models without a name mapper."""
    out: dict[str, ExpertDestination] = {}
    for name, module in model.named_modules():
        w13 = getattr(module, "w13_weight", None)
        w2 = getattr(module, "w2_weight", None)
        mapper = getattr(module, "_map_global_expert_id_to_local_expert_id", None)
        if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or mapper is None or w13.dim() != 3:
            continue
        global_experts = int(module.global_num_experts)
        local = int(w13.shape[0])
        slots = [-1] * local
        for g in range(global_experts):
            slot = int(mapper(g))
            if 0 <= slot < local:
                slots[slot] = g
        why = why_not_direct(module)
        if why is None and -1 in slots:
            why = "vLLM's expert map leaves a local slot empty (redundant experts?)"
        out[name] = ExpertDestination(name, w13.data, w2.data, global_experts, tuple(slots),
                                      int(module.tp_rank), int(module.tp_size), why)
    return out


__all__ = ["CopyOp", "DIRECT_BACKENDS", "ExpertDestination", "FusedLoadStats", "FusedLoader", "Route", "RouteTable",
           "build_routes", "specs_fingerprint", "unfuse", "vllm_expert_destinations", "why_not_direct"]
