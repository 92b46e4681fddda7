"""docs/planner.md's table of public configurations shows what the planner computes today."""
from __future__ import annotations

import pytest

from rlc.compiler import api

from validation_helpers import FAILURES, HERE, PRODUCTION, recipes

DOC = (HERE.parents[1] / "docs" / "planner.md").read_text(encoding="utf-8")
GIB = 1 << 30


@pytest.mark.parametrize("path", recipes(PRODUCTION) + recipes(FAILURES), ids=lambda p: p.stem)
def test_the_row_of_each_configuration_matches_the_plan(path):
    refit = api.check(str(path)).plan.refit
    cells = (f"| {refit.free_at_refit / GIB:.2f} |", f"| {refit.per_side / GIB:.2f} / {refit.largest / GIB:.2f} |")
    rows = [line for line in DOC.splitlines() if all(cell in line for cell in cells)]
    assert rows, f"no row of docs/planner.md shows {cells} for {path.stem}: re-run the plan and update the table"
