"""plan.txt / plan.json / plan.svg: the planner's memory plan, or a resource summary without one."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from rlc.compiler.planner.render_svg import escape_text

from rlc.compiler.planner.plan import MemoryPlan
from rlc.compiler.recipe_types import Recipe
from rlc.contract.runtime_config import RuntimeConfig


def _summary(recipe: Recipe, runtime_config: RuntimeConfig) -> dict[str, Any]:
    cluster = runtime_config.cluster
    return {
        "model": recipe.model.id,
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "world_size": cluster.world_size,
        "gpu": cluster.gpu_type,
        "gpu_memory_gib": cluster.gpu_memory_gib,
        "train_parallel": dataclasses.asdict(runtime_config.train_parallel),
        "generation_parallel": dataclasses.asdict(runtime_config.generation_parallel),
    }


def _summary_svg(lines: list[str]) -> str:
    height = 20 * len(lines) + 20
    rows = "".join(f'<text x="10" y="{20 * (i + 1)}">{escape_text(line)}</text>' for i, line in enumerate(lines))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="720" height="{height}" '
            f'font-family="monospace" font-size="13">{rows}</svg>\n')


def plan_files(plan: MemoryPlan | None, recipe: Recipe, runtime_config: RuntimeConfig) -> dict[str, str]:
    """The three plan files' contents, by file name."""
    if plan is not None:
        return {
            "plan.txt": plan.to_text().rstrip("\n") + "\n",
            "plan.json": json.dumps(plan.to_json(), indent=2, sort_keys=True, default=str) + "\n",
            "plan.svg": plan.to_svg(),
        }
    summary = _summary(recipe, runtime_config)
    lines = ["No memory plan (the model's architecture facts were not available).", "Resources:"]
    lines += [f"  {k}: {v}" for k, v in summary.items()]
    return {
        "plan.txt": "\n".join(lines) + "\n",
        "plan.json": json.dumps({"plan": None, "resources": summary}, indent=2, sort_keys=True) + "\n",
        "plan.svg": _summary_svg(lines),
    }
