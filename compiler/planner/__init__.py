"""The memory planner: per-GPU memory by phase (train, generate, refit, export staging) and the
refit buffer math, with every non-derived constant in ``calibration.yaml`` (docs/planner.md).

``plan_memory(recipe, facts, gpu) -> MemoryPlan``; the plan renders as text (``to_text``), plain
data (``to_json``) and a hand-written SVG (``to_svg``).
"""
from rlc.compiler.planner.calibration import Calibration, calibration_for, parse_record
from rlc.compiler.planner.memory import plan_memory
from rlc.compiler.planner.refit_math import ratio_window
from rlc.compiler.planner.plan import Check, Fix, Item, MemoryPlan, Phase, RefitMath

__all__ = ["Calibration", "Check", "Fix", "Item", "MemoryPlan", "Phase", "RefitMath", "calibration_for",
           "parse_record", "plan_memory", "ratio_window"]
