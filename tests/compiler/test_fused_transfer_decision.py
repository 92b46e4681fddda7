"""``refit.fused_transfer``: what ``auto`` decides (RLC209), what reaches runtime.yaml and the plan."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api
from rlc.compiler.planner.refit_math import refit_facts
from rlc.compiler.resolve import resolve_runtime_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MOE_EP2 = RECIPES / "tiny-moe-mtp-2gpu-ep2.yaml"  # tiny DeepSeek-V3-style MoE, trainer and vLLM EP2
ONE_GPU = ("cluster.gpus_per_node=1", "parallelism.train.ep=1", "parallelism.generation.ep=1")
KEY = "refit.fused_transfer"


def decided(*sets: str, path: Path = MOE_EP2) -> tuple[bool, str, api.CheckResult]:
    result = api.check(str(path), list(sets))
    assert result.ok, [d.message for d in result.diagnostics if d.severity == "error"]
    cfg = resolve_runtime_config(result)
    return cfg.refit.fused_transfer, cfg.refit.decisions["fused_transfer"], result


def test_auto_turns_it_on_where_every_expert_is_whole_on_one_gpu():
    on, why, result = decided(*ONE_GPU)
    assert on is True and why.startswith("RLC209: on: bf16 rollouts of a MoE model"), why
    infos = [d for d in result.diagnostics if d.rule == "RLC209"]
    assert len(infos) == 1 and infos[0].severity == "info" and infos[0].path == KEY
    # the plan moves the stacked expert tensor, as the runtime will
    assert refit_facts(result.recipe, result.facts).expert_export == "stacked"


@pytest.mark.parametrize("sets, words", [
    ((), "(trainer EP2)"),
    (("parallelism.train.ep=1", "parallelism.generation.ep=1", "parallelism.generation.tp=2",
      "parallelism.generation.dp=1"), "(vLLM TP2)"),
    ((*ONE_GPU, "generation.precision=fp8"), "FP8 rollouts"),
])
def test_auto_keeps_the_per_expert_path_elsewhere_and_says_why(sets, words):
    on, why, result = decided(*sets)
    assert on is False and words in why, why
    assert not [d for d in result.diagnostics if d.rule == "RLC209"]  # nothing to tell: the path is unchanged
    assert refit_facts(result.recipe, result.facts).expert_export == "per_expert"


def test_a_dense_model_has_nothing_to_fuse():
    on, why, _ = decided(path=RECIPES / "tiny-qwen3-1gpu.yaml")
    assert on is False and why == "RLC209: off: the model has no routed experts"


def test_on_opts_a_split_layout_in_and_off_opts_out():
    on, why, result = decided(f"{KEY}=on")
    assert on is True and why == "set in recipe"
    assert refit_facts(result.recipe, result.facts).expert_export == "stacked"
    on, why, _ = decided(*ONE_GPU, f"{KEY}=off")
    assert on is False and why == "set in recipe"


def test_a_boolean_on_the_command_line_names_the_choices():
    result = api.check(str(MOE_EP2), [f"{KEY}=true"])
    errors = [(d.path, d.message) for d in result.diagnostics if d.severity == "error"]
    assert errors == [(KEY, "true is not allowed; choose one of: 'auto', 'on', 'off'")], errors
