"""Solving for the ``buffer_memory_ratio`` window without stepping through every ratio.

The refit checks pass at a ratio when the buffer half holds the largest tensor and enough memory is
left at the staging site. As a function of the grid index ``k`` (ratio ``k × step``) the half is
non-decreasing, so the grid splits into a few segments (below the largest tensor, then one per
piece of the piecewise-linear fragmentation curve) in each of which the staging-site check is
monotone (the half grows linearly, fragmentation is linear in it). Each segment's passing indices
are therefore a prefix, a suffix, all or none, found with a handful of evaluations by bisection.

This module knows nothing about memory: :func:`rlc.compiler.planner.memory.ratio_window` gives it
the predicates, so the arithmetic stays in one place.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

Run = tuple[int, int]  # first and last grid index of a contiguous passing range, inclusive


def first_true(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """The smallest ``k`` in ``[lo, hi]`` with ``pred(k)`` true (``hi + 1`` if none); ``pred`` is
    false then true over the range."""
    while lo <= hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid - 1
        else:
            lo = mid + 1
    return lo


def passing_runs(n: int, segment_starts: Iterable[int], ok: Callable[[int], bool]) -> list[Run]:
    """Contiguous runs of ``k`` in ``[1, n]`` with ``ok(k)`` true, given the first indices of the
    segments in which ``ok`` is monotone (indices before the first start never pass)."""
    starts = sorted({s for s in segment_starts if 1 <= s <= n})
    runs: list[Run] = []
    for i, a in enumerate(starts):
        b = starts[i + 1] - 1 if i + 1 < len(starts) else n
        ok_a, ok_b = ok(a), ok(b)
        if ok_a and ok_b:
            run = (a, b)
        elif ok_a:
            run = (a, first_true(a, b, lambda k: not ok(k)) - 1)
        elif ok_b:
            run = (first_true(a, b, ok), b)
        else:
            continue
        if runs and runs[-1][1] + 1 == run[0]:
            runs[-1] = (runs[-1][0], run[1])
        else:
            runs.append(run)
    return runs


def widest(runs: Iterable[Run], value: Callable[[int], float]) -> Optional[tuple[float, float]]:
    """The run with the widest value range (the first of equals), as ``(value(first), value(last))``."""
    best: Optional[tuple[float, float]] = None
    for a, b in runs:
        lo, hi = value(a), value(b)
        if best is None or hi - lo > best[1] - best[0]:
            best = (lo, hi)
    return best
