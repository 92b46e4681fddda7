"""``rlc doctor`` on the command line: exit codes, the report, and re-planning with a recipe."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from rlc.compiler.cli import main

HERE = Path(__file__).resolve().parent
LOGS = HERE / "logs"
REPO = HERE.parents[1]
SEED_RECIPES = REPO / "tests" / "recipes" / "nemo-rl-2471"
FINAL = REPO / "rlc" / "recipes" / "qwen35-397b-grpo-32xh100.yaml"


def rlc(*argv: str, stdin: str | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    import sys

    old = sys.stdin
    try:
        if stdin is not None:
            sys.stdin = io.StringIO(stdin)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        sys.stdin = old
    return code, out.getvalue(), err.getvalue()


def test_recognised_failure_exits_0_and_names_rule_fix_and_source():
    code, out, _ = rlc("doctor", str(LOGS / "nemo_rl_mtp_owner.log"))
    assert code == 0
    assert "[RLC201]" in out and "refit.dedupe_mtp_embedding" in out and "rlc explain RLC201" in out
    assert "log line 10: ValueError: Object present on multiple PP ranks: [0, 7]" in out
    assert "seen in: NeMo-RL" in out


def test_nothing_recognised_exits_1_and_names_no_rule():
    code, out, _ = rlc("doctor", str(LOGS / "healthy.log"))
    assert code == 1 and "no known failure recognised" in out and "RLC" not in out


def test_stdin_and_usage_errors():
    code, out, _ = rlc("doctor", "-", stdin=(LOGS / "expandable_segments.log").read_text())
    assert code == 0 and "[RLC301]" in out and out.startswith("stdin:")
    code, _, err = rlc("doctor", str(LOGS / "no-such.log"))
    assert code == 2 and "cannot read" in err and "Traceback" not in err
    code, _, err = rlc("doctor", str(LOGS / "healthy.log"), "--set", "refit.sleep_level=2")
    assert code == 2 and "--set needs --recipe" in err


def test_buffer_too_small_replanned_at_the_logs_free_memory_finds_a_ratio_that_fits():
    """The field report's ratio-0.3 failure: 2 × 6263046144 / 0.3 = 38.89 GiB free at refit; the
    re-plan names the window of ratios that pass both the half and the staging site there."""
    code, out, _ = rlc("doctor", str(LOGS / "nemo_rl_buffer_too_small.log"),
                       "--recipe", str(SEED_RECIPES / "qwen35-397b-nemo-rl-2471-1-defaults.yaml"))
    assert code == 0
    assert "re-plan (fits)" in out and "38.89 GiB free at refit" in out and "half too small" in out
    assert "buffer_memory_ratio 0.4" in out  # the window starts above 2 × 8 / 38.89 = 0.411


def test_stack_oom_replanned_says_no_ratio_fits_and_names_the_lever():
    """Ratio 0.5 OOMed at the stack with 6.76 GiB free: no ratio passes at that free memory; the
    planner's lever (the larger generation EP) is named, not sleep level 2 (it frees nothing at the refit)."""
    code, out, _ = rlc("doctor", str(LOGS / "megatron_bridge_stack_oom.log"),
                       "--recipe", str(SEED_RECIPES / "qwen35-397b-nemo-rl-2471-2-ratio05.yaml"))
    assert code == 0
    assert "re-plan (does not fit)" in out and "staging site too small" in out
    # the two cheapest sufficient levers: NVLS off (the reference ran with it on), then the larger EP
    assert 'planned: NCCL_NVLS_ENABLE: "0" in cluster.env' in out and "; or generation EP 128" in out
    assert "sleep_level: 2" not in out


def test_residue_growth_replanned_with_the_levers():
    code, out, _ = rlc("doctor", str(LOGS / "vllm_sleep_residue_growth.log"),
                       "--recipe", str(SEED_RECIPES / "qwen35-397b-nemo-rl-2471-3-ep128.yaml"))
    assert code == 0 and "[RLC212]" in out and "residue grew 12.20 GiB" in out and "re-plan (fits)" in out
    # the growth is the CUDA graphs' own: enforce_eager removes it (sleep level 2 would not change it)
    assert "no CUDA graphs to grow" in out and "sleep_level: 2" not in out


@pytest.mark.parametrize("log, recipe_sets, verdict", [
    ("nemo_rl_mtp_owner.log", (), "re-plan (fits): with this recipe rlc turns refit.dedupe_mtp_embedding on"),
    ("megatron_overlap_stale.log", ("training.overlap_param_gather=true",),
     "re-plan (fits): this recipe decides refit.sync_params_before_refit: on"),
    ("ray_node_lost.log", (), "re-plan (does not fit): the recipe does not resume after a lost node"),
    ("ray_node_lost.log", ("cluster.slurm.requeue=true",), "re-plan (fits): the recipe requeues"),
    ("expandable_segments.log", (), "re-plan (fits): the recipe's cluster.env has no expandable_segments"),
])
def test_decisions_of_the_recipe_judge_the_fix(log, recipe_sets, verdict):
    args = ["doctor", str(LOGS / log), "--recipe", str(FINAL)]
    for s in recipe_sets:
        args += ["--set", s]
    code, out, _ = rlc(*args)
    assert code == 0 and verdict in out, out


def test_dedupe_switched_off_in_the_recipe_is_reported_as_not_fitting():
    code, out, _ = rlc("doctor", str(LOGS / "nemo_rl_mtp_owner.log"), "--recipe", str(FINAL),
                       "--set", "refit.dedupe_mtp_embedding=off")
    assert code == 0 and "re-plan (does not fit)" in out and "dedupe_mtp_embedding" in out


def test_dynamic_sampling_replanned_with_the_measured_hit_rate():
    import runtime_messages as R

    _, text = R.dynamic_sampling_exhausted()
    code, out, _ = rlc("doctor", "-", "--recipe", str(FINAL), "--set", "grpo.dynamic_sampling.enabled=true",
                       stdin=text)
    # 32 prompts per step, batches of 32, hit rate 18.75 % -> 6 batches; the recipe allows 10
    assert code == 0 and "takes 6 batches; the recipe allows 10" in out and "re-plan (fits)" in out


def test_a_job_folder_is_read_recursively_and_findings_name_file_and_line(tmp_path):
    job = tmp_path / "logs" / "4711"
    job.mkdir(parents=True)
    (job / "driver.log").write_text((LOGS / "megatron_overlap_stale.log").read_text())
    (job / "slurm-4711.out").write_text((LOGS / "nemo_rl_mtp_owner.log").read_text())
    (job / "metrics.jsonl").write_text('{"step": 1, "note": "Object present on multiple PP ranks: [0, 1]"}\n')
    code, out, _ = rlc("doctor", str(tmp_path / "logs"))
    assert code == 0 and "[RLC202]" in out and "[RLC201]" in out
    assert "4711/slurm-4711.out:10: ValueError: Object present on multiple PP ranks: [0, 7]" in out
    assert "evidence, 4711/driver.log:3:" in out
    assert "[0, 1]" not in out  # only log files are read, not metrics.jsonl
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = rlc("doctor", str(empty))
    assert code == 2 and "no log files" in err


def test_replan_uses_the_recipes_calibration_not_the_shipped_table(tmp_path):
    """A recipe that names its own calibration (``cluster.calibration``) is re-planned with it: the same
    log and recipe with the staging-site overhead raised by 10 GiB leave 10 GiB less at the staging site."""
    import yaml

    from rlc.compiler.planner.calibration import CALIBRATION_FILE

    table = yaml.safe_load(Path(CALIBRATION_FILE).read_text(encoding="utf-8"))
    h100 = next(e for e in table["entries"] if e["gpu"] == "h100-80gb")
    h100["constants"]["export_staging_overhead_gib"]["value"] += 10.0
    own = tmp_path / "h100-own.yaml"
    own.write_text(yaml.safe_dump({"format": 1, "entries": [h100]}), encoding="utf-8")
    args = ["doctor", str(LOGS / "nemo_rl_buffer_too_small.log"),
            "--recipe", str(SEED_RECIPES / "qwen35-397b-nemo-rl-2471-1-defaults.yaml")]

    def staging_gib(out: str) -> float:
        return float(out.split("leaves ")[1].split(" GiB at the staging site")[0])

    _, shipped, _ = rlc(*args)
    code, with_own, _ = rlc(*args, "--set", f"cluster.calibration={own}")
    assert code == 0
    assert abs(staging_gib(shipped) - staging_gib(with_own) - 10.0) < 0.05, (shipped, with_own)


def test_a_log_from_another_model_is_flagged_not_replanned():
    """The log's tensor is not in the recipe's model: doctor used to re-plan it with the recipe's numbers anyway."""
    tiny = REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml"
    code, out, _ = rlc("doctor", str(LOGS / "nemo_rl_buffer_too_small.log"), "--recipe", str(tiny))
    assert code == 0 and "[RLC210]" in out
    assert "warning: the log's model does not match the recipe's" in out and "named under model.language_model" in out
    assert "re-plan (" not in out
    # the recipe of the job the log came from: no warning, re-planned
    code, out, _ = rlc("doctor", str(LOGS / "nemo_rl_buffer_too_small.log"), "--recipe",
                       str(SEED_RECIPES / "qwen35-397b-nemo-rl-2471-1-defaults.yaml"))
    assert "warning:" not in out and "re-plan (fits)" in out


def test_a_tensor_of_another_size_or_layer_is_flagged_too():
    from rlc.compiler import catalog
    from rlc.compiler.doctor.model_match import mismatch

    small = catalog.model_facts("Qwen/Qwen3.5-35B-A3B", REPO)  # same names as the 397B, other sizes
    gate_up = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert "256" not in (mismatch({"name": gate_up, "tensor_bytes": 8589934592}, small) or "")
    assert "8589934592 bytes" in mismatch({"name": gate_up, "tensor_bytes": 8589934592}, small)
    assert mismatch({"name": gate_up, "tensor_bytes": 2 * 256 * 2 * 512 * 2048}, small) is None
    assert "layer 45" in mismatch({"name": "model.language_model.layers.45.mlp.gate.weight"}, small)
    llama = catalog.model_facts("meta-llama/Llama-3.1-8B", REPO)
    assert "[128256, 4096]" in mismatch({"name": "model.embed_tokens.weight", "shape": [152064, 5120]}, llama)
    assert mismatch({"name": "model.embed_tokens.weight", "shape": [128256, 4096]}, llama) is None


def test_the_verl_bucket_assertion_is_replanned_with_the_recipes_refit_buffer():
    code, out, _ = rlc("doctor", str(LOGS / "verl_bucket_too_small.log"), "--recipe", str(FINAL))
    assert code == 0 and "[RLC210]" in out and "update_weights_bucket_megabytes" in out
    assert "re-plan (fits): this recipe's refit halves are" in out and "needs 8.00 GiB: both hold it" in out
    code, out, _ = rlc("doctor", str(LOGS / "openrlhf_weight_sync_ib.log"), "--recipe", str(FINAL))
    assert "warning: the log's model does not match" in out  # Qwen2.5-32B-style names vs the 397B recipe
