"""The Megatron generation backend's GPU checks on the CPU (tests/gpu/test_mcore_generation.py): the verdicts fail
on the evidence of a broken run and pass on a working one; the summaries read the driver's metrics as written."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu import test_mcore_generation as g

ROOT = Path(__file__).resolve().parents[2]

MEGATRON_LOG = "rlc.runtime.driver INFO Megatron inference engines up in 12.0 s\n"


def _run(rewards: list[float], rc: int = 0, log: str = MEGATRON_LOG, refits: int | None = None,
         kl: float = 0.001) -> dict:
    n = len(rewards)
    metrics = [{"step": i + 1, "reward/mean": r, "gen_kl": kl, "timing/step_s": 2.0, "timing/megatron_generate_s": 0.5,
                "memory/generate/used_gib": 5.0, "memory/train/used_gib": 4.0} for i, r in enumerate(rewards)]
    ranks = [{"step": s, "rank": 0} for s in range(0, (n if refits is None else refits) + 1)]
    return {"rc": rc, "metrics": metrics, "ranks": ranks, "log": log, "verify": []}


LEARNS = [0.1] * 20 + [0.9] * 30


def test_a_run_that_learns_with_megatron_engines_passes():
    v = g.verdict_learning(_run(LEARNS), 50)
    assert v["passed"] and v["step_10mean_reached_goal"] == 29 and v["gen_kl"]["within_goal"]


@pytest.mark.parametrize("run, why", [
    (_run([0.1] * 50), "never reaches the goal"),
    (_run(LEARNS, log="vLLM engines up in 40 s\n" + MEGATRON_LOG), "a vLLM engine generated"),
    (_run(LEARNS, refits=30), "a step without its refit"),
    (_run(LEARNS, rc=3), "stopped by the gen-KL guard"),
    (_run(LEARNS[:25], rc=124), "cut by the timeout before the goal"),
])
def test_broken_runs_fail(run, why):
    assert not g.verdict_learning(run, 50)["passed"], why


def test_a_run_cut_by_the_timeout_after_the_goal_passes_and_says_so():
    v = g.verdict_learning(_run(LEARNS[:40], rc=124), 150)
    assert v["passed"] and v["cut_by_timeout_after_goal"] and v["steps"] == 40
    # cut between a step's refit and its metrics line: one refit more than logged steps
    assert g.verdict_learning(_run(LEARNS[:40], rc=124, refits=41), 150)["passed"]
    assert not g.verdict_learning(_run(LEARNS[:40], rc=124, refits=43), 150)["passed"]


def test_the_mismatch_is_reported_against_the_goal_without_failing_the_run():
    v = g.verdict_learning(_run(LEARNS, kl=0.03), 50)
    assert v["passed"] and not v["gen_kl"]["within_goal"] and v["gen_kl"]["max"] == 0.03


def _verified(steps: int, fp32: list[str], mismatches: list[dict] | None = None) -> dict:
    records = [{"step": s, "worker": 0, "bit_exact": not mismatches, "mismatches": mismatches or [],
                "params_compared": 40, "bytes_compared": 10_000, "fp32_params": fp32} for s in range(steps + 1)]
    return {"rc": 0 if not mismatches else 1, "verify": records}


BIASES = [f"decoder.layers.{i}.mlp.router.expert_bias" for i in (1, 2, 3)]


def test_every_swap_bit_exact_with_the_router_biases_passes():
    v = g.verdict_swaps(_verified(25, BIASES), 20, 3)
    assert v["passed"] and v["verified_swaps"] == 26 and v["fp32_router_biases_min"] == 3


@pytest.mark.parametrize("run, why", [
    (_verified(10, BIASES), "too few swaps"),
    (_verified(25, BIASES[:2]), "a router bias not compared in fp32"),
    (_verified(25, BIASES, [{"name": BIASES[0], "rounded_to_bf16": True}]), "a bias rounded to bf16"),
])
def test_swaps_that_prove_nothing_or_differ_fail(run, why):
    assert not g.verdict_swaps(run, 20, 3)["passed"], why


def test_memory_and_timing_summaries_read_the_metrics_and_the_plan():
    run = _run(LEARNS)
    plan = {"phases": {"generate": {"used_gib": 4.5}, "train": {"used_gib": 3.5}},
            "megatron": {"kv_pool": {"bytes": 1 << 27}}}
    m = g.memory_vs_plan(run["metrics"], plan)
    assert m["side_by_side"]["generate"] == {"planned_gib": 4.5, "measured_max_gib": 5.0, "measured_as": "generate",
                                             "measured_minus_planned_gib": 0.5}
    assert m["kv_pool"] == {"bytes": 1 << 27}
    assert m["under_planned"] == ["generate", "train"]  # 5.0 > 4.5 and 4.0 > 3.5
    t = g.timings(run["metrics"])
    assert t["step_s"] == 2.0 and t["megatron_generate_s"] == 0.5 and t["steps_averaged"] == 49


def test_each_plan_phase_is_held_to_the_largest_moment_it_covers():
    # after_wake (engine resumed) above the last generate sample, after_sleep above the logprob pass: each plan phase
    # is compared with the fullest moment of the GPU it stands for
    metrics = [{"step": 1, "memory/generate/used_gib": 5.0, "memory/after_wake/used_gib": 5.2,
                "memory/logprobs/used_gib": 4.0, "memory/after_sleep/used_gib": 4.1,
                "memory/refit_offload/used_gib": 4.05, "memory/train/used_gib": 4.3}]
    plan = {"phases": {"generate": {"used_gib": 5.1}, "logprob": {"used_gib": 4.2}, "refit": {"used_gib": 4.06},
                       "train": {"used_gib": 4.3}}}
    m = g.memory_vs_plan(metrics, plan)
    assert m["side_by_side"]["generate"]["measured_as"] == "after_wake"
    assert m["side_by_side"]["logprob"]["measured_as"] == "after_sleep"
    assert m["under_planned"] == ["generate"]  # 5.2 > 5.1; train equal to its plan is covered


def test_the_stage_recipes_are_the_shipped_ones():
    for name in (g.DENSE_MG, g.MOE_MG, g.DENSE_VLLM):
        assert (g.RECIPES / f"{name}.yaml").exists()
    assert g._router_biases() == 3
