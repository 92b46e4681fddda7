"""``MemoryPlan.to_svg()``: stacked memory per GPU at each phase with the GPU limit drawn.

Hand-written SVG (no plotting library in the compiler). One bar per phase; segments are the
phase's items bottom-up, one colour per component; the allocation the phase is about to make
(the IPC buffer at refit, ``torch.stack`` at the staging site) is a dashed outline on top, red
when it crosses the GPU limit; unknown items are a hatched "?" cap.
"""
from __future__ import annotations


from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the plan renders itself through this module
    from rlc.compiler.planner.plan import MemoryPlan


def escape_text(text: str) -> str:
    """Text for an SVG text node: ``&``, ``<`` and ``>`` escaped, as ``html.escape(text, quote=False)``
    escapes them (without importing ``html``, whose entity table every command would load; nor
    ``xml.sax.saxutils``, which imports urllib and with it http and ssl)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


_W, _H = 900, 470
_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 300, 40, 90
_COLORS = {
    "Megatron params": "#1f77b4", "Megatron grads": "#4a94c9", "optimizer fp32 master": "#75b0dd",
    "optimizer Adam moments": "#a0ccf0", "CPU-offload staging": "#5b7fa3", "Megatron context (CUDA/NCCL)": "#2b4f73",
    "Megatron residual": "#0f3a60", "vLLM weight shard": "#2ca02c",
    "vLLM MTP drafter (speculative decoding)": "#17becf", "vLLM contexts + non-pool buffers": "#98df8a",
    "vLLM CUDA graphs": "#1e6e1e", "vLLM pool (weights + KV cache + activations)": "#5cbf5c",
    "IPC buffer (2 halves)": "#d62728", "gathered pieces of the largest tensor": "#ff7f0e",
    "export staging overhead": "#f5b041", "allocator fragmentation": "#8c564b",
    "reference policy params": "#9467bd", "fp32 logits of the logprob pass": "#e377c2",
}
_PHASE_ORDER = ("train", "train_late", "logprob", "logprob_late", "generate", "refit", "stack")


def _key(label: str) -> str:
    for suffix in (" (bf16)", " (offloaded)"):
        label = label.replace(suffix, "")
    return label


def render_svg(plan: MemoryPlan) -> str:
    phases = [plan.phases[n] for n in _PHASE_ORDER if n in plan.phases]
    limit = plan.gpu_memory_gib
    heights = [limit] + [(p.used_gib or 0) + (p.request.gib or 0 if p.request else 0) for p in phases]
    top_value = max(heights) * 1.08
    plot_h = _H - _TOP - _BOTTOM
    plot_w = _W - _LEFT - _RIGHT

    def y(v: float) -> float:
        return _TOP + plot_h * (1 - v / top_value)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
           'font-family="sans-serif" font-size="11">',
           '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="#999" stroke-width="2"/>'
           '</pattern></defs>',
           f'<rect width="{_W}" height="{_H}" fill="white"/>',
           f'<text x="{_LEFT}" y="20" font-size="13" font-weight="bold">'
           f'{escape_text(plan.model_id)}: memory per GPU ({escape_text(plan.gpu)}, {limit:.2f} GiB)</text>']
    step = 10 if top_value <= 100 else 20
    v = 0
    while v <= top_value:
        out.append(f'<line x1="{_LEFT}" y1="{y(v):.1f}" x2="{_LEFT + plot_w}" y2="{y(v):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v}</text>')
        v += step
    out.append(f'<text x="14" y="{_TOP + plot_h / 2:.0f}" transform="rotate(-90 14 {_TOP + plot_h / 2:.0f})" '
               'text-anchor="middle">GiB</text>')
    slot = plot_w / max(1, len(phases))
    bar_w = min(70.0, slot * 0.6)
    legend: dict[str, str] = {}
    for i, phase in enumerate(phases):
        x = _LEFT + slot * i + (slot - bar_w) / 2
        base, unknown = 0.0, False
        for item in phase.items:
            if item.gib is None:
                unknown = True
                continue
            key = _key(item.label)
            color = legend.setdefault(key, _COLORS.get(key, "#7f7f7f"))
            y0, y1 = y(base + item.gib), y(base)
            title = f"{item.label}: {item.gib:.2f} GiB ({item.source})"
            out.append(f'<rect x="{x:.1f}" y="{y0:.1f}" width="{bar_w:.1f}" height="{max(0.0, y1 - y0):.1f}" '
                       f'fill="{color}" stroke="white" stroke-width="0.5"><title>{escape_text(title)}</title></rect>')
            base += item.gib
        top = base
        if unknown:
            out.append(f'<rect x="{x:.1f}" y="{y(base) - 24:.1f}" width="{bar_w:.1f}" height="24" '
                       'fill="url(#hatch)" stroke="#999"><title>unknown items</title></rect>')
            out.append(f'<text x="{x + bar_w / 2:.1f}" y="{y(base) - 8:.1f}" text-anchor="middle">?</text>')
        elif phase.request is not None and phase.request.gib is not None:
            req = phase.request
            req_gib: float = phase.request.gib
            over = base + req_gib > limit
            stroke = "#c00" if over else "#333"
            out.append(
                f'<rect x="{x:.1f}" y="{y(base + req_gib):.1f}" width="{bar_w:.1f}" '
                f'height="{y(base) - y(base + req_gib):.1f}" fill="none" stroke="{stroke}" stroke-width="1.5" '
                f'stroke-dasharray="4,3"><title>{escape_text(f"next: {req.label}: {req_gib:.2f} GiB")}</title></rect>'
            )
            short = "stack" if "stack" in req.label else "buffer"
            out.append(f'<text x="{x + bar_w / 2:.1f}" y="{y(base + req_gib / 2) + 4:.1f}" fill="{stroke}" '
                       f'text-anchor="middle" font-size="10">{short} {req_gib:.1f}</text>')
            top = base + req_gib
        label = f"{base:.1f}" + ("+?" if unknown else "")
        out.append(f'<text x="{x + bar_w / 2:.1f}" y="{y(top) - (28 if unknown else 4):.1f}" '
                   f'text-anchor="middle">{label}</text>')
        out.append(f'<text x="{x + bar_w / 2:.1f}" y="{_TOP + plot_h + 16:.1f}" text-anchor="middle" '
                   f'font-weight="bold">{escape_text(phase.name)}</text>')
        if phase.stage is not None:
            out.append(f'<text x="{x + bar_w / 2:.1f}" y="{_TOP + plot_h + 30:.1f}" text-anchor="middle" '
                       f'fill="#555">PP stage {phase.stage}</text>')
    out.append(f'<line x1="{_LEFT}" y1="{y(limit):.1f}" x2="{_LEFT + plot_w}" y2="{y(limit):.1f}" '
               'stroke="black" stroke-width="1.5" stroke-dasharray="6,4"/>')
    out.append(f'<text x="{_LEFT + 4}" y="{y(limit) - 4:.1f}">GPU limit {limit:.2f} GiB</text>')
    row = 0
    for k in ("buffer", "stack"):
        check = plan.checks.get(k)
        if check is None:
            continue
        verdict = {True: "ok", False: "FAIL", None: "not reached"}[check.ok]
        color = {True: "#2a2", False: "#c00", None: "#777"}[check.ok]
        margin = check.margin_gib
        out.append(f'<text x="{_LEFT}" y="{_TOP + plot_h + 52 + 14 * row}" fill="{color}">{k} check: {verdict}'
                   + (f" (margin {margin:+.2f} GiB)" if margin is not None else "") + "</text>")
        row += 1
    lx, ly = _W - _RIGHT + 20, _TOP
    for n, (label, color) in enumerate(legend.items()):
        yy = ly + 16 * n
        out.append(f'<rect x="{lx}" y="{yy}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{lx + 14}" y="{yy + 9}">{escape_text(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
