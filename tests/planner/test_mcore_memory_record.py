"""The Megatron generation backend's plan against what a GPU run measured, and the terms that close the gap.

The record: ``tests/gpu/test_mcore_generation.py --case dedicated`` on one H200 (25 steps of the tiny GLM-style MoE
in dedicated mode), ``docs/results/mcore-dedicated-h200/mcore_dedicated.json``: device memory in use per phase, the
largest over the steps. The plan it ran under was below every phase (generate +0.40, train +1.07, refit +0.73 GiB):
it counted the trainer's process but not what megatron-core's engine adds to it, no train-step activations and no
logprob phase.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import yaml

from rlc.compiler import api
from rlc.compiler.cli import main
from rlc.compiler.mcore_generation import kv_pool
from rlc.compiler.planner.calibration import (MEGATRON_BACKEND_CONSTANTS, CalibrationError, load_table,
                                              shipped_calibrations)
from rlc.compiler.planner.layout import train_layout
from rlc.compiler.planner.mcore_fit import (MegatronRunMemory, fit_megatron_backend, run_microbatch_tokens,
                                           suspended_gib)
from rlc.compiler.planner.mcore_memory import ENGINE_CONTEXT_LABEL, SAVED_ACTIVATIONS_LABEL, bookkeeping_bytes
from rlc.compiler.planner.passes import forward_working_set, logits_bytes, train_activations
from rlc.contract.calibration_record import CalibrationRecord

from planner_helpers import GIB, ROOT, TOLERANCES

RECORD = ROOT / "docs/results/mcore-dedicated-h200/mcore_dedicated.json"
MOE = ROOT / "rlc/recipes/tiny-glm-moe-1gpu-megatron.yaml"
DENSE = ROOT / "rlc/recipes/tiny-qwen3-1gpu-megatron.yaml"
VLLM_RUN = ROOT / "docs/results/tiny-qwen3-h200-grpo"
#: what the GPU check compiled the recipe with (tests/gpu/test_mcore_generation.py, case_dedicated)
RUN_SETS = ("generation.megatron.mode=dedicated", "grpo.max_steps=25")
#: Plan phase -> the measured moments it must cover (tests/gpu/test_mcore_generation.py's COVERS)
COVERS = {"generate": ("generate", "after_wake"), "train": ("train",), "refit": ("refit_offload",),
          "logprob": ("logprobs", "after_sleep", "refit_offload")}
UNDER = 0.0  # the plan is never below a measurement (an under-prediction lets through a job that then dies)
OVER = TOLERANCES["plan_over_record"]


def check(path: Path = MOE, *sets: str) -> api.CheckResult:
    result = api.check(str(path), list(sets))
    assert result.plan is not None, [d.message for d in result.diagnostics]
    return result


def record() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def items(plan, phase: str) -> dict[str, float | None]:
    return {i.label: i.gib for i in plan.phases[phase].items}


# --------------------------------------------------------------------------- the record, replayed


def test_the_plan_covers_every_phase_the_dedicated_h200_run_measured():
    plan = check(MOE, *RUN_SETS).plan
    measured = {phase: v["max"] for phase, v in record()["memory"]["measured"].items()}
    for phase, moments in COVERS.items():
        planned = plan.phases[phase].used_gib
        worst = max(measured[m] for m in moments)
        assert planned >= worst - UNDER, (phase, planned, worst)
        assert planned - worst <= OVER.value, (phase, planned, worst)


def test_the_plan_the_run_had_was_below_every_phase_and_says_by_how_much():
    # the record keeps the plan it ran under: these gaps are what the new terms close
    side = record()["memory"]["side_by_side"]
    assert {k: v["measured_minus_planned_gib"] for k, v in side.items()} == {
        "generate": 0.4028, "train": 1.0677, "refit": 0.7262}
    plan = check(MOE, *RUN_SETS).plan
    for phase, gap in side.items():
        assert plan.phases[phase].used_gib - gap["planned_gib"] >= gap["measured_minus_planned_gib"], phase


def test_the_shipped_constants_are_the_fit_of_the_record():
    result = check(MOE, *RUN_SETS)
    (shipped,) = load_table(str(shipped_calibrations()["h200-141gb"]))
    zero = dataclasses.replace(shipped, megatron_engine_context_gib=0.0, megatron_train_workspace_gib=0.0)
    fitted, how = fit_megatron_backend(MegatronRunMemory.from_record(RECORD), result.recipe, result.facts, result.gpu,
                                       zero)
    for f in how:
        assert getattr(shipped, f.name) == getattr(fitted, f.name) == f.value, f.name
        assert shipped.derivations[f.name] == f.derived, f.name
        assert "docs/results/mcore-dedicated-h200/mcore_dedicated.json" in shipped.sources[f.name]
        assert "NVIDIA H200" in shipped.sources[f.name] and "--case dedicated" in shipped.sources[f.name]
    # the engine's process memory is what the trainer alone does not explain at the suspended moment, rounded up
    trainer = suspended_gib(result.recipe, result.facts, result.gpu, zero)
    assert 0 <= fitted.megatron_engine_context_gib - (4.0409 - trainer) < 1e-4


def test_the_plan_at_the_fitting_moments_is_not_below_them():
    # the constants are rounded up: at the moments they were fitted to the plan is at or just above the measurement
    run = MegatronRunMemory.from_record(RECORD)
    plan = check(MOE, *RUN_SETS).plan
    weights = items(plan, "refit")["inference model weights (dedicated)"]
    suspended = plan.phases["refit"].used_gib - weights  # refit_offload: before the swap allocates the weights
    assert 0 <= suspended - run.at("refit_offload") < 1e-4
    assert plan.phases["train"].used_gib >= run.at("train")


def test_a_record_without_a_fitting_moment_is_refused_naming_it(tmp_path):
    partial = tmp_path / "mcore_dedicated.json"
    partial.write_text(json.dumps({"memory": {"measured": {"train": {"max": 4.4, "mean": 4.1}}}}))
    result = check(MOE, *RUN_SETS)
    (shipped,) = load_table(str(shipped_calibrations()["h200-141gb"]))
    with pytest.raises(CalibrationError, match="memory/refit_offload/used_gib"):
        fit_megatron_backend(MegatronRunMemory.from_record(partial), result.recipe, result.facts, result.gpu, shipped)
    with pytest.raises(CalibrationError, match="generation.backend: megatron"):
        vllm = check(ROOT / "rlc/recipes/tiny-qwen3-1gpu.yaml")
        fit_megatron_backend(MegatronRunMemory.from_record(RECORD), vllm.recipe, vllm.facts, vllm.gpu, shipped)


def test_the_run_micro_batch_is_the_longest_sequence_the_recipe_allows_padded():
    recipe = check(MOE, *RUN_SETS).recipe
    # prompts of at most 16 tokens + 2 sampled = 18, padded to a multiple of 16 per TP x CP rank: 256 rows x 32
    assert run_microbatch_tokens(recipe) == (256 * 32, "256 × 32 tokens")


# --------------------------------------------------------------------------- the terms


@pytest.mark.parametrize("mode", ["shared", "dedicated"])
def test_the_engine_process_memory_is_in_every_phase(mode):
    plan = check(MOE, f"generation.megatron.mode={mode}").plan
    (shipped,) = load_table(str(shipped_calibrations()["h200-141gb"]))
    assert set(plan.phases) == ({"train", "logprob", "generate", "refit"} if mode == "dedicated"
                                else {"train", "logprob", "generate"})
    for name in plan.phases:
        assert items(plan, name)[ENGINE_CONTEXT_LABEL] == shipped.megatron_engine_context_gib, name


@pytest.mark.parametrize("mode, in_suspended", [("recompute", False), ("offload", False), ("persist", True)])
def test_the_pool_is_freed_while_the_engine_is_suspended_unless_it_persists(mode, in_suspended):
    plan = check(MOE, "generation.megatron.mode=dedicated", f"generation.megatron.kv_cache={mode}").plan
    pool = "KV pool (generation.kv_cache_memory_bytes)"
    for phase in ("train", "logprob", "refit"):
        assert (pool in items(plan, phase)) is in_suspended, phase
    assert items(plan, "generate")[pool] == 1.0


def test_the_dedicated_weights_are_freed_while_training_and_back_for_the_swap():
    plan = check(MOE, "generation.megatron.mode=dedicated").plan
    weights = "inference model weights (dedicated)"
    assert items(plan, "train")[weights] == 0.0 and weights not in items(plan, "logprob")
    assert items(plan, "refit")[weights] == items(plan, "generate")[weights] > 0


def test_the_bookkeeping_is_megatron_cores_context_layout():
    result = check(MOE)
    pool = kv_pool(result.recipe, result.facts)
    assert (pool.max_tokens, pool.max_requests, pool.blocks_per_request) == (32768, 2048, 1)
    # ContextGPUView: int64 input ids, position ids, block index + int32 block offset, request index, position in
    # request per token; 7 four-byte request fields, 4 int32 flash-attention lengths per request, the block table;
    # the active and decode logit indices (int32 each) and the sampled tokens (int64) per request
    tokens = 32768 * (3 * 8 + 3 * 4)
    requests = 2048 * (7 * 4 + 4 * 4 + 2 * 4 + 8)
    table = 2048 * 1 * 4
    assert bookkeeping_bytes(pool, 0) == tokens + requests + table
    assert items(result.plan, "generate")["engine bookkeeping"] == pytest.approx((tokens + requests + table) / GIB)
    # MTP speculative decoding adds per-request and per-token buffers
    assert bookkeeping_bytes(dataclasses.replace(pool, blocks_per_request=2), 1) > bookkeeping_bytes(pool, 0)


def test_saved_activations_scale_with_the_micro_batch_and_shrink_with_recomputation():
    result = check(MOE)
    recipe, facts = result.recipe, result.facts
    tl = train_layout(recipe)
    one = train_activations(recipe, facts, tl, 0, 1, (1000, "1000 tokens")).bytes
    assert train_activations(recipe, facts, tl, 0, 1, (4000, "4000 tokens")).bytes == pytest.approx(4 * one, rel=1e-6)
    # 1 dense + 3 MoE layers + the MTP block (a MoE layer): (10 + 8) × hidden + 6 × MLP width per token, the routed
    # experts' dispatched inputs (2 × 2 × hidden), their MLP (2 × 6 × 64) and the router's fp32 scores (8 × 4)
    dense = 18 * 128 + 6 * 256
    moe = 18 * 128 + 6 * 64 + 2 * (2 * 128 + 6 * 64) + 4 * 8
    assert one == 1000 * (dense + 4 * moe)
    full = dataclasses.replace(recipe, training=dataclasses.replace(recipe.training, activation_checkpointing="full"))
    kept = train_activations(full, facts, tl, 0, 1, (1000, "")).bytes
    assert kept == 1000 * (2 * 128 * 5 + moe) < one
    # sequence parallelism splits what tensor parallelism alone leaves whole
    tp2 = dataclasses.replace(tl, tp=2, sequence_parallel=False)
    sp2 = dataclasses.replace(tl, tp=2, sequence_parallel=True)
    assert (train_activations(recipe, facts, sp2, 0, 1, (1000, "")).bytes
            < train_activations(recipe, facts, tp2, 0, 1, (1000, "")).bytes < one)
    # megatron-core's all-to-all dispatcher: with sequence parallelism a GPU routes its 1/TP of the tokens (the
    # experts' part halves with the rest at SP 2), and expert TP all-gathers the routed inputs over its ranks, each
    # computing 1/ETP of the expert's width (the dispatched inputs double at ETP 2, the experts' MLP does not)
    dense_sp2, moe_sp2 = (18 * 128 + 6 * 256) / 2, (18 * 128 + 6 * 64 + 2 * (2 * 128 + 6 * 64) + 4 * 8) / 2
    assert train_activations(recipe, facts, sp2, 0, 1, (1000, "")).bytes == int(1000 * (dense_sp2 + 4 * moe_sp2))
    etp2 = dataclasses.replace(tl, etp=2)
    moe_etp2 = 18 * 128 + 6 * 64 + 2 * (2 * 128 * 2 + 6 * 64) + 4 * 8
    assert train_activations(recipe, facts, etp2, 0, 1, (1000, "")).bytes == 1000 * (dense + 4 * moe_etp2)
    # the logprob pass holds one layer at a time
    assert forward_working_set(recipe, facts, tl, 0, 1000) == 1000 * moe


def test_the_activation_estimate_covers_the_dense_runs_train_step():
    # the vLLM-backend run of the same dense tiny model (per-step records): what the allocator held at the end of
    # the train step beyond the state the refit offload keeps, against the estimate at that run's micro batch
    rows = [json.loads(line) for line in (VLLM_RUN / "metrics.jsonl").read_text().splitlines() if line.strip()]
    held = max(r["memory/train/used_gib"] - r["memory/refit_offload/used_gib"] for r in rows)
    result = check(ROOT / "rlc/recipes/tiny-qwen3-1gpu.yaml")
    tokens = run_microbatch_tokens(result.recipe)
    assert tokens == (2048 * 32, "2048 × 32 tokens")
    tl = train_layout(result.recipe)
    estimate = (train_activations(result.recipe, result.facts, tl, 0, 0, tokens).bytes
                + logits_bytes(tokens[0], result.facts.vocab, tl.tp)) / GIB
    assert 0.3 < held <= estimate, (held, estimate)


def test_the_train_step_errs_without_the_estimate_and_warns_with_it(tmp_path):
    plan = check(MOE).plan
    train = plan.phases["train"]
    saved = items(plan, "train")[SAVED_ACTIVATIONS_LABEL]
    assert plan.checks["train_fit"].need_gib == pytest.approx(train.used_gib - saved)
    assert plan.checks["train_activations_fit"].need_gib == pytest.approx(train.used_gib)
    # micro batches of 2048 rows of 8192 tokens: the state fits, the estimated activations do not (a warning)
    result = api.check(str(DENSE), ["training.max_sequence_length=8192", "generation.max_model_len=8192"])
    assert result.plan.checks["train_fit"].ok and result.plan.checks["train_activations_fit"].ok is False
    [d] = [d for d in result.diagnostics if d.rule == "RLC215"]
    assert d.severity == "warning" and d.path == "training.activation_checkpointing" and "estimate" in d.message


def test_the_logprob_phase_holds_the_logits_and_one_layer():
    plan = check(MOE, *RUN_SETS).plan
    got = items(plan, "logprob")
    assert got["fp32 logits of the logprob pass"] == pytest.approx(2 * 256 * 64 * 64 * 4 / GIB)
    assert got["forward working set (one layer)"] > 0
    assert "logprob_fit" in plan.checks and plan.checks["logprob_fit"].ok


# --------------------------------------------------------------------------- calibration files


def test_a_calibration_file_without_the_engine_constants_takes_the_shipped_ones(tmp_path):
    shipped_file = shipped_calibrations()["h200-141gb"]
    raw = yaml.safe_load(shipped_file.read_text())
    for key in MEGATRON_BACKEND_CONSTANTS:
        del raw["entries"][0]["constants"][key]
    older = tmp_path / "older.yaml"
    older.write_text(yaml.safe_dump(raw))
    (entry,) = load_table(str(older))
    fallback = next((c for c in load_table() if c.gpu == entry.gpu), load_table()[0])
    for key in MEGATRON_BACKEND_CONSTANTS:
        assert getattr(entry, key) == getattr(fallback, key)
        assert entry.sources[key].startswith(f"not in this file: from the shipped entry {fallback.id}")
    assert entry.megatron_context_gib == load_table(str(shipped_file))[0].megatron_context_gib


def rlc(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def test_rlc_calibrate_fits_the_engine_constants_from_a_megatron_run_folder(tmp_path):
    # a run folder as the runtime writes it, with the record's per-phase maxima as its steps' largest samples
    rec = record()
    measured = rec["memory"]["measured"]
    run = tmp_path / "run"
    run.mkdir()
    versions = rec["machine"]["versions"]
    first = CalibrationRecord.from_memory("policy_started", {"free_gib": 137.4, "used_gib": 2.4, "total_gib": 139.8},
                                          step=0, sleep_level=check(MOE).recipe.refit.sleep_level, enforce_eager=True,
                                          gpu_type="h200-141gb", versions=versions, worker="rank0")
    (run / "calibration.jsonl").write_text(json.dumps(first.to_dict()) + "\n")
    steps = [{"step": s, **{f"memory/{p}/used_gib": (v["max"] if s == 2 else v["mean"]) for p, v in measured.items()}}
             for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    out = tmp_path / "h200.yaml"
    code, text, err = rlc("calibrate", run, "--recipe", MOE, *[w for s in RUN_SETS for w in ("--set", s)], "-o", out)
    assert code == 0, err
    (entry,) = yaml.safe_load(out.read_text())["entries"]
    (shipped,) = load_table(str(shipped_calibrations()["h200-141gb"]))
    for key in MEGATRON_BACKEND_CONSTANTS:
        assert entry["constants"][key]["value"] == getattr(shipped, key), key
        assert entry["constants"][key]["source"].startswith("rlc calibrate: ")
    # the trainer's constants stay the recipe's calibration's, their arithmetic with them
    assert entry["constants"]["megatron_context_gib"]["value"] == round(shipped.megatron_context_gib, 4)
    assert entry["constants"]["megatron_context_gib"]["derived"] == shipped.derivations["megatron_context_gib"]
    assert set(entry["check"]) == {"train", "logprob", "generate", "refit"}
    assert entry["check"]["train"]["measured_used_gib"] == round(measured["train"]["max"], 3)
    for line in ("train", "logprob", "generate", "refit"):
        assert any(row.startswith(line) for row in text[text.index("phase"):].splitlines()), line
