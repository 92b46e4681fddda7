"""generation.max_model_len and training.max_sequence_length against the model's context length, derived as
vLLM 0.22 derives it before refusing a max_model_len (vllm/config/model.py _get_and_verify_max_len)."""
from __future__ import annotations

import pytest

from rlc.compiler import api
from rlc.compiler.catalog.context import context_length

from planner_helpers import BASE

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("cfg,tokens,how", [
    ({"max_position_embeddings": 40960}, 40960, "max_position_embeddings 40960"),
    # YaRN: factor × original_max_position_embeddings (Qwen3's documented 131072 from 32768), not × 40960
    ({"max_position_embeddings": 40960, "rope_scaling": YARN}, 131072, "YaRN rope factor 4 × original"),
    ({"max_position_embeddings": 40960, "rope_parameters": {**YARN, "rope_theta": 1e6}}, 131072, "YaRN"),
    # the legacy "type" key, and a top-level original length (Phi-3 style) that wins over the rope dict's
    ({"max_position_embeddings": 40960, "rope_scaling": {"type": "yarn", "factor": 2.0}}, 81920, "YaRN"),
    ({"max_position_embeddings": 40960, "original_max_position_embeddings": 4096, "rope_scaling": YARN}, 16384,
     "original_max_position_embeddings 4096"),
    # llama3 (Llama-3.1/3.2) and longrope state the scaled length already; linear / dynamic scale it
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}}, 131072, ""),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "su", "factor": 32.0}}, 4096, ""),
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 8192, "factor 2"),
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "dynamic", "factor": None}}, 4096, ""),
    ({"model_type": "gemma3_text", "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "linear",
                                                                                       "factor": 8.0}}, 131072, ""),
    # the smallest length key counts, and model_max_length wins when set
    ({"max_position_embeddings": 8192, "seq_length": 4096}, 4096, "seq_length"),
    ({"max_position_embeddings": 8192, "model_max_length": 16384}, 16384, "model_max_length"),
    # per-layer-type rope parameters (nested)
    ({"max_position_embeddings": 32768, "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0},
                                                            "sliding_attention": {"rope_type": "default"}}},
     65536, "YaRN"),
])
def test_context_length_as_vllm_derives_it(cfg, tokens, how):
    got, text = context_length(cfg)
    assert got == tokens and how in text


def test_a_config_without_a_length_is_not_checked():
    assert context_length({"hidden_size": 8})[0] is None


def _errors(result, rule="RLC112"):
    return [d for d in result.diagnostics if d.rule == rule]


def test_max_model_len_beyond_the_context_is_an_error_naming_the_key_and_the_limit():
    # the field case: 2,000,000 on Qwen3.5-397B-A17B (max_position_embeddings 262144) used to validate
    result = api.check(BASE, ["generation.max_model_len=2000000"])
    (err,) = _errors(result)
    assert err.severity == "error" and err.path == "generation.max_model_len"
    assert "2000000" in err.message and "262144" in err.message and "max_position_embeddings" in err.message
    assert err.hint == "set generation.max_model_len to at most 262144"
    assert not _errors(api.check(BASE, ["generation.max_model_len=262144"]))


def test_training_max_sequence_length_is_checked_too_and_vllms_switch_makes_both_warnings():
    result = api.check(BASE, ["generation.max_model_len=300000", "training.max_sequence_length=300000"])
    assert {d.path for d in _errors(result) if d.severity == "error"} == {"generation.max_model_len",
                                                                           "training.max_sequence_length"}
    allowed = api.check(BASE, ["generation.max_model_len=300000", "cluster.env.VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"])
    assert [d.severity for d in _errors(allowed)] == ["warning"]


def test_a_yarn_override_extends_the_limit_as_vllm_computes_it(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {BASE}\nmodel:\n  id: Qwen/Qwen3-8B\nparallelism:\n  train: {{tp: 4, pp: 1, ep: 1, "
                      "cp: 1, etp: 1}\n  generation: {tp: 4, ep: 1}\n")
    assert _errors(api.check(recipe, ["generation.max_model_len=65536"]))  # Qwen3-8B: 40960
    yarn = ["model.overrides.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}"]
    assert not _errors(api.check(recipe, ["generation.max_model_len=131072", *yarn]))
    (err,) = _errors(api.check(recipe, ["generation.max_model_len=131073", *yarn]))
    assert "131072" in err.message and "YaRN rope factor 4 × original_max_position_embeddings 32768" in err.message
