"""Megatron-core inference (``generation.backend: megatron``): what the recipe's settings become.

One source for the decisions the rules record, the resolver writes into ``runtime.yaml`` and the planner
counts: which model generates (``shared`` or ``dedicated``), with which layer implementation, which
switches the vLLM refit has that mean nothing here, and the KV pool's block arithmetic (megatron-core
``DynamicInferenceContext``: a block holds ``block_size_tokens`` tokens of K and V of every attention layer
of the stage; a request needs ``ceil(max_sequence_length / block)`` blocks, one more with speculative
decoding; one block of the pool is megatron-core's dummy block).

Pure Python on the typed recipe and the model facts (no torch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from rlc.compiler.recipe_types import Recipe
from rlc.contract.mamba_states import MAMBA_STATE_DTYPES

MEGATRON = "megatron"
#: megatron-core ``DynamicInferenceContext.REQUEST_ROUNDER``: the default request count is a multiple of it.
REQUEST_ROUNDER = 4
#: megatron-core ``DynamicInferenceContext.DEFAULT_MAX_TOKENS``.
DEFAULT_MAX_TOKENS = 16384
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def uses_megatron(recipe: Recipe) -> bool:
    """The recipe generates with megatron-core's engine."""
    return recipe.generation.backend == MEGATRON


# --------------------------------------------------------------------------- which model generates


@dataclass(frozen=True)
class InferenceModel:
    """The model megatron-core's engine runs on, and why."""

    mode: str  # "shared" | "dedicated"
    transformer_impl: str  # "transformer_engine" | "inference_optimized"
    differs: tuple[str, ...]  # what makes the inference model differ from the training model
    reason: str
    router_dtype: str  # "fp32" | "fp64" | "auto" (the model provider's own): how the generating model routes


def layout_differences(recipe: Recipe) -> list[str]:
    """What of the inference layout (``parallelism.generation``; context parallelism is always 1 in
    megatron-core inference) differs from the trainer's."""
    t, g = recipe.parallelism.train, recipe.parallelism.generation
    out = [
        f"{k.upper()} {getattr(t, k)} -> {getattr(g, k)}" for k in ("tp", "pp", "ep") if getattr(t, k) != getattr(g, k)
    ]
    if t.cp > 1:
        out.append(f"CP {t.cp} -> 1 (megatron-core inference runs without context parallelism)")
    return out


def inference_model(recipe: Recipe) -> InferenceModel:
    """Shared or dedicated, the layer implementation and the router dtype (``generation.megatron.mode`` /
    ``transformer_impl`` / ``router_dtype``)."""
    m = recipe.generation.megatron
    impl = "transformer_engine" if m.transformer_impl == "auto" else m.transformer_impl
    trainer_router = recipe.training.moe.router_dtype
    router = trainer_router if m.router_dtype == "auto" else m.router_dtype
    differs = layout_differences(recipe)
    if impl != "transformer_engine":
        differs.append(f"transformer_impl transformer_engine -> {impl}")
    if router != trainer_router:
        differs.append(f"router dtype {trainer_router} -> {router}")
    if m.mode == "shared":
        return InferenceModel("shared", impl, tuple(differs), "set in recipe", router)
    if m.mode == "dedicated":
        why = "set in recipe" + ("" if differs else " (same layout: every swap is a local copy)")
        return InferenceModel("dedicated", impl, tuple(differs), why, router)
    if differs:
        return InferenceModel(
            "dedicated",
            impl,
            tuple(differs),
            f"auto -> dedicated: the inference model differs from the training model ({'; '.join(differs)})",
            router,
        )
    return InferenceModel("shared", impl, (), "auto -> shared: the inference model would equal the training model "
                          "(same layout, transformer_impl and router dtype), so the engine runs on it and no weights "
                          "move", router)


def weight_sync_kind(recipe: Recipe) -> str:
    """``vllm-ipc`` | ``megatron-shared`` | ``megatron-swap``: what the refit does every step."""
    if not uses_megatron(recipe):
        return "vllm-ipc"
    return "megatron-swap" if inference_model(recipe).mode == "dedicated" else "megatron-shared"


def reset_router_num_groups(recipe: Recipe, facts: Any) -> bool:
    """megatron-core's ``InferenceTopKRouter`` asserts ``moe_router_num_groups is None``; Megatron-Bridge maps a
    degenerate HF ``n_group: 1`` to 1, which routes exactly like None (NeMo-RL PR #3490 resets it)."""
    return (uses_megatron(recipe) and inference_model(recipe).transformer_impl == "inference_optimized"
            and facts is not None and getattr(facts, "router_groups", None) == 1)


# --------------------------------------------------------------------------- vLLM-only settings


@dataclass(frozen=True)
class VllmOnly:
    """A setting that only the vLLM backend reads; ``neutral`` values (besides the schema default) are harmless."""

    key: str
    why: str
    neutral: tuple[Any, ...] = ()


_IPC = "sizes or shapes the CUDA-IPC stream into vLLM; Megatron inference reads the trainer's weights in process"
VLLM_ONLY: tuple[VllmOnly, ...] = (
    VllmOnly("refit.sleep_level", "selects vLLM's sleep mode; the Megatron engine's KV pool follows "
             "generation.megatron.kv_cache"),
    VllmOnly("refit.keep_weights_awake", "keeps vLLM's weights on the GPU while only its KV cache sleeps; the Megatron "
             "engine generates from the trainer's own weights (or its dedicated model)"),
    VllmOnly("refit.wake_kv_during_transfer", "wakes vLLM's KV cache during the IPC transfer; the Megatron engine "
             "has no transfer to overlap", (False,)),
    VllmOnly("refit.keep_kv_cache_awake", "keeps vLLM's KV cache on the GPU between rollouts; the Megatron engine's "
             "KV pool follows generation.megatron.kv_cache", (False,)),
    VllmOnly("refit.buffer_memory_ratio", _IPC),
    VllmOnly("refit.buffer_gb", _IPC),
    VllmOnly("refit.alignment_bytes", _IPC),
    VllmOnly("refit.transport", _IPC),
    VllmOnly("refit.fused_transfer", "moves stacked expert tensors into vLLM's fused expert parameters; the "
             "Megatron engine and swap_model_weights address Megatron's own tensors", ("auto", "off")),
    VllmOnly("refit.keep_buffers_gb", _IPC),
    VllmOnly("refit.direct_export", "exports HF tensors for vLLM's loader; the Megatron engine and swap_model_weights "
             "address Megatron's own tensors", (False,)),
    VllmOnly("refit.zero_copy_views", "lets vLLM read the trainer's parameters over CUDA IPC; the Megatron engine "
             "reads them in its own process", (False,)),
    VllmOnly("refit.zero_copy_experts", "lets vLLM read the trainer's experts over CUDA IPC; the Megatron engine "
             "reads the trainer's weights in process", (False,)),
    VllmOnly("refit.replay_load", "replays vLLM's own load_weights; the Megatron engine has no such loader", (False,)),
    VllmOnly("refit.per_rank_ipc_metadata", "is the IPC slicing metadata of the vLLM refit (SkyRL #1816); nothing is "
             "sliced in process", ("auto",)),
    VllmOnly("refit.dedupe_mtp_embedding", "drops the MTP replica of the word embedding from the HF export to vLLM "
             "(NeMo-RL #2471); the Megatron engine and swap_model_weights address Megatron's own tensors", ("auto",)),
    VllmOnly("refit.fp32_params", "keeps tensors fp32 on the IPC wire (SkyRL #1816); the shared engine reads the "
             "trainer's tensors and swap_model_weights keeps each buffer's dtype (the fp32 router bias stays fp32)",
             ("auto",)),
    VllmOnly("generation.vllm_version", "selects vLLM's sleep-mode semantics in the plan"),
    VllmOnly("generation.gpu_memory_utilization", "is vLLM's share of the GPU; the Megatron engine's KV pool is "
             "generation.kv_cache_memory_bytes"),
    VllmOnly("generation.vllm_kwargs", "is handed to vllm.LLM", ({},)),
    VllmOnly("generation.precision", "selects FP8 vLLM rollouts; the Megatron engine runs the trainer's precision",
             ("auto",)),
)


# --------------------------------------------------------------------------- the KV pool


@dataclass(frozen=True)
class KvPool:
    """megatron-core's KV pool for a recipe (one GPU of the worst pipeline stage)."""

    pool_bytes: int
    block_bytes: int
    block_tokens: int
    blocks: int  # in the pool, the dummy block included
    blocks_per_request: int  # of one full-length request (max_model_len)
    max_requests: int  # per engine step (recipe, or megatron-core's default from the pool)
    max_tokens: int

    @property
    def full_requests(self) -> int:
        """Full-length requests the pool holds at once (the dummy block excluded)."""
        return max(0, self.blocks - 1) // max(1, self.blocks_per_request)


def kv_block_bytes(recipe: Recipe, facts: Any) -> Optional[int]:
    """Bytes of one KV block on one GPU (megatron-core ``DynamicInferenceContext``: dtype × 2 (K, V) × attention
    layers of the stage × block tokens × KV heads per TP rank × head dim); None when a fact is missing."""
    if facts is None or facts.num_layers is None:
        return None
    heads = facts.kv_heads or facts.heads
    if heads is None:
        return None
    head_dim = facts.head_dim or (facts.hidden // facts.heads if facts.hidden and facts.heads else None)
    if head_dim is None:
        return None
    g = recipe.parallelism.generation
    per_rank = max(1, heads // g.tp) if heads >= g.tp else 1
    layers = math.ceil(facts.num_layers / max(1, g.pp))
    kinds = facts.layer_kinds
    if kinds is not None:  # attention layers only (a hybrid model's Mamba layers keep no KV)
        attention = sum(1 for mixer, _ in kinds if mixer in ("full_attention", "mla"))
        layers = math.ceil(attention / max(1, g.pp))
    dtype = DTYPE_BYTES[recipe.model.dtype]
    return dtype * 2 * layers * recipe.generation.megatron.block_size_tokens * per_rank * head_dim


def mamba_state_bytes(recipe: Recipe, facts: Any) -> int:
    """Bytes of Mamba state one request holds on one GPU in megatron-core's engine (0 for a model without Mamba
    layers): per Mamba layer of the stage, the conv state ((d_inner + 2 × groups × d_state) / TP × d_conv) and the SSM
    state (heads / TP × head dim × d_state), each in its ``generation.megatron.mamba_*_states_dtype`` (``auto``: the
    model's dtype, ``MambaInferenceStateConfig.from_model``'s default), and again per speculative token (megatron-core
    0.19 ``DynamicInferenceContext``: ``mamba_states_memory_per_request``). megatron-core reserves it per KV block
    when it derives the request count."""
    kinds = facts.layer_kinds if facts is not None else None
    if not kinds:
        return 0
    mamba = sum(1 for mixer, _ in kinds if mixer == "mamba")
    heads, head_dim = facts.mamba_heads, facts.mamba_head_dim
    groups, state, conv = facts.mamba_groups, facts.mamba_state, facts.mamba_conv_kernel
    if not mamba or None in (heads, head_dim, groups, state, conv):
        return 0
    g = recipe.parallelism.generation
    tp = max(1, g.tp)
    conv_bytes = (heads * head_dim // tp + 2 * (groups // tp) * state) * conv
    ssm_bytes = heads // tp * head_dim * state
    m = recipe.generation.megatron
    per_layer = (conv_bytes * mamba_state_dtype_bytes(recipe, m.mamba_conv_states_dtype)
                 + ssm_bytes * mamba_state_dtype_bytes(recipe, m.mamba_ssm_states_dtype))
    drafts = speculative_tokens(recipe)
    copies = 1 + (drafts + 1 if drafts else 0)  # the intermediate states of every drafted token besides
    return math.ceil(mamba / max(1, g.pp)) * per_layer * copies


def mamba_state_dtype_bytes(recipe: Recipe, setting: str) -> int:
    """Bytes per element of a Mamba state kept in ``setting`` (``auto``: the model's dtype)."""
    return DTYPE_BYTES[recipe.model.dtype if setting == "auto" else MAMBA_STATE_DTYPES[setting]]


def speculative_tokens(recipe: Recipe) -> int:
    spec = recipe.generation.speculative_decoding
    return spec.num_speculative_tokens if spec is not None else 0


def kv_pool(recipe: Recipe, facts: Any) -> Optional[KvPool]:
    """The pool of ``generation.kv_cache_memory_bytes``; None when it or a fact is missing."""
    m = recipe.generation.megatron
    pool = recipe.generation.kv_cache_memory_bytes
    block = kv_block_bytes(recipe, facts)
    if pool is None or block is None:
        return None
    mamba = mamba_state_bytes(recipe, facts)
    if mamba and m.max_requests is not None:  # megatron-core sets aside the Mamba states of max_requests first
        blocks = max(2, (int(pool) - m.max_requests * mamba) // block)
    else:  # and otherwise reserves one request's Mamba state beside every block (none without Mamba layers)
        blocks = max(2, int(pool) // (block + mamba))  # at least one active block and the dummy block
    per_request = math.ceil(recipe.generation.max_model_len / m.block_size_tokens) + (
        1 if speculative_tokens(recipe) else 0
    )
    tp = recipe.parallelism.generation.tp
    if m.max_requests is not None:
        max_requests = m.max_requests
    else:
        max_requests = (blocks - 1) // tp * tp // REQUEST_ROUNDER * REQUEST_ROUNDER
    return KvPool(pool_bytes=int(pool), block_bytes=block, block_tokens=m.block_size_tokens, blocks=blocks,
                  blocks_per_request=per_request, max_requests=max_requests,
                  max_tokens=m.max_tokens if m.max_tokens is not None else DEFAULT_MAX_TOKENS)


def pool_bytes_for(recipe: Recipe, facts: Any, requests: int) -> Optional[int]:
    """The smallest ``kv_cache_memory_bytes`` that holds ``requests`` full-length requests at once."""
    block = kv_block_bytes(recipe, facts)
    if block is None:
        return None
    m = recipe.generation.megatron
    per_request = math.ceil(recipe.generation.max_model_len / m.block_size_tokens) + (
        1 if speculative_tokens(recipe) else 0
    )
    return (max(1, requests) * per_request + 1) * block + max(1, requests) * mamba_state_bytes(recipe, facts)


__all__ = ["DEFAULT_MAX_TOKENS", "InferenceModel", "KvPool", "MEGATRON", "REQUEST_ROUNDER", "VLLM_ONLY", "VllmOnly",
           "inference_model", "kv_block_bytes", "kv_pool", "layout_differences", "mamba_state_bytes",
           "mamba_state_dtype_bytes", "pool_bytes_for",
           "reset_router_num_groups", "speculative_tokens", "uses_megatron", "weight_sync_kind"]
