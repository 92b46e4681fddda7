"""``rlc doctor LOG [--recipe RECIPE]``: read a failed job's log (rlc bundle logs, NeMo-RL, verl, plain
vLLM / Megatron output), name the rule that would have caught each failure it recognises and the
recipe change that fixes it, with the numbers found in the log; given the recipe, re-plan with those
numbers and say whether the change fits.

:mod:`.patterns` is the table (pattern -> rule -> extractor), :mod:`.scan` runs it, :mod:`.replan`
judges the fixes, :mod:`.report` prints. Exit codes of the command: 0 something recognised, 1
nothing recognised, 2 usage or IO errors.
"""
from __future__ import annotations

from typing import Any, Optional

from rlc.compiler.doctor.findings import Finding, Match
from rlc.compiler.doctor.patterns import PATTERNS, Pattern
from rlc.compiler.doctor.scan import scan, scan_files
from rlc.compiler.doctor.replan import replan

__all__ = ["Finding", "Match", "PATTERNS", "Pattern", "diagnose", "scan", "scan_files"]


def diagnose(text: str | list[tuple[str, str]], result: Optional[Any] = None) -> list[Finding]:
    """Findings of a log's ``text`` (or of ``(file name, text)`` logs of one job); with ``result``
    (``rlc.compiler.api.check`` of the recipe) each carries the re-planned verdict."""
    findings = scan(text) if isinstance(text, str) else scan_files(text)
    if result is not None:
        replan(findings, result)
    return findings
