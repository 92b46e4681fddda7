"""megatron-core's dynamic inference engine in a policy worker: build, generate, suspend/resume, and the dedicated
inference model with its ``swap_model_weights`` refit and bit-exact check.

Runs inside a policy worker (torch, megatron-core and Megatron-Bridge imported in the functions). Every API is
megatron-core 0.19's: ``InferenceConfig`` -> ``DynamicInferenceContext`` -> ``GPTInferenceWrapper`` ->
``TextGenerationController`` -> ``DynamicInferenceEngine`` (as ``MegatronLLM`` builds them, without its direct-mode
refusal of suspend/resume), driven in direct mode (``add_request`` + ``step_modern`` in this process, no
coordinator); ``build_inference_pg_collection`` + ``prepare_swap_model_weights`` / ``swap_model_weights`` for the
dedicated model (NeMo-RL PR #3490's colocated reshard). Settings and outputs as plain data live in
``rlc.runtime.generation.megatron_sampling`` (CPU-tested).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from rlc.contract.runtime_config import RuntimeConfig, SamplingConfig
from rlc.runtime.generation.megatron_sampling import (group_samples, inference_config_kwargs, mamba_state_dtypes,
                                                      parse_request, sampling_params_kwargs)
from rlc.runtime.generation.reshard_plan import Grid, ReshardLayout
from rlc.runtime.worker_api import Sample


def unwrap(model: Any) -> Any:
    """The bare ``GPTModel`` of a DDP / Float16Module-wrapped chunk."""
    from megatron.core.utils import unwrap_model  # noqa: PLC0415

    return unwrap_model(model)


def clear_rotary_cache(model: Any) -> None:
    """Drop the rotary embedding's ``lru_cache`` (its entries depend on the mode the model last ran in)."""
    rotary = getattr(unwrap(model), "rotary_pos_emb", None)
    forward = getattr(rotary, "forward", None)
    if forward is not None and hasattr(forward, "cache_clear"):
        forward.cache_clear()


def keep_router_bias_fp32(model: Any) -> int:
    """Cast every MoE router's ``expert_bias`` to fp32 now (megatron-core does it at the router's first forward or
    state-dict load): swap_model_weights records each source buffer's dtype at the first swap and keeps it, so an
    fp32 bias must be fp32 before then. Returns the routers touched."""
    touched = 0
    for module in unwrap(model).modules():
        fix = getattr(module, "_maintain_float32_expert_bias", None)
        if callable(fix) and getattr(module, "expert_bias", None) is not None:
            fix()
            touched += 1
    return touched


# --------------------------------------------------------------------------- the engine

FLASH_ATTENTION_MISSING = (
    "generation.backend megatron: megatron-core's dynamic inference engine needs FlashAttention with paged KV "
    "(flash-attn >= 2.7.3, FlashAttention-3 as flash_attn_3, or flash-attn-4 >= 4.0.0b20; megatron-core asserts "
    "'flash attn verion v2.7.3 and above is required for dynamic batching' at the first forward), and none "
    "imports in this container (vLLM's own vllm_flash_attn is not one of them); install one in the container "
    "image (on Hopper next to vLLM 0.22: FlashAttention-3, e.g. tokenspeed-fa3 3.0.0.post20260810, with its "
    "flash_attn_interface.py also in the flash_attn_3 package; flash-attn-4 breaks vLLM 0.22's rotary embedding, "
    "vLLM #42675), or generate with generation.backend: vllm")

FA3_LAYOUT_HINT = (
    "FlashAttention-3 is installed, but its interface is the top-level module flash_attn_interface ({src}) and "
    "megatron-core 0.19 imports flash_attn_3.flash_attn_interface: copy that file into {dst}")


def fa3_layout_hint() -> str | None:
    """The fix when a FlashAttention-3 wheel's interface module is not where megatron-core imports it, else None
    (finds modules without importing them: no CUDA needed)."""
    import importlib.util  # noqa: PLC0415

    try:
        top = importlib.util.find_spec("flash_attn_interface")
        pkg = importlib.util.find_spec("flash_attn_3")
        if top is None or pkg is None or not pkg.submodule_search_locations:
            return None
        if importlib.util.find_spec("flash_attn_3.flash_attn_interface") is not None:
            return None
    except (ImportError, ValueError):
        return None
    return FA3_LAYOUT_HINT.format(src=top.origin, dst=next(iter(pkg.submodule_search_locations)))


def flash_attention() -> str | None:
    """Which FlashAttention megatron-core's dynamic batching will use here (None: none it accepts)."""
    from megatron.core.transformer import attention  # noqa: PLC0415

    if getattr(attention, "HAVE_FA4", False):
        return "flash-attn-4"
    if getattr(attention, "HAVE_FA3", False):
        return "FlashAttention-3"
    try:
        from megatron.core.utils import is_fa_min_version  # noqa: PLC0415

        if getattr(attention, "flash_attn_varlen_func", None) is not None and is_fa_min_version("2.7.3"):
            return "flash-attn 2"
    except Exception:  # noqa: BLE001 - no flash-attn distribution: megatron-core's version check raises
        pass
    return None


def require_flash_attention() -> str:
    """The FlashAttention in use, or a clear error before any model is built (not an assert mid-rollout)."""
    found = flash_attention()
    if found is None:
        hint = fa3_layout_hint()
        raise RuntimeError(hint if hint else FLASH_ATTENTION_MISSING)
    return found


def build_engine(gen_model: Any, cfg: RuntimeConfig, tokenizer: Any, *, pg_collection: Any = None) -> Any:
    """A suspended ``DynamicInferenceEngine`` on ``gen_model`` (its KV pool freed per
    ``generation.megatron.kv_cache``)."""
    from megatron.core.inference.config import (  # noqa: PLC0415
        InferenceConfig, KVCacheManagementMode, MambaInferenceStateConfig)
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext  # noqa: PLC0415
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine  # noqa: PLC0415
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (  # noqa: PLC0415
        GPTInferenceWrapper)
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (  # noqa: PLC0415
        TextGenerationController)
    from megatron.core.utils import get_model_config  # noqa: PLC0415

    kwargs = inference_config_kwargs(cfg)
    kwargs["kv_cache_management_mode"] = KVCacheManagementMode(kwargs["kv_cache_management_mode"])
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    states = {k: None if name is None else getattr(torch, name) for k, name in mamba_state_dtypes(cfg).items()}
    mamba = MambaInferenceStateConfig.from_model(gen_model, **states)
    if mamba is not None:
        kwargs["mamba_inference_state_config"] = mamba
    config = get_model_config(gen_model)
    config.flash_decode = False  # the deprecated static-batching decode path (NeMo-RL PR #3490)
    config.inference_sampling_seed = int(cfg.grpo.seed)  # megatron-core adds the data-parallel rank
    context = DynamicInferenceContext(config, InferenceConfig(**kwargs))
    controller = TextGenerationController(GPTInferenceWrapper(gen_model, context), tokenizer)
    engine = DynamicInferenceEngine(controller, context)  # marks InferenceMode active: suspend clears it
    engine.suspend()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return engine


def pool_facts(engine: Any) -> dict[str, Any]:
    """The KV pool as megatron-core sized it (for the log and the plan comparison)."""
    ctx = engine.context
    return {"blocks": int(ctx.kv_block_allocator.total_count), "block_bytes": int(ctx.block_size_bytes),
            "block_tokens": int(ctx.block_size_tokens), "max_requests": int(ctx.max_requests),
            "max_tokens": int(ctx.max_tokens), "max_sequence_length": int(ctx.max_sequence_length)}


def generate(engine: Any, prompts: list[list[int]], n: int, sampling: SamplingConfig, *, eos_token_id: int | None,
             decode: Any) -> list[list[Sample]]:
    """``n`` samples of every prompt (one request each, prompt by prompt)."""
    from megatron.core.inference.sampling_params import SamplingParams  # noqa: PLC0415

    kw = sampling_params_kwargs(sampling, eos_token_id)
    ids = []
    for prompt in prompts:
        for _ in range(n):
            rid = int(next(engine.request_counter))
            engine.add_request(rid, [int(t) for t in prompt], SamplingParams(**kw))
            ids.append(rid)
    finished: dict[int, Any] = {}
    # every step samples a token for some request; more steps than tokens requested means the engine is stuck
    limit = len(ids) * (int(sampling.max_tokens) + 2) + 100
    steps = 0
    while engine.has_unfinished_requests():
        result = engine.step_modern()
        for record in result["finished_request_records"]:
            finished[int(record.request_id)] = record
        steps += 1
        if steps > limit:
            raise RuntimeError(f"megatron-core's engine ran {steps} steps for {len(ids)} requests of at most "
                               f"{sampling.max_tokens} tokens without finishing them (requests paused for KV "
                               "blocks that never free?); check generation.kv_cache_memory_bytes")
    for rid in ids:  # a request refused when it was added finishes without a step
        if rid not in finished and rid in engine.requests:
            finished[rid] = engine.requests.pop(rid).record
    engine.failed_request_ids.clear()
    missing = [rid for rid in ids if rid not in finished]
    if missing:
        raise RuntimeError(f"megatron-core's engine returned no result for {len(missing)} of {len(ids)} requests "
                           f"(ids {missing[:5]}...)")
    flat = [parse_request(finished[rid].merge(), eos_token_id=eos_token_id, max_tokens=int(sampling.max_tokens),
                          decode=decode) for rid in ids]
    return group_samples(flat, n)


# --------------------------------------------------------------------------- the dedicated inference model


def build_inference_model(bridge: Any, cfg: RuntimeConfig) -> tuple[Any, Any]:
    """The dedicated inference model (``generation.megatron.mode: dedicated``): the trainer's provider, no HF load
    (every tensor comes from the swap), no recompute, the inference layout's process groups
    (``build_inference_pg_collection``), not DDP-wrapped. Returns ``(model, pg_collection)``."""
    from megatron.core.inference.shards import build_inference_pg_collection  # noqa: PLC0415

    from rlc.runtime.policy.megatron_setup import make_provider, torch_dtype  # noqa: PLC0415

    m, g, t = cfg.generation.megatron, cfg.generation_parallel, cfg.train_parallel
    if m is None:
        raise RuntimeError("the dedicated inference model: runtime.yaml has no generation.megatron (compiled for vLLM)")
    provider = make_provider(bridge, cfg, load_weights=False)
    provider.recompute_granularity = None
    provider.recompute_method = None
    provider.recompute_num_layers = None
    provider.perform_initialization = False  # the swap writes every parameter and persistent buffer
    provider.virtual_pipeline_model_parallel_size = None
    provider.tensor_model_parallel_size = g.tp
    provider.pipeline_model_parallel_size = g.pp
    provider.expert_model_parallel_size = g.ep
    etp = inference_expert_tp(cfg)
    provider.expert_tensor_parallel_size = etp
    provider.context_parallel_size = 1
    provider.sequence_parallel = bool(t.sequence_parallel and g.tp > 1)
    if m.router_dtype != "auto":  # its own (NeMo-RL merges it over the trainer's for its dedicated model only)
        provider.moe_router_dtype = m.router_dtype
    if m.transformer_impl == "inference_optimized":
        provider.transformer_impl = "inference_optimized"
        if m.reset_router_num_groups:
            provider.moe_router_num_groups = None
            provider.moe_router_group_topk = None
    provider.finalize()
    # collective: every trainer rank builds the same groups in the same order (new_group)
    pg = build_inference_pg_collection(torch.distributed.get_world_size(), tp_size=g.tp, pp_size=g.pp, cp_size=1,
                                       ep_size=g.ep, expt_tp_size=etp)
    dtype = torch_dtype(cfg.model.dtype)
    chunks = provider.provide_distributed_model(wrap_with_ddp=False, bf16=dtype == torch.bfloat16,
                                                fp16=dtype == torch.float16, pg_collection=pg)
    if len(chunks) != 1:
        raise NotImplementedError(f"the inference model has {len(chunks)} chunks; megatron-core's engine and "
                                  "swap_model_weights run one (parallelism.train.vpp must be 1)")
    model = chunks[0]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, pg


def resharded(cfg: RuntimeConfig) -> bool:
    """The inference layout differs from the trainer's: the swap moves slices between GPUs."""
    g, t = cfg.generation_parallel, cfg.train_parallel
    return (g.tp, g.pp, g.ep) != (t.tp, t.pp, t.ep) or t.cp > 1


def inference_expert_tp(cfg: RuntimeConfig) -> int:
    """The inference model's expert-TP size: the trainer's with the trainer's layout, else the inference TP
    (megatron-core's default: experts split like the dense layers)."""
    return cfg.train_parallel.etp if not resharded(cfg) else cfg.generation_parallel.tp


def reshard_layout(cfg: RuntimeConfig) -> ReshardLayout:
    """Both grids of this run (``rlc.runtime.generation.reshard_plan``)."""
    t, g = cfg.train_parallel, cfg.generation_parallel
    world = cfg.cluster.world_size
    return ReshardLayout(Grid(world, t.tp, t.ep, t.etp), Grid(world, g.tp, g.ep, inference_expert_tp(cfg)))


def refit_tensors(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer swap_model_weights writes, by name (megatron-core's own walk)."""
    from megatron.core.resharding.utils import named_refit_tensors  # noqa: PLC0415

    return dict(named_refit_tensors(unwrap(model)))


@dataclass
class FreedWeights:
    """Storage sizes of the inference model's tensors while their memory is given back (between rollouts)."""

    sizes: list[tuple[torch.Tensor, int]]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.sizes)


def free_weights(model: Any) -> FreedWeights:
    """Give the inference model's weights' GPU memory back (storage resized to 0, as megatron-core's DDP buffer
    offload does): the next swap writes every one of them, so nothing is copied out."""
    seen: dict[int, tuple[torch.Tensor, int]] = {}
    for tensor in refit_tensors(model).values():
        storage = tensor.data.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (tensor, storage.nbytes())
    torch.cuda.synchronize()
    for tensor, _ in seen.values():
        tensor.data.untyped_storage().resize_(0)
    torch.cuda.empty_cache()
    return FreedWeights(list(seen.values()))


def restore_weights(freed: FreedWeights | None) -> int:
    """Allocate the freed storage again (its values are undefined until the swap writes them)."""
    if freed is None:
        return 0
    for tensor, nbytes in freed.sizes:
        tensor.data.untyped_storage().resize_(nbytes)
    return freed.nbytes


def prepare_swap(train_chunk: Any, inference_model: Any) -> dict[str, Any]:
    """Build and cache megatron-core's reshard plan (collective over all ranks); the trainer's router biases fp32."""
    from megatron.core.resharding.refit import prepare_swap_model_weights  # noqa: PLC0415

    t0 = time.perf_counter()
    routers = keep_router_bias_fp32(train_chunk)
    prepare_swap_model_weights(train_chunk, inference_model, group=None, src_rank_offset=0, dst_rank_offset=0)
    return {"routers_fp32": routers, "prepare_s": time.perf_counter() - t0}


def swap(train_chunk: Any, inference_model: Any, refit_backend: str) -> dict[str, Any]:
    """``swap_model_weights`` from the training chunk into the inference model."""
    from megatron.core.resharding.refit import swap_model_weights  # noqa: PLC0415

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    swap_model_weights(train_chunk, inference_model, refit_method=refit_backend, group=None)
    torch.cuda.synchronize()
    tensors = refit_tensors(inference_model)
    return {"seconds": time.perf_counter() - t0, "num_tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def verify_swap(train_chunk: Any, inference_model: Any, *, resharded: bool = False) -> dict[str, Any]:
    """Every tensor of the inference model equal, bit for bit and in dtype, to the trainer's of the same name
    (the trainer's layout: same names and shapes) or, ``resharded``, to its slice of the trainer's tensor
    gathered over the trainer's groups (``rlc.runtime.generation.reshard_verify``; collective over all ranks);
    ``rlc.runtime.refit.verify.VerifyReport`` as a dict."""
    from rlc.runtime.refit.verify import ParamMismatch, compare_parameters  # noqa: PLC0415

    got = refit_tensors(inference_model)
    with torch.no_grad():
        if resharded:
            from rlc.runtime.generation import reshard_verify  # noqa: PLC0415

            whole = reshard_verify.gathered_training_tensors(unwrap(train_chunk), refit_tensors(train_chunk))
            reference, _ = reshard_verify.expected_inference_tensors(unwrap(inference_model), got, whole)
        else:
            reference = refit_tensors(train_chunk)
        report = compare_parameters(got, reference)
    out = report.to_dict()
    extra = sorted(set(got) - set(reference))
    for name in extra:  # a tensor of the inference model no trainer tensor wrote
        t = got[name]
        out["mismatches"].append(ParamMismatch(name, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel(),
                                               float("inf"), False, 0).__dict__)
    out["bit_exact"] = not out["mismatches"] and out["params_compared"] > 0
    out["not_in_trainer"] = extra
    return out


__all__ = [
    "FA3_LAYOUT_HINT",
    "FLASH_ATTENTION_MISSING",
    "FreedWeights",
    "build_engine",
    "fa3_layout_hint",
    "flash_attention",
    "require_flash_attention",
    "build_inference_model",
    "clear_rotary_cache",
    "free_weights",
    "generate",
    "keep_router_bias_fp32",
    "pool_facts",
    "prepare_swap",
    "inference_expert_tp",
    "refit_tensors",
    "reshard_layout",
    "resharded",
    "restore_weights",
    "swap",
    "unwrap",
    "verify_swap",
]
