"""The refit buffer arithmetic of a plan (bytes): the ping-pong halves a recipe's refit allocates at the free
memory before it, whether a half holds the largest tensor on the wire, the free memory left where the exporter
stacks that tensor, the ``buffer_memory_ratio`` window that passes both, and the halves
``refit.keep_buffers_gb`` keeps between refits. The formulas the runtime allocates by are in
:mod:`rlc.contract.refit_buffer`; ``docs/planner.md`` ("The refit math") states them."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from rlc.contract import fp8 as fp8_contract
from rlc.contract import refit_buffer
from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.calibration import Calibration
from rlc.compiler.planner.fp8_layout import fp8_scales
from rlc.compiler.planner.fused_transfer import fused_transfer
from rlc.compiler.planner.layout import TrainLayout
from rlc.compiler.planner.plan import GIB, Item, RefitMath, gib, gib_bytes
from rlc.compiler.planner.window import first_true, passing_runs, widest
from rlc.compiler.recipe_types import Recipe, RefitSection

RATIO_STEP = 0.001
RATIO_MAX = 0.9


def _half_at(free: int, refit: RefitSection, ratio: float) -> int:
    """One ping-pong half at ``buffer_memory_ratio`` = ``ratio``."""
    return refit_buffer.half_bytes(free, buffer_memory_ratio=ratio, buffer_gb=None,
                                   alignment=max(1, int(refit.alignment_bytes)))


def _per_side(free: int, refit: RefitSection, ratio: Optional[float] = None) -> tuple[int, Optional[float], str]:
    """The half the recipe's refit allocates at ``free`` (or at ``ratio``), the ratio, and where its size comes from."""
    if ratio is None and refit.buffer_gb is not None:
        gb = float(refit.buffer_gb)
        half = refit_buffer.half_bytes(free, buffer_memory_ratio=None, buffer_gb=gb,
                                       alignment=max(1, int(refit.alignment_bytes)))
        return half, None, f"buffer_gb {gb:g} GiB (both halves)"
    r = float(ratio if ratio is not None else refit.buffer_memory_ratio)
    return _half_at(free, refit, r), r, f"buffer_memory_ratio {r:g} × {free / GIB:.2f} GiB free"


def _headroom(per_side: int, largest: int) -> float:
    """How far a buffer half exceeds the largest tensor, as a fraction of the tensor."""
    return (per_side - largest) / largest if largest else 1.0


def _stack_free(free: int, per_side: int, largest: int, gathered: int, cal: Calibration,
                reload_halves: int = 0) -> tuple[int, int, float]:
    """Free memory at the staging site; ``reload_halves``: bucket copies (one half each) vLLM's layerwise
    reload may hold at that moment with FP8 rollouts (:func:`reload_copy_halves`)."""
    headroom = _headroom(per_side, largest)
    frag = gib_bytes(cal.fragmentation_gib(headroom, largest / GIB))
    return (free - (2 + reload_halves) * per_side - gathered - gib_bytes(cal.export_staging_overhead_gib) - frag,
            frag, headroom)


#: FP8 rollouts: vLLM processes a layer once all its tensors are in, so the consumer loads from a private
#: copy of each bucket, and a layer that spans two buckets keeps both copies until it completes.
FP8_RELOAD_COPY_HALVES = 2


def reload_copy_halves(recipe: Recipe) -> int:
    """Bucket copies vLLM's layerwise reload may hold during a refit (0 for bf16 rollouts)."""
    return FP8_RELOAD_COPY_HALVES if recipe.generation.precision == "fp8" else 0


def wire_tensor(recipe: Recipe, facts: ModelFacts, bpp: int) -> Optional[tuple[str, int]]:
    """FP8 rollouts: the largest tensor on the refit's wire (block scales: projections quantized to 1 byte
    plus fp32 block scales, ``rlc.contract.fp8``; tensor scales: the export as it is); None for bf16
    rollouts or when the shapes are unknown."""
    scales, _ = fp8_scales(recipe, facts)
    if scales is None:
        return None
    shapes = facts.export_tensor_shapes()
    if not shapes:
        return None
    return fp8_contract.largest_wire_tensor(shapes, bpp, scales, recipe.generation.fp8.keep_bf16)


def refit_facts(recipe: Recipe, facts: ModelFacts) -> ModelFacts:
    """The facts the refit math reads: with ``refit.fused_transfer`` the routed experts travel stacked
    (``rlc.contract.refit_buffer.exported_experts``), so the largest tensor on the wire is a stacked one."""
    fused, _ = fused_transfer(recipe, facts)
    layout = refit_buffer.exported_experts(facts.expert_export, fused=fused)
    return facts if layout == facts.expert_export else dataclasses.replace(facts, expert_export=layout)


def _ratio_at(k: int) -> float:
    return round(k * RATIO_STEP, 3)


def ratio_window(free: int, recipe: Recipe, largest: int, gathered: int,
                 cal: Calibration, wire: Optional[int] = None) -> Optional[tuple[float, float]]:
    """The widest contiguous range of ``buffer_memory_ratio`` (grid ``RATIO_STEP`` up to ``RATIO_MAX``)
    passing both refit checks at ``free``.

    Solved rather than stepped (``window.py``): the half grows with the ratio, so the grid splits
    where the half reaches the largest tensor and where its headroom crosses a fragmentation point;
    within each piece the staging-site check is monotone and its boundary is found by bisection.
    """
    steps = int(RATIO_MAX / RATIO_STEP)
    on_wire = largest if wire is None else wire
    copies = reload_copy_halves(recipe)
    halves: dict[int, int] = {}  # the searches below probe some grid points more than once

    def per_side(k: int) -> int:
        if k not in halves:
            halves[k] = _half_at(free, recipe.refit, _ratio_at(k))
        return halves[k]

    def stack_ok(k: int) -> bool:
        return _stack_free(free, per_side(k), largest, gathered, cal, copies)[0] >= largest

    def headroom_reaches(x: float) -> Callable[[int], bool]:
        return lambda k: _headroom(per_side(k), largest) >= x

    holds = first_true(1, steps, lambda k: refit_buffer.half_holds(per_side(k), on_wire))
    starts = [holds] + [max(holds, first_true(1, steps, headroom_reaches(x))) for x, _ in cal.fragmentation_points]
    return widest(passing_runs(steps, starts, stack_ok), _ratio_at)


def _gathered(name: str, largest: int, tl: TrainLayout) -> int:
    """Bytes of the largest tensor's gathered pieces alive when it is assembled (0 if one rank owns it)."""
    ranks = tl.ep * tl.etp if ".experts." in name else tl.tp
    return largest if ranks > 1 else 0


def buffer_math(free: int, recipe: Recipe, largest_name: str, largest: int, tl: TrainLayout,
                cal: Calibration, wire: Optional[tuple[str, int]] = None) -> RefitMath:
    """The refit math at ``free``; ``wire``: the largest tensor on the wire when it is not the exported one
    (FP8 rollouts, :func:`wire_tensor`)."""
    per_side, ratio, source = _per_side(free, recipe.refit)
    gathered = _gathered(largest_name, largest, tl)
    copies = reload_copy_halves(recipe)
    stack, frag, headroom = _stack_free(free, per_side, largest, gathered, cal, copies)
    on_wire = largest if wire is None else wire[1]
    window = ratio_window(free, recipe, largest, gathered, cal, on_wire)
    tolerance = None
    margins = []
    if refit_buffer.half_holds(per_side, on_wire) and ratio:
        margins.append((per_side - on_wire) / GIB / (ratio / 2))
    slope = (1 - ratio * (2 + copies) / 2) if ratio else 1.0  # free at stack per byte of free memory
    if stack >= largest and slope > 0:
        margins.append((stack - largest) / GIB / slope)
    if refit_buffer.half_holds(per_side, on_wire) and stack >= largest:
        tolerance = min(margins) if margins else None
    return RefitMath(free_at_refit=free, buffer_source=source, ratio=ratio, per_side=per_side,
                     largest_name=largest_name, largest=largest, gathered=gathered,
                     staging_overhead=gib_bytes(cal.export_staging_overhead_gib), fragmentation=frag,
                     headroom_fraction=headroom, free_at_stack=stack, ratio_window=window, tolerance_gib=tolerance,
                     wire_largest_name=None if wire is None else wire[0],
                     wire_largest=None if wire is None else wire[1], reload_copies=copies * per_side)


#: The plan item of the IPC halves ``refit.keep_buffers_gb`` keeps (the rules' hints look for it).
KEPT_BUFFERS_LABEL = "IPC buffer kept between refits (2 halves)"


def kept_buffer_items(recipe: Recipe, math: Optional[RefitMath]) -> list[Item]:
    """The IPC buffer's two halves where ``refit.keep_buffers_gb`` keeps them from one refit to the next
    (:func:`rlc.contract.refit_buffer.halves_kept`): on the trainer's side in every phase, vLLM's generation
    included. The runtime caps a half at the export's size, so a model whose whole export is smaller than the
    planned half keeps less than this (never more)."""
    if math is None or not refit_buffer.halves_kept(math.per_side, refit_buffer.keep_buffers_bytes(
            recipe.refit.keep_buffers_gb)):
        return []
    return [Item(KEPT_BUFFERS_LABEL, gib(2 * math.per_side), "refit",
                 "recipe:refit.keep_buffers_gb", f"both halves within refit.keep_buffers_gb "
                 f"{float(recipe.refit.keep_buffers_gb):g} GiB stay allocated")]


__all__ = ["FP8_RELOAD_COPY_HALVES", "KEPT_BUFFERS_LABEL", "RATIO_MAX", "RATIO_STEP", "buffer_math",
           "kept_buffer_items", "ratio_window", "refit_facts", "reload_copy_halves", "wire_tensor"]
