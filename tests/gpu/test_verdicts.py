"""CPU checks of the GPU proofs' verdicts: each passes on good evidence and fails on each kind of bad."""
from __future__ import annotations

import json
from pathlib import Path


import pytest

from tests.gpu.common import GpuStackBroken, gpu_available
from tests.gpu.verdicts import (
    BF16_U,
    FREE_AT_REFIT_TOLERANCE_GIB,
    PACKING_FLOORS,
    RESUME_MIN_REWARD,
    calibration_verdict,
    foreign_metadata_caught,
    free_at_refit_verdict,
    packing_tolerances,
    packing_verdict,
    resume_verdict,
)


def _records(start=90.0, s1=130.0, s2=130.6, total=140.0):
    out = []
    for eager in (True, False):
        for phase, level, free in (("vllm_started", 0, start), ("refit_free", 1, s1), ("refit_free", 2, s2)):
            out.append({"phase": phase, "sleep_level": level, "enforce_eager": eager, "free_gib": free,
                        "total_gib": total})
    return out


def test_calibration_passes_on_measured_sleep_figures():
    assert calibration_verdict(_records(), gpu_memory_utilization=0.3) == (True, [])


@pytest.mark.parametrize("records, words", [
    (_records(s1=100.0), "sleep(1) freed 10.00 GiB"),  # 10 GiB freed < 0.5 x 42 GiB budget
    (_records(s2=128.0), "free after sleep(2)"),
    (_records()[:5], "missing records"),
    (_records(start=float("nan")), "not in (0, total_gib"),
    (_records(s2=150.0), "not in (0, total_gib"),
])
def test_calibration_fails_on_each_bad_figure(records, words):
    passed, reasons = calibration_verdict(records, gpu_memory_utilization=0.3)
    assert not passed and any(words in r for r in reasons), reasons


def test_foreign_metadata_needs_the_manifest_error_from_a_consumer():
    good = [{"who": "consumer1", "type": "RefitManifestError",
             "error": "consumer of producer rank 1 (GPU GPU-1), refit 1: bucket 0 carries slicing metadata from "
                      "producer rank 0 (GPU GPU-0)"}]
    assert foreign_metadata_caught(good) == (True, [])
    for bad in ([], [{"who": "consumer1", "type": "TimeoutError", "error": "refit receive timed out"}],
                [{"who": "producer0", "type": "RefitManifestError", "error": good[0]["error"]}],
                [{"who": "consumer0", "type": "RefitManifestError", "error": "bucket 3 arrived, expected bucket 2"}]):
        passed, reasons = foreign_metadata_caught(bad)
        assert not passed and "no consumer raised RefitManifestError" in reasons[0]


def test_resume_needs_exit_zero_the_next_steps_and_trained_rewards():
    assert resume_verdict(0, [151, 152, 153], [0.9, 0.95, 0.92], steps=150, resume_steps=3) == (True, [])
    assert "exit code 1" in resume_verdict(1, [151, 152, 153], [0.9] * 3, steps=150, resume_steps=3)[1][0]
    assert "expected [151, 152, 153]" in resume_verdict(0, [1, 2, 3], [0.9] * 3, steps=150, resume_steps=3)[1][0]
    chance = resume_verdict(0, [151, 152, 153], [0.1, 0.12, 0.09], steps=150, resume_steps=3)
    assert not chance[0] and f"< {RESUME_MIN_REWARD}" in chance[1][0]
    assert not resume_verdict(None, [], [], steps=150, resume_steps=3)[0]  # the restart never ran


def test_free_at_refit_is_compared_with_the_plan():
    assert free_at_refit_verdict(117.0, 119.0) == (True, [])
    assert free_at_refit_verdict(119.0 - FREE_AT_REFIT_TOLERANCE_GIB, 119.0)[0]  # the boundary passes
    off = free_at_refit_verdict(110.0, 119.0)
    assert not off[0] and "off by -9.00 GiB" in off[1][0]
    assert not free_at_refit_verdict(None, 119.0)[0]
    assert not free_at_refit_verdict(float("nan"), 119.0)[0]


def test_gpu_tests_skip_only_off_a_gpu_host():
    def broken(name):
        if name == "vllm":
            raise ImportError("libcudart.so.12: cannot open shared object file")
        return __import__("types").SimpleNamespace(cuda=__import__("types").SimpleNamespace(is_available=lambda: True))

    assert gpu_available(gpu_host=False, importer=broken) is False  # CI: the GPU tests skip
    with pytest.raises(GpuStackBroken, match="vllm does not import: ImportError: libcudart"):
        gpu_available(gpu_host=True, importer=broken)  # a GPU host: they fail
    no_cuda = lambda name: __import__("types").SimpleNamespace(  # noqa: E731
        cuda=__import__("types").SimpleNamespace(is_available=lambda: False))
    with pytest.raises(GpuStackBroken, match="cuda.is_available"):
        gpu_available(gpu_host=True, importer=no_cuda)
    fine = lambda name: __import__("types").SimpleNamespace(  # noqa: E731
        cuda=__import__("types").SimpleNamespace(is_available=lambda: True))
    assert gpu_available(gpu_host=True, importer=fine) is True


PADDED_ERROR = {"logprob_max_abs": 0.01, "logprob_mean_abs": 1e-4, "loss_rel": 0.0, "grad_rel_l2": 2e-3}


def test_packing_tolerance_is_twice_the_padded_bf16_error_or_the_bf16_floor():
    tol = packing_tolerances(PADDED_ERROR)
    assert tol["logprob_max_abs"] == pytest.approx(0.02) and tol["grad_rel_l2"] == pytest.approx(4e-3)
    assert tol["loss_rel"] == BF16_U == PACKING_FLOORS["loss_rel"]  # an exact padded figure falls back to the floor
    assert tol["logprob_mean_abs"] == BF16_U / 4


def test_packing_verdict_passes_within_and_names_each_figure_outside():
    good = {"logprob_max_abs": 0.015, "logprob_mean_abs": 5e-4, "loss_rel": 1e-3, "grad_rel_l2": 3e-3}
    assert packing_verdict(PADDED_ERROR, good, good, {"logprob_max_abs": 2.0}) == (True, [])
    bad = {**good, "grad_rel_l2": 0.02, "logprob_mean_abs": float("nan")}
    ok, why = packing_verdict(PADDED_ERROR, bad)
    assert not ok and len(why) == 2 and any("grad_rel_l2" in w for w in why) and any("mean_abs" in w for w in why)
    ok, why = packing_verdict(PADDED_ERROR, good, {**good, "logprob_max_abs": 0.05})  # further from exact
    assert not ok and why[0].startswith("packed vs fp32 logprob_max_abs")
    ok, why = packing_verdict(PADDED_ERROR, good, leak={"logprob_max_abs": 0.05})  # a leak rounding could hide
    assert not ok and "negative control" in why[0]


SMOKE_RECORDS = [Path(__file__).resolve().parents[2] / "docs" / "results" / "grpo-smoke-h200" / name
                 for name in ("grpo_learning.json", "grpo_learning_rerun.json")]


@pytest.mark.parametrize("record", SMOKE_RECORDS, ids=lambda p: p.name)
def test_the_smoke_verdict_passes_the_measured_smoke_run_and_fails_a_restart_from_scratch(record):
    from tests.gpu.test_grpo_learning import smoke_verdict  # noqa: PLC0415 - the GPU script's own verdict

    rec = json.loads(record.read_text(encoding="utf-8"))
    assert smoke_verdict(rec, 4, {}) == (True, [])
    # its reward after 4 steps is at chance: the learning run's resume rule cannot judge a smoke run
    assert not resume_verdict(rec["resume_rc"], rec["resume"]["steps"], rec["resume"]["reward"], steps=4,
                              resume_steps=2)[0]
    ok, why = smoke_verdict({**rec, "resume": {"steps": [1, 2], "reward": [0.1, 0.1]}}, 4, {})
    assert not ok and "expected 5.." in why[0]
    assert not smoke_verdict({**rec, "resume_rc": 1}, 4, {})[0]
    assert not smoke_verdict({**rec, "summary": {**rec["summary"], "refits_logged": 3}}, 4, {})[0]
