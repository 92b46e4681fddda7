"""vLLM's KV cache holds one request of max_model_len tokens (RLC229): the per-token lower bound of each attention
kind, and the check against the cache's upper bound on a published configuration."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rlc.compiler import api, catalog
from rlc.compiler.planner.vllm_kv import kv_bytes_per_token

from planner_helpers import RECIPES

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = ROOT / "tests" / "validation" / "recipes" / "nemo-rl-grpo-llama3.1-8b-instruct-2n8g.yaml"


def _recipe(tp: int = 1, pp: int = 1, kv_cache_dtype: str | None = None) -> SimpleNamespace:
    kwargs = {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}
    return SimpleNamespace(parallelism=SimpleNamespace(generation=SimpleNamespace(tp=tp, pp=pp)),
                           generation=SimpleNamespace(vllm_kwargs=kwargs), model=SimpleNamespace(dtype="bfloat16"))


@pytest.mark.parametrize("model_id, recipe, per_token", [
    # 36 layers × (K, V) × 8 KV heads × 128 × 2 B
    ("Qwen/Qwen3-8B", _recipe(), 36 * 2 * 8 * 128 * 2),
    ("Qwen/Qwen3-8B", _recipe(tp=2), 36 * 2 * 4 * 128 * 2),
    ("Qwen/Qwen3-8B", _recipe(tp=16), 36 * 2 * 1 * 128 * 2),  # 8 KV heads on 16 ranks: one (replicated) each
    ("Qwen/Qwen3-8B", _recipe(pp=4), 9 * 2 * 8 * 128 * 2),
    # multi-latent attention: the 512-wide latent and the 64-wide rotary key, on every rank
    ("deepseek-ai/DeepSeek-V3", _recipe(tp=8), 61 * (512 + 64) * 2),
    ("deepseek-ai/DeepSeek-V3", _recipe(tp=8, kv_cache_dtype="fp8_e4m3"), 61 * (512 + 64)),
    # Gated DeltaNet layers keep a fixed state, not a per-token cache: the 15 full-attention layers of 60 count
    ("Qwen/Qwen3.5-397B-A17B", _recipe(tp=2), 15 * 2 * 1 * 256 * 2),
])
def test_the_per_token_bound_counts_the_layers_that_keep_every_token(model_id, recipe, per_token):
    assert kv_bytes_per_token(recipe, catalog.model_facts(model_id, RECIPES)) == per_token


def test_models_whose_layers_may_keep_a_sliding_window_are_not_bounded():
    assert kv_bytes_per_token(_recipe(), catalog.model_facts("openai/gpt-oss-20b", RECIPES)) is None


def test_a_cache_that_cannot_hold_one_full_length_request_is_refused_with_the_length_that_fits():
    # Llama-3.1-8B on one vLLM GPU: 14.96 GiB of weights, 128 KiB of KV a token, 4096-token requests (0.5 GiB)
    tight = api.check(str(LLAMA_8B), ["generation.gpu_memory_utilization=0.195"])
    (err,) = [d for d in tight.errors if d.rule == "RLC229"]
    assert err.path == "generation.gpu_memory_utilization" and "max_model_len 4096" in err.message
    assert "131072 bytes a token" in err.message and "lower generation.max_model_len to at most 3841" in err.hint
    shorter = api.check(str(LLAMA_8B), ["generation.gpu_memory_utilization=0.195", "generation.max_model_len=3841",
                                        "data.max_prompt_length=1024", "generation.sampling.max_tokens=2048"])
    assert "RLC229" not in {d.rule for d in shorter.errors}
    assert "RLC229" not in {d.rule for d in api.check(str(LLAMA_8B), ["generation.gpu_memory_utilization=0.25"]).errors}
    fixed = api.check(str(LLAMA_8B), [f"generation.kv_cache_memory_bytes={400 << 20}"])  # 0.39 GiB, exact
    (err,) = [d for d in fixed.errors if d.rule == "RLC229"]
    assert err.path == "generation.kv_cache_memory_bytes" and "kv_cache_memory_bytes 0.39 GiB" in err.message
