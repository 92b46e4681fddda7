"""Parameter accounting against published totals and the fused-tensor table."""
from __future__ import annotations

import pytest

from rlc.compiler import catalog
from rlc.compiler.model import ParamSplit

from planner_helpers import RECIPES

# Published totals (model cards / HF parameter counts), main model without MTP unless noted.
PUBLISHED = {
    "Qwen/Qwen3-0.6B": (0.596e9, 0.01),  # tied embeddings
    "Qwen/Qwen3-8B": (8.19e9, 0.01),
    "Qwen/Qwen3-30B-A3B": (30.5e9, 0.01),
    "Qwen/Qwen3-235B-A22B": (235.1e9, 0.01),
    "Qwen/Qwen3.5-122B-A10B": (122e9, 0.01),
    "Qwen/Qwen3.5-397B-A17B": (397e9, 0.01),
    "deepseek-ai/DeepSeek-V3": (671e9, 0.005),
    "meta-llama/Llama-3.1-8B": (8.03e9, 0.005),
    "meta-llama/Llama-3.1-70B": (70.6e9, 0.005),
    "openai/gpt-oss-120b": (116.8e9, 0.01),
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B": (31.6e9, 0.01),
}


def facts(model_id):
    return catalog.model_facts(model_id, RECIPES)


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_total_params_match_published(model_id):
    expected, rel = PUBLISHED[model_id]
    counts = facts(model_id).param_counts()
    assert counts["total_without_mtp"] == pytest.approx(expected, rel=rel)


def test_qwen35_397b_components_and_hf_total():
    f = facts("Qwen/Qwen3.5-397B-A17B")
    c = f.param_counts()
    assert c["routed_experts"] == 60 * 512 * 3 * 1024 * 4096
    assert c["embedding"] == c["output_layer"] == 248320 * 4096
    assert c["linear_attention"] > c["attention"] > 0  # 45 Gated DeltaNet + 15 gated-attention layers
    # HF's count (403,397,928,944) includes the MTP block and the ~0.4B vision tower we do not count.
    assert 0 < f.reference_total_params - c["total"] < 0.6e9
    assert f.mtp_num_layers == 1 and f.mtp_shared_embedding is True


def test_deepseek_mla_and_dense_first_layers():
    f = facts("deepseek-ai/DeepSeek-V3")
    kinds = f.layer_kinds
    assert kinds[:3] == (("mla", "dense"),) * 3 and kinds[3] == ("mla", "moe")
    assert f.param_counts()["mtp"] == pytest.approx(11.6e9, rel=0.02)
    assert [p.pattern for p in f.fp32_params] == ["*e_score_correction_bias*", "*expert_bias*"]


@pytest.mark.parametrize("model_id,name,nbytes", [
    ("Qwen/Qwen3.5-397B-A17B", "model.language_model.layers.0.mlp.experts.gate_up_proj", 8_589_934_592),
    ("openai/gpt-oss-120b", "model.layers.0.mlp.experts.gate_up_proj", 4_246_732_800),
    ("deepseek-ai/DeepSeek-V3", "model.embed_tokens.weight", 1_853_358_080),
    ("Qwen/Qwen3-30B-A3B", "model.embed_tokens.weight", 622_329_856),
    ("meta-llama/Llama-3.1-70B", "model.embed_tokens.weight", 2_101_346_304),
    ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B", "backbone.embed_tokens.weight", 704_643_072),
])
def test_largest_export_tensor_matches_fused_tensor_table(model_id, name, nbytes):
    assert facts(model_id).largest_export_tensor() == (name, nbytes)


def test_nemotron_h_hybrid_layers_and_latent_moe():
    nano = facts("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B")
    kinds = [k for k in nano.layer_kinds]
    assert (kinds.count(("mamba", None)), kinds.count((None, "moe")), kinds.count(("full_attention", None))) == (
        23,
        23,
        6,
    )
    assert not nano.gated_mlp and nano.expert_export == "per_expert"
    super_ = facts("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B")
    assert not super_.layer_order_known  # only per-kind counts are public
    assert super_.latent_size == 1024 and super_.moe_components()["routed_experts"].expert == 512 * 2 * 2688 * 1024
    # untied (the NemotronHConfig default every loader applies): the total is known, 120.7B without MTP (published 120B)
    assert super_.unknown == () and super_.tied_embeddings is False
    assert super_.param_counts()["total_without_mtp"] == pytest.approx(120.7e9, rel=0.01)


def test_nemotron_ultra_degrades_to_unknown_instead_of_guessing():
    f = facts("nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B")
    for name in ("num_layers", "vocab", "moe_intermediate", "heads"):
        assert name in f.unknown and getattr(f, name) is None
    assert f.param_counts()["total"] is None
    name, size = f.largest_export_tensor()
    assert size is None and name.startswith("unknown")
    assert f.hidden == 8192 and f.latent_size == 2048 and f.num_experts == 512
    assert any("secondary" in n for n in f.notes) and f.mtp_num_layers == 2


def test_param_split_per_gpu():
    s = ParamSplit(tp=800, replicated=10, expert=1600)
    assert s.per_gpu(tp=8, expert_shards=16) == 100 + 10 + 100
    assert (s + s).total == 2 * s.total and s.times(3).expert == 4800
