"""FP8 rollouts and FP8 training from the recipe to what the runtime starts: the new keys through schema, typed
recipe, runtime.yaml and the vLLM / Megatron arguments; the compile-time checks (block alignment per vLLM
rank, the recipe a GPU runs); the refit math with quantized weights on the wire."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rlc.compiler import api
from rlc.compiler.catalog.models import model_facts
from rlc.compiler.resolve import to_runtime_config
from rlc.compiler.rules.fp8_rules import block_alignment_problems
from rlc.compiler.runtime_support import runtime_gaps
from rlc.contract.fp8 import ROUTER_IGNORE_REGEX
from rlc.contract.runtime_config import runtime_config_from_dict
from rlc.runtime.generation.engine_args import engine_kwargs
from rlc.runtime.policy.provider_options import apply_provider_settings, ddp_settings

RECIPES = Path(__file__).resolve().parents[2] / "rlc" / "recipes"
TINY = str(RECIPES / "tiny-qwen3-1gpu.yaml")


def check(*sets: str, recipe: str = TINY) -> api.CheckResult:
    return api.check(recipe, list(sets))


def errors(result: api.CheckResult, rule: str) -> list[str]:
    return [d.message for d in result.diagnostics if d.rule == rule and d.severity == "error"]


def runtime(*sets: str, recipe: str = TINY):
    result = check(*sets, recipe=recipe)
    assert result.ok, [(d.rule, d.message) for d in result.errors]
    return runtime_config_from_dict(to_runtime_config(result))


def facts(model_id: str):
    got = model_facts(model_id, Path("."))
    return got[0] if isinstance(got, tuple) else got


# ------------------------------------------------------------------ keys end to end


def test_fp8_rollouts_compile_and_reach_vllm_with_tensor_scales():
    cfg = runtime("generation.precision=fp8", "generation.fp8.scales=tensor")
    assert (cfg.generation.precision, cfg.generation.fp8.scales, cfg.generation.fp8.pow2_scales) == (
        "fp8",
        "tensor",
        False,
    )
    kw = engine_kwargs(cfg, 0, distributed=False)
    assert kw["quantization"] == "fp8_per_tensor"
    assert kw["quantization_config"] == {"ignore": [ROUTER_IGNORE_REGEX]}
    assert "load_format" not in kw and "hf_overrides" not in kw
    assert "quantization" not in engine_kwargs(runtime(), 0, distributed=False)  # bf16 rollouts: nothing


def test_block_scales_start_a_deepseek_style_fp8_engine_from_random_weights(tmp_path):
    recipe = aligned_tiny(tmp_path)
    cfg = runtime("generation.precision=fp8", "generation.fp8.pow2_scales=true", recipe=recipe)
    assert (cfg.generation.fp8.scales, cfg.generation.fp8.pow2_scales) == ("block", True)
    kw = engine_kwargs(cfg, 0, distributed=False)
    qc = kw["hf_overrides"]["quantization_config"]
    assert kw["quantization"] == "fp8" and kw["load_format"] == "dummy"
    assert (
        qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128] and qc["activation_scheme"] == "dynamic"
    )
    assert qc["ignored_layers"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    merged = dataclasses.replace(cfg, generation=dataclasses.replace(
        cfg.generation, vllm_kwargs={"hf_overrides": {"rope_theta": 5.0}}))
    kw = engine_kwargs(merged, 0, distributed=False)
    assert kw["hf_overrides"]["rope_theta"] == 5.0 and "quantization_config" in kw["hf_overrides"]
    for bad in ({"load_format": "auto"}, {"hf_overrides": {"quantization_config": {}}}):
        edited = dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, vllm_kwargs=bad))
        with pytest.raises(ValueError, match="FP8 engine"):
            engine_kwargs(edited, 0, distributed=False)


def aligned_tiny(tmp_path: Path) -> str:
    """The tiny recipe on a tiny Qwen3 whose k/v projections are a block tall (head_dim 64)."""
    cfg = json.loads((RECIPES / "models" / "tiny-qwen3" / "config.json").read_text(encoding="utf-8"))
    cfg["head_dim"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    recipe = yaml.safe_load(Path(TINY).read_text(encoding="utf-8"))
    recipe["model"]["config"] = str(tmp_path / "config.json")
    path = tmp_path / "tiny-aligned.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return str(path)


def test_fp8_rollouts_and_fp8_param_gather_are_no_longer_runtime_gaps(tmp_path):
    result = check("generation.precision=fp8", "generation.fp8.scales=tensor", "training.fp8.enabled=true",
                   "training.fp8.param_gather=true")
    assert result.ok and "RLC311" not in [d.rule for d in result.diagnostics]
    assert runtime_gaps(result.recipe) == []
    from rlc.compiler.bundle import build_bundle

    build_bundle(result, tmp_path / "bundle")
    written = yaml.safe_load((tmp_path / "bundle" / "runtime.yaml").read_text(encoding="utf-8"))
    assert written["generation"]["fp8"] == {"scales": "tensor", "pow2_scales": False, "keep_bf16": []}
    assert written["training"]["fp8"]["param_gather"] is True


def test_fp8_training_sets_megatron_fields_and_fp8_param_gather_in_ddp():
    cfg = runtime("training.fp8.enabled=true", "training.fp8.format=hybrid", "training.fp8.recipe=tensorwise",
                  "training.fp8.param_gather=true")
    provider = SimpleNamespace()
    apply_provider_settings(provider, cfg)
    assert (provider.fp8, provider.fp8_recipe, provider.fp8_param) == ("hybrid", "tensorwise", True)
    assert ddp_settings(cfg) == {"fp8_param_gather": True}
    off = runtime("training.fp8.param_gather=true")  # FP8 off: nothing gathers in FP8
    assert ddp_settings(off) == {"fp8_param_gather": False} and "fp8" not in apply_provider_settings(
        SimpleNamespace(), off)


# ------------------------------------------------------------------ compile-time checks


def test_block_scales_refuse_the_tiny_models_64_row_k_projection_and_name_the_fix():
    result = check("generation.precision=fp8", "generation.fp8.scales=block")
    [message] = errors(result, "RLC330")
    assert "k_proj rows per vLLM rank (fused q/k/v, TP 1) = 64" in message
    [diag] = [d for d in result.diagnostics if d.rule == "RLC330"]
    assert diag.path == "generation.fp8.scales" and "scales: tensor" in diag.hint


def test_auto_scales_take_block_where_the_layout_allows_and_say_why_not_elsewhere(tmp_path):
    tiny = check("generation.precision=fp8")
    assert tiny.ok and [d.severity for d in tiny.diagnostics if d.rule == "RLC330"] == ["info"]
    cfg = runtime("generation.precision=fp8")
    assert cfg.generation.fp8.scales == "tensor" and "k_proj rows" in cfg.refit.decisions["fp8_scales"]
    aligned = runtime("generation.precision=fp8", recipe=aligned_tiny(tmp_path))
    assert aligned.generation.fp8.scales == "block" and "128-aligned" in aligned.refit.decisions["fp8_scales"]
    assert "fp8_scales" not in runtime().refit.decisions  # bf16 rollouts: nothing decided
    assert runtime().generation.fp8.scales in ("block", "tensor")  # the runtime never sees auto


@pytest.mark.parametrize(("model", "tp", "ep", "bad"), [
    ("Qwen/Qwen3-8B", 1, 1, []),
    ("Qwen/Qwen3-8B", 8, 1, ["k_proj", "v_proj"]),  # 8 KV heads x 128 over TP 8: one head, 128 rows: fine...
    ("Qwen/Qwen3-30B-A3B", 2, 1, []),
    ("Qwen/Qwen3-30B-A3B", 4, 1, ["expert intermediate width per vLLM rank (TP 4) = 192"]),
    ("Qwen/Qwen3-30B-A3B", 4, 4, []),
    ("deepseek-ai/DeepSeek-V3", 16, 16, []),
    ("deepseek-ai/DeepSeek-V3", 32, 32, ["MLP gate_proj rows per vLLM rank (fused gate/up, TP 32) = 576",
                                         "MLP down_proj columns per vLLM rank (TP 32) = 576",
                                         "shared expert gate_proj rows per vLLM rank (fused gate/up, TP 32) = 64",
                                         "shared expert down_proj columns per vLLM rank (TP 32) = 64"]),
    ("Qwen/Qwen3.5-35B-A3B", 1, 1, ["linear_attention layers", "stacked tensor"]),
])
def test_block_alignment_follows_vllms_own_conditions(model, tp, ep, bad):
    got = block_alignment_problems(facts(model), tp, ep)
    if model == "Qwen/Qwen3-8B" and tp == 8:
        assert got == []  # ...one replicated-split KV head of 128 rows per rank
        return
    assert len(got) == len(bad) and all(any(b in g for g in got) for b in bad), got


def test_pow2_scales_need_block_scales_and_fp8_settings_without_fp8_rollouts_are_named():
    assert errors(check("generation.precision=fp8", "generation.fp8.scales=tensor",
                        "generation.fp8.pow2_scales=true"), "RLC330")
    info = [d for d in check("generation.fp8.scales=tensor").diagnostics if d.rule == "RLC330"]
    assert [d.severity for d in info] == ["info"] and "no effect" in info[0].message


def test_a_pass_through_load_format_contradicts_block_scales(tmp_path):
    result = check("generation.precision=fp8", "generation.vllm_kwargs.load_format=auto", recipe=aligned_tiny(tmp_path))
    assert any("generation.vllm_kwargs.load_format" in m for m in errors(result, "RLC330"))
    owned = check("generation.precision=fp8", "generation.vllm_kwargs.quantization_config={}")
    assert any(d.rule == "RLC310" and "generation.fp8" in d.message for d in owned.errors)


@pytest.mark.parametrize(("gpu", "recipe", "ok"), [
    ("h200-141gb", "blockwise", True), ("h200-141gb", "tensorwise", True), ("h200-141gb", "mxfp8", False),
    ("b200-180gb", "mxfp8", True), ("l40s-48gb", "tensorwise", True), ("l40s-48gb", "blockwise", False),
    ("a100-80gb", "delayed", False),
])
def test_fp8_training_recipe_must_run_on_the_cluster_gpu(gpu, recipe, ok):
    result = check(f"cluster.gpu={gpu}", "training.fp8.enabled=true", f"training.fp8.recipe={recipe}")
    got = errors(result, "RLC331")
    assert (not got) == ok, got
    if recipe == "mxfp8" and not ok:
        assert "needs a Blackwell GPU" in got[0] and "Hopper" in got[0]


# ------------------------------------------------------------------ the refit math with FP8 on the wire


def test_fp8_plans_hold_the_largest_wire_tensor_and_the_reload_copies(tmp_path):
    recipe = aligned_tiny(tmp_path)
    bf16 = check(recipe=recipe).plan.refit
    fp8 = check("generation.precision=fp8", recipe=recipe).plan
    r = fp8.refit
    # the tiny model's largest export is gate_proj (384 x 128 bf16, its vocabulary is 23): on the wire it is one
    # byte per weight plus 3 x 1 fp32 block scales
    assert (r.largest_name, r.largest) == ("model.layers.0.mlp.gate_proj.weight", 384 * 128 * 2)
    assert (r.wire_largest_name, r.wire_largest) == ("model.layers.0.mlp.gate_proj.weight", 384 * 128 + 3 * 4)
    assert r.buffer_margin == r.per_side - r.wire_largest
    tensor = check("generation.precision=fp8", "generation.fp8.scales=tensor", recipe=recipe).plan.refit
    assert tensor.wire_largest == tensor.largest  # vLLM quantizes: the wire carries bf16
    assert r.reload_copies == 2 * r.per_side
    assert r.free_at_stack == pytest.approx(bf16.free_at_stack - 2 * r.per_side, abs=2 << 20)
    assert "vLLM FP8 reload: bucket copies" in [i.label for i in fp8.phases["stack"].items]
    assert "largest on wire" in fp8.to_text()
    assert (
        "wire_largest" in fp8.to_json()["refit"] and "wire_largest" not in check(recipe=recipe).plan.to_json()["refit"]
    )


# ------------------------------------------------------------------ layers kept in the model dtype


def test_kept_layers_stay_bf16_on_the_wire_in_vllms_weights_and_engine_arguments(tmp_path):
    from rlc.compiler.planner.memory import vllm_weights

    recipe = aligned_tiny(tmp_path)
    plain_check = check("generation.precision=fp8", recipe=recipe)
    kept_check = check("generation.precision=fp8", "generation.fp8.keep_bf16=[mlp]", recipe=recipe)
    plain, kept = plain_check.plan, kept_check.plan
    # the largest tensor on the wire is gate_proj, now sent as it is
    assert (kept.refit.wire_largest_name, kept.refit.wire_largest) == ("model.layers.0.mlp.gate_proj.weight",
                                                                      384 * 128 * 2)
    assert plain.refit.wire_largest == 384 * 128 + 3 * 4

    # per layer the MLP's 3 x 384 x 128 weights are kept in bf16 (one more byte each) beside the attention's
    # q/k/v/o (head_dim 64: 256 + 128 + 128 rows and 256 columns of 128)
    mlp = 2 * 3 * 384 * 128
    got = vllm_weights(kept_check.recipe, kept_check.facts)[0].shard - vllm_weights(plain_check.recipe,
                                                                                   plain_check.facts)[0].shard
    assert mlp <= got <= 1.01 * mlp  # the share is applied to the shard's linear weights, norms included
    cfg = runtime("generation.precision=fp8", "generation.fp8.keep_bf16=[mlp]", recipe=recipe)
    assert cfg.generation.fp8.keep_bf16 == ["mlp"]
    tensor = runtime("generation.precision=fp8", "generation.fp8.scales=tensor",
                     "generation.fp8.keep_bf16=[mlp, o_proj]")
    assert engine_kwargs(tensor, 0, distributed=False)["quantization_config"]["ignore"] == [
        ROUTER_IGNORE_REGEX, r"re:.*mlp.*", r"re:.*o_proj.*"]


def test_block_scales_fit_once_the_misaligned_or_unquantized_layers_are_kept():
    qwen35 = facts("Qwen/Qwen3.5-35B-A3B")
    assert any("linear_attention" in p for p in block_alignment_problems(qwen35, 1, 1))
    # NeMo-RL's Qwen3.5 list keeps part of the linear attention: the rest would still be FP8 in vLLM
    partial = ("linear_attn.conv1d", "linear_attn.in_proj_a", "linear_attn.in_proj_b", "visual")
    assert any("linear_attention" in p for p in block_alignment_problems(qwen35, 1, 1, partial))
    whole = block_alignment_problems(qwen35, 1, 1, ("linear_attn", "experts"))
    assert not any("linear_attention" in p or "stacked" in p for p in whole), whole
    # the tiny model's 64-row k_proj stops block scales unless the attention is kept
    tiny = check("generation.precision=fp8", "generation.fp8.scales=block")
    assert errors(tiny, "RLC330")
    kept = check("generation.precision=fp8", "generation.fp8.scales=block",
                 "generation.fp8.keep_bf16=[q_proj, k_proj, v_proj, o_proj]")
    assert not errors(kept, "RLC330"), [d.message for d in kept.errors]


def test_kept_share_counts_whole_components_by_checkpoint_names():
    from rlc.compiler.planner.fp8_keep import component_fully_kept, component_kept

    assert component_kept("mla", ("a_proj", "b_proj")) and not component_fully_kept("mla", ("a_proj", "b_proj"))
    assert component_fully_kept("attention", ("self_attn",)) and component_fully_kept("routed_experts", ("experts",))
    assert not component_kept("dense_mlp", ("visual",)) and not component_kept("attention", ())
    # a fragment naming one layer counts that component as kept (memory) but exempts nothing from the alignment
    assert component_kept("dense_mlp", ("layers.0.",)) and not component_fully_kept("dense_mlp", ("layers.0.",))


def test_block_scales_name_the_kept_modules_as_the_checkpoint_does(tmp_path):
    pytest.importorskip("transformers")
    recipe = aligned_tiny(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    config = {k: v for k, v in json.loads((tmp_path / "config.json").read_text(encoding="utf-8")).items()
              if not k.startswith("_")}
    (ckpt / "config.json").write_text(json.dumps(config), encoding="utf-8")
    cfg = runtime("generation.precision=fp8", "generation.fp8.keep_bf16=[mlp.down_proj, self_attn]",
                  f"model.checkpoint={ckpt}", recipe=recipe)
    ignored = engine_kwargs(cfg, 0, distributed=False)["hf_overrides"]["quantization_config"]["ignored_layers"]
    kept = [name for name in ignored if not name.endswith(".mlp.gate")]  # the routers' names come first
    assert kept == sorted(f"model.layers.{i}.{m}" for i in range(2) for m in (
        "mlp.down_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "self_attn.q_norm", "self_attn.k_norm"))
