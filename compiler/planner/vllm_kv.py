"""The KV cache one full-length request needs in vLLM, per GPU: a lower bound, for the check that vLLM's cache holds
one request of ``generation.max_model_len`` tokens (vLLM refuses to start otherwise: "To serve at least one request
with the model's max seq len (...), (... GiB KV cache is needed, which is larger than the available KV cache
memory"; vLLM 0.22 ``vllm/v1/core/kv_cache_utils.py``).

A lower bound on purpose, so that the check never fires on a configuration vLLM starts: only the layers that keep
keys and values for every token are counted (full attention: 2 × KV heads on the rank × head dim; multi-latent
attention: the latent and the rotary key, on every rank), on the pipeline stage that holds the fewest of them a
stage can hold (all of them divided evenly, rounded up); the recurrent state of linear-attention and Mamba layers,
which vLLM also pages, is left out. Models whose attention layers may keep only a sliding window are not bounded
(None): their config says which layers do, and the facts do not record it.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from rlc.compiler.planner.parts import DTYPE_BYTES

#: Families whose attention layers all keep every token (the check applies to them).
FULL_HISTORY_FAMILIES = frozenset({"llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next",
                                   "deepseek_v2", "deepseek_v3", "kimi_k2", "nemotron_h", "glm4_moe"})


def kv_cache_element_bytes(recipe: Any) -> int:
    """Bytes per KV element: 1 with an FP8 ``kv_cache_dtype`` in ``generation.vllm_kwargs``, else the model dtype
    (vLLM's ``auto``)."""
    dtype = str((recipe.generation.vllm_kwargs or {}).get("kv_cache_dtype", "auto"))
    return 1 if dtype.startswith("fp8") else DTYPE_BYTES.get(recipe.model.dtype, 2)


def kv_bytes_per_token(recipe: Any, facts: Any) -> Optional[int]:
    """A lower bound on the KV bytes one token of one request takes on one GPU (see the module docstring); None when
    the model's facts do not give it."""
    if facts is None or facts.family not in FULL_HISTORY_FAMILIES or facts.layer_kinds is None:
        return None
    g = recipe.parallelism.generation
    pp = max(1, g.pp)
    element = kv_cache_element_bytes(recipe)
    mixers = [mixer for mixer, _ in facts.layer_kinds]
    full, latent = mixers.count("full_attention"), mixers.count("mla")
    per_token = 0
    if full:
        heads, head_dim = facts.kv_heads or facts.heads, facts.head_dim
        if heads is None or head_dim is None:
            return None
        per_token += math.ceil(full / pp) * 2 * max(1, heads // max(1, g.tp)) * head_dim * element
    if latent:
        if facts.kv_lora_rank is None or facts.qk_rope_head_dim is None:
            return None
        per_token += math.ceil(latent / pp) * (facts.kv_lora_rank + facts.qk_rope_head_dim) * element
    return per_token or None


__all__ = ["FULL_HISTORY_FAMILIES", "kv_bytes_per_token", "kv_cache_element_bytes"]
