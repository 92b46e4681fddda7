"""``refit.offload_params_for_generation``: the trainer's bf16 parameters on the GPU or in host memory
while vLLM generates.

Off (the default), the bundled runtime keeps the parameters where the refit left them and the plan's
generate phase counts them; on, the runtime moves Megatron's parameter buffers to host memory after the
refit and the plan counts them there instead. A recipe that overfills generation only because of the
resident parameters is told to turn the switch on.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api

ROOT = Path(__file__).resolve().parents[2]
SKYRL_235B = str(ROOT / "tests" / "validation" / "recipes" / "skyrl-grpo-qwen3-235b-8n8g.yaml")
VERL_30B = str(ROOT / "tests" / "validation" / "recipes" / "verl-grpo-qwen3-30ba3b-4n8g-h20.yaml")
KEY = "refit.offload_params_for_generation"
PARAMS = "Megatron params (bf16)"
HOST_PARAMS = "Megatron params (offloaded for generation)"


def _check(recipe: str, on: bool, *more: str):
    result = api.check(recipe, [f"{KEY}={'true' if on else 'false'}", *more])
    assert result.plan is not None
    return result


def _item(phase, label):
    return next((i.gib for i in phase.items if i.label == label), None)


@pytest.mark.parametrize("recipe", [SKYRL_235B, VERL_30B])
def test_resident_params_are_the_refit_stage_params_in_generation(recipe):
    """Off: generation carries the bf16 params of the stage the refit counts, on the worst stage."""
    plan = _check(recipe, False).plan
    gen = plan.phases["generate"]
    params = _item(gen, PARAMS)
    assert params is not None and params > 1.0
    stage = next(f for f in plan.stages if f["stage"] == gen.stage)
    assert params == pytest.approx(stage["params_bytes"] / 2**30, rel=1e-6)


@pytest.mark.parametrize("recipe", [SKYRL_235B, VERL_30B])
def test_offloaded_params_leave_generation_and_land_in_host_memory(recipe):
    off, on = _check(recipe, False).plan, _check(recipe, True).plan
    params = _item(off.phases["generate"], PARAMS)
    assert _item(on.phases["generate"], PARAMS) is None
    assert off.phases["generate"].used_gib - on.phases["generate"].used_gib == pytest.approx(params, abs=0.01)
    assert on.host.phase == "generate"
    per_node = 8
    assert on.host.item_gib(HOST_PARAMS) == pytest.approx(params * per_node, rel=1e-3)
    assert off.host.item_gib(HOST_PARAMS) == 0.0
    # the switch acts after the refit: the refit math does not move
    assert on.refit.free_at_refit == off.refit.free_at_refit


def test_generation_that_overfills_only_with_resident_params_names_the_switch():
    """SkyRL's Qwen3-235B-A22B at 0.8: 87.80 GiB with the params on the GPU, within 79.11 GiB without."""
    result = _check(SKYRL_235B, False)
    errors = [d for d in result.errors if d.rule == "RLC214"]
    assert len(errors) == 1, [d.message for d in result.diagnostics]
    assert errors[0].path == KEY and f"{KEY}: true" in (errors[0].hint or "")
    fix = result.plan.generate_fix
    assert fix is not None and fix.key == KEY and fix.value is True and fix.sufficient
    assert not _check(SKYRL_235B, True).errors


def test_the_fix_is_not_offered_when_the_switch_cannot_close_the_gap():
    """At 0.95 vLLM's pool alone overfills the GPU: the error names gpu_memory_utilization, and says what
    the switch would still leave."""
    result = _check(SKYRL_235B, False, "generation.gpu_memory_utilization=0.95")
    errors = [d for d in result.errors if d.rule == "RLC214" and "generation needs" in d.message]
    assert len(errors) == 1
    assert errors[0].path == "generation.gpu_memory_utilization"
    assert f"{KEY}: true" in (errors[0].hint or "") and result.plan.generate_fix.sufficient is False


def test_no_fix_once_the_switch_is_on():
    result = _check(SKYRL_235B, True, "generation.gpu_memory_utilization=0.95")
    assert result.plan.generate_fix is None
    assert any(d.rule == "RLC214" and d.path == "generation.gpu_memory_utilization" for d in result.errors)


def test_the_switch_needs_the_distributed_optimizer():
    result = _check(VERL_30B, True, "training.use_distributed_optimizer=false")
    errors = [d for d in result.errors if d.rule == "RLC221"]
    assert [d.path for d in errors] == [KEY]
    assert "training.use_distributed_optimizer: true" in (errors[0].hint or "")
    assert "RLC221" not in {d.rule for d in _check(VERL_30B, False, "training.use_distributed_optimizer=false").errors}


def test_the_plan_text_and_json_carry_the_generation_fix():
    plan = _check(SKYRL_235B, False).plan
    assert f"{KEY}: true moves the trainer's bf16 parameters" in plan.to_text()
    fix = plan.to_json()["generate_fix"]
    assert fix["key"] == KEY and fix["sufficient"] is True
    assert _check(SKYRL_235B, True).plan.to_json()["generate_fix"] is None


@pytest.mark.parametrize("on", [True, False])
def test_runtime_yaml_carries_the_switch(on):
    from rlc.compiler.resolve import to_runtime_config
    from rlc.contract.runtime_config import runtime_config_from_dict

    result = _check(VERL_30B, on)
    data = to_runtime_config(result)
    assert data["refit"]["offload_params_for_generation"] is on
    assert runtime_config_from_dict(data).refit.offload_params_for_generation is on


def test_off_is_the_default():
    """A recipe that does not name the switch runs the runtime's proven path: parameters stay on the GPU."""
    tiny = ROOT / "recipes" / "tiny-qwen3-1gpu.yaml"
    assert KEY.split(".")[1] not in tiny.read_text(encoding="utf-8")
    result = api.check(str(tiny))
    assert result.recipe.refit.offload_params_for_generation is False
    assert _item(result.plan.phases["generate"], PARAMS) is not None
