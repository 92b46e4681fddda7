"""A KL penalty keeps a frozen reference policy; the plan counts its parameters where the runtime keeps them.

The runtime (``rlc.runtime.policy.megatron_setup``) builds the reference policy with the trainer's
parallel layout when ``loss.kl_penalty > 0``. On the GPU (the default) every phase the planner stacks
Megatron's parameters in (train, refit, the staging site, the logprob pass) holds a second bf16 copy of
the stage. With ``training.offload_reference_policy`` the copy lives in pinned host memory, in blocks
whose sizes are powers of two (``rlc.contract.host_blocks``, what the runtime allocates), and is on the
GPU only for the reference's logprob pass, next to the trainer as the refit left it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api
from rlc.compiler.bundle import build_bundle
from rlc.contract.host_blocks import pinned_bytes
from rlc.contract.runtime_config import load_runtime_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "tests" / "validation" / "recipes" / "verl-grpo-qwen3-30ba3b-4n8g-h20.yaml")
LABEL = "reference policy params (bf16)"
HOST_LABEL = "reference policy params (offloaded)"
GIB = 2**30


def _plan(kl: float, *sets: str):
    result = api.check(RECIPE, [f"loss.kl_penalty={kl}", *sets])
    assert result.plan is not None
    return result.plan


def _item(phase, label):
    return next((i.gib for i in phase.items if i.label == label), None)


def test_no_reference_policy_without_a_kl_penalty():
    plan = _plan(0.0)
    assert all(_item(plan.phases[p], LABEL) is None for p in ("train", "refit", "stack", "logprob"))
    assert plan.phases["logprob"].title == "logprob pass (vLLM asleep)"


@pytest.mark.parametrize("phase", ["train", "refit", "stack", "logprob"])
def test_the_reference_policy_is_the_stage_bf16_params(phase):
    plan = _plan(0.001)
    ref = _item(plan.phases[phase], LABEL)
    params = _item(plan.phases[phase], "Megatron params") or _item(plan.phases[phase], "Megatron params (bf16)")
    assert ref is not None and ref == pytest.approx(params) and ref > 1.0


def test_the_reference_policy_takes_its_size_from_the_refit_free_memory():
    without, with_ref = _plan(0.0), _plan(0.001)
    ref = _item(with_ref.phases["refit"], LABEL)
    assert (without.refit.free_at_refit - with_ref.refit.free_at_refit) / GIB == pytest.approx(ref, abs=1e-6)


def test_an_offloaded_reference_policy_is_in_pinned_host_memory_and_compiles(tmp_path):
    """The copy leaves the train, refit and staging phases, lands in host memory per node at the runtime's
    pinned-block size, and the bundled runtime runs it: no RLC311, the bundle compiles, runtime.yaml says so."""
    on_gpu = _plan(0.001)
    result = api.check(RECIPE, ["loss.kl_penalty=0.001", "training.offload_reference_policy=true"])
    plan = result.plan
    assert all(_item(plan.phases[p], LABEL) is None for p in ("train", "refit", "stack", "generate"))
    params_bytes = plan.stages[0]["params_bytes"]
    assert _item(on_gpu.phases["refit"], LABEL) == pytest.approx(params_bytes / GIB)
    # 8 GPUs per node, each a copy in power-of-two blocks: less than 2 MiB above the parameters' bytes
    host = plan.host.item_gib(HOST_LABEL) * GIB
    assert host == 8 * pinned_bytes(params_bytes) and 0 <= host / 8 - params_bytes < 2 << 20
    assert plan.refit.free_at_refit > on_gpu.refit.free_at_refit
    assert "RLC311" not in {d.rule for d in result.diagnostics} and result.ok
    build_bundle(result, tmp_path / "bundle")
    cfg = load_runtime_config(tmp_path / "bundle" / "runtime.yaml")
    assert cfg.training.offload_reference_policy is True and cfg.loss.kl_penalty == 0.001


def test_the_offloaded_reference_is_on_the_gpu_for_its_logprob_pass():
    """Swapped in next to the trainer as the refit left it: the logprob phase is the same either way, and it is
    the trainer's refit state plus the reference and the pass's logits."""
    resident, swapped = _plan(0.001), _plan(0.001, "training.offload_reference_policy=true")
    on, off = swapped.phases["logprob"], resident.phases["logprob"]
    assert _item(on, LABEL) == pytest.approx(_item(off, LABEL)) and on.used_gib == pytest.approx(off.used_gib)
    assert "offload_reference_policy" in next(i.note for i in on.items if i.label == LABEL)
    assert on.title == "reference logprob pass (vLLM asleep)"
    refit_megatron = sum(i.gib for i in swapped.phases["refit"].items if i.owner == "megatron")
    assert sum(i.gib for i in on.items if i.owner == "megatron") == pytest.approx(
        refit_megatron + _item(on, LABEL) + _item(on, "fp32 logits of the logprob pass"))
    # the offload moves memory out of the train step, not out of the logprob pass
    assert resident.phases["train"].used_gib - swapped.phases["train"].used_gib == pytest.approx(_item(off, LABEL))


def test_offloading_without_a_kl_penalty_changes_nothing():
    plain = _plan(0.0)
    result = api.check(RECIPE, ["loss.kl_penalty=0", "training.offload_reference_policy=true"])
    assert result.plan.host.item_gib(HOST_LABEL) == 0.0
    assert result.plan.refit.free_at_refit == plain.refit.free_at_refit
    assert result.plan.phases["logprob"].used_gib == pytest.approx(plain.phases["logprob"].used_gib)
    assert "RLC311" not in {d.rule for d in result.diagnostics}


def test_where_the_refit_fails_with_the_reference_on_the_gpu_the_offload_is_the_fix():
    """verl's DeepSeek-V3 run with its reference policy kept on the GPU fails at the staging site (RLC211); the
    re-planned fixes name training.offload_reference_policy, the setting verl runs with, and it suffices."""
    recipe = str(ROOT / "tests" / "validation" / "recipes" / "verl-grpo-deepseek-v3-12n8g-h20.yaml")
    broken = api.check(recipe, ["training.offload_reference_policy=false"])
    assert not broken.ok and "RLC211" in {d.rule for d in broken.errors}
    [fix] = [f for f in broken.plan.fixes if f.key == "training.offload_reference_policy"]
    assert fix.sufficient and fix.value is True and fix.freed_gib > 10
    assert api.check(recipe).ok  # as verl runs it
