"""The planner model: sleep semantics per vLLM version, residency per phase, the precision-aware optimizer,
host memory, reported residue growth, missing facts and checkpoint variants — each on the configuration
that motivated it (public GRPO runs and failure reports)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlc.compiler import api
from rlc.compiler.planner.vllm_sleep import load_sleep_table, sleep_semantics

# DeepSeek-V3 on 32 x 8 H100, TP1/PP16/EP16 + vLLM TP32: NeMo-RL's grpo-deepseek-v3-32n8g performance recipe
DSV3 = {
    "version": 1,
    "model": {"id": "deepseek-ai/DeepSeek-V3", "overrides": {"num_nextn_predict_layers": 0}},
    "cluster": {
        "nodes": 32,
        "gpus_per_node": 8,
        "gpu": "h100-80gb",
        "container": {"image": "nvcr.io/nvidia/nemo-rl:v0.6.0", "mounts": ["/data:/data:ro"]},
    },
    "parallelism": {
        "train": {
            "tp": 1,
            "pp": 16,
            "ep": 16,
            "num_layers_in_first_pipeline_stage": 3,
            "num_layers_in_last_pipeline_stage": 2,
        },
        "generation": {"tp": 32},
    },
    "generation": {"max_model_len": 1536, "sampling": {"max_tokens": 1536}},
    "data": {"train": "/data/train.jsonl", "max_prompt_length": 1536},
    "training": {
        "use_precision_aware_optimizer": True,
        "max_sequence_length": 1536,
        "grad_reduce_in_fp32": False,
    },  # NeMo-RL's default: bf16 grad buffers
    "grpo": {"prompts_per_step": 32, "generations_per_prompt": 16},
}

# NeMo-RL #2619: Qwen3.5-35B-A3B on 2 x 8 GPUs, trainer TP1 / EP16, vLLM TP8 on vLLM 0.20
QWEN35_2619 = {
    "version": 1,
    "model": {"id": "Qwen/Qwen3.5-35B-A3B-Base"},
    "cluster": {
        "nodes": 2,
        "gpus_per_node": 8,
        "gpu": "h100-80gb",
        "container": {"image": "nvcr.io/nvidia/nemo-rl:v0.6.0", "mounts": ["/data:/data:ro"]},
    },
    "parallelism": {"train": {"tp": 1, "ep": 16}, "generation": {"tp": 8}},
    "generation": {"vllm_version": "0.20.0", "enforce_eager": True, "max_model_len": 4096},
    "data": {"train": "/data/train.jsonl", "max_prompt_length": 4096},
    "training": {
        "use_precision_aware_optimizer": True,
        "max_sequence_length": 4096,
        "grad_reduce_in_fp32": False,
    },  # NeMo-RL's default: bf16 grad buffers
    "grpo": {"prompts_per_step": 64, "generations_per_prompt": 32},
}


def check(tmp_path: Path, recipe: dict, *sets: str) -> api.CheckResult:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return api.check(str(path), list(sets))


def rules(result, severity=None) -> list[str]:
    return [d.rule for d in result.diagnostics if severity is None or d.severity == severity]


def labels(phase) -> list[str]:
    return [i.label for i in phase.items]


# ------------------------------------------------------------------ sleep level 1: GPU vs host


def test_sleep_level_1_offloads_the_weights_to_host_memory_during_the_train_step(tmp_path):
    result = check(tmp_path, DSV3)
    plan = result.plan
    assert "RLC215" not in rules(result)
    train = plan.phases["train"]
    assert "vLLM weight shard" not in labels(train)
    assert plan.checks["train_fit"].ok and train.used_gib < 70
    # the shard went to host memory instead, 8 GPUs' copies on every node, each allocation of the 40.9 GiB
    # shard in a pinned block rounded up to a power of two (pinned_copy.py)
    copy = plan.host.item_gib("vLLM weight copy (sleep level 1)") / 8
    assert plan.vllm_weights_gib < copy < 2 * plan.vllm_weights_gib
    level2 = check(tmp_path, DSV3, "refit.sleep_level=2").plan.host
    assert level2.item_gib("vLLM weight copy (sleep level 1)") == 0


def test_sleep_semantics_follow_the_vllm_version(tmp_path):
    old, new = sleep_semantics("0.17.1"), sleep_semantics("0.22.0")
    # the refit wakes the weights before it sizes the buffer (NeMo-RL and the runtime alike), and vLLM
    # re-creates discarded allocations on wake-up: the shard is on the GPU at the refit at either level
    assert all(s.level(n).gpu_at_refit for s in (old, new) for n in (1, 2))
    assert all(not s.level(n).gpu_asleep for s in load_sleep_table() for n in (1, 2))
    assert old.level(1).host_copy and not old.level(2).host_copy
    for version in ("0.17.1", "0.22.0"):
        recipe = {**DSV3, "refit": {"sleep_level": 2},
                  "generation": {**DSV3["generation"], "vllm_version": version}}
        plan = check(tmp_path, recipe).plan
        assert "vLLM weight shard" in labels(plan.phases["refit"])
        level1 = check(tmp_path, {**recipe, "refit": {"sleep_level": 1}}).plan
        assert plan.refit.free_at_refit == level1.refit.free_at_refit  # level 2 only saves host memory
        assert plan.host.used_gib < level1.host.used_gib


def test_the_planned_vllm_version_defaults_to_the_calibration_and_is_recorded(tmp_path):
    from rlc.compiler.resolve import to_runtime_config

    result = check(tmp_path, DSV3, "refit.buffer_memory_ratio=0.45")
    assert result.ok, [(d.rule, d.message) for d in result.errors]
    assert result.plan.vllm_version == "0.17.1"
    runtime = to_runtime_config(result)
    assert runtime["generation"]["vllm_version"] == "0.17.1"
    assert runtime["training"]["use_precision_aware_optimizer"] is True


# ------------------------------------------------------------------ precision-aware optimizer


def test_precision_aware_optimizer_moves_the_fp32_masters_off_the_gpu_for_the_refit(tmp_path):
    aware = check(tmp_path, DSV3).plan
    plain = check(tmp_path, DSV3, "training.use_precision_aware_optimizer=false").plan
    assert "optimizer fp32 master" not in labels(aware.phases["refit"])
    master = plain.item_gib("refit", "optimizer fp32 master")
    assert master > 10
    assert aware.phases["refit"].free_gib == pytest.approx(plain.phases["refit"].free_gib + master, abs=0.01)
    # ... and they are in host memory instead
    assert aware.host.item_gib("optimizer fp32 master (offloaded)") > 0
    assert plain.host.item_gib("optimizer fp32 master (offloaded)") == 0


def test_precision_aware_optimizer_needs_the_distributed_optimizer(tmp_path):
    result = check(tmp_path, DSV3, "training.use_distributed_optimizer=false")
    assert "RLC312" in rules(result, "error")


# ------------------------------------------------------------------ host memory


def test_host_memory_at_sleep_level_1_is_checked_per_node(tmp_path):
    # GLM-4.5-Air on 16 GB200 (4 per node, 882 GiB host): sleep level 1 backs up 4 weight shards per node
    recipe = {
        "version": 1, "model": {"id": "zai-org/GLM-4.5-Air"},
        "cluster": {"nodes": 4, "gpus_per_node": 4, "gpu": "gb200-186gb"},
        "parallelism": {"train": {"tp": 1, "ep": 16}, "generation": {"tp": 2}},
        "generation": {"enforce_eager": True}, "data": {"train": "/data/train.jsonl"},
        "training": {"use_precision_aware_optimizer": True},
    }
    level1 = check(tmp_path, recipe)
    hits = [d for d in level1.diagnostics if d.rule == "RLC219"]
    assert hits and hits[0].severity == "error" and hits[0].path == "refit.sleep_level"
    assert "sleep_level: 2 frees" in hits[0].hint and "882 GiB" in hits[0].message
    assert "RLC219" not in rules(check(tmp_path, recipe, "refit.sleep_level=2"))
    # the nodes' real memory wins over the catalog's typical node
    assert "RLC219" not in rules(check(tmp_path, recipe, "cluster.host_memory_gib=1800"))


# ------------------------------------------------------------------ RLC305


def test_prompt_plus_max_tokens_above_max_model_len_is_not_an_error(tmp_path):
    recipe = {**DSV3, "generation": {"max_model_len": 1536, "sampling": {"max_tokens": 1536}}}
    result = check(tmp_path, recipe, "refit.buffer_memory_ratio=0.45")
    assert [d.severity for d in result.diagnostics if d.rule == "RLC305"] == ["info"]
    too_long = check(tmp_path, recipe, "data.max_prompt_length=2048", "refit.buffer_memory_ratio=0.45")
    errors = [d for d in too_long.diagnostics if d.rule == "RLC305" and d.severity == "error"]
    assert errors and "2048" in errors[0].message and "1536" in errors[0].message


# ------------------------------------------------------------------ missing facts, variants


def test_a_missing_model_fact_is_an_error_naming_the_key_to_set(tmp_path):
    # the Nemotron-3-Super catalog entry as it was before it stated tie_word_embeddings: the plan used to be
    # "unknown" with a warning and the recipe compiled; now nothing compiles on a fact no source states
    import json

    from rlc.compiler.catalog.models import MODELS_DIR

    entry = json.loads((MODELS_DIR / "nvidia__NVIDIA-Nemotron-3-Super-120B-A12B.json").read_text())
    del entry["tie_word_embeddings"]
    (tmp_path / "super.json").write_text(json.dumps(entry))
    recipe = {"version": 1, "model": {"id": "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B", "config": "super.json"},
              "cluster": {"nodes": 4, "gpus_per_node": 8, "gpu": "h100-80gb"},
              "parallelism": {"train": {"tp": 4, "pp": 2, "ep": 8, "sequence_parallel": True},
                              "generation": {"tp": 8}},
              "data": {"train": "/data/train.jsonl"}}
    result = check(tmp_path, recipe)
    errors = [d for d in result.diagnostics if d.rule == "RLC216"]
    assert errors and all(d.severity == "error" for d in errors) and not result.ok
    assert "tied_embeddings (tie_word_embeddings)" in errors[0].message and "local config" in errors[0].message
    assert "tie_word_embeddings: ..." in errors[0].hint and "model.overrides" in errors[0].hint
    fixed = check(tmp_path, {**recipe, "model": {**recipe["model"], "overrides": {"tie_word_embeddings": False}}})
    assert "RLC216" not in rules(fixed) and fixed.plan.refit is not None
    assert "RLC218" in rules(fixed, "info")  # the override is stated


def test_checkpoint_variants_resolve_to_their_base_entry(tmp_path):
    result = check(tmp_path, QWEN35_2619)
    assert result.facts.model_id == "Qwen/Qwen3.5-35B-A3B"
    infos = [d for d in result.diagnostics if d.rule == "RLC218"]
    assert infos and "checkpoint variant" in infos[0].message


# ------------------------------------------------------------------ residue growth over steps (NeMo-RL #2619)


def test_reported_residue_growth_catches_the_tp1_layout_and_names_the_fix(tmp_path):
    result = check(tmp_path, QWEN35_2619)
    hits = [d for d in result.diagnostics if d.rule == "RLC220"]
    # the growth was recorded on vLLM 0.20 (the recipe's): a step-2 OOM is an error like any other
    assert hits and hits[0].severity == "error" and hits[0].path == "parallelism.train.tp"
    assert "4.11 → 11.57 → 25" in hits[0].message and "logits" in hits[0].message
    assert hits[0].hint.startswith("parallelism.train.tp: 2 with sequence_parallel: true")
    assert result.plan.checks["train_fit"].ok  # step 1 fits: only the growth breaks it
    fixed = check(tmp_path, QWEN35_2619, "parallelism.train.tp=2", "parallelism.train.sequence_parallel=true")
    assert "RLC220" not in rules(fixed) and fixed.plan.checks["train_late_fit"].ok
    # the growth was reported for vLLM 0.20; the field-report version does not have it
    assert "train_late" not in check(tmp_path, QWEN35_2619, "generation.vllm_version=0.17.1").plan.phases
    # later versions get it as a projection, not a measurement: a warning that says so
    later = check(tmp_path, QWEN35_2619, "generation.vllm_version=0.26.0")
    [hit] = [d for d in later.diagnostics if d.rule == "RLC220"]
    assert hit.severity == "warning" and "projected onto 0.26.0" in hit.message
    assert later.plan.residue_growth_recorded is False and result.plan.residue_growth_recorded is True


# ------------------------------------------------------------------ engine options


def test_pass_through_blocks_cannot_set_what_rlc_sets(tmp_path):
    recipe = {**DSV3, "generation": {**DSV3["generation"],
                                     "vllm_kwargs": {"enable_prefix_caching": True, "gpu_memory_utilization": 0.9}},
              "training": {**DSV3["training"], "megatron_kwargs": {"apply_rope_fusion": False,
                                                                    "moe_token_dispatcher_type": "flex"}}}
    result = check(tmp_path, recipe, "refit.buffer_memory_ratio=0.45")
    errors = {d.path: d for d in result.diagnostics if d.rule == "RLC310"}
    assert set(errors) == {"generation.vllm_kwargs.gpu_memory_utilization",
                           "training.megatron_kwargs.moe_token_dispatcher_type"}
    assert (
        errors["training.megatron_kwargs.moe_token_dispatcher_type"].hint == "use training.moe.token_dispatcher instead"
    )


def test_an_option_rlc_fixes_itself_is_named_with_its_reason(tmp_path):
    recipe = {**DSV3, "training": {**DSV3["training"], "megatron_kwargs": {"gradient_accumulation_fusion": True}}}
    result = check(tmp_path, recipe, "refit.buffer_memory_ratio=0.45")
    [error] = [d for d in result.diagnostics if d.rule == "RLC310"]
    assert error.message == ("training.megatron_kwargs.gradient_accumulation_fusion is set by rlc (always off: the "
                             "fused weight-gradient accumulation needs APEX)")
    assert error.hint == "drop it: rlc sets this option itself"


def test_settings_the_runtime_cannot_run_warn_and_compile_refuses(tmp_path):
    from rlc.compiler.bundle import BundleError, build_bundle

    result = check(tmp_path, DSV3, "refit.buffer_memory_ratio=0.45", "parallelism.train.cp=2")
    assert result.ok and "RLC311" in rules(result, "warning")
    with pytest.raises(BundleError, match="parallelism.train.cp"):
        build_bundle(result, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


def test_the_shipped_growth_series_are_runtime_calibration_records():
    from rlc.contract.calibration_record import CalibrationRecord
    from rlc.compiler.planner.vllm_sleep import SLEEP_FILE, after_sleep_series

    path = SLEEP_FILE.with_name("residue_growth_nemo_rl_2619.jsonl")
    records = [CalibrationRecord.from_json(line) for line in path.read_text().splitlines()]
    assert after_sleep_series(records) == ((0, 4.11), (1, 11.57), (2, 25.0), (3, 25.0))
    growth = sleep_semantics("0.20.0").residue_growth
    assert growth is not None and growth.growth_gib == pytest.approx(20.89)
    assert sleep_semantics("0.17.1").residue_growth is None


def test_new_keys_are_strict_with_did_you_mean(tmp_path):
    recipe = {**DSV3, "training": {**DSV3["training"], "fp8": {"enabled": True, "recipie": "blockwise"}},
              "generation": {**DSV3["generation"], "vllm_verison": "0.22.0"}}
    result = check(tmp_path, recipe)
    messages = {d.path: d.message for d in result.diagnostics if d.severity == "error"}
    assert "did you mean 'recipe'" in messages["training.fp8.recipie"]
    assert "did you mean 'vllm_version'" in messages["generation.vllm_verison"]
    bad = check(tmp_path, {**DSV3, "generation": {**DSV3["generation"], "vllm_version": "latest"}})
    assert any(d.path == "generation.vllm_version" for d in bad.errors)


def test_fragmentation_scales_with_the_largest_tensor():
    from rlc.compiler.planner.calibration import calibration_for

    cal = calibration_for("h100-80gb")
    x0, y0 = cal.fragmentation_points[0]
    assert cal.fragmentation_tensor_gib == 8.0
    assert cal.fragmentation_gib(x0, 8.0) == pytest.approx(y0)  # the seed's own 8 GiB tensor: as measured
    assert cal.fragmentation_gib(x0, 1.73) == pytest.approx(y0 * 1.73 / 8.0)  # a DeepSeek-V3 embedding


# ------------------------------------------------------------------ FP8 generation


def test_fp8_generation_keeps_the_embedding_and_lm_head_in_bf16(tmp_path):
    """vLLM's FP8 quantizes the linear layers only: Llama-3.1-8B (untied, vocab 128256 x hidden 4096) keeps
    2 x 0.53 B embedding / lm_head parameters at 2 bytes, the rest at 1 byte."""
    recipe = yaml.safe_load((Path(__file__).parents[1] / "validation" / "failures" /
                             "nemo-rl-pr3280-llama3.1-8b-vllm-0.25.yaml").read_text(encoding="utf-8"))
    fp8 = check(tmp_path, recipe).plan
    bf16 = check(tmp_path, recipe, "generation.precision=auto").plan
    vocab = 2 * 128256 * 4096
    params = bf16.vllm_weights_gib * (1 << 30) / 2
    assert fp8.vllm_weights_gib * (1 << 30) == pytest.approx((params - vocab) + 2 * vocab, rel=1e-9)
    assert 8.4 < fp8.vllm_weights_gib < 8.5 < bf16.vllm_weights_gib / 1.7  # 7.48 GiB if all were 1 byte


# ------------------------------------------------------------------ FP8 training


def _fp8_training(tmp_path: Path, *sets: str) -> dict[str, dict[str, float]]:
    recipe = yaml.safe_load(
        (Path(__file__).parents[2] / "recipes" / "tiny-qwen3-1gpu.yaml").read_text(encoding="utf-8"))
    recipe["model"] = {"id": "Qwen/Qwen3-0.6B", "dtype": "bfloat16"}
    plan = check(tmp_path, recipe, *sets).plan
    return {name: {i.label: i.gib for i in phase.items} for name, phase in plan.phases.items()}


def test_fp8_training_counts_the_weight_copies_transformer_engine_keeps(tmp_path):
    """Measured on an H200 (Qwen3-0.6B, blockwise): an FP8 train step holds 0.86 GiB more than the bf16 one. The
    plan counts 2 bytes per linear-layer parameter (its FP8 copy and that of its transpose; 0.44 B parameters
    outside the tied 151,936 x 1,024 embedding), in every phase the trainer is on the GPU, and nothing with
    param_gather (the FP8 weights are the parameters)."""
    from rlc.compiler.planner.parts import FP8_WEIGHTS_LABEL

    bf16 = _fp8_training(tmp_path)
    fp8 = _fp8_training(tmp_path, "training.fp8.enabled=true", "training.fp8.recipe=blockwise")
    gathered = _fp8_training(tmp_path, "training.fp8.enabled=true", "training.fp8.param_gather=true")
    params = bf16["train"]["Megatron params"] * (1 << 30) / 2
    linear = params - 151936 * 1024
    assert fp8["train"][FP8_WEIGHTS_LABEL] * (1 << 30) == pytest.approx(2 * linear, rel=1e-9)
    assert 0.80 < fp8["train"][FP8_WEIGHTS_LABEL] < 0.86
    for phase in ("train", "refit", "generate"):
        assert fp8[phase][FP8_WEIGHTS_LABEL] == fp8["train"][FP8_WEIGHTS_LABEL], phase
        assert FP8_WEIGHTS_LABEL not in bf16[phase] and FP8_WEIGHTS_LABEL not in gathered[phase]
    assert sum(fp8["train"].values()) == pytest.approx(sum(bf16["train"].values()) + fp8["train"][FP8_WEIGHTS_LABEL])


def test_a_tight_refit_is_not_told_that_sleep_level_2_frees_the_shard(tmp_path):
    """The refit wakes the weights at either sleep level, so with little margin (eager on, ratio 0.22)
    the plan offers other levers and RLC213 stays silent (it used to promise the 40.9 GiB TP32 shard)."""
    result = check(tmp_path, DSV3, "generation.enforce_eager=true", "refit.buffer_memory_ratio=0.22")
    plan = result.plan
    assert plan.refit.tolerance_gib < plan.graph_uncertainty_gib  # tight: the fixes were computed
    assert plan.fixes and all(f.key != "refit.sleep_level" for f in plan.fixes)
    assert "RLC213" not in rules(result)
