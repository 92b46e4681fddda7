"""The refit checks redone at a measured free memory (``rlc doctor``: the log's numbers instead of
the calibration's).

``refit_at_free`` answers "with this recipe's buffer setting, at the free memory the log shows,
does the half hold the tensor and does the staging site have room, and which ratios would?".
``free_at_refit_for_stack`` inverts the staging-site formula: from the free memory a CUDA OOM at the
``torch.stack`` reported, the free memory at refit time that leads there with this recipe.
"""
from __future__ import annotations

from typing import Optional, Sequence

from rlc.compiler.planner.calibration import Calibration, calibration_for
from rlc.compiler.planner.layout import train_layout
from rlc.compiler.planner.refit_math import buffer_math
from rlc.compiler.planner.plan import RefitMath
from rlc.compiler.recipe_types import Recipe


def refit_at_free(recipe: Recipe, gpu_name: str, free_bytes: int, largest_name: str,
                  largest_bytes: int, calibration: Optional[Sequence[Calibration]] = None) -> RefitMath:
    """The planner's refit math at ``free_bytes`` for a largest tensor of ``largest_bytes``.

    ``calibration``: the recipe's table (``cluster.calibration`` / ``--calibration``); the shipped
    table when None, as in :func:`~rlc.compiler.planner.memory.plan_memory`.
    """
    cal = calibration_for(gpu_name, table=calibration)
    return buffer_math(int(free_bytes), recipe, largest_name, int(largest_bytes), train_layout(recipe), cal)


def free_at_refit_for_stack(recipe: Recipe, gpu_name: str, free_at_stack: int, largest_name: str,
                            largest_bytes: int, gpu_bytes: int,
                            calibration: Optional[Sequence[Calibration]] = None) -> Optional[int]:
    """The free memory at refit that leaves ``free_at_stack`` at the staging site (None if none does)."""
    lo, hi = int(free_at_stack), int(gpu_bytes)

    def stack(free: int) -> int:
        return refit_at_free(recipe, gpu_name, free, largest_name, largest_bytes, calibration).free_at_stack

    if stack(hi) < free_at_stack:
        return None
    for _ in range(60):  # free_at_stack grows with free (the buffer takes a fraction of it)
        mid = (lo + hi) // 2
        if stack(mid) < free_at_stack:
            lo = mid + 1
        else:
            hi = mid
        if hi - lo <= 1 << 20:
            break
    return hi
