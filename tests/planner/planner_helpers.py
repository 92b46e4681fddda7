"""Shared constants and helpers of the planner/rules tests (imported by name; tests/ has no packages)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlc.compiler.recipe import load_recipe
from rlc.compiler.recipe_types import Recipe, recipe_from_data, with_value
from rlc.compiler.schema import validate, with_defaults

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "rlc" / "recipes"
#: Test fixtures replaying a field report's chronology (two fail by design), not shipped recipes.
CHAIN_DIR = ROOT / "tests" / "recipes" / "nemo-rl-2471"
SEED000 = {
    "defaults": CHAIN_DIR / "qwen35-397b-nemo-rl-2471-1-defaults.yaml",
    "ratio05": CHAIN_DIR / "qwen35-397b-nemo-rl-2471-2-ratio05.yaml",
    "ep128": CHAIN_DIR / "qwen35-397b-nemo-rl-2471-3-ep128.yaml",
    "final": CHAIN_DIR / "qwen35-397b-nemo-rl-2471-4-final.yaml",
}
BASE = RECIPES / "qwen35-397b-grpo-32xh100.yaml"
ULTRA = RECIPES / "nemotron3-ultra-grpo-64xh200.yaml"
GB = 1e9
GIB = 1 << 30


def load(path: Path, overrides: tuple[str, ...] = ()) -> tuple[Recipe, dict[str, Any]]:
    """(typed recipe, raw merged recipe); fails the test on schema errors."""
    loaded = load_recipe(path, overrides)
    errors = [d for d in validate(loaded) if d.severity == "error"]
    assert not errors, [f"{d.path}: {d.message}" for d in errors]
    return recipe_from_data(with_defaults(loaded.data)), loaded.data


def with_changes(recipe: Recipe, **changes: Any) -> Recipe:
    """A copy of ``recipe`` with dotted keys (``__`` for ``.``) set, e.g. ``refit__sleep_level=2``."""
    for key, value in changes.items():
        recipe = with_value(recipe, key.replace("__", "."), value)
    return recipe




# --------------------------------------------------------------------------- tolerances (one place)

@dataclass(frozen=True)
class Tolerance:
    """How far a planner figure may be from a field measurement, and why that far."""

    value: float
    unit: str  # "GiB" | "GB"
    why: str


#: Every tolerance of the planner-vs-measurement tests; docs/planner.md quotes these reasons.
TOLERANCES = {
    "calibration": Tolerance(
        0.05, "GiB", "a calibration point reproduces the measurement it was fitted to; the field report prints "
        "two decimals and a derivation chains up to three printed figures"),
    "constants_across_runs": Tolerance(
        0.3, "GiB", "figures of one run reproduced by constants fitted on other runs of the same job (staging "
        "overhead on the ratio-0.5 OOM, fragmentation on the ratio-0.45 OOM, residency on the offload runs): "
        "1 % of the ~30 GiB these figures stack up, the precision of a report that mixes GB and GiB"),
    "whole_gb_estimate": Tolerance(
        1.0, "GB", "the report's '~N GB' figures are estimates to the whole GB"),
    "plan_over_record": Tolerance(
        0.5, "GiB", "how far above a GPU run's largest measurement a phase of that run's own plan may be (never "
        "below it): the estimates in it (activations, logits, one layer's working set) are upper bounds, and this "
        "bounds how loose they may be on the run they are checked against"),
}


def run_to_run_band(measured: tuple[float, ...]) -> tuple[float, float]:
    """The range repeated measurements of one quantity at identical settings span, widened on both sides
    by their spread: a prediction cannot be judged more finely than the runs agree with each other."""
    lo, hi = min(measured), max(measured)
    return lo - (hi - lo), hi + (hi - lo)
