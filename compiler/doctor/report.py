"""``rlc doctor``'s text: per finding the rule, the numbers, the fix, the verdict, the public reports."""
from __future__ import annotations

from typing import Sequence

from rlc.compiler.doctor.findings import Finding


def render(findings: Sequence[Finding], log_name: str, recipe_name: str | None = None) -> str:
    if not findings:
        return (f"{log_name}: no known failure recognised (no rule to name). `rlc doctor` knows the patterns "
                "listed in docs/import-and-doctor.md; `rlc plan RECIPE` still shows the memory budget.\n")
    lines = [f"{log_name}: {len(findings)} known failure(s) recognised" + (f"; re-planned with {recipe_name}"
                                                                         if recipe_name else "")]
    for n, f in enumerate(findings, 1):
        rule = f.rule or "no compile-time rule"
        lines.append("")
        lines.append(f"{n}. [{rule}] {f.title}")
        lines.append(f"   {f.first.where}: {f.first.text}")
        if f.summary:
            lines.append(f"   found: {f.summary}")
        for e in f.evidence:
            lines.append(f"   evidence, {e.where}: {e.text}")
        if f.candidates:
            lines.append(f"   other possible causes: {', '.join(f.candidates)}")
        lines.append(f"   fix: {f.fix}")
        for w in f.warnings:
            lines.append(f"   warning: {w}")
        if f.replan:
            verdict = {True: "fits", False: "does not fit", None: "not judged"}[f.fits]
            lines.append(f"   re-plan ({verdict}): {f.replan}")
        if f.rule:
            lines.append(f"   why: rlc explain {f.rule}")
        lines.append(f"   seen in: {'; '.join(f.reports)}")
    return "\n".join(lines) + "\n"
