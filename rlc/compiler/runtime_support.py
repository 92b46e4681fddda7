"""What the bundled runtime can run, and which engine options it sets itself.

One source of truth for two things the compiler checks before writing a bundle:

* :data:`VLLM_OWNED` / :data:`MEGATRON_OWNED`: options of ``vllm.LLM(...)`` and of the
  Megatron-Bridge model provider that the runtime sets from typed recipe keys. The pass-through
  blocks (``generation.vllm_kwargs``, ``training.megatron_kwargs``) may not set them: the typed key
  (named here) is the one rlc reasons about, and two places for one setting would disagree.
* :func:`runtime_gaps`: recipe settings the schema can express (so a configuration that ran
  elsewhere validates and plans) but this runtime cannot execute yet. ``rlc validate`` warns about
  them (RLC311); ``rlc compile`` refuses to write a bundle that would run something else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: vLLM engine options the runtime sets -> the recipe key that controls them.
VLLM_OWNED: dict[str, str] = {
    "model": "model.checkpoint",
    "tokenizer": "model.tokenizer",
    "dtype": "model.dtype",
    "trust_remote_code": "model.trust_remote_code",
    "tensor_parallel_size": "parallelism.generation.tp",
    "pipeline_parallel_size": "parallelism.generation.pp",
    "enable_expert_parallel": "parallelism.generation.ep",
    "enforce_eager": "generation.enforce_eager",
    "gpu_memory_utilization": "generation.gpu_memory_utilization",
    "kv_cache_memory_bytes": "generation.kv_cache_memory_bytes",
    "max_model_len": "generation.max_model_len",
    "quantization": "generation.precision",
    "seed": "grpo.seed",
    "logprobs_mode": "generation.sampling (set from temperature / top_p / top_k)",
    "enable_sleep_mode": "refit.sleep_level (sleep mode is always on when colocated)",
    "worker_extension_cls": "refit (the runtime's refit consumer)",
    "distributed_executor_backend": "parallelism.generation (the runtime picks it)",
}

#: Megatron provider options the runtime sets -> the recipe key that controls them.
MEGATRON_OWNED: dict[str, str] = {
    "tensor_model_parallel_size": "parallelism.train.tp",
    "pipeline_model_parallel_size": "parallelism.train.pp",
    "virtual_pipeline_model_parallel_size": "parallelism.train.vpp",
    "context_parallel_size": "parallelism.train.cp",
    "expert_model_parallel_size": "parallelism.train.ep",
    "expert_tensor_parallel_size": "parallelism.train.etp",
    "sequence_parallel": "parallelism.train.sequence_parallel",
    "num_layers_in_first_pipeline_stage": "parallelism.train.num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage": "parallelism.train.num_layers_in_last_pipeline_stage",
    "params_dtype": "model.dtype",
    "pipeline_dtype": "model.dtype",
    "bf16": "model.dtype",
    "fp16": "model.dtype",
    "recompute_granularity": "training.activation_checkpointing",
    "recompute_method": "training.activation_checkpointing",
    "recompute_num_layers": "training.activation_checkpointing",
    "fp8": "training.fp8.enabled / training.fp8.format",
    "fp8_recipe": "training.fp8.recipe",
    "fp8_param": "training.fp8.param_gather",
    "fp8_param_gather": "training.fp8.param_gather",
    "moe_token_dispatcher_type": "training.moe.token_dispatcher",
    "moe_enable_deepep": "training.moe.deepep",
    "moe_router_dtype": "training.moe.router_dtype",
    "mtp_loss_scaling_factor": "training.mtp_loss_scale",
    "hidden_dropout": "(always 0 in RL: the trainer's logprobs must match the sampler's)",
    "attention_dropout": "(always 0 in RL: the trainer's logprobs must match the sampler's)",
    "use_precision_aware_optimizer": "training.use_precision_aware_optimizer",
    "use_distributed_optimizer": "training.use_distributed_optimizer",
    "optimizer_cpu_offload": "training.optimizer_cpu_offload",
}


@dataclass(frozen=True)
class Gap:
    """A recipe setting the bundled runtime cannot execute yet."""

    key: str
    message: str


def runtime_gaps(recipe: dict[str, Any]) -> list[Gap]:
    """Settings of ``recipe`` (schema defaults filled) that this runtime cannot run yet."""
    gaps = []
    generation, training = recipe.get("generation", {}), recipe.get("training", {})
    if generation.get("precision", "auto") == "fp8":
        gaps.append(Gap("generation.precision",
                        "FP8 rollouts need a refit that quantizes every delivered weight into vLLM's FP8 "
                        "parameters; the bundled runtime's refit writes bf16 weights"))
    if (training.get("sequence_packing") or {}).get("enabled", False):
        gaps.append(Gap("training.sequence_packing.enabled",
                        "the bundled runtime pads each rollout to the longest of its micro batch; it does not "
                        "pack sequences yet"))
    fp8 = training.get("fp8") or {}
    if fp8.get("enabled") and fp8.get("param_gather"):
        gaps.append(Gap("training.fp8.param_gather",
                        "FP8 parameters would reach the refit exporter as FP8; the bundled runtime exports "
                        "bf16 weights only"))
    return gaps


__all__ = ["Gap", "MEGATRON_OWNED", "VLLM_OWNED", "runtime_gaps"]
