"""The memory plan's data: phases of stacked items per GPU, the refit math, checks, fixes.

Produced by :func:`rlc.compiler.planner.memory.plan_memory`; rendered by ``render_text`` and
``render_svg``; read by the RLC2xx rules through the properties at the bottom of
:class:`MemoryPlan`. ``None`` anywhere means "cannot be computed from the known facts".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from rlc.compiler.planner.render_svg import render_svg
from rlc.compiler.planner.render_text import render_text
from rlc.contract.refit_buffer import GIB


def gib(nbytes: Optional[int]) -> Optional[float]:
    return None if nbytes is None else nbytes / GIB


def gib_bytes(x: float) -> int:
    """GiB to bytes, rounded (the inverse of :func:`gib`)."""
    return int(round(x * GIB))


@dataclass(frozen=True)
class Item:
    """One block of memory on a GPU in a phase."""

    label: str
    gib: Optional[float]
    owner: str  # "megatron" | "vllm" | "refit"
    source: str  # "params" (first principles) | "calibration:<key>" | "recipe:<key>"
    note: str = ""


@dataclass(frozen=True)
class Phase:
    """Memory of the worst GPU in one phase: stacked items against the GPU limit."""

    name: str  # train | train_late | logprob | logprob_late | generate | refit | stack
    title: str
    items: tuple[Item, ...]
    limit_gib: float
    stage: Optional[int] = None  # Megatron pipeline stage of the worst GPU
    note: str = ""
    request: Optional[Item] = None  # the allocation this phase is about to make (must fit in free_gib)

    @property
    def used_gib(self) -> Optional[float]:
        total = 0.0
        for item in self.items:
            if item.gib is None:
                return None
            total += item.gib
        return total

    @property
    def free_gib(self) -> Optional[float]:
        used = self.used_gib
        return None if used is None else self.limit_gib - used


@dataclass(frozen=True)
class Check:
    """One pass/fail question the plan answers (``ok`` None = unknown)."""

    id: str  # buffer | stack | generate_fit | train_fit
    ok: Optional[bool]
    have_gib: Optional[float]
    need_gib: Optional[float]
    text: str  # the math, with numbers

    @property
    def margin_gib(self) -> Optional[float]:
        if self.have_gib is None or self.need_gib is None:
            return None
        return self.have_gib - self.need_gib


@dataclass(frozen=True)
class RefitMath:
    """The refit buffer and export-staging arithmetic (bytes), see docs/planner.md."""

    free_at_refit: int
    buffer_source: str  # "buffer_memory_ratio 0.3 of free" | "buffer_gb 20"
    ratio: Optional[float]
    per_side: int
    largest_name: str
    largest: int
    gathered: int  # the gathered pieces of the largest tensor still alive when it is stacked
    staging_overhead: int
    fragmentation: int
    headroom_fraction: float  # (per_side - largest) / largest
    free_at_stack: int
    ratio_window: Optional[tuple[float, float]]  # ratios that pass both checks at this free memory
    tolerance_gib: Optional[float]  # how much less free memory would flip a passing check
    #: FP8 rollouts with block scales: the largest tensor on the wire (a weight quantized to 1 byte with its
    #: block scales, or one that stays in model.dtype), which the buffer half must hold; None when the wire
    #: carries the export as it is
    wire_largest_name: Optional[str] = None
    wire_largest: Optional[int] = None
    #: FP8 rollouts: bucket copies vLLM's layerwise reload may hold while the exporter stacks (0 otherwise)
    reload_copies: int = 0

    @property
    def wire(self) -> tuple[str, int]:
        """The tensor the buffer half must hold: the largest on the wire."""
        if self.wire_largest is None or self.wire_largest_name is None:
            return self.largest_name, self.largest
        return self.wire_largest_name, self.wire_largest

    @property
    def buffer_margin(self) -> int:
        return self.per_side - self.wire[1]

    @property
    def stack_margin(self) -> int:
        return self.free_at_stack - self.largest


@dataclass(frozen=True)
class Fix:
    """A lever that frees memory or resizes the buffer, evaluated by re-planning."""

    key: str  # recipe key path it changes
    value: Any
    text: str  # "sleep_level: 2 frees ≈ 12.6 GiB; then buffer_memory_ratio 0.33–0.60 passes"
    freed_gib: Optional[float]
    sufficient: bool  # passes both refit checks (with the ratio named in text)
    cost: int  # 0 free, 1 cheap, 2 layout change, 3 throughput cost


@dataclass
class MemoryPlan:
    """Memory per GPU per phase, the refit math, checks and the cheapest fixes."""

    model_id: str
    gpu: str
    gpu_memory_gib: float
    calibration_id: str
    layout: dict[str, Any]
    graph_uncertainty_gib: float  # how much the CUDA-graph residue varies (calibration), for the margin rules
    phases: dict[str, Phase] = field(default_factory=dict)
    refit: Optional[RefitMath] = None
    checks: dict[str, Check] = field(default_factory=dict)
    fixes: list[Fix] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)  # per Megatron stage figures
    vllm_weights_gib: Optional[float] = None  # everything in vLLM's weight pool on its worst GPU
    vllm_drafter_gib: Optional[float] = None  # of which the MTP speculative-decoding drafter (None: no drafter)
    unknown: list[str] = field(default_factory=list)  # figures not computable, each with why
    notes: list[str] = field(default_factory=list)
    vllm_version: Optional[str] = None  # the vLLM version planned against (recipe or calibration)
    sleep_label: str = ""  # which sleep-semantics entry applied
    residency: dict[str, Any] = field(default_factory=dict)  # phase -> residency.PhaseResidency
    host: Any = None  # host.HostPlan: host memory per node at its worst phase
    late_fix: Optional[Fix] = None  # what makes the train step fit once the vLLM residue has grown
    generate_fix: Optional[Fix] = None  # refit.offload_params_for_generation, where generation overfills without it
    logprob_fix: Optional[Fix] = None  # a logprob batch (or trainer TP) that fits, where the logprob pass overfills
    # where the vLLM residue grows over steps (train_late, logprob_late): whether the growth was recorded on the
    # planned vLLM version's series (else the sleep table carries it there as a projection); None: no growth
    residue_growth_recorded: Optional[bool] = None
    # with optimizer_cpu_offload on: the train step (GiB) with the whole optimizer state on the GPU instead,
    # so a rule can tell a layout that needs the CPU optimizer from one that merely uses it
    train_gib_without_cpu_offload: Optional[float] = None
    backend: str = "vllm"  # generation.backend the plan is for
    mcore: Optional[dict[str, Any]] = None  # generation.backend megatron: mode, weight sync, KV pool arithmetic

    # ------------------------------------------------------------------ figures the rules read

    @property
    def per_side_bytes(self) -> Optional[int]:
        return None if self.refit is None else self.refit.per_side

    @property
    def largest_tensor(self) -> tuple[str, Optional[int]]:
        if self.refit is None:
            return ("unknown", None)
        return (self.refit.largest_name, self.refit.largest)

    @property
    def largest_wire_tensor(self) -> tuple[str, Optional[int]]:
        """The largest tensor the refit moves (FP8 rollouts with block scales: quantized), which a buffer
        half must hold."""
        if self.refit is None:
            return ("unknown", None)
        return self.refit.wire

    @property
    def free_at_refit_bytes(self) -> Optional[int]:
        return None if self.refit is None else self.refit.free_at_refit

    @property
    def free_at_stack_bytes(self) -> Optional[int]:
        return None if self.refit is None else self.refit.free_at_stack

    @property
    def buffer_margin_bytes(self) -> Optional[int]:
        return None if self.refit is None else self.refit.buffer_margin

    @property
    def stack_margin_bytes(self) -> Optional[int]:
        return None if self.refit is None else self.refit.stack_margin

    def phase_used_gib(self, name: str) -> Optional[float]:
        phase = self.phases.get(name)
        return None if phase is None else phase.used_gib

    def item_gib(self, phase: str, label: str) -> Optional[float]:
        for item in self.phases[phase].items:
            if item.label == label:
                return item.gib
        raise KeyError(f"{phase} has no item {label!r}")

    # ------------------------------------------------------------------ output

    def to_json(self) -> dict[str, Any]:
        """A plain-data dict (JSON-serialisable) of everything in the plan."""
        out = {
            "model": self.model_id,
            "gpu": self.gpu,
            "gpu_memory_gib": self.gpu_memory_gib,
            "calibration": self.calibration_id,
            "layout": self.layout,
            "phases": {
                name: {"title": p.title, "stage": p.stage, "limit_gib": p.limit_gib, "used_gib": p.used_gib,
                       "free_gib": p.free_gib, "note": p.note, "items": [asdict(i) for i in p.items],
                       "request": asdict(p.request) if p.request else None}
                for name, p in self.phases.items()
            },
            "refit": None,
            "checks": {k: {**asdict(c), "margin_gib": c.margin_gib} for k, c in self.checks.items()},
            "fixes": [asdict(f) for f in self.fixes],
            "generate_fix": None if self.generate_fix is None else asdict(self.generate_fix),
            "logprob_fix": None if self.logprob_fix is None else asdict(self.logprob_fix),
            "stages": self.stages,
            "vllm_weights_gib": self.vllm_weights_gib,
            "vllm_drafter_gib": self.vllm_drafter_gib,
            "unknown": self.unknown,
            "notes": self.notes,
            "vllm_version": self.vllm_version,
            "sleep_semantics": self.sleep_label,
            "residency": {k: asdict(v) for k, v in self.residency.items()},
            "host": None if self.host is None else {
                "node_gib": self.host.node_gib, "node_source": self.host.node_source,
                "limit_gib": self.host.limit_gib, "phase": self.host.phase, "used_gib": self.host.used_gib,
                "ok": self.host.ok, "items": [asdict(i) for i in self.host.items]},
        }
        if self.mcore is not None:
            out["megatron"] = self.mcore
        if self.refit is not None:
            r = self.refit
            refit = {**asdict(r), "buffer_margin": r.buffer_margin, "stack_margin": r.stack_margin,
                     "ratio_window": list(r.ratio_window) if r.ratio_window else None}
            if r.wire_largest is None:  # bf16 rollouts: the wire is the export (no FP8 fields)
                for key in ("wire_largest_name", "wire_largest", "reload_copies"):
                    refit.pop(key)
            out["refit"] = refit
        return out

    def to_text(self) -> str:
        return render_text(self)

    def to_svg(self) -> str:
        return render_svg(self)
