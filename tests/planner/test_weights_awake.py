"""``refit.keep_weights_awake``: vLLM's weight shard stays on the GPU through the train step and the logprob pass
(only the KV cache sleeps), the plan counts it there and drops sleep level 1's host copy, the rules refuse it
with level 2 and name it where the memory it holds is what overfills a phase."""
from __future__ import annotations

import pytest

from rlc.compiler.planner.memory import VLLM_SHARD_LABEL
from rlc.compiler.planner.refit_math import KEPT_BUFFERS_LABEL
from tests.planner.test_planner_model import DSV3, QWEN35_2619, check, labels, rules

AWAKE = "refit.keep_weights_awake=true"
HOST_COPY = "vLLM weight copy (sleep level 1)"


def test_the_shard_is_counted_in_the_train_and_logprob_phases_and_leaves_host_memory(tmp_path):
    asleep = check(tmp_path, DSV3).plan
    awake = check(tmp_path, DSV3, AWAKE).plan
    shard = awake.item_gib("refit", VLLM_SHARD_LABEL)
    assert shard == pytest.approx(asleep.vllm_weights_gib) and shard > 1
    for phase in ("train", "logprob"):
        assert VLLM_SHARD_LABEL not in labels(asleep.phases[phase])
        assert awake.item_gib(phase, VLLM_SHARD_LABEL) == shard
        assert awake.phases[phase].used_gib == pytest.approx(asleep.phases[phase].used_gib + shard, abs=0.01)
    # the refit and generation phases hold the same either way: the refit woke the shard before
    assert awake.refit.free_at_refit == asleep.refit.free_at_refit
    assert awake.phases["generate"].used_gib == asleep.phases["generate"].used_gib
    # level 1's pinned copy is not taken: nothing of the weights goes to host memory
    assert asleep.host.item_gib(HOST_COPY) > 0 and awake.host.item_gib(HOST_COPY) == 0
    assert awake.host.used_gib < asleep.host.used_gib


def test_a_train_step_the_kept_shard_overfills_is_an_error_naming_the_switch(tmp_path):
    # DeepSeek-V3 with vLLM TP 32: a 40.9 GiB shard on every GPU; the train step fits only while it sleeps
    assert "RLC215" not in rules(check(tmp_path, DSV3))
    result = check(tmp_path, DSV3, AWAKE)
    shard = result.plan.item_gib("train", VLLM_SHARD_LABEL)
    step = [d for d in result.diagnostics if d.rule == "RLC215"]
    assert [d.severity for d in step] == ["error"]
    assert f"refit.keep_weights_awake: false frees the {shard:.2f} GiB of vLLM weights" in step[0].hint


def test_kept_awake_with_sleep_level_2_is_an_error_naming_both_keys(tmp_path):
    result = check(tmp_path, DSV3, AWAKE, "refit.sleep_level=2")
    errors = [d for d in result.diagnostics if d.rule == "RLC223"]
    assert [d.severity for d in errors] == ["error"]
    assert errors[0].path == "refit.keep_weights_awake" and "sleep_level" in errors[0].hint
    assert "RLC223" not in rules(check(tmp_path, DSV3, AWAKE))
    assert "RLC223" not in rules(check(tmp_path, DSV3, "refit.sleep_level=2"))


def test_a_step_the_kept_shard_overfills_names_the_switch_as_the_fix(tmp_path):
    # NeMo-RL #2619's fixed layout (trainer TP 2 + sequence parallel) fits from step 2 on with vLLM asleep;
    # the 35B shard kept awake on top of it does not
    fixed = ("parallelism.train.tp=2", "parallelism.train.sequence_parallel=true")
    asleep = check(tmp_path, QWEN35_2619, *fixed)
    assert asleep.plan.checks["train_late_fit"].ok and "RLC220" not in rules(asleep)
    awake = check(tmp_path, QWEN35_2619, *fixed, AWAKE)
    shard = awake.plan.item_gib("train", VLLM_SHARD_LABEL)
    assert not awake.plan.checks["train_late_fit"].ok
    late = [d for d in awake.diagnostics if d.rule == "RLC220"]
    assert late and f"refit.keep_weights_awake: false frees the {shard:.2f} GiB" in late[0].hint


def test_the_megatron_backend_refuses_the_vllm_only_switch(tmp_path):
    result = check(tmp_path, {**DSV3, "generation": {**DSV3["generation"], "backend": "megatron",
                                                     "kv_cache_memory_bytes": 1 << 30}}, AWAKE)
    assert any("refit.keep_weights_awake" in (d.path or "") and d.severity == "error" for d in result.diagnostics)


KV_LABEL = "vLLM KV cache (woken during the transfer)"
KV_DURING = "refit.wake_kv_during_transfer=true"


def test_a_kv_cache_woken_during_the_transfer_is_counted_in_the_refit_phase(tmp_path):
    awake = check(tmp_path, DSV3, AWAKE).plan
    overlap = check(tmp_path, DSV3, AWAKE, KV_DURING).plan
    assert KV_LABEL not in labels(awake.phases["refit"])
    kv = overlap.item_gib("refit", KV_LABEL)  # vLLM's budget less its weights: an upper bound of its KV cache
    pool = overlap.item_gib("generate", "vLLM pool (weights + KV cache + activations)")
    assert kv == pytest.approx(pool - overlap.vllm_weights_gib, abs=0.01) and kv > 0
    assert overlap.refit.free_at_refit == pytest.approx(awake.refit.free_at_refit - kv * (1 << 30), rel=1e-3)
    fixed = check(tmp_path, DSV3, AWAKE, KV_DURING, "generation.kv_cache_memory_bytes=2147483648").plan
    assert fixed.item_gib("refit", KV_LABEL) == pytest.approx(2.0)


def test_the_kv_cache_wakes_during_the_transfer_only_with_the_weights_awake(tmp_path):
    result = check(tmp_path, DSV3, KV_DURING)
    errors = [d for d in result.diagnostics if d.rule == "RLC226"]
    assert [(d.severity, d.path) for d in errors] == [("error", "refit.wake_kv_during_transfer")]
    assert "refit.keep_weights_awake: true" in errors[0].hint
    assert "RLC226" not in rules(check(tmp_path, DSV3, AWAKE, KV_DURING))
    megatron = {**DSV3, "generation": {**DSV3["generation"], "backend": "megatron", "kv_cache_memory_bytes": 1 << 30}}
    assert any(d.path == "refit.wake_kv_during_transfer" and d.severity == "error"
               for d in check(tmp_path, megatron, KV_DURING).diagnostics)


KEPT_KV_LABEL = "vLLM KV cache (kept awake)"
KV_AWAKE = "refit.keep_kv_cache_awake=true"


def halves(plan, phase: str) -> float:
    return sum(i.gib or 0.0 for i in plan.phases[phase].items if i.label == KEPT_BUFFERS_LABEL)


def test_a_kv_cache_kept_awake_is_counted_in_every_phase_outside_generation(tmp_path):
    awake = check(tmp_path, DSV3, AWAKE).plan
    kept = check(tmp_path, DSV3, AWAKE, KV_AWAKE).plan
    kv = kept.item_gib("train", KEPT_KV_LABEL)
    pool = kept.item_gib("generate", "vLLM pool (weights + KV cache + activations)")
    assert kv == pytest.approx(pool - kept.vllm_weights_gib, abs=0.01) and kv > 0
    for phase in ("train", "refit", "logprob"):
        assert KEPT_KV_LABEL not in labels(awake.phases[phase])
        assert kept.item_gib(phase, KEPT_KV_LABEL) == kv
        # less free memory at the refit gives halves small enough to be kept between refits (counted outside it)
        assert kept.phases[phase].used_gib == pytest.approx(awake.phases[phase].used_gib + kv + halves(kept, phase)
                                                            - halves(awake, phase), abs=0.01)
    # generation counts vLLM's whole pool either way; the refit buffers are sized without the KV cache
    assert kept.phases["generate"].used_gib == pytest.approx(
        awake.phases["generate"].used_gib + halves(kept, "generate") - halves(awake, "generate"), abs=0.01)
    assert kept.refit.free_at_refit == pytest.approx(awake.refit.free_at_refit - kv * (1 << 30), rel=1e-3)
    sized = check(tmp_path, DSV3, AWAKE, KV_AWAKE, "generation.kv_cache_memory_bytes=2147483648").plan
    assert all(sized.item_gib(phase, KEPT_KV_LABEL) == pytest.approx(2.0) for phase in ("train", "refit", "logprob"))


def test_a_train_step_the_kept_kv_cache_overfills_names_both_switches(tmp_path):
    # DeepSeek-V3 with vLLM TP 32 overfills its train step with the weights kept awake; the KV cache adds to it
    result = check(tmp_path, DSV3, AWAKE, KV_AWAKE)
    kv = result.plan.item_gib("train", KEPT_KV_LABEL)
    step = [d for d in result.diagnostics if d.rule == "RLC215"]
    assert [d.severity for d in step] == ["error"]
    assert f"refit.keep_kv_cache_awake: false frees the {kv:.2f} GiB of vLLM's KV cache" in step[0].hint
    assert "refit.keep_weights_awake: false frees" in step[0].hint


def test_the_kv_cache_stays_awake_only_with_the_weights_and_then_nothing_wakes_it(tmp_path):
    alone = [d for d in check(tmp_path, DSV3, KV_AWAKE).diagnostics if d.rule == "RLC227"]
    assert [(d.severity, d.path) for d in alone] == [("error", "refit.keep_kv_cache_awake")]
    assert "refit.keep_weights_awake: true" in alone[0].hint
    both = [d for d in check(tmp_path, DSV3, AWAKE, KV_AWAKE, KV_DURING).diagnostics if d.rule == "RLC227"]
    assert [(d.severity, d.path) for d in both] == [("error", "refit.wake_kv_during_transfer")]
    assert "RLC227" not in rules(check(tmp_path, DSV3, AWAKE, KV_AWAKE))
    megatron = {**DSV3, "generation": {**DSV3["generation"], "backend": "megatron", "kv_cache_memory_bytes": 1 << 30}}
    assert any(d.path == "refit.keep_kv_cache_awake" and d.severity == "error"
               for d in check(tmp_path, megatron, AWAKE, KV_AWAKE).diagnostics)


def test_a_refit_the_kept_kv_cache_leaves_no_room_for_the_buffer_names_the_switch(tmp_path):
    # NeMo-RL #2619's layout with a 45 GiB KV pool: the refit buffer fits while the KV cache sleeps through the refit,
    # not while it stays mapped
    pool = f"generation.kv_cache_memory_bytes={45 << 30}"
    assert "RLC210" not in rules(check(tmp_path, QWEN35_2619, AWAKE, pool))
    result = check(tmp_path, QWEN35_2619, AWAKE, KV_AWAKE, pool)
    half = [d for d in result.diagnostics if d.rule == "RLC210"]
    assert [d.severity for d in half] == ["error"]
    assert "refit.keep_kv_cache_awake: false frees the 45.00 GiB of vLLM's KV cache mapped during the refit" \
        in half[0].hint
