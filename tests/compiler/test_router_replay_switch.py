"""training.router_replay end to end on CPU: schema → typed recipe → rules (RLC320, RLC311, RLC310) → plan →
runtime.yaml → the runtime config the workers read → vLLM's engine arguments and Megatron's provider settings;
and ``rlc import nemo-rl`` of NeMo-RL's ``policy.router_replay``."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rlc.compiler import api
from rlc.compiler.bundle.build import BundleError, build_bundle
from rlc.compiler.importers.nemo_rl import import_nemo_rl
from rlc.compiler.resolve import to_runtime_config
from rlc.compiler.rules import explain
from rlc.contract.runtime_config import load_runtime_config, runtime_config_from_dict
from rlc.runtime.generation.engine_args import engine_kwargs
from rlc.runtime.policy.provider_options import apply_provider_settings

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "rlc" / "recipes"
TINY_MOE = RECIPES / "tiny-moe-mtp-2gpu-ep2.yaml"
TINY_DENSE = RECIPES / "tiny-qwen3-1gpu.yaml"
QWEN35 = RECIPES / "qwen35-397b-grpo-32xh100.yaml"
ON = "training.router_replay.enabled=true"
KEY = "training.router_replay.enabled"
ONE_GPU = ("cluster.gpus_per_node=1", "parallelism.train.ep=1", "parallelism.generation.ep=1",
           "generation.speculative_decoding.method=mtp", "generation.speculative_decoding.num_speculative_tokens=1",
           "refit.sleep_level=1", "training.mtp_loss_scale=0")
NEMO_RL_CHILD = ROOT / "tests/importers/nemo_rl_configs/recipes/llm/grpo-qwen3-30ba3b-2n8g-megatron.yaml"


def check(path, *sets):
    return api.check(str(path), list(sets))


def found(result, rule):
    return [(d.severity, d.path, d.message, d.hint) for d in result.diagnostics if d.rule == rule]


def test_off_by_default_and_on_reaches_the_runtime_config_vllm_and_megatron(tmp_path):
    off = check(TINY_MOE, *ONE_GPU)
    assert off.ok and off.recipe.training.router_replay.enabled is False
    cfg_off = runtime_config_from_dict(to_runtime_config(off))
    assert "enable_return_routed_experts" not in engine_kwargs(cfg_off, 0, distributed=False)
    on = check(TINY_MOE, *ONE_GPU, ON)
    assert on.ok, [(d.rule, d.message) for d in on.errors]
    bundle = build_bundle(on, tmp_path / "bundle").path
    written = yaml.safe_load((bundle / "runtime.yaml").read_text(encoding="utf-8"))
    assert written["training"]["router_replay"] == {"enabled": True}
    cfg = load_runtime_config(bundle / "runtime.yaml")  # what the workers read
    assert cfg.training.router_replay.enabled is True and cfg.model.num_experts == 8
    assert engine_kwargs(cfg, 0, distributed=False)["enable_return_routed_experts"] is True
    provider = SimpleNamespace()
    apply_provider_settings(provider, cfg)
    assert provider.moe_enable_routing_replay is True
    provider_off = SimpleNamespace()
    apply_provider_settings(provider_off, cfg_off)
    assert not hasattr(provider_off, "moe_enable_routing_replay")


def test_a_dense_model_is_refused_naming_the_key_and_the_fix():
    result = check(TINY_DENSE, ON)
    assert found(result, "RLC320") == [("error", KEY, "routing replay on rlc/tiny-qwen3, a dense model: it has no "
                                        "routed experts to replay", f"{KEY}: false")]
    assert not result.ok


def test_a_hand_edited_runtime_config_on_a_dense_model_stops_the_trainer():
    cfg = runtime_config_from_dict(to_runtime_config(check(TINY_DENSE)))
    edited = runtime_config_from_dict({**to_runtime_config(check(TINY_DENSE)),
                                       "training": {**to_runtime_config(check(TINY_DENSE))["training"],
                                                    "router_replay": {"enabled": True}}})
    apply_provider_settings(SimpleNamespace(), cfg)
    with pytest.raises(ValueError, match="no routed experts"):
        apply_provider_settings(SimpleNamespace(), edited)


@pytest.mark.parametrize("sets,path,words", [
    (("parallelism.generation.pp=2", "parallelism.generation.tp=1", "cluster.gpus_per_node=2"),
     "parallelism.generation.pp", "only without pipeline parallelism"),
    (("generation.vllm_version=0.21.0",), "generation.vllm_version", "vLLM 0.21.0"),
    (("training.megatron_kwargs.moe_router_fusion=true",), "training.megatron_kwargs.moe_router_fusion",
     "fused top-k"),
])
def test_what_the_stack_cannot_do_is_an_error_at_the_key_to_change(sets, path, words):
    result = check(TINY_MOE, ON, *sets)
    errors = [f for f in found(result, "RLC320") if f[0] == "error"]
    assert [e[1] for e in errors] == [path], found(result, "RLC320")
    assert words in errors[0][2]
    assert not [f for f in found(check(TINY_MOE, *sets), "RLC320")]  # the same layout without replay: quiet


def test_mtp_drafting_is_refused_where_vllms_drafter_shares_the_decoders_layer_ids():
    deepseek = check(TINY_MOE, *ONE_GPU, ON)  # deepseek_mtp.py numbers its layers after the decoder's
    assert found(deepseek, "RLC320") == []
    qwen = check(QWEN35, ON, "generation.vllm_version=0.22.0", "generation.speculative_decoding.method=mtp",
                 "generation.speculative_decoding.num_speculative_tokens=1", "refit.sleep_level=1")
    [(severity, path, message, hint)] = found(qwen, "RLC320")
    assert (severity, path) == ("error", "generation.speculative_decoding.method")
    assert "qwen3_5_moe" in message and "numbers its layers from 0" in message


def test_virtual_pipeline_stages_validate_and_are_not_compiled(tmp_path):
    result = check(TINY_MOE, ON, "parallelism.train.pp=2", "parallelism.train.vpp=2", "parallelism.train.ep=1")
    gaps = [f for f in found(result, "RLC311") if f[1] == KEY]
    assert gaps and "vpp > 1" in gaps[0][2] and result.ok
    with pytest.raises(BundleError, match="the bundled runtime cannot run this yet"):
        build_bundle(result, tmp_path / "bundle")


def test_packed_micro_batches_with_context_parallelism_compile_and_plan_per_packed_micro_batch(tmp_path):
    """Production R3 configurations pack (NeMo-RL's R3 recipes: CP 2, sequence packing)."""
    result = check(TINY_MOE, ON, "parallelism.train.cp=2", "parallelism.train.ep=1", "cluster.gpus_per_node=2",
                   "training.sequence_packing.enabled=true", "training.sequence_packing.train_mb_tokens=4096")
    assert result.ok and not [f for f in found(result, "RLC311") if f[1] == KEY]
    cfg = load_runtime_config(build_bundle(result, tmp_path / "bundle").path / "runtime.yaml")
    assert cfg.training.router_replay.enabled and cfg.training.sequence_packing.enabled
    [gpu] = [i for i in result.plan.phases["train"].items if i.label == "routing replay indices"]
    # 4096 packed tokens, half on each CP rank: x 3 MoE layers x 2 experts x (int64 + 1 byte)
    assert gpu.gib == pytest.approx(2048 * 3 * 2 * 9 / 2**30) and "4096 packed tokens / CP2" in gpu.note


def test_the_engine_options_it_owns_are_refused_in_the_pass_through_blocks():
    result = check(TINY_MOE, "generation.vllm_kwargs.enable_return_routed_experts=true",
                   "training.megatron_kwargs.moe_enable_routing_replay=true")
    assert {(f[1], f[3]) for f in found(result, "RLC310")} == {
        ("generation.vllm_kwargs.enable_return_routed_experts", f"use {KEY} instead"),
        ("training.megatron_kwargs.moe_enable_routing_replay", f"use {KEY} instead")}


def test_the_plan_counts_the_routes_on_the_host_and_per_micro_batch_on_the_gpu():
    off = check(TINY_MOE, *ONE_GPU).plan
    on = check(TINY_MOE, *ONE_GPU, ON).plan
    label = "routing replay routes (rollout batch)"
    assert off.host.item_gib(label) == 0.0
    # 128 prompts x 16 samples x 64 tokens x 3 MoE layers x 2 experts x 1 byte; the worst phase holds the driver's
    # 2 copies, and the train phase 2 + the object store's + 1 trainer process's
    batch = 2048 * 64 * 3 * 2 / 2**30
    assert on.host.item_gib(label) == pytest.approx(batch * (4 if on.host.phase == "train" else 2))
    assert on.host.used_gib - off.host.used_gib >= 2 * batch - 1e-9
    gpu = [i for i in on.phases["train"].items if i.label == "routing replay indices"]
    # micro batch 256 x 64 tokens x 3 layers x 2 experts: int64 indices + the 1-byte routes they came from
    assert len(gpu) == 1 and gpu[0].gib == pytest.approx(256 * 64 * 3 * 2 * 9 / 2**30)
    assert not [i for i in off.phases["train"].items if i.label == "routing replay indices"]


def test_recompute_keeps_a_micro_batch_per_pipeline_stage_in_flight():
    plain = check(TINY_MOE, ON, "parallelism.train.pp=2", "parallelism.train.ep=1").plan
    full = check(TINY_MOE, ON, "parallelism.train.pp=2", "parallelism.train.ep=1",
                 "training.activation_checkpointing=full").plan

    def gpu(plan):
        return next(i.gib for i in plan.phases["train"].items if i.label == "routing replay indices")

    # PP 2 puts 2 of the 4 decoder layers on a stage: at most 2 MoE layers there
    assert gpu(plain) == pytest.approx(256 * 64 * 2 * 2 * 9 / 2**30)
    assert gpu(full) == pytest.approx(256 * 64 * 2 * 2 * (8 * 2 + 1) / 2**30)


def test_explain_names_the_sources():
    text = explain("RLC320")
    assert "vLLM PR #28284" in text and "NeMo-RL PR #2590" in text and "training.router_replay.enabled" in text


def test_nemo_rl_router_replay_maps_to_the_typed_key():
    imported = import_nemo_rl(str(NEMO_RL_CHILD), ["++policy.router_replay.enabled=true"])
    got = {v.target: v.value for v in imported.mapping.values}
    assert got[KEY] is True
    assert imported.data["training"]["router_replay"] == {"enabled": True}
    off = import_nemo_rl(str(NEMO_RL_CHILD), ["++policy.router_replay.enabled=false"])
    assert {v.target: v.value for v in off.mapping.values}[KEY] is False
    assert not any(u.key.startswith("policy.router_replay") for u in imported.mapping.unmapped)
