"""runtime.yaml's engine options reach vLLM and Megatron as recorded: typed keys, then the pass-through blocks."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlc.compiler import api
from rlc.compiler.resolve import to_runtime_config
from rlc.contract.runtime_config import runtime_config_from_dict
from rlc.runtime.generation.engine_args import check_vllm_version, engine_kwargs
from rlc.runtime.generation.sampling import sampling_kwargs
from rlc.runtime.policy.provider_options import apply_provider_settings, optimizer_settings

RECIPES = Path(__file__).resolve().parents[2] / "rlc" / "recipes"


def runtime(recipe: str, *sets: str):
    result = api.check(str(RECIPES / recipe), list(sets))
    assert result.ok, [(d.rule, d.message) for d in result.errors]
    return runtime_config_from_dict(to_runtime_config(result))


def test_vllm_gets_the_typed_settings_then_the_pass_through_block():
    cfg = runtime("tiny-qwen3-1gpu.yaml", "generation.kv_cache_memory_bytes=1073741824",
                  "generation.vllm_kwargs.enable_prefix_caching=true", "generation.vllm_kwargs.max_num_seqs=64")
    kw = engine_kwargs(cfg, 0, distributed=False)
    assert (
        kw["kv_cache_memory_bytes"] == 1 << 30 and kw["gpu_memory_utilization"] == cfg.generation.gpu_memory_utilization
    )
    assert kw["enable_prefix_caching"] is True and kw["max_num_seqs"] == 64
    assert kw["enable_sleep_mode"] is True and "distributed_executor_backend" not in kw


def test_a_hand_edited_pass_through_cannot_replace_a_typed_setting():
    cfg = runtime("tiny-qwen3-1gpu.yaml")
    edited = dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation,
                                                                     vllm_kwargs={"max_model_len": 10}))
    with pytest.raises(ValueError, match="max_model_len"):
        engine_kwargs(edited, 0, distributed=False)
    fp8 = dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, precision="fp8",
                                                                  vllm_kwargs={"quantization": "fp8"}))
    with pytest.raises(ValueError, match="quantization from generation.precision"):
        engine_kwargs(fp8, 0, distributed=False)


def test_installed_vllm_other_than_planned_is_reported():
    assert check_vllm_version("0.22.0", "0.22.1+cu130") is None
    assert "0.17.1" in check_vllm_version("0.17.1", "0.22.0")


def test_stop_token_ids_join_the_eos():
    cfg = runtime("tiny-qwen3-1gpu.yaml", "generation.sampling.stop_token_ids=[7, 2]")
    assert sampling_kwargs(cfg.generation.sampling, 4, eos_token_id=2)["stop_token_ids"] == [2, 7]


def test_megatron_provider_gets_fp8_moe_and_the_pass_through_block():
    cfg = runtime("tiny-moe-mtp-4gpu.yaml", "training.fp8.enabled=true", "training.moe.token_dispatcher=flex",
                  "training.moe.deepep=true", "training.megatron_kwargs.apply_rope_fusion=false",
                  "training.use_precision_aware_optimizer=true")
    provider = SimpleNamespace(apply_rope_fusion=True)
    applied = apply_provider_settings(provider, cfg)
    assert (provider.fp8, provider.fp8_recipe, provider.fp8_param) == ("e4m3", "blockwise", False)
    assert (provider.moe_token_dispatcher_type, provider.moe_enable_deepep) == ("flex", True)
    assert provider.apply_rope_fusion is False and applied["apply_rope_fusion"] is False
    assert optimizer_settings(cfg) == {"use_precision_aware_optimizer": True}
    typo = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                 megatron_kwargs={"apply_rope_fusio": False}))
    with pytest.raises(ValueError, match="no such option"):
        apply_provider_settings(SimpleNamespace(), typo)


def test_mtp_loss_is_the_recipes_choice_and_off_by_default():
    """Megatron's default (0.1) would mix a cross-entropy on the rollouts into the policy gradient."""
    default = runtime("tiny-moe-mtp-2gpu-pp2.yaml")
    provider = SimpleNamespace(mtp_loss_scaling_factor=0.1)  # Megatron's own default
    apply_provider_settings(provider, default)
    assert default.training.mtp_loss_scale == 0.0 and provider.mtp_loss_scaling_factor == 0.0
    chosen = runtime("tiny-moe-mtp-2gpu-pp2.yaml", "training.mtp_loss_scale=0.1")
    apply_provider_settings(provider, chosen)
    assert provider.mtp_loss_scaling_factor == 0.1
    dense = SimpleNamespace()
    apply_provider_settings(dense, runtime("tiny-qwen3-1gpu.yaml"))  # no MTP layers: nothing set
    assert not hasattr(dense, "mtp_loss_scaling_factor")
    with pytest.raises(AssertionError, match="mtp_loss_scale"):
        runtime("tiny-moe-mtp-2gpu-pp2.yaml", "training.megatron_kwargs.mtp_loss_scaling_factor=0.1")


SPEC = "generation.speculative_decoding"


def test_speculative_decoding_reaches_vllm_as_its_speculative_config():
    """mtp: vLLM's generic method (the drafter is the checkpoint's MTP module); ngram: with its n-gram window
    (the schema's defaults); off: no speculative_config at all."""
    mtp = runtime("tiny-moe-mtp-2gpu-pp2.yaml", "refit.sleep_level=1", f"{SPEC}.method=mtp",
                  f"{SPEC}.num_speculative_tokens=2")
    assert engine_kwargs(mtp, 0, distributed=True)["speculative_config"] == {"method": "mtp",
                                                                             "num_speculative_tokens": 2}
    ngram = runtime("tiny-qwen3-1gpu.yaml", f"{SPEC}.method=ngram", f"{SPEC}.num_speculative_tokens=3")
    assert engine_kwargs(ngram, 0, distributed=False)["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert "speculative_config" not in engine_kwargs(runtime("tiny-qwen3-1gpu.yaml"), 0, distributed=False)


def test_a_hand_edited_speculative_config_is_refused_with_the_typed_key():
    cfg = runtime("tiny-qwen3-1gpu.yaml")
    edited = dataclasses.replace(cfg, generation=dataclasses.replace(
        cfg.generation, vllm_kwargs={"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}))
    with pytest.raises(ValueError, match=r"speculative_config from generation\.speculative_decoding"):
        engine_kwargs(edited, 0, distributed=False)
