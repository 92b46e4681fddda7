"""``rlc calibrate``: the tiny H200 run's records give a calibration that predicts its measured memory."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import statistics
from pathlib import Path

import pytest
import yaml

from rlc.compiler.cli import main
from rlc.compiler.planner.calibration import load_table, shipped_calibrations

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs/results/tiny-qwen3-h200-grpo"
TINY = ROOT / "rlc/recipes/tiny-qwen3-1gpu.yaml"
UNCALIBRATED = "cluster.calibration=null"  # the shipped table, as before any calibration


def rlc(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def measured(phase: str) -> float:
    rows = [json.loads(line) for line in (RUN / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(r[f"memory/{phase}/used_gib"] for r in rows)


def plan_used(*argv: str) -> dict[str, float]:
    code, out, err = rlc("plan", TINY, "--json", *argv)
    assert code == 0, err
    return {name: p["used_gib"] for name, p in json.loads(out)["plan"]["phases"].items()}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    target = tmp_path_factory.mktemp("cal") / "h200.yaml"
    code, out, err = rlc("calibrate", RUN, "--recipe", TINY, "--set", UNCALIBRATED, "-o", target)
    assert code == 0, err
    return target, out


def test_fitted_calibration_predicts_the_measured_train_and_generate_memory(fitted):
    target, _ = fitted
    before = plan_used("--set", UNCALIBRATED)
    after = plan_used("--calibration", target)
    for phase in ("train", "generate"):
        assert abs(after[phase] - measured(phase)) / measured(phase) < 0.10, (phase, after[phase], measured(phase))
    # the shipped H100 table is far off on this GPU and stack (the reason to calibrate)
    assert abs(before["train"] - measured("train")) / measured("train") > 0.5


def test_fit_uses_per_gpu_facts_not_the_compared_phases(fitted):
    target, _ = fitted
    (entry,) = yaml.safe_load(target.read_text())["entries"]
    fitted_names = {k for k, v in entry["constants"].items() if "rlc calibrate" in v["source"]}
    assert fitted_names == {"vllm_base_gib", "vllm_awake_extra_gib", "megatron_context_gib",
                            "megatron_refit_residual_gib"}
    assert entry["gpu"] == "h200-141gb" and entry["versions"]["vllm"] == "0.22.0"
    assert entry["id"] == "h200-141gb-vllm-0.22.0"
    # every fitted constant is a physical amount: non-negative and smaller than the GPU
    for name in fitted_names:
        assert 0 <= entry["constants"][name]["value"] < 10, name
    # unfitted constants say where they come from
    assert "not measured on h200-141gb" in entry["constants"]["export_staging_overhead_gib"]["source"]


def test_report_prints_before_and_after_per_phase(fitted):
    _, out = fitted
    table = out[out.index("phase"):]
    for phase in ("train", "generate", "refit"):
        assert any(line.startswith(phase) for line in table.splitlines()), phase
    assert "before: h100-nemo-rl-0.6.0" in out and "after: h200-141gb-vllm-0.22.0" in out


def test_shipped_h200_calibration_is_the_fit_of_the_recorded_run(fitted):
    target, _ = fitted
    (fresh,) = load_table(str(target))
    (shipped,) = load_table(str(shipped_calibrations()["h200-141gb"]))
    for name in ("vllm_base_gib", "vllm_awake_extra_gib", "megatron_context_gib", "megatron_refit_residual_gib"):
        assert getattr(shipped, name) == pytest.approx(getattr(fresh, name), abs=1e-3), name


def test_tiny_recipe_plans_with_the_shipped_calibration():
    used = plan_used()
    for phase in ("train", "generate"):
        assert abs(used[phase] - measured(phase)) / measured(phase) < 0.10


def test_plan_json_keeps_used_and_free_per_phase():
    code, out, _ = rlc("plan", TINY, "--json")
    plan = json.loads(out)["plan"]
    assert plan["calibration"] == "h200-141gb-vllm-0.22.0"
    for phase in plan["phases"].values():
        assert phase["used_gib"] + phase["free_gib"] == pytest.approx(phase["limit_gib"])


def test_records_from_another_gpu_are_refused(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    lines = (run / "calibration.jsonl").read_text().replace('"h200-141gb"', '"h100-80gb"')
    (run / "calibration.jsonl").write_text(lines)
    code, _, err = rlc("calibrate", run, "--recipe", TINY, "-o", tmp_path / "c.yaml")
    assert code == 2 and "measured on h100-80gb" in err and "Traceback" not in err
    assert not (tmp_path / "c.yaml").exists()


def test_records_of_a_run_with_the_weights_kept_awake_are_refused_for_a_recipe_without(tmp_path):
    """Their after-sleep memory holds vLLM's weights: fitting a recipe that sleeps them would count them twice."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    lines = [json.loads(line) for line in (run / "calibration.jsonl").read_text().splitlines() if line.strip()]
    (run / "calibration.jsonl").write_text("".join(json.dumps({**r, "weights_awake": True}) + "\n" for r in lines))
    code, _, err = rlc("calibrate", run, "--recipe", TINY, "-o", tmp_path / "c.yaml")
    assert code == 2 and "refit.keep_weights_awake True" in err and "Traceback" not in err
    assert not (tmp_path / "c.yaml").exists()


def test_records_of_a_run_with_the_kv_cache_kept_awake_are_refused_for_a_recipe_that_sleeps_it(tmp_path):
    """Their after-sleep memory holds vLLM's weights and KV cache (the engine never slept)."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    lines = [json.loads(line) for line in (run / "calibration.jsonl").read_text().splitlines() if line.strip()]
    (run / "calibration.jsonl").write_text("".join(json.dumps({**r, "sleep_level": 1, "weights_awake": True,
                                                               "kv_cache_awake": True})
                                                   + "\n" for r in lines))
    code, _, err = rlc("calibrate", run, "--recipe", TINY, "--set", "refit.keep_weights_awake=true",
                       "--set", "refit.sleep_level=1", "-o", tmp_path / "c.yaml")
    assert code == 2 and "refit.keep_kv_cache_awake True" in err and "Traceback" not in err
    assert not (tmp_path / "c.yaml").exists()


def test_a_malformed_record_names_file_and_line(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    lines = (run / "calibration.jsonl").read_text().splitlines()
    lines[2] = lines[2].replace('"phase": "refit_free"', '"phase": "warmup"')
    (run / "calibration.jsonl").write_text("\n".join(lines) + "\n")
    code, _, err = rlc("calibrate", run, "--recipe", TINY, "-o", tmp_path / "c.yaml")
    assert code == 2 and "calibration.jsonl:3" in err and "warmup" in err


def test_missing_run_folder_is_a_usage_error(tmp_path):
    code, _, err = rlc("calibrate", tmp_path / "nope", "--recipe", TINY, "-o", tmp_path / "c.yaml")
    assert code == 2 and "not a folder" in err


def test_unusable_calibration_file_is_a_recipe_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: 1\nentries: [{id: x, gpu: h200-141gb, constants: {}}]\n")
    code, _, err = rlc("validate", TINY, "--calibration", bad)
    assert code == 1 and "RLC004" in err and "calibration entry x: constant" in err and "missing" in err
    code, _, err = rlc("plan", TINY, "--calibration", tmp_path / "absent.yaml")
    assert code == 1 and "not found" in err and "h200-141gb" in err  # names the shipped calibrations
