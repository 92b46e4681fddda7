"""Engine options that rlc sets itself from typed recipe keys, for vLLM and for the Megatron-Bridge
model provider: the compiler refuses them in the pass-through blocks (``generation.vllm_kwargs``,
``training.megatron_kwargs``; RLC310) and the runtime refuses them again in a hand-edited bundle.
Each maps to the recipe key that controls it (named in both messages).
"""
from __future__ import annotations

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
    "quantization_config": "generation.fp8",
    "seed": "grpo.seed",
    "speculative_config": "generation.speculative_decoding",
    "logprobs_mode": "generation.sampling (set from temperature / top_p / top_k)",
    "enable_sleep_mode": "refit.sleep_level (sleep mode is always on when colocated)",
    "worker_extension_cls": "refit (the runtime's refit consumer)",
    "distributed_executor_backend": "parallelism.generation (the runtime picks it)",
    "enable_return_routed_experts": "training.router_replay.enabled",
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
    "moe_enable_routing_replay": "training.router_replay.enabled",
    "mtp_loss_scaling_factor": "training.mtp_loss_scale",
    "gradient_accumulation_fusion": "(always off: the fused weight-gradient accumulation needs APEX)",
    "hidden_dropout": "(always 0 in RL: the trainer's logprobs must match the sampler's)",
    "attention_dropout": "(always 0 in RL: the trainer's logprobs must match the sampler's)",
    "use_precision_aware_optimizer": "training.use_precision_aware_optimizer",
    "use_distributed_optimizer": "training.use_distributed_optimizer",
    "optimizer_cpu_offload": "training.optimizer_cpu_offload",
}
