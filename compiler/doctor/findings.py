"""What ``rlc doctor`` found: one :class:`Finding` per recognised failure, with the numbers read
from the log and (given a recipe) the re-planned verdict on the fix."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class Match:
    """One place in the log a pattern matched, with the values its extractor read there."""

    line: int  # 1-based
    text: str  # the matched line, trimmed
    values: dict[str, Any]
    file: str = ""  # the log file, when several were read

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.file else f"log line {self.line}"


@dataclass
class Finding:
    """A recognised failure: which pattern, which rule would have caught it, the fix, the numbers."""

    pattern: str  # pattern id, e.g. "refit-buffer-too-small"
    rule: Optional[str]  # rlc rule id, or None when no compile-time rule can catch it
    title: str
    fix: str
    reports: tuple[str, ...]  # public reports the pattern is modelled on
    matches: list[Match] = field(default_factory=list)
    summary: str = ""  # the numbers in one sentence
    candidates: tuple[str, ...] = ()  # other rules that could be the cause (logprob mismatch)
    evidence: list[Match] = field(default_factory=list)  # other lines that point at the rule
    replan: Optional[str] = None  # the verdict of re-planning with the recipe and the log's numbers
    fits: Optional[bool] = None  # whether the proposed change fits (None: not judged)
    warnings: list[str] = field(default_factory=list)  # e.g. the log's model is not the recipe's

    @property
    def first(self) -> Match:
        """The earliest of the matches that read the most values (the line to show)."""
        return max(self.matches, key=lambda m: (len(m.values), -m.line))

    @property
    def values(self) -> dict[str, Any]:
        """The first match's values, with later matches filling what it lacked."""
        out: dict[str, Any] = {}
        for m in self.matches:
            for k, v in m.values.items():
                if v not in (None, [], {}, ""):
                    out.setdefault(k, v)
        return out
