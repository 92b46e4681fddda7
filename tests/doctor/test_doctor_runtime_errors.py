"""``rlc doctor`` on the failures rlc's own runtime raises, produced by the real code paths (bucket
planner, completion manifest, pipeline-owner check, gen-KL guard, dynamic sampler, worker reports,
and the multi-process refit protocol on the shared-memory backend)."""
from __future__ import annotations

import multiprocessing as mp
import uuid

import pytest
import runtime_messages as R

from rlc.compiler.doctor import diagnose

GIB = 1 << 30


def _only(text: str):
    findings = diagnose(text)
    assert len(findings) == 1, [(f.pattern, f.rule, f.summary) for f in findings]
    return findings[0]


def test_planner_error_names_rlc210_with_the_planners_numbers():
    exc, text = R.refit_plan_error()
    f = _only(text)
    assert f.rule == "RLC210" and f.values["name"] == R.FUSED.name
    assert f.values["tensor_bytes"] == R.FUSED.nbytes == 8 * GIB
    assert f.values["free_bytes"] == R.FREE_AT_REFIT
    assert f.values["half_bytes"] == int(R.FREE_AT_REFIT * 0.3) // 2 // 256 * 256


def test_fixed_buffer_over_free_names_rlc210():
    _, text = R.buffer_gb_over_free()
    f = _only(text)
    assert (f.rule, f.values["buffer_gb"], f.values["free_bytes"]) == ("RLC210", 16.0, 12 * GIB)


@pytest.mark.parametrize("make, fields", [(R.foreign_metadata, {"own": 1, "got": 0}),
                                          (R.unannounced_tensor, {"rank": 1, "name": "layers.0.experts.0.w"})])
def test_manifest_mismatch_names_rlc203(make, fields):
    f = _only(make()[1])
    assert f.rule == "RLC203"
    for key, value in fields.items():
        assert f.values[key] == value


def test_duplicate_delivery_and_two_pipeline_owners_name_rlc201():
    f = _only(R.duplicate_tensor()[1])
    assert (f.rule, f.values["name"]) == ("RLC201", "layers.1.experts.0.w")
    f = _only(R.multiple_owners()[1])
    assert f.rule == "RLC201" and f.values["ranks"] == [0, 3]
    assert f.values["name"] == "language_model.embedding.word_embeddings.weight"


def test_gen_kl_stop_names_the_guard_and_the_candidate_fixes():
    exc, text = R.gen_kl_exceeded()
    f = _only(text)
    assert f.rule == "RLC306" and f.values["step"] == 7 and f.values["threshold"] == 0.05
    assert f.values["gen_kl"] == pytest.approx(float(str(exc).split()[1]), rel=1e-3)
    assert f.candidates == ("RLC202", "RLC203", "RLC204")


def test_dynamic_sampling_exhausted_reads_the_hit_rate():
    f = _only(R.dynamic_sampling_exhausted()[1])
    assert f.pattern == "dynamic-sampling-exhausted" and f.rule is None
    assert (f.values["max_gen_batches"], f.values["kept"], f.values["target"]) == (2, 3, 8)
    assert f.values["hit_rate"] == pytest.approx(3 / 16, abs=1e-3)


def test_a_stop_by_sigterm_is_named_as_a_stop_not_a_failure():
    f = _only(R.stopped_by_sigterm()[1])
    assert f.pattern == "stopped-by-signal" and f.rule is None
    assert "cluster.slurm.time" in f.fix and "resumes from the last checkpoint" in f.fix


def test_worker_failure_report_names_worker_node_and_phase():
    f = _only(R.worker_died()[1])
    assert f.pattern == "worker-lost" and f.rule is None
    assert (f.values["role"], f.values["rank"], f.values["node"], f.values["phase"]) == (
        "policy",
        "3",
        "10.0.4.17",
        "refit",
    )


# ------------------------------------------------------------------ the refit protocol across processes

@pytest.fixture(scope="module")
def pool():
    from concurrent.futures import ProcessPoolExecutor

    from tests.refit import harness as H

    ctx = mp.get_context("spawn")
    ex = ProcessPoolExecutor(max_workers=4, mp_context=ctx, initializer=H.init_worker,
                             initargs=(ctx.Value("q", 0), ctx.Queue(), ctx.Event()))
    yield ex
    ex.shutdown(wait=False, cancel_futures=True)


def _run(pool, producers, consumers):
    from tests.refit import harness as H

    futs_c = [pool.submit(H.consumer_main, c) for c in consumers]
    futs_p = [pool.submit(H.producer_main, p) for p in producers]
    return [f.result(90) for f in futs_p], [f.result(90) for f in futs_c]


def test_protocol_with_rank0_metadata_everywhere_names_rlc203(pool):
    """The refit engine's own failure test (per_rank_ipc_metadata off): both sides' logs -> RLC203."""
    s = uuid.uuid4().hex[:10]
    prods, cons = _run(pool, [{"session": s, "rank": r, "cfg": {"per_rank_ipc_metadata": False}} for r in (0, 1)],
                       [{"session": s, "device": r} for r in (0, 1)])
    assert not cons[1]["ok"] and not prods[1]["ok"]
    for side in (cons[1], prods[1]):
        log = f"{side['error_type']}: {side['error']}\n"
        f = _only(log)
        assert (f.rule, f.values["own"], f.values["got"]) == ("RLC203", 1, 0)


def test_protocol_plan_error_names_rlc210_on_both_sides(pool):
    s = uuid.uuid4().hex[:10]
    prods, cons = _run(pool, [{"session": s, "rank": 1, "world_size": 1, "free_bytes": 40000}],
                       [{"session": s, "device": 1}])
    assert not prods[0]["ok"] and not cons[0]["ok"]
    for side in (prods[0], cons[0]):
        f = _only(f"{side['error_type']}: {side['error']}\n")
        assert f.rule == "RLC210" and f.values["name"] == "model.layers.1.mlp.experts.gate_up_proj"
        assert f.values["free_bytes"] == pytest.approx(40000, rel=1e-3)  # printed as "39.06 KiB"


def test_refit_verify_stop_names_rlc204_when_an_fp32_parameter_was_rounded():
    f = _only(R.refit_not_bit_exact(rounded=True)[1])
    assert f.rule == "RLC204" and f.values["bits"] == 16 and f.values["worker"] == 0
    assert f.values["name"] == "model.layers.1.mlp.gate.e_score_correction_bias"


def test_refit_verify_stop_without_rounding_points_at_the_refit_switches():
    f = _only(R.refit_not_bit_exact(rounded=False)[1])
    assert f.rule == "RLC306" and f.values["step"] == 4


def test_a_sequence_over_the_packing_budget_names_rlc315_with_the_key_to_raise():
    _, text = R.packed_sequence_too_long()
    f = _only(text)
    assert (f.pattern, f.rule) == ("packed-sequence-too-long", "RLC315")
    assert f.values == {"tokens": 5000, "budget_tokens": 4096, "key": "training.sequence_packing.train_mb_tokens"}
