"""The solved ``buffer_memory_ratio`` window equals the window found by stepping every ratio.

``ratio_window`` bisects monotone pieces instead of evaluating all 899 grid ratios; the reference
below is the stepping search it replaced, evaluating the planner's own per-side and staging-site
arithmetic at every grid point. They must agree on real plans and on arbitrary memory figures.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlc.compiler import api
from rlc.compiler.planner.calibration import calibration_for
from rlc.compiler.planner import refit_math
from rlc.compiler.planner.refit_math import ratio_window

from planner_helpers import GIB, with_changes

ROOT = Path(__file__).resolve().parents[2]


def stepped_window(free, recipe, largest, gathered, cal):
    """Every grid ratio evaluated; the widest contiguous passing range (the first of equals)."""
    best, start, prev = None, None, None
    for k in range(1, int(refit_math.RATIO_MAX / refit_math.RATIO_STEP) + 1):
        r = round(k * refit_math.RATIO_STEP, 3)
        per_side = refit_math._per_side(free, recipe.refit, r)[0]
        stack = refit_math._stack_free(free, per_side, largest, gathered, cal)[0]
        ok = per_side >= largest and stack >= largest
        if ok and start is None:
            start = r
        if not ok and start is not None:
            if best is None or prev - start > best[1] - best[0]:
                best = (start, prev)
            start = None
        prev = r
    if start is not None and (best is None or prev - start > best[1] - best[0]):
        best = (start, prev)
    return best


def _all_recipes():
    return sorted(p for p in (ROOT / "rlc" / "recipes").rglob("*.yaml") if "models" not in p.parts) + \
        sorted((ROOT / "tests" / "validation" / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", _all_recipes(), ids=lambda p: p.stem)
def test_solved_window_equals_stepped_on_shipped_and_suite_recipes(path):
    result = api.check(str(path))
    if result.plan is None or result.plan.refit is None:
        pytest.skip("no refit math for this recipe (facts unknown)")
    r = result.plan.refit
    cal = calibration_for(result.gpu.name)
    for free in (r.free_at_refit, r.free_at_refit - 5 * GIB, r.free_at_refit + 12 * GIB, 2 * r.largest + 3 * GIB):
        assert ratio_window(free, result.recipe, r.largest, r.gathered, cal) == \
            stepped_window(free, result.recipe, r.largest, r.gathered, cal)


def test_seed_layouts_windows_match_across_free_memory(base_recipe):
    """The 397B layout across free memory from 0 to 70 GiB, both gathered cases, two alignments."""
    cal = calibration_for("h100-80gb")
    largest = 8 * GIB
    for align in (256, 1 << 20):
        recipe = with_changes(base_recipe, refit__alignment_bytes=align)
        for tenth in range(0, 700, 7):
            free = tenth * GIB // 10 + 12345
            for gathered in (0, largest):
                assert ratio_window(free, recipe, largest, gathered, cal) == \
                    stepped_window(free, recipe, largest, gathered, cal), (free, gathered, align)


_points = st.lists(st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 12.0)), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(free=st.integers(-GIB, 160 * GIB), largest=st.integers(0, 40 * GIB), gathered_on=st.booleans(),
       align=st.sampled_from([1, 256, 4096, 1 << 20]), staging=st.floats(0.0, 4.0), points=_points)
def test_solved_window_equals_stepped_on_arbitrary_figures(free, largest, gathered_on, align, staging, points,
                                                           base_recipe):
    pts = tuple(sorted(points))
    cal = dataclasses.replace(calibration_for("h100-80gb"), export_staging_overhead_gib=staging,
                              fragmentation_points=pts)
    recipe = with_changes(base_recipe, refit__alignment_bytes=align)
    gathered = largest if gathered_on else 0
    assert ratio_window(free, recipe, largest, gathered, cal) == stepped_window(free, recipe, largest, gathered, cal)


def test_window_is_none_when_nothing_passes(base_recipe):
    cal = calibration_for("h100-80gb")
    assert ratio_window(10 * GIB, base_recipe, 8 * GIB, 8 * GIB, cal) is None
    assert stepped_window(10 * GIB, base_recipe, 8 * GIB, 8 * GIB, cal) is None
