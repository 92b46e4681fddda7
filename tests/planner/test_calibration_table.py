"""The calibration table: derived constants reproduce from the measurements (record format: tests/contract)."""
from __future__ import annotations


import pytest

from rlc.compiler import catalog
from rlc.compiler.planner.calibration import calibration_for, load_table
from rlc.compiler.planner.derive import derive_constants

from planner_helpers import ROOT, load


def test_every_constant_has_a_source():
    for entry in load_table():
        assert entry.source and entry.versions and entry.gpu
        for key in ("megatron_context_gib", "megatron_refit_residual_gib", "vllm_base_gib", "vllm_cuda_graph_gib",
                    "export_staging_overhead_gib", "fragmentation_points", "vllm_cuda_graph_uncertainty_gib"):
            assert "seed" in entry.sources[key].lower() or "attempt" in entry.sources[key] \
                or "failure" in entry.sources[key] or "config" in entry.sources[key], key


def test_derived_constants_match_the_stored_values(qwen397, h100):
    cal = calibration_for("h100-80gb")
    recipe = load(ROOT / cal.reference["recipe"])[0]
    derived = derive_constants(cal.measured, recipe, qwen397, h100.memory_gib, cal)
    assert derived["megatron_context_gib"] == pytest.approx(cal.megatron_context_gib, abs=0.01)
    assert derived["vllm_base_gib"] == pytest.approx(cal.vllm_base_gib, abs=0.01)
    # the reference run had NVLS on: 4 trainer and 2 vLLM communicators of 256 MiB are netted out
    assert (derived["trainer_nvls_gib"], derived["vllm_nvls_gib"]) == pytest.approx((1.0, 0.5))
    assert derived["megatron_refit_residual_gib"] == pytest.approx(cal.megatron_refit_residual_gib, abs=0.01)
    assert derived["vllm_cuda_graph_gib"] == pytest.approx(cal.vllm_cuda_graph_gib, abs=0.01)
    assert derived["export_staging_overhead_gib"] == pytest.approx(cal.export_staging_overhead_gib, abs=0.01)
    points = dict((round(gib, 2), headroom) for headroom, gib in cal.fragmentation_points)
    for ratio, frag in cal.measured["fragmentation"].items():
        assert derived["fragmentation_headroom"][ratio] == pytest.approx(points[frag], abs=0.001)


def test_fragmentation_interpolates_between_measurements():
    cal = calibration_for("h100-80gb")
    (x0, y0), (x1, y1) = cal.fragmentation_points
    assert cal.fragmentation_gib(-0.5) == y0 and cal.fragmentation_gib(0.9) == y1
    mid = cal.fragmentation_gib((x0 + x1) / 2)
    assert mid == pytest.approx((y0 + y1) / 2)


def test_other_gpus_fall_back_with_a_note():
    cal = calibration_for("h200-141gb")
    assert cal.fallback_note and "h100-80gb" in cal.fallback_note
    assert calibration_for("h100-80gb").fallback_note is None


def test_gpu_of_every_entry_is_in_the_catalog():
    for entry in load_table():
        catalog.gpu_spec(entry.gpu)
