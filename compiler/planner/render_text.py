"""``MemoryPlan.to_text()``: one table per phase, the refit math with margins, the cheapest fixes."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from rlc.compiler.planner.mcore_text import mcore_layout_lines, mcore_refit_lines
from rlc.contract.refit_buffer import GIB, half_holds

if TYPE_CHECKING:  # the plan renders itself through this module
    from rlc.compiler.planner.plan import MemoryPlan, Phase

_PHASE_ORDER = ("train", "train_late", "logprob", "logprob_late", "generate", "refit", "stack")


def _num(x: Optional[float], width: int = 7) -> str:
    return f"{'unknown':>{width}}" if x is None else f"{x:{width}.2f}"


def _layout_line(plan: MemoryPlan) -> list[str]:
    t, g = plan.layout["train"], plan.layout["generation"]
    moe = plan.layout.get("moe", True)  # a dense model has no expert lines
    stages = "/".join(str(s["layers"]) for s in plan.stages) if plan.stages else "unknown"
    if plan.mcore is not None:
        return mcore_layout_lines(plan, stages)
    return [
        f"  train:      TP{t['tp']} PP{t['pp']} CP{t['cp']}" + (f" EP{t['ep']} ETP{t['etp']}" if moe else "")
        + (f" VPP{t['vpp']}" if t["vpp"] > 1 else "")
        + f" (DP {t['dp']}" + (f", expert DP {t['expert_dp']}" if moe else "") + f"; layers per stage {stages})",
        f"  generation: TP{g['tp']} PP{g['pp']}" + (f" EP{g['ep']}" if moe else "") + f" x {g['dp']} ("
        + (f"experts split {g['expert_shards']} ways; " if moe else "")
        + f"weight shard {_num(plan.vllm_weights_gib, 0).strip()} GiB per GPU"
        + (f", of which MTP drafter {plan.vllm_drafter_gib:.2f}" if plan.vllm_drafter_gib else "") + ")",
    ]


def _phase_table(phase: Phase) -> list[str]:
    where = f" (worst GPU: pipeline stage {phase.stage})" if phase.stage is not None else ""
    lines = [f"{phase.title}{where}", f"  {'item':<44}{'GiB':>8}  source"]
    for item in phase.items:
        note = f"  [{item.note}]" if item.note else ""
        lines.append(f"  {item.label:<44}{_num(item.gib, 8)}  {item.source}{note}")
    used, free = phase.used_gib, phase.free_gib
    lines.append(f"  {'total':<44}{_num(used, 8)}  of {phase.limit_gib:.2f} GiB; free {_num(free, 0).strip()} GiB"
                 + (f"  ({phase.note})" if phase.note else ""))
    if phase.request is not None:
        req = phase.request
        fits = "" if free is None or req.gib is None else ("  fits" if req.gib <= free else "  DOES NOT FIT")
        lines.append(f"  {'next: ' + req.label:<44}{_num(req.gib, 8)}  [{req.note}]{fits}")
    return lines


def _refit_lines(plan: MemoryPlan) -> list[str]:
    r = plan.refit
    if r is None:
        return ["refit math: unknown (" + "; ".join(u for u in plan.unknown) + ")"]
    wire_name, on_wire = r.wire
    side_ok = half_holds(r.per_side, on_wire)
    stack_ok = r.free_at_stack >= r.largest
    copies = f" − vLLM reload copies {r.reload_copies / GIB:.2f}" if r.reload_copies else ""
    lines = [
        "refit math",
        f"  free at refit      {r.free_at_refit / GIB:8.2f} GiB ({r.free_at_refit / 1e9:.2f} GB)",
        f"  per side           {r.per_side / GIB:8.2f} GiB = {r.buffer_source} / 2 ({r.per_side / 1e9:.2f} GB)",
        f"  largest tensor     {r.largest / GIB:8.2f} GiB = {r.largest_name} ({r.largest} bytes)",
    ]
    if r.wire_largest is not None:
        lines.append(f"  largest on wire    {on_wire / GIB:8.2f} GiB = {wire_name} ({on_wire} bytes, FP8 rollouts)")
    lines += [
        f"  buffer check       {'ok  ' if side_ok else 'FAIL'}  per side − largest = {r.buffer_margin / GIB:+.2f} GiB",
        f"  free at stack      {r.free_at_stack / GIB:8.2f} GiB = free − 2 × per side − gathered "
        f"{r.gathered / GIB:.2f} − staging {r.staging_overhead / GIB:.2f} − fragmentation {r.fragmentation / GIB:.2f}"
        f"{copies}",
        f"  stack check        {('ok  ' if stack_ok else 'FAIL') if side_ok else 'n/a '}  free at stack − largest = "
        f"{r.stack_margin / GIB:+.2f} GiB" + ("" if side_ok else " (not reached: the buffer check fails first)"),
    ]
    if r.ratio_window:
        lines.append(f"  ratio window       buffer_memory_ratio {r.ratio_window[0]:.3f}–{r.ratio_window[1]:.3f} "
                     "passes both checks at this free memory")
    else:
        lines.append("  ratio window       none: no buffer_memory_ratio passes both checks at this free memory")
    if r.tolerance_gib is not None:
        lines.append(f"  tolerance          both checks still pass with {r.tolerance_gib:.2f} GiB less free memory")
    return lines


def _host_lines(plan: MemoryPlan) -> list[str]:
    h = plan.host
    what = f"vLLM {plan.vllm_version}: {plan.sleep_label}" if plan.mcore is None else "Megatron inference"
    lines = [f"host memory per node ({h.phase} phase; {what})",
             f"  {'item':<44}{'GiB':>8}  source"]
    for i in h.items:
        lines.append(f"  {i.label:<44}{i.gib or 0.0:>8.1f}  {i.source}" + (f"  [{i.note}]" if i.note else ""))
    if h.limit_gib is None:
        lines.append(f"  {'total':<44}{h.used_gib:>8.1f}  not checked: {h.node_source}")
    else:
        lines.append(f"  {'total':<44}{h.used_gib:>8.1f}  of {h.limit_gib:.1f} GiB (95 % of {h.node_gib:.1f} GiB, "
                     f"{h.node_source}){'' if h.ok else '  EXCEEDED'}")
    return lines


def render_text(plan: MemoryPlan) -> str:
    """The plain-text plan (``plan.txt`` in the bundle, ``rlc plan`` on the terminal)."""
    world = plan.layout["world"]
    lines = [f"memory plan: {plan.model_id} on {world} x {plan.gpu} ({plan.gpu_memory_gib:.2f} GiB usable each); "
             f"calibration {plan.calibration_id}", "layout"]
    lines += _layout_line(plan)
    for name in _PHASE_ORDER:
        if name in plan.phases:
            lines.append("")
            lines += _phase_table(plan.phases[name])
    if plan.host is not None:
        lines.append("")
        lines += _host_lines(plan)
    lines.append("")
    if plan.mcore is not None:
        lines += mcore_refit_lines(plan)
    else:
        lines += _refit_lines(plan)
    others = [c for k, c in plan.checks.items() if k not in ("buffer", "stack")]
    if others:
        lines.append("")
        lines.append("other checks")
        for c in others:
            lines.append(f"  {c.id:<18} {'ok  ' if c.ok else ('FAIL' if c.ok is False else '?   ')}  {c.text}")
    if plan.generate_fix is not None:
        lines.append("")
        lines.append("generation fix (re-planned)")
        lines.append(f"  {plan.generate_fix.text}")
    if plan.logprob_fix is not None:
        lines.append("")
        lines.append("logprob pass fix")
        lines.append(f"  {plan.logprob_fix.text}")
    if plan.fixes:
        lines.append("")
        lines.append("cheapest fixes (each evaluated by re-planning)")
        for i, f in enumerate(plan.fixes, 1):
            lines.append(f"  {i}. {f.text}{'' if f.sufficient else ''}")
    if plan.unknown:
        lines.append("")
        lines.append("unknown (not computed; the facts are not public or not in the config)")
        lines += [f"  - {u}" for u in plan.unknown]
    if plan.notes:
        lines.append("")
        lines.append("notes")
        lines += [f"  - {n}" for n in plan.notes]
    return "\n".join(lines) + "\n"
