"""Sequence packing turns on fused RoPE (megatron-core's unfused RoPE on a packed row runs a loop of small kernels
per sequence): Transformer Engine's kernel for standard attention, megatron-core's Triton kernels for multi-latent
attention's YaRN embedding; the recipe's own ``training.megatron_kwargs.apply_rope_fusion`` wins, and models whose
RoPE the fused packed kernels do not cover keep theirs."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from rlc.compiler import api
from rlc.compiler.resolve import to_runtime_config
from rlc.contract.runtime_config import runtime_config_from_dict
from rlc.runtime.policy.provider_options import apply_provider_settings, packed_rope_fusion

RECIPES = Path(__file__).resolve().parents[2] / "rlc" / "recipes"


def runtime(*sets: str, recipe: str = "tiny-qwen3-1gpu.yaml"):
    result = api.check(str(RECIPES / recipe), list(sets))
    assert result.ok, [(d.rule, d.message) for d in result.errors]
    return runtime_config_from_dict(to_runtime_config(result))


def qwen3_provider(**fields):
    """The attributes of a Megatron-Bridge Qwen3 provider that decide (its default: no RoPE fusion)."""
    return SimpleNamespace(**{"apply_rope_fusion": False, "position_embedding_type": "rope",
                              "yarn_rotary_scaling_factor": None, "multi_latent_attention": False,
                              "mrope_section": None, **fields})


def test_packing_turns_on_fused_rope():
    provider = qwen3_provider()
    applied = apply_provider_settings(provider, runtime("training.sequence_packing.enabled=true"))
    assert provider.apply_rope_fusion is True and applied["apply_rope_fusion"] is True


def test_padded_micro_batches_leave_rope_as_the_model_has_it():
    provider = qwen3_provider()
    applied = apply_provider_settings(provider, runtime())
    assert provider.apply_rope_fusion is False and "apply_rope_fusion" not in applied


def test_the_recipes_own_setting_wins():
    provider = qwen3_provider()
    applied = apply_provider_settings(provider, runtime("training.sequence_packing.enabled=true",
                                                        "training.megatron_kwargs.apply_rope_fusion=false"))
    assert provider.apply_rope_fusion is False and applied["apply_rope_fusion"] is False


def test_models_whose_rope_the_fused_packed_kernel_does_not_cover_keep_theirs():
    cfg = runtime("training.sequence_packing.enabled=true")
    for fields in ({"position_embedding_type": "yarn"}, {"position_embedding_type": "learned_absolute"},
                   {"yarn_rotary_scaling_factor": 4.0}, {"multi_latent_attention": True, "rope_type": "rope"},
                   {"mrope_section": [16, 24, 24]}):
        provider = qwen3_provider(**fields)
        applied = apply_provider_settings(provider, cfg)
        assert provider.apply_rope_fusion is False and "apply_rope_fusion" not in applied, fields


def mla_provider(**fields):
    """The attributes of a Megatron-Bridge MLA (DeepSeek-V3) provider that decide: YaRN rotary embedding (plain RoPE
    at scaling factor 1, what the Bridge sets for a checkpoint without rope_scaling), no fusion."""
    return qwen3_provider(**{"multi_latent_attention": True, "rope_type": "yarn", "cache_mla_latents": False,
                             **fields})


def test_packing_turns_on_mlas_fused_rope_when_its_kernels_load():
    cfg = runtime("training.sequence_packing.enabled=true")
    assert packed_rope_fusion(mla_provider(), cfg, mla_kernels=True) is True
    assert packed_rope_fusion(mla_provider(), cfg, mla_kernels=False) is False  # no Triton: left unfused
    assert packed_rope_fusion(mla_provider(), runtime(), mla_kernels=True) is False  # padded micro batches


def test_mla_keeps_unfused_rope_where_megatron_core_has_no_fused_path():
    cfg = runtime("training.sequence_packing.enabled=true")
    assert packed_rope_fusion(mla_provider(rope_type="rope"), cfg, mla_kernels=True) is False
    assert packed_rope_fusion(mla_provider(cache_mla_latents=True), cfg, mla_kernels=True) is False
    # the Megatron generation backend generates with this model config, and megatron-core's MLA inference asserts
    # that RoPE fusion is off
    megatron = runtime("training.sequence_packing.enabled=true", recipe="tiny-qwen3-1gpu-megatron.yaml")
    assert packed_rope_fusion(mla_provider(), megatron, mla_kernels=True) is False
