"""NeMo-RL keys of the rollout engine whose rlc value depends on other keys: vLLM's options, its speculative
decoding and FP8 rollouts, and megatron-core inference (``mcore_generation_config``: which model generates, its
layout, KV pool and router dtype).

Each function takes the mapper of :mod:`.mapping` and adds values (``m.put`` / ``m.take``), consumed keys
(``m.consume``) or unmapped keys (``m.out.unmapped``) as the table rows there do.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlc.compiler.importers.nemo_rl.config_sections import MCORE, VLLM_CFG, M
from rlc.compiler.importers.nemo_rl.converters import (
    boolean,
    dtype,
    gib_to_bytes,
    kv_cache_mode,
    positive_int,
    refit_backend,
    router_dtype,
    state_dtype,
    transformer_impl,
)
from rlc.compiler.importers.nemo_rl.results import Unmappable, Unmapped
from rlc.contract.engine_options import VLLM_OWNED

if TYPE_CHECKING:
    from rlc.compiler.importers.nemo_rl.mapping import _Mapper


def expert_parallel_flag(m: _Mapper) -> None:
    key = f"{VLLM_CFG}.enable_expert_parallel"
    if key not in m.leaves:
        return
    m.consume(key, why="implied by parallelism.generation.ep > 1")
    ep = m.cfg.get(f"{VLLM_CFG}.expert_parallel_size") or 1
    if bool(m.leaves[key]) != (ep > 1):
        m.out.unmapped.append(Unmapped(key, m.leaves[key], f"rlc turns vLLM expert parallelism on exactly when "
                                       f"parallelism.generation.ep > 1 (here {ep})", effect="none"))


def vllm_kwargs(m: _Mapper) -> None:
    """``policy.generation.vllm_kwargs``: ``kv_cache_memory_bytes`` has a typed rlc key; the rest goes
    to ``generation.vllm_kwargs`` unchanged, except options rlc sets from typed keys."""
    prefix = "policy.generation.vllm_kwargs."
    if m.leaves.get(prefix[:-1]) == {}:
        m.consume(prefix[:-1], why="empty: no vLLM options")
    block: dict[str, Any] = {}
    sources: list[str] = []
    speculative: dict[str, str] = {}  # speculative_config option -> its NeMo-RL key
    for key, value in m.leaves.items():
        if not key.startswith(prefix):
            continue
        m.consumed.add(key)
        path = key[len(prefix):].split(".")
        if path == ["kv_cache_memory_bytes"]:
            m.take(key, "generation.kv_cache_memory_bytes", positive_int)
            continue
        if path[0] == "speculative_config" and len(path) == 2:
            speculative[path[1]] = key
            continue
        if path[0] in VLLM_OWNED:
            m.out.unmapped.append(
                Unmapped(key, value, f"rlc sets vLLM's {path[0]} from {VLLM_OWNED[path[0]]}", effect="none")
            )
            continue
        node = block
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        sources.append(key)
    caching = "policy.generation.vllm_cfg.enable_prefix_caching"  # NeMo-RL hands it to vllm.LLM (null: on)
    if caching in m.leaves:
        m.consume(caching, why="null: vLLM's default (prefix caching on)")
        if m.leaves[caching] is not None and "enable_prefix_caching" not in block:
            block["enable_prefix_caching"] = m.leaves[caching]
            sources.append(caching)
    if block:
        m.put("generation.vllm_kwargs", block, tuple(sources), "handed to vllm.LLM unchanged")
    if speculative:
        _speculative_config(m, speculative)


#: vLLM ``speculative_config`` options with a key under ``generation.speculative_decoding``.
_SPECULATIVE_KEYS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def _speculative_config(m: _Mapper, options: dict[str, str]) -> None:
    """``vllm_kwargs.speculative_config`` -> ``generation.speculative_decoding``: vLLM's MTP methods (``mtp`` and
    the per-model names it maps to ``mtp``, e.g. ``deepseek_mtp``) become ``mtp``; ``ngram`` stays."""
    method_key = options.get("method")
    method = str(m.leaves[method_key]) if method_key else ""
    typed = "mtp" if method == "mtp" or method.endswith("_mtp") else "ngram" if method == "ngram" else None
    if typed is None:
        for key in options.values():
            m.out.unmapped.append(
                Unmapped(
                    key,
                    m.leaves[key],
                    f"speculative method {method or '(none)'!r}: rlc "
                    "runs mtp or ngram (generation.speculative_decoding.method); it changes speed, not the samples",
                    effect="none",
                )
            )
        return
    m.put("generation.speculative_decoding.method", typed, (method_key,) if method_key else (),
          f"vLLM method {method!r}" if method != typed else "")
    for option, key in options.items():
        if option == "method":
            continue
        if option in _SPECULATIVE_KEYS and (typed == "ngram" or option == "num_speculative_tokens"):
            m.take(key, f"generation.speculative_decoding.{option}", positive_int)
        else:
            m.out.unmapped.append(Unmapped(key, m.leaves[key], f"generation.speculative_decoding ({typed}) has "
                                           f"no {option}"))


def vllm_precision(m: _Mapper) -> None:
    key = f"{VLLM_CFG}.precision"
    if key not in m.leaves:
        return
    if str(m.leaves[key]).lower() == "fp8":
        m.take(key, "generation.precision", lambda v: "fp8", "FP8 rollouts")
        return
    m.consume(key, why="equal to policy.precision (model.dtype)")
    try:
        same_dtype = dtype(m.leaves[key]) == dtype(m.cfg.get("policy.precision", "bfloat16"))
    except Unmappable:
        same_dtype = False
    if not same_dtype:
        m.out.unmapped.append(Unmapped(key, m.leaves[key], "rlc rolls out in model.dtype (the trainer's "
                                       "precision) or fp8 (generation.precision)"))


#: NeMo-RL's FP8-rollout options (vllm_cfg) with the value that means "nothing special".
_FP8_DEFAULTS = {"use_deep_gemm": False, "num_first_layers_in_bf16": 0, "num_last_layers_in_bf16": 0,
                 "pow2_activation_scaling_factors": False, "quantization_ignored_layer_kws": []}


#: What NeMo-RL's ``use_deep_gemm`` sets in its vLLM workers' environment (``nemo_rl/models/generation/vllm/
#: quantization/fp8.py``): DeepGEMM's block-FP8 GEMMs, scales not rounded to powers of two.
_DEEP_GEMM_ENV = {"VLLM_USE_DEEP_GEMM": "1", "VLLM_USE_DEEP_GEMM_E8M0": "0"}

_FP8_UNMAPPED = {
    "use_deep_gemm": "not a boolean (true sets VLLM_USE_DEEP_GEMM in cluster.env)",
    "num_first_layers_in_bf16": "rlc keeps only the embedding, LM head, norms and routers in bf16",
    "num_last_layers_in_bf16": "rlc keeps only the embedding, LM head, norms and routers in bf16",
    "pow2_activation_scaling_factors": "a NeMo-RL patch of vLLM's activation quantization; rlc runs vLLM's own",
}


def vllm_fp8(m: _Mapper) -> None:
    """NeMo-RL's FP8 rollouts are DeepSeek-style 128×128 block scales, quantized for vLLM at refit
    (``nemo_rl/models/generation/fp8.py``): ``generation.fp8.scales: block``; its power-of-two weight scales
    are ``pow2_scales``. Its other FP8 options patch vLLM and have no rlc equivalent unless left at their
    defaults."""
    keys = ["pow2_weight_scaling_factors", *_FP8_DEFAULTS]
    present = [f"{VLLM_CFG}.{k}" for k in keys if f"{VLLM_CFG}.{k}" in m.leaves]
    if str(m.leaves.get(f"{VLLM_CFG}.precision", "")).lower() != "fp8":
        m.consume(*present, why="only used with FP8 rollouts (policy.generation.vllm_cfg.precision: fp8)")
        return
    m.put("generation.fp8.scales", "block", (f"{VLLM_CFG}.precision",), "NeMo-RL's FP8 rollouts: 128×128 block scales")
    m.take(f"{VLLM_CFG}.pow2_weight_scaling_factors", "generation.fp8.pow2_scales", boolean)
    for key, default in _FP8_DEFAULTS.items():
        source = f"{VLLM_CFG}.{key}"
        if source not in m.leaves:
            continue
        value = m.leaves[source]
        if value is None or value == default or (isinstance(default, list) and not value):
            m.consume(source, why=f"{value!r}: the FP8 engine's default")
        elif key == "quantization_ignored_layer_kws" and isinstance(value, list):
            m.consumed.add(source)
            m.put("generation.fp8.keep_bf16", [str(v) for v in value], (source,),
                  "the layers whose module names contain one stay in bf16 on both sides")
        elif key == "use_deep_gemm" and value is True:
            m.consumed.add(source)
            for name, setting in _DEEP_GEMM_ENV.items():
                m.put(f"cluster.env.{name}", setting, (source,), "NeMo-RL sets it in vLLM's workers for DeepGEMM; "
                      "rlc for every task")
        else:
            m.consumed.add(source)
            m.out.unmapped.append(Unmapped(source, value, _FP8_UNMAPPED[key]))


#: ``mcore_generation_config`` layout keys -> (the trainer's key, the rlc generation key).
MCORE_LAYOUT = {"tensor_model_parallel_size": "parallelism.generation.tp",
                "pipeline_model_parallel_size": "parallelism.generation.pp",
                "expert_model_parallel_size": "parallelism.generation.ep"}


#: ``mcore_generation_config`` keys rlc has no setting for, and why.
MCORE_UNMAPPED = {
    "num_cuda_graphs": "rlc runs the Megatron engine eager (CUDA graphs are not captured)",
    "use_cuda_graphs_for_non_decode_steps": "rlc runs the Megatron engine eager (CUDA graphs are not captured)",
    "inference_cuda_graph_scope": "rlc runs the Megatron engine eager (CUDA graphs are not captured)",
    "enable_chunked_prefill": "rlc runs the Megatron engine without chunked prefill",
    "enable_prefix_caching": "rlc runs the Megatron engine without prefix caching",
    "expose_http_server": "rlc generates in process; it serves no HTTP endpoint",
    "parsers": "rlc generates in process; it serves no HTTP endpoint",
    "inference_grouped_gemm_backend": "megatron-core picks its grouped-GEMM kernels itself (speed)",
}


def mcore_dedicated(m: _Mapper) -> bool:
    """NeMo-RL builds a dedicated inference model when the merged inference layout or transformer_impl differs
    from the trainer's (its inference context parallelism is always 1)."""
    for key in (*MCORE_LAYOUT, "expert_tensor_parallel_size"):
        own = m.cfg.get(f"{MCORE}.{key}")
        if own is not None and own != (m.cfg.get(f"{M}.{key}") or 1):
            return True
    impl = m.cfg.get(f"{MCORE}.transformer_impl")
    if impl is not None and impl != m.cfg.get(f"{M}.transformer_impl", "transformer_engine"):
        return True
    return (m.cfg.get(f"{M}.context_parallel_size") or 1) > 1


def _inference_router_dtype(m: _Mapper, megatron: bool) -> None:
    """``mcore_generation_config.moe_router_dtype``: NeMo-RL merges it over ``megatron_cfg`` for a dedicated inference
    model only (``merged_inference_megatron_cfg``); a colocated engine on the training model routes as it trains."""
    key = f"{MCORE}.moe_router_dtype"
    if key not in m.leaves:
        return
    if megatron and not mcore_dedicated(m):
        m.consume(key, why="NeMo-RL generates on the training model here (same layout and transformer_impl), which "
                           "routes in policy.megatron_cfg.moe_router_dtype")
        return
    m.take(key, "generation.megatron.router_dtype", router_dtype,
           "the dedicated inference model's router dtype (NeMo-RL merges it over policy.megatron_cfg's)")


def mcore_generation(m: _Mapper, megatron: bool) -> None:
    """``policy.generation.backend: megatron``: ``mcore_generation_config`` -> ``generation.megatron`` and its
    neighbours; the inference layout is the trainer's unless ``mcore_generation_config`` overrides it (NeMo-RL
    merges it over ``megatron_cfg``)."""
    m.inactive(VLLM_CFG, "vLLM settings; policy.generation.backend is megatron")
    m.inactive("policy.generation.vllm_kwargs", "vLLM settings; policy.generation.backend is megatron")
    m.take(f"{MCORE}.buffer_size_gb", "generation.kv_cache_memory_bytes", gib_to_bytes,
           "megatron-core's fixed KV pool")
    m.take(f"{MCORE}.block_size_tokens", "generation.megatron.block_size_tokens", positive_int)
    m.take(f"{MCORE}.max_tokens", "generation.megatron.max_tokens", positive_int)
    m.take(f"{MCORE}.max_requests", "generation.megatron.max_requests", positive_int)
    m.take(f"{MCORE}.kv_cache_management_mode", "generation.megatron.kv_cache", kv_cache_mode)
    m.take(f"{MCORE}.refit_backend", "generation.megatron.refit_backend", refit_backend)
    m.take(f"{MCORE}.transformer_impl", "generation.megatron.transformer_impl", transformer_impl)
    m.take(f"{MCORE}.max_model_len", "generation.max_model_len", positive_int)
    _inference_router_dtype(m, megatron)
    for state in ("ssm", "conv"):  # NeMo-RL sets them on the engine's MambaInferenceStateConfig (hybrid models)
        m.take(f"{MCORE}.mamba_inference_{state}_states_dtype", f"generation.megatron.mamba_{state}_states_dtype",
               state_dtype)
    recompute = "grpo.async_grpo.recompute_kv_cache_after_weight_updates"
    if m.cfg.get(recompute) is True:
        m.take(recompute, "generation.megatron.kv_cache", lambda v: "recompute",
               "NeMo-RL selects megatron-core's recompute mode with this flag")
    graphs = f"{MCORE}.cuda_graph_impl"
    m.take(graphs, "generation.enforce_eager", lambda v: v == "none",
           "rlc runs the Megatron engine eager; 'local' graphs are refused by rlc compile (RLC311)")
    spec = f"{MCORE}.num_speculative_tokens"
    tokens = m.cfg.get(spec)
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
        m.consume(spec, why="generation.speculative_decoding")
        m.put("generation.speculative_decoding.method", "mtp", (spec,), "megatron-core drafts with the MTP layers")
        m.put("generation.speculative_decoding.num_speculative_tokens", tokens, (spec,))
    else:
        m.consume(spec, why="0: no speculative decoding")
    m.consume(f"{MCORE}.materialize_only_last_token_logits",
              why="rlc always materializes the sampled rows' logits only (decode logprobs)")
    m.consume(f"{MCORE}.activation_checkpointing", why="the inference model never recomputes activations")
    m.consume(f"{MCORE}.sequence_parallel", why="the inference model takes the trainer's sequence parallelism")
    for key, why in MCORE_UNMAPPED.items():
        if f"{MCORE}.{key}" in m.leaves:
            m.consumed.add(f"{MCORE}.{key}")
            # engine features rlc runs without: speed and serving, not what is sampled
            m.out.unmapped.append(Unmapped(f"{MCORE}.{key}", m.leaves[f"{MCORE}.{key}"], why, effect="none"))
    for key, target in MCORE_LAYOUT.items():
        own = f"{MCORE}.{key}"
        if m.cfg.get(own) is not None:
            m.take(own, target, positive_int, "the inference model's layout (NeMo-RL merges it over megatron_cfg)")
        elif megatron and m.cfg.get(f"{M}.{key}") is not None:
            m.put(target, m.cfg.get(f"{M}.{key}"), (f"{M}.{key}",), "the trainer's, as NeMo-RL's inference model")
