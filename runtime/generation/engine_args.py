"""The keyword arguments of ``vllm.LLM(...)`` for one engine, from ``runtime.yaml`` (pure Python, CPU-tested).

Typed settings first (model, parallelism, memory, sleep mode, speculative decoding, the refit consumer, routing
replay's routes), then ``generation.vllm_kwargs`` unchanged. A pass-through key that would replace a typed setting is an
error here too (the compiler rejects it first, RLC310), so a hand-edited bundle cannot silently
run something the plan did not check. FP8 rollouts are refused: the refit writes bf16 weights.
"""
from __future__ import annotations

import logging
from typing import Any

from rlc.contract.engine_options import VLLM_OWNED
from rlc.contract.runtime_config import vllm_speculative_config
from rlc.runtime.generation.sampling import logprobs_mode

log = logging.getLogger(__name__)

EXTENSION = "rlc.runtime.generation.extension.RlcWorkerExtension"


def engine_kwargs(cfg: Any, engine_index: int, *, distributed: bool) -> dict[str, Any]:
    """``vllm.LLM`` arguments of engine ``engine_index`` (``distributed``: more than one GPU)."""
    gp, gen = cfg.generation_parallel, cfg.generation
    if gen.precision != "auto":
        raise ValueError(f"generation.precision={gen.precision!r}: this runtime's refit writes {cfg.model.dtype} "
                         "weights and cannot fill FP8 engine weights; recompile with generation.precision: auto")
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
    kwargs.update(gen.vllm_kwargs)
    return kwargs


def check_vllm_version(planned: str, installed: str) -> str | None:
    """A warning when the installed vLLM's major.minor differs from the version the plan assumed."""
    def major_minor(v: str) -> tuple[str, ...]:
        return tuple(str(v).split("+")[0].split(".")[:2])

    if major_minor(planned) != major_minor(installed):
        return (f"vLLM {installed} is installed but the memory plan assumed vLLM {planned} "
                "(generation.vllm_version): sleep-mode residue and host memory may differ from the plan")
    return None
