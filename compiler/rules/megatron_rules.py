"""RLC40x: the Megatron generation backend (``generation.backend: megatron``).

megatron-core's dynamic inference engine runs inside each trainer process, on the training model (shared mode)
or on a second model refit in process by ``swap_model_weights`` (dedicated mode; NeMo-RL PR #3490). These rules
settle which model generates and which refit switches apply (recorded in ``refit.decisions``), and refuse at
compile time what megatron-core 0.19 or the colocated refit cannot do: virtual pipeline stages, the vLLM-only
settings, sampling the engine cannot reproduce, the inference-optimized layers' limits and a KV pool that cannot
hold one request.
"""
from __future__ import annotations

from typing import Any

from rlc.compiler.mcore_generation import (VLLM_ONLY, inference_model, kv_pool, mamba_state_bytes, pool_bytes_for,
                                           reset_router_num_groups, uses_megatron, weight_sync_kind)
from rlc.compiler.rules.engine import Context, rule
from rlc.compiler.schema import default_at

G = "generation.megatron"


def _user_set(ctx: Context, path: str, value: Any) -> bool:
    """Whether the recipe set ``path`` (the raw recipe when the caller has it, else: differs from the default)."""
    stated = ctx.user_set(path)
    if stated is not None:
        return stated
    try:
        return value != default_at(path)
    except KeyError:
        return value is not None


def _value(ctx: Context, path: str) -> Any:
    node: Any = ctx.recipe
    for part in path.split("."):
        node = getattr(node, part)
    return node


@rule("RLC401", "virtual pipeline stages cannot generate with Megatron inference", severities=("error",),
      rationale="megatron-core's engine wraps one model chunk (its inference wrapper refuses a list of chunks), "
                "and swap_model_weights takes only the first chunk of each model (megatron-core "
                "resharding/refit.py unwraps model[0]): with virtual pipeline stages the inference model would be "
                "silently truncated to chunk 0. NeMo-RL's colocated reshard raises the same NotImplementedError.",
      seed="NeMo-RL PR #3490 review: 'get_model returns one module per virtual-pipeline chunk, so with "
           "virtual_pipeline_model_parallel_size > 1 … the inference model is silently truncated to chunk 0' "
           "(guard added in nemo_rl/models/megatron/setup.py).",
      fixes="Set parallelism.train.vpp: 1, or generate with generation.backend: vllm.")
def vpp_guard(ctx: Context) -> None:
    vpp = ctx.recipe.parallelism.train.vpp
    if uses_megatron(ctx.recipe) and vpp > 1:
        ctx.error(f"generation.backend megatron with {vpp} virtual pipeline stages: the engine and the swap see only "
                  "the first model chunk, so the other chunks' layers would be silently left out",
                  "parallelism.train.vpp", hint="parallelism.train.vpp: 1 (or generation.backend: vllm)")


@rule("RLC402", "vLLM-only settings with the Megatron backend (and Megatron settings with vLLM)",
      severities=("error",),
      rationale="The sleep level, the CUDA-IPC buffer and its switches, gpu_memory_utilization, vllm_version, "
                "vllm_kwargs and FP8 rollouts configure vLLM and its refit stream. With generation.backend "
                "megatron nothing reads them; a recipe that sets them was written for the other backend and would "
                "plan and run something else than it says. generation.megatron is read only by the Megatron "
                "backend, for the same reason.",
      seed="NeMo-RL PR #3490 (the Megatron backend's refit goes through its own weight synchronizer, not the "
           "vLLM IPC path); rlc design: one source of truth per setting.",
      fixes="Remove the key (the message says what the Megatron backend uses instead), or switch the backend.")
def backend_keys(ctx: Context) -> None:
    r = ctx.recipe
    if not uses_megatron(r):
        if ctx.user_set(G):
            ctx.error("generation.megatron is set but generation.backend is vllm, which does not read it", G,
                      hint="remove generation.megatron, or set generation.backend: megatron")
        return
    for item in VLLM_ONLY:
        value = _value(ctx, item.key)
        if value in item.neutral or not _user_set(ctx, item.key, value):
            continue
        ctx.error(f"{item.key} is a vLLM setting: it {item.why}", item.key,
                  hint=f"remove {item.key} (generation.backend is megatron)")


@rule("RLC403", "Megatron inference: which model generates and which refit switches apply",
      severities=("error", "info"),
      rationale="Shared mode generates on the training model: no weights move, but the trainer's parameters must "
                "stay on the GPU while it generates (refit.offload_params_for_generation would take them away) and "
                "the inference layout must be the trainer's. Dedicated mode keeps a second model in the inference "
                "layout and refits it every step with swap_model_weights, after which the trainer's parameters may "
                "go to host memory as NeMo-RL does. The vLLM refit's switches (per-rank IPC metadata, the MTP "
                "embedding dedupe, fp32 on the wire) have nothing to act on here; the parameter sync before the "
                "refit still applies (the engine or the swap reads the parameters) and so does the optimizer "
                "offload (NeMo-RL applies it to every colocated refit).",
      seed="NeMo-RL PR #3490: MegatronWeightSynchronizer (colocated: offload_before_refit, then wake the engine; "
           "dedicated: swap_model_weights then the training params to host memory); "
           "dedicated_inference_megatron_cfg (dedicated only when layout or transformer_impl differ).",
      fixes="generation.megatron.mode: auto (or dedicated where the layouts differ); "
            "refit.offload_params_for_generation: false in shared mode.")
def inference_mode(ctx: Context) -> None:
    r = ctx.recipe
    if not uses_megatron(r):
        return
    model = inference_model(r)
    if r.generation.megatron.mode == "shared" and model.differs:
        ctx.error("generation.megatron.mode shared, but the inference model differs from the training model ("
                  + "; ".join(model.differs) + "): shared mode generates on the training model itself",
                  f"{G}.mode", hint=f"{G}.mode: dedicated (or auto)")
        return
    ctx.decide("generation.megatron.mode", model.mode, model.reason)
    ctx.decide("generation.megatron.transformer_impl", model.transformer_impl,
               "set in recipe" if r.generation.megatron.transformer_impl != "auto" else "auto -> the trainer's")
    ctx.decide("generation.megatron.router_dtype", model.router_dtype,
               "set in recipe" if r.generation.megatron.router_dtype != "auto" else
               "auto -> the trainer's (training.moe.router_dtype)")
    kind = weight_sync_kind(r)
    ctx.decide("weight_sync", kind, ("megatron-core swap_model_weights into the dedicated inference model every "
                                     "refit") if kind == "megatron-swap" else
               "shared mode: the engine reads the trainer's parameters, the refit moves no bytes")
    if r.generation.megatron.mode == "auto":
        ctx.info(f"generation.megatron.mode: {model.reason}", f"{G}.mode")
    na = "off: n/a with generation.backend megatron (no IPC stream: the engine reads Megatron's own tensors)"
    ctx.decide("refit.per_rank_ipc_metadata", False, na)
    ctx.decide("refit.dedupe_mtp_embedding", False, na)
    ctx.decide("refit.fp32_params", [], "n/a with generation.backend megatron: the shared engine reads the trainer's "
               "tensors; swap_model_weights keeps each persistent buffer's dtype (the fp32 router bias stays fp32)")
    if model.mode == "shared" and r.refit.offload_params_for_generation:
        ctx.error("refit.offload_params_for_generation moves the trainer's parameters to host memory while the "
                  "engine generates, but in shared mode the engine generates with exactly those parameters",
                  "refit.offload_params_for_generation",
                  hint=f"refit.offload_params_for_generation: false (or {G}.mode: dedicated)")
    if model.mode == "shared" and r.refit.verify_every:
        ctx.info("refit.verify_every: nothing to compare in shared mode (the engine reads the trainer's own "
                 "tensors); the runtime skips the check", "refit.verify_every")


@rule("RLC404", "sampling the Megatron engine cannot do as vLLM does", severities=("error",),
      rationale="megatron-core 0.19's sampler asserts 'Cannot have top-p and top-k both greater than zero'; a request "
                "has one termination id (the tokenizer's end of sequence), so extra stop token ids cannot be "
                "honoured; stop strings are matched as the token ids of each string tokenized alone, so a stop "
                "string that the model produces with other token boundaries never stops it (vLLM matches text), "
                "and the stop tokens are cut from the response, which vLLM keeps. Speculative decoding drafts only "
                "with the model's own MTP layers, at most one token per MTP layer, and its logprobs are the raw "
                "model's (megatron-core refuses processed logprobs with speculative tokens).",
      seed="megatron-core 0.19 inference/sampling/torch_sampling.py (top-k with top-p assert); sampling_params.py "
           "(one termination_id); engines/dynamic_engine.py (stop words as token ids; 'Number of speculative "
           "tokens … must be less than or equal to number of MTP layers'); inference/config.py "
           "(\"logprobs_mode='processed_logprobs' is not yet supported with speculative decoding\").",
      fixes="top_k: -1 or top_p: 1.0; no stop_token_ids and no stop strings (end responses with the EOS token); "
            "speculative decoding with method mtp, no more tokens than MTP layers, at temperature 1 without "
            "top-k/top-p.")
def sampling(ctx: Context) -> None:
    r = ctx.recipe
    if not uses_megatron(r):
        return
    s = r.generation.sampling
    path = "generation.sampling"
    if s.top_k > 0 and s.top_p < 1.0:
        ctx.error(f"top_k {s.top_k} with top_p {s.top_p}: megatron-core's sampler refuses both at once "
                  "('Cannot have top-p and top-k both greater than zero')", f"{path}.top_k",
                  hint=f"{path}.top_k: -1 or {path}.top_p: 1.0")
    if s.stop_token_ids:
        ctx.error(f"stop_token_ids {list(s.stop_token_ids)}: a megatron-core request stops on one termination id "
                  "(the tokenizer's EOS) only", f"{path}.stop_token_ids", hint=f"remove {path}.stop_token_ids")
    if s.stop:
        ctx.error(f"stop strings {list(s.stop)}: megatron-core matches each as the token ids of the string tokenized "
                  "alone and cuts them from the response, so a stop string produced with other token boundaries "
                  "never stops it and the responses differ from vLLM's", f"{path}.stop",
                  hint=f"remove {path}.stop (responses end at EOS or sampling.max_tokens)")
    spec = r.generation.speculative_decoding
    if spec is None:
        return
    sp = "generation.speculative_decoding"
    if spec.method != "mtp":
        ctx.error(f"speculative decoding method {spec.method}: megatron-core drafts only with the model's MTP layers",
                  f"{sp}.method", hint=f"{sp}.method: mtp, or no speculative decoding")
        return
    layers = None if ctx.facts is None else ctx.facts.mtp_num_layers
    if layers is not None and spec.num_speculative_tokens > layers:
        ctx.error(f"{spec.num_speculative_tokens} speculative tokens but the trained model has {layers} MTP layer(s): "
                  "megatron-core asserts one MTP layer per speculative token", f"{sp}.num_speculative_tokens",
                  hint=f"{sp}.num_speculative_tokens: {max(1, layers)}" if layers else f"remove {sp}")
    if s.temperature != 1.0 or s.top_p < 1.0 or s.top_k > 0:
        ctx.error("speculative decoding with temperature, top-p or top-k: the trainer compares processed logprobs, "
                  "which megatron-core does not produce with speculative tokens", sp,
                  hint="temperature 1.0 without top-p/top-k, or no speculative decoding")


@rule("RLC405", "megatron-core 0.19 inference: what its layers and routers cannot run", severities=("error", "info"),
      needs=("facts",),
      rationale="transformer_impl inference_optimized in megatron-core 0.19 refuses MoE layers with gated linear "
                "units (SwiGLU: Qwen3-MoE, DeepSeek-V3), expert tensor parallelism and a router not in fp32 "
                "(TransformerConfig checks), asserts RMSNorm and no linear or QKV bias, needs sequence parallelism "
                "with TP > 1, and its InferenceTopKRouter asserts moe_router_num_groups is None: a degenerate HF "
                "n_group of 1 is reset (NeMo-RL PR #3490), group-limited routing (n_group > 1) cannot run. The "
                "dynamic inference context raises NotImplementedError for gated delta-net (linear attention) layers "
                "with either implementation, and runs multi-latent attention (DeepSeek-V3) only with latent caching, "
                "which the training forward refuses.",
      seed="megatron-core 0.19 transformer_config.py (\"--transformer-impl='inference_optimized' does not yet "
           "support gated linear units (SwiGLU/GeGLU)\"); moe/router.py ('InferenceTopKRouter requires "
           "moe_router_num_groups=None'); inference/contexts/dynamic_context.py ('GDN layers are not supported "
           "for inference'); transformer/multi_latent_attention.py (dynamic batching asserts cache_mla_latents, "
           "which asserts not training); NeMo-RL PR #3490 (_apply_moe_config resets moe_router_num_groups 1 -> None).",
      fixes="generation.megatron.transformer_impl: auto (Transformer Engine layers) for SwiGLU MoE models, grouped "
            "routers and biased layers; generation.megatron.router_dtype: fp32 (or training.moe.router_dtype: fp32); "
            "parallelism.train.etp: 1; "
            "generation.backend: vllm for gated delta-net and multi-latent attention models.")
def layer_limits(ctx: Context) -> None:
    r, f = ctx.recipe, ctx.facts
    if not uses_megatron(r):
        return
    kinds = f.layer_kinds or ()
    if any(mixer == "linear_attention" for mixer, _ in kinds):
        ctx.error(f"{f.model_id} has linear-attention (gated delta-net) layers, which megatron-core 0.19's inference "
                  "context does not run ('GDN layers are not supported for inference')", "generation.backend",
                  hint="generation.backend: vllm")
    if any(mixer == "mla" for mixer, _ in kinds):
        ctx.error(f"{f.model_id} has multi-latent attention: megatron-core 0.19's dynamic engine runs it only with "
                  "latent caching ('currently to use dynamic backend for MLA cache mla latents must be true': 64-token "
                  "blocks, FlashMLA decode), which its training forward refuses ('cache_mla_latents conflicts with "
                  "training') and the bundled runtime does not set up", "generation.backend",
                  hint="generation.backend: vllm")
    if not f.is_moe and r.generation.megatron.router_dtype != "auto":
        ctx.error(f"generation.megatron.router_dtype {r.generation.megatron.router_dtype}: {f.model_id} has no MoE "
                  "router (a dense model), and a router dtype of its own would only build a dedicated inference model",
                  f"{G}.router_dtype", hint=f"{G}.router_dtype: auto")
    if not any(mixer == "mamba" for mixer, _ in kinds):
        for key in ("mamba_ssm_states_dtype", "mamba_conv_states_dtype"):
            value = getattr(r.generation.megatron, key)
            if value != "auto":
                ctx.error(f"generation.megatron.{key} {value}: {f.model_id} has no Mamba layers, so the engine keeps "
                          "no Mamba state and the setting changes nothing", f"{G}.{key}", hint=f"{G}.{key}: auto")
    if inference_model(r).transformer_impl != "inference_optimized":
        return
    path = f"{G}.transformer_impl"
    hint = f"{path}: auto (Transformer Engine layers)"
    if f.is_moe:
        if f.gated_mlp:
            ctx.error(f"{f.model_id}'s experts use gated linear units (SwiGLU); megatron-core 0.19's "
                      "inference-optimized MoE refuses them (\"does not yet support gated linear units\")", path,
                      hint=hint)
        if r.parallelism.train.etp > 1:
            ctx.error(f"expert tensor parallelism {r.parallelism.train.etp}: inference-optimized MoE layers do not "
                      "support it", path, hint=f"{hint}, or parallelism.train.etp: 1")
        router = inference_model(r).router_dtype
        if router != "fp32":
            own = r.generation.megatron.router_dtype != "auto"
            source = f"{G}.router_dtype" if own else "the trainer's training.moe.router_dtype"
            ctx.error(f"the generating model routes in {router} ({source}): inference-optimized MoE requires the "
                      "router in fp32 (--moe-router-dtype=fp32)",
                      f"{G}.router_dtype" if own else "training.moe.router_dtype",
                      hint=f"{G}.router_dtype: fp32 (the dedicated inference model routes in fp32, the trainer keeps "
                           "its own dtype), or training.moe.router_dtype: fp32")
        groups = getattr(f, "router_groups", None)
        if groups is not None and groups > 1:
            ctx.error(f"{f.model_id} routes within {groups} expert groups (n_group); InferenceTopKRouter asserts "
                      "moe_router_num_groups is None", path, hint=hint)
        if reset_router_num_groups(r, f):
            ctx.decide("generation.megatron.reset_router_num_groups", True,
                       "n_group 1 routes like no groups; InferenceTopKRouter asserts moe_router_num_groups is None "
                       "(NeMo-RL PR #3490)")
            ctx.info("moe_router_num_groups 1 -> None for the inference model (InferenceTopKRouter asserts None; "
                     "one group routes identically)", path)
    if f.attention_bias:
        ctx.error(f"{f.model_id} has attention biases; inference-optimized layers assert no linear or QKV bias",
                  path, hint=hint)
    g = r.parallelism.generation
    if g.tp > 1 and not r.parallelism.train.sequence_parallel:
        ctx.error(f"inference TP {g.tp} without sequence parallelism: inference-optimized layers need it with TP > 1",
                  "parallelism.train.sequence_parallel", hint="parallelism.train.sequence_parallel: true")


@rule("RLC406", "Megatron's KV pool must hold one full-length request", severities=("error", "info"),
      needs=("facts",),
      rationale="megatron-core's engine has a fixed KV pool (buffer_size_gb) of blocks of block_size_tokens tokens; "
                "a request needs ceil(max_model_len / block) blocks (one more with speculative decoding) and one "
                "block is the engine's dummy block. A pool that cannot hold one full-length request fails the "
                "request (BlockOverflowError) at the first long rollout. The engine also asserts max_tokens >= "
                "max_requests, and the default request count (the pool's blocks, rounded down to a multiple of 4) "
                "can exceed the default 16384 tokens on a large pool or be 0 on a tiny one. A hybrid (Mamba) "
                "model's request also holds its Mamba state: megatron-core reserves one beside every block when it "
                "derives the request count, and sets aside max_requests of them first when that is given.",
      seed="megatron-core 0.19 inference/contexts/dynamic_context.py (block bytes, 'max_tokens … must be >= "
           "max_requests'); engines/dynamic_engine.py (_add_request: BlockOverflowError when the request needs "
           "more blocks than the pool has).",
      fixes="Raise generation.kv_cache_memory_bytes (the message names the size), lower generation.max_model_len or "
            "block_size_tokens; set generation.megatron.max_requests at most max_tokens.")
def kv_pool_holds_a_request(ctx: Context) -> None:
    r, f = ctx.recipe, ctx.facts
    if not uses_megatron(r):
        return
    gen = r.generation
    concurrent = max(1, r.grpo.samples_per_step // max(1, r.cluster.world_size))
    if gen.kv_cache_memory_bytes is None:
        need = pool_bytes_for(r, f, concurrent)
        ctx.error("generation.backend megatron needs generation.kv_cache_memory_bytes: megatron-core's engine "
                  "allocates a fixed KV pool", "generation.kv_cache_memory_bytes",
                  hint=(f"generation.kv_cache_memory_bytes: {need} holds all {concurrent} rollouts per GPU of a step "
                        "at max_model_len") if need else "set generation.kv_cache_memory_bytes")
        return
    pool = kv_pool(r, f)
    if pool is None:
        ctx.info("the KV pool's block size needs the model's layer count, heads and head size: not checked",
                 "generation.kv_cache_memory_bytes")
        return
    path = "generation.kv_cache_memory_bytes"
    mamba = mamba_state_bytes(r, f)
    asked = gen.megatron.max_requests
    if mamba and asked is not None and asked * mamba >= pool.pool_bytes:
        ctx.error(f"{G}.max_requests {asked} of a hybrid model hold {asked * mamba} bytes of Mamba state, all of the "
                  f"{pool.pool_bytes}-byte pool: megatron-core asserts 'Not enough memory for {asked} mamba requests'",
                  f"{G}.max_requests",
                  hint=f"{path}: {asked * mamba + (pool_bytes_for(r, f, 1) or 0)} or more, or fewer {G}.max_requests")
        return
    if pool.blocks - 1 < pool.blocks_per_request:
        need = pool_bytes_for(r, f, 1)
        ctx.error(f"the KV pool of {pool.pool_bytes} bytes holds {pool.blocks} blocks of {pool.block_bytes} bytes "
                  f"(one is megatron-core's dummy block), but one request of max_model_len {gen.max_model_len} "
                  f"needs {pool.blocks_per_request}: it would fail with BlockOverflowError", path,
                  hint=f"{path}: {need} or more, or a smaller max_model_len / block_size_tokens")
        return
    if pool.max_requests < 1:
        ctx.error(f"the KV pool holds {pool.blocks - 1} blocks; megatron-core rounds its request count down to a "
                  f"multiple of 4, which leaves 0 requests", path,
                  hint=f"{path}: {pool_bytes_for(r, f, 4)} or more, or {G}.max_requests")
        return
    if pool.max_requests > pool.max_tokens:
        key = f"{G}.max_requests" if gen.megatron.max_requests is not None else path
        ctx.error(f"{pool.max_requests} requests per step > max_tokens {pool.max_tokens}: megatron-core asserts "
                  "'max_tokens … must be >= max_requests'", key,
                  hint=f"{G}.max_requests: {pool.max_tokens} (or raise {G}.max_tokens)")
        return
    tp = r.parallelism.generation.tp
    if gen.megatron.max_requests is not None and gen.megatron.max_requests % tp:
        ctx.error(f"{G}.max_requests {gen.megatron.max_requests} is not a multiple of the inference TP {tp} "
                  "(megatron-core asserts it)", f"{G}.max_requests")
        return
    at_once = min(pool.full_requests, pool.max_requests)
    waves = -(-concurrent // max(1, at_once))
    ctx.info(f"KV pool: {pool.blocks} blocks of {pool.block_tokens} tokens; {at_once} full-length requests at once "
             f"for {concurrent} rollouts per GPU per step ({waves} wave(s) at worst)", path)


@rule("RLC407", "generation with the Megatron engine must fit the GPU", severities=("error",), needs=("plan",),
      rationale="While the engine generates, the GPU holds the trainer as the refit left it (its bf16 parameters "
                "in shared mode), the dedicated inference model's weights, the fixed KV pool, and the engine's "
                "activations and logits; in dedicated mode the swap briefly holds both weight copies. The plan adds "
                "them up per phase (rlc plan); more than the GPU has fails at the first rollout or refit.",
      seed="NeMo-RL PR #3490: the training params go to host memory after the swap, and torch_memory_saver "
           "pauses the inference weights during training ('a silent ~2x memory regression' without it).",
      fixes="Lower generation.kv_cache_memory_bytes or generation.megatron.max_tokens; in dedicated mode set "
            "refit.offload_params_for_generation: true; or shard the model further.")
def generation_fits(ctx: Context) -> None:
    if not uses_megatron(ctx.recipe):
        return
    plan = ctx.plan
    for key in ("mcore_generate_fit", "mcore_swap_fit"):
        check = plan.checks.get(key)
        if check is None or check.ok is not False:
            continue
        dedicated = inference_model(ctx.recipe).mode == "dedicated"
        hint = "lower generation.kv_cache_memory_bytes or generation.megatron.max_tokens"
        if dedicated and key == "mcore_generate_fit" and not ctx.recipe.refit.offload_params_for_generation:
            hint += "; or refit.offload_params_for_generation: true (the trainer's parameters to host memory)"
        ctx.error(check.text + " (rlc plan shows every item)", "generation.kv_cache_memory_bytes", hint=hint)


__all__: list[str] = []
