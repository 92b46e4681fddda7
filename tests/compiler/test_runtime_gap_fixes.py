"""RLC311 and `rlc compile` name the exact setting that lifts each runtime gap, and it is one the schema
accepts (the hint used to say "turn generation.precision off": `off` is not a precision)."""
from __future__ import annotations

from rlc.compiler.api import check
from rlc.compiler.recipe import shipped_recipe_path
from rlc.compiler.runtime_support import runtime_gaps

RECIPE = shipped_recipe_path("tiny-qwen3-1gpu")
EVERY_GAP = ("parallelism.train.cp=2", "training.router_replay.enabled=true", "parallelism.train.vpp=2")


def _set(fix: str) -> str:
    key, _, value = fix.partition(": ")
    return f"{key}={value}"


def test_every_gap_names_a_setting_the_schema_accepts_and_that_lifts_it():
    result = check(RECIPE, EVERY_GAP)
    assert result.recipe is not None, result.errors
    gaps = runtime_gaps(result.recipe)
    assert {g.key for g in gaps} == {"parallelism.train.cp", "training.router_replay.enabled"}
    assert [g.fix for g in gaps if g.key == "training.router_replay.enabled"] == [
        "training.router_replay.enabled: false"
    ]
    hints = {d.path: d.hint for d in result.diagnostics if d.rule == "RLC311"}
    for gap in gaps:  # a gap with a fix of its own (cp: turn packing on) keeps it
        assert hints[gap.key] == (gap.hint or f"set `{gap.fix}` to compile for the bundled runtime")
        fixed = check(RECIPE, (*EVERY_GAP, _set(gap.fix)))
        assert fixed.recipe is not None, (gap.fix, fixed.errors)  # the schema accepts the fix
        assert gap.key not in {g.key for g in runtime_gaps(fixed.recipe)}, gap.fix
