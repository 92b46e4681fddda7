"""What leaving a NeMo-RL key out of the recipe does to the experiment.

Every key rlc has no setting for is one of

* ``default``: its value is NeMo-RL's own default (``nemo_rl_defaults.yaml``, from NeMo-RL's base GRPO config),
  or unset (``null`` / empty): summarised in one line;
* ``none``: a setting that does not change what is trained (logging, validation cadence, checkpoint file
  format, ports, progress bars, memory and speed knobs of NeMo-RL's own workers): listed;
* ``changes``: anything else (loss terms, reward shaping, quantised rollouts, model-config overrides, ...):
  listed as dropped, and the import stops unless ``--accept-loss`` accepts the loss.

A key is ``changes`` unless a table here says otherwise: an unknown key is never assumed harmless.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from rlc.compiler.importers.nemo_rl.config_sections import MCORE

DEFAULTS_FILE = Path(__file__).with_name("nemo_rl_defaults.yaml")
EFFECTS = ("changes", "none", "default")

#: megatron-core inference's settings: no effect where the config generates with vLLM (see :func:`effect_of`).
MCORE_PREFIX = MCORE + "."

#: megatron-core inference's settings that change how fast it runs or what memory it holds, not what is sampled.
MCORE_NO_EFFECT = {
    "refit_backend": "the swap's copy service",
    "kv_cache_management_mode": "the KV pool while training",
    "expert_tensor_parallel_size": "the inference model's expert layout (rlc: the trainer's, or the inference TP "
                                   "where it reshards)",
    "context_parallel_size": "megatron-core inference runs without context parallelism (NeMo-RL pins it to 1)",
}

#: Key prefixes whose settings do not change what is trained, and why.
NO_EFFECT: tuple[tuple[str, str], ...] = (
    ("logger.", "logging"),
    ("checkpointing.metric_name", "which checkpoints NeMo-RL ranks best"),
    ("checkpointing.higher_is_better", "which checkpoints NeMo-RL ranks best"),
    ("checkpointing.model_save_format", "checkpoint file format"),
    ("checkpointing.save_consolidated", "checkpoint file format"),
    ("checkpointing.save_optimizer", "checkpoint contents"),
    ("checkpointing.checkpoint_must_save_by", "checkpoint timing"),
    ("grpo.val_", "validation"),
    ("grpo.max_val_samples", "validation"),
    ("grpo.stop_at_validation_", "validation"),
    ("policy.generation.val_", "validation sampling"),
    ("policy.generation.port_range_", "ports"),
    ("cluster.master_port_range_", "ports"),
    ("cluster.segment_size", "NVLink-domain placement"),
    ("policy.generation.vllm_cfg.use_tqdm", "progress bars"),
    ("policy.generation.vllm_cfg.enable_vllm_metrics_logger", "metrics"),
    ("policy.generation.vllm_cfg.vllm_metrics_logger_interval", "metrics"),
    ("policy.generation.vllm_cfg.http_refit_", "NeMo-RL's refit server"),
    ("policy.generation.vllm_cfg.zmq_refit_", "NeMo-RL's refit server"),
    ("policy.generation.vllm_cfg.async_engine", "NeMo-RL's engine API (rlc drives vLLM itself)"),
    ("policy.generation.refit_transport", "NeMo-RL's refit transport (rlc refits over CUDA IPC)"),
    ("policy.generation.refit_cfg.", "NeMo-RL's refit transport"),
    ("policy.generation.real_quant_export_cpu_offload", "NeMo-RL's refit staging"),
    ("policy.generation.vllm_cfg.env_vars.NRL_REFIT_", "NeMo-RL's refit buffers in its vLLM workers (rlc sizes its "
     "own: refit.buffer_memory_ratio, refit.buffer_gb)"),
    ("policy.generation.vllm_cfg.env_vars.VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "the Ray executor NeMo-RL runs vLLM's "
     "workers with (rlc runs one vLLM engine per GPU in its own actor)"),
    (MCORE_PREFIX, "megatron-core inference's settings, read only with policy.generation.backend: megatron"),
    ("policy.generation_batch_size", "the HF generation backend"),
    ("policy.megatron_cfg.checkpoint.", "checkpoint writing"),
    ("policy.megatron_cfg.force_reconvert_from_hf", "checkpoint conversion"),
    ("policy.megatron_cfg.empty_unused_memory_level", "memory housekeeping"),
    ("policy.megatron_cfg.moe_per_layer_logging", "logging"),
    ("policy.megatron_cfg.use_gloo_process_groups", "process-group backend"),
    ("policy.megatron_cfg.pipeline_dtype", "follows policy.precision (model.dtype)"),
    ("policy.megatron_cfg.cuda_graph_", "training CUDA graphs (speed)"),
    ("policy.megatron_cfg.use_fused_linear_logprobs", "how the logprobs are computed: a chunked kernel from the "
     "hidden states, the same values without the full logits in memory (rlc materializes them, and its plan counts "
     "them)"),
    ("policy.megatron_cfg.fused_linear_logprobs_chunk_size", "the fused logprob kernel's chunk (memory)"),
    ("policy.megatron_cfg.attention_backend", "Transformer Engine's attention kernel (speed)"),
    ("policy.megatron_cfg.optimizer.overlap_cpu_optimizer_d2h_h2d", "CPU-offload overlap (speed)"),
    ("policy.megatron_cfg.optimizer.bf16", "follows policy.precision (model.dtype)"),
    ("policy.megatron_cfg.optimizer.fp16", "follows policy.precision (model.dtype)"),
    ("policy.megatron_cfg.optimizer.params_dtype", "fp32 master parameters, as rlc keeps them"),
    ("policy.megatron_cfg.distributed_data_parallel_config.use_custom_fsdp", "NeMo-RL's FSDP switch (off)"),
    (
        "policy.megatron_cfg.distributed_data_parallel_config.data_parallel_sharding_strategy",
        "distributed-optimizer sharding (rlc: training.use_distributed_optimizer)",
    ),
    ("policy.logprob_batch_size", "logprob micro-batch (speed and memory)"),
    ("policy.logprob_chunk_size", "logprob chunking (speed and memory)"),
    ("policy.offload_optimizer_for_logprob", "memory while computing logprobs"),
    ("policy.make_sequence_length_divisible_by", "padding for sequence parallelism"),
    ("policy.dynamic_batching.", "micro-batch shapes (the same tokens, batched differently)"),
    ("policy.tokenizer.use_fastokens", "tokenizer implementation"),
    ("data.num_workers", "data-loader workers"),
    ("env.math.num_workers", "reward workers"),
    ("data_plane.", "NeMo-RL's data plane"),
    ("data.validation.", "validation data"),
    ("env.dapo.num_workers", "reward workers"),
    (
        "grpo.max_num_epochs",
        "run length: rlc stops at grpo.max_steps, over as many epochs of the prompts as that takes",
    ),
    (
        "policy.megatron_cfg.converter_type",
        "the checkpoint's architecture (rlc's Megatron-Bridge reads it from config.json)",
    ),
)

#: Keys that change nothing given another key's value: (key, other key, its value, why).
MOOT: tuple[tuple[str, str, Any, str], ...] = (
    ("policy.megatron_cfg.scheduler.lr_decay_iters", "policy.megatron_cfg.scheduler.lr_decay_style", "constant",
     "a constant schedule does not decay"),
    ("policy.megatron_cfg.scheduler.lr_warmup_init", "policy.megatron_cfg.scheduler.lr_warmup_iters", 0,
     "no warm-up"),
    ("policy.generation.real_quant", "policy.generation.quant_cfg", None, "no quantisation config: the rollouts are "
     "not quantised"),
)


@lru_cache(maxsize=1)
def nemo_rl_defaults() -> dict[str, Any]:
    """NeMo-RL's default of each base-config key (flat, dotted)."""
    data = yaml.safe_load(DEFAULTS_FILE.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _unset(value: Any) -> bool:
    return value is None or value == {} or value == []


def is_default(key: str, value: Any, raw: Any) -> bool:
    """``value`` (``raw``: as written, ``${...}`` kept) is NeMo-RL's default for ``key``, or unset."""
    defaults = nemo_rl_defaults()
    if key not in defaults:
        return _unset(value)
    default = defaults[key]
    if isinstance(default, str) and "${" in default:
        return raw == default
    if _unset(value) and _unset(default):
        return True
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return bool(value == default)


def no_effect_reason(key: str) -> str:
    """Why ``key`` does not change what is trained, or ``""``."""
    return next((why for prefix, why in NO_EFFECT if key == prefix or key.startswith(prefix)), "")


def effect_of(key: str, value: Any, raw: Any, backend: Any = None) -> str:
    """``default``, ``none`` or ``changes`` for a key rlc has no setting for (see the module docstring); ``backend``:
    the config's ``policy.generation.backend`` (megatron-core inference's settings count where it is ``megatron``)."""
    if is_default(key, value, raw):
        return "default"
    if backend == "megatron" and key.startswith(MCORE_PREFIX):  # the engine reads it: never assumed harmless
        return "none" if key[len(MCORE_PREFIX):] in MCORE_NO_EFFECT else "changes"
    if no_effect_reason(key):
        return "none"
    return "changes"
