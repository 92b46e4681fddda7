"""The keyword arguments of ``vllm.LLM(...)`` for one engine, from ``runtime.yaml`` (pure Python, CPU-tested).

Typed settings first (model, parallelism, memory, sleep mode, speculative decoding, the refit consumer, routing
replay's routes), then ``generation.vllm_kwargs`` unchanged. A pass-through key that would replace a typed setting is an
error here too (the compiler rejects it first, RLC310), so a hand-edited bundle cannot silently
run something the plan did not check.

FP8 rollouts (``generation.precision: fp8``, :func:`fp8_engine_kwargs`): with ``generation.fp8.scales: block``
the engine is a DeepSeek-V3-style FP8 checkpoint (vLLM ``Fp8Config`` with ``weight_block_size: [128, 128]``)
started from random weights (``load_format: dummy``): the refit's first transfer writes the trainer's
quantized weights and their scales. With ``scales: tensor`` vLLM's online ``fp8_per_tensor`` quantizes the
checkpoint (and every refit's bf16 weights) as it loads them. Both keep the MoE routers unquantized, and the
layers ``generation.fp8.keep_bf16`` names: by their checkpoint module names in ``ignored_layers`` (block scales; the
names of the model's parameters, built on the meta device from its config) or as ``ignore`` patterns (tensor scales).

``model.overrides`` (all but the MTP block counts, which build the trainer only) reach vLLM as ``hf_overrides``:
:class:`rlc.runtime.model_config.EngineConfig`, the checkpoint's ``config.json`` with them, read as the trainer reads
it; the FP8 engine's quantization config and ``generation.vllm_kwargs.hf_overrides`` are set on it afterwards.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from rlc.contract.engine_options import VLLM_OWNED
from rlc.contract.fp8 import BLOCK, ROUTER_IGNORE_REGEX, keep_regexes, kept, module_of, router_ignore_prefixes
from rlc.contract.model_overrides import engine_overrides
from rlc.contract.runtime_config import RuntimeConfig, vllm_speculative_config
from rlc.runtime.generation.sampling import logprobs_mode
from rlc.runtime.model_config import EngineConfig, checkpoint_config, parameter_names

log = logging.getLogger(__name__)

EXTENSION = "rlc.runtime.generation.extension.RlcWorkerExtension"


def engine_kwargs(cfg: RuntimeConfig, engine_index: int, *, distributed: bool) -> dict[str, Any]:
    """``vllm.LLM`` arguments of engine ``engine_index`` (``distributed``: more than one GPU)."""
    gp, gen = cfg.generation_parallel, cfg.generation
    kwargs: dict[str, Any] = dict(
        model=cfg.model.checkpoint,
        tokenizer=cfg.model.tokenizer,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
        tensor_parallel_size=gp.tp,
        pipeline_parallel_size=gp.pp,
        enable_expert_parallel=gp.ep > 1,
        enforce_eager=gen.enforce_eager,
        gpu_memory_utilization=gen.gpu_memory_utilization,
        max_model_len=gen.max_model_len,
        enable_sleep_mode=True,
        worker_extension_cls=EXTENSION,
        seed=cfg.grpo.seed + engine_index,
        logprobs_mode=logprobs_mode(gen.sampling),
    )
    if gen.speculative_decoding is not None:
        kwargs["speculative_config"] = vllm_speculative_config(gen.speculative_decoding)
    if cfg.training.router_replay.enabled:
        # routing replay: each completion carries the experts vLLM routed its tokens to (vLLM PR #28284)
        kwargs["enable_return_routed_experts"] = True
    if gen.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = int(gen.kv_cache_memory_bytes)
    if distributed:
        kwargs["distributed_executor_backend"] = "ray"
    clash = sorted(set(gen.vllm_kwargs) & set(VLLM_OWNED))
    if clash:
        owners = "; ".join(f"{key} from {VLLM_OWNED[key]}" for key in clash)
        raise ValueError(f"generation.vllm_kwargs sets {', '.join(clash)}, which the runtime sets from typed keys "
                         f"({owners}); recompile the bundle without them")
    fp8 = fp8_engine_kwargs(cfg)
    passed = dict(gen.vllm_kwargs)
    if "hf_overrides" in fp8 and isinstance(passed.get("hf_overrides"), dict):
        if "quantization_config" in passed["hf_overrides"]:
            raise ValueError("generation.vllm_kwargs.hf_overrides.quantization_config: the FP8 engine sets its "
                             "quantization config from generation.fp8; recompile the bundle without it")
        passed["hf_overrides"] = {**passed["hf_overrides"], **fp8.pop("hf_overrides")}
    if "load_format" in fp8 and "load_format" in passed:
        raise ValueError(f"generation.vllm_kwargs.load_format={passed['load_format']!r}: the FP8 engine with block "
                         "scales starts from random weights (load_format dummy) that the first refit replaces; "
                         "recompile the bundle without it")
    kwargs.update(fp8)
    kwargs.update(passed)
    if engine_overrides(cfg.model.overrides):
        extra = kwargs.pop("hf_overrides", None) or {}
        if not isinstance(extra, Mapping):
            raise ValueError("generation.vllm_kwargs.hf_overrides: with model.overrides the engine's config is the "
                             "checkpoint's config.json with them, and further hf_overrides must be a mapping; put "
                             "the keys under model.overrides instead")
        kwargs["hf_overrides"] = EngineConfig(cfg.model.checkpoint, cfg.model.overrides, extra)
    return kwargs


def fp8_engine_kwargs(cfg: RuntimeConfig) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of FP8 rollouts (empty for ``generation.precision: auto``)."""
    gen = cfg.generation
    if gen.precision == "auto":
        return {}
    if gen.precision != "fp8":
        raise ValueError(f"generation.precision={gen.precision!r}: expected auto or fp8")
    keep = list(gen.fp8.keep_bf16)
    if gen.fp8.scales == "tensor":
        return {"quantization": "fp8_per_tensor",
                "quantization_config": {"ignore": [ROUTER_IGNORE_REGEX, *keep_regexes(keep)]}}
    if gen.fp8.scales != "block":
        raise ValueError(f"generation.fp8.scales={gen.fp8.scales!r}: expected block or tensor")
    if cfg.model.num_layers is None:
        raise ValueError("generation.fp8.scales block: runtime.yaml has no model.num_layers (the FP8 checkpoint's "
                         "layers); recompile with the model's config.json")
    layers = int(cfg.model.num_layers) + int(cfg.model.mtp_num_layers)
    return {
        "quantization": "fp8",
        "load_format": "dummy",
        "hf_overrides": {"quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK),
            "ignored_layers": router_ignore_prefixes(layers) + kept_modules(cfg, keep),
        }},
    }


def kept_modules(cfg: RuntimeConfig, keep: list[str]) -> list[str]:
    """The checkpoint's module names that ``generation.fp8.keep_bf16`` names (vLLM's ``Fp8Config`` takes exact
    names in ``ignored_layers``): the modules of the parameters of the model its config describes."""
    if not keep:
        return []
    config = checkpoint_config(cfg.model.checkpoint, cfg.model.overrides, trust_remote_code=cfg.model.trust_remote_code)
    names = parameter_names(config, trust_remote_code=cfg.model.trust_remote_code)
    return sorted({module_of(name) for name in names if kept(name, keep)})


def check_vllm_version(planned: str, installed: str) -> str | None:
    """A warning when the installed vLLM's major.minor differs from the version the plan assumed."""
    def major_minor(v: str) -> tuple[str, ...]:
        return tuple(str(v).split("+")[0].split(".")[:2])

    if major_minor(planned) != major_minor(installed):
        return (f"vLLM {installed} is installed but the memory plan assumed vLLM {planned} "
                "(generation.vllm_version): sleep-mode residue and host memory may differ from the plan")
    return None
