"""The resolved runtime config (``bundle/runtime.yaml``): the only contract between compiler and runtime.

The compiler (``rlc.compiler.resolve``) writes every value explicitly: defaults filled, derived
values (world size, data-parallel sizes) computed, and each ``auto`` refit switch decided, with the
rule that decided it recorded in ``refit.decisions``. The runtime reads nothing else.

This module is pure Python (no torch, ray, vllm or megatron) so that the compiler, CI and the
runtime share one definition. ``load_runtime_config`` rejects unknown and missing keys, naming the
key path, so a stale or hand-edited ``runtime.yaml`` fails loudly instead of running with a default.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlc.contract.errors import RuntimeConfigError
from rlc.contract.ranges import range_problems
from rlc.contract.runtime_file import read_runtime_yaml
from rlc.contract.typed_fields import field_types
from rlc.contract.version import RUNTIME_CONFIG_VERSION


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelConfig:
    """What to train. ``checkpoint`` is an HF checkpoint directory (config.json + weights)."""

    name: str  # HF id or catalog name, for logs
    checkpoint: str  # HF checkpoint directory the workers load (AutoBridge / vLLM)
    tokenizer: str  # tokenizer directory (defaults to checkpoint in the compiler)
    dtype: str  # "bfloat16" | "float16" | "float32"
    trust_remote_code: bool
    # Architecture facts the runtime needs (from the catalog or config.json, see rlc/compiler/model.py)
    num_layers: int | None  # None where the architecture is not public (planner says so)
    num_experts: int  # 0 for dense models
    mtp_num_layers: int
    mtp_shared_embedding: bool  # HF mtp_use_dedicated_embeddings == False


@dataclass(frozen=True)
class RayConfig:
    """How the runtime reaches Ray. ``address: local`` starts a private cluster (hand runs, tests)."""

    address: str  # "auto" (inside an sbatch job) | "local" | "host:port"
    namespace: str
    join_timeout_s: int


@dataclass(frozen=True)
class ClusterConfig:
    nodes: int
    gpus_per_node: int
    world_size: int  # derived: nodes * gpus_per_node
    gpu_type: str
    gpu_memory_gib: float
    log_dir: str
    ray: RayConfig


@dataclass(frozen=True)
class TrainParallelConfig:
    tp: int
    pp: int
    ep: int
    etp: int
    cp: int
    vpp: int  # 1 = no virtual pipeline
    sequence_parallel: bool
    num_layers_in_first_pipeline_stage: int | None
    num_layers_in_last_pipeline_stage: int | None
    dp: int  # derived: world / (tp * pp * cp)
    expert_dp: int  # derived: world / (ep * etp * pp)


@dataclass(frozen=True)
class GenerationParallelConfig:
    tp: int
    pp: int
    ep: int  # 1 = no expert parallelism
    dp: int  # number of vLLM engines (derived when the recipe leaves it out)


@dataclass(frozen=True)
class RefitConfig:
    """Every seed fix, switched by a flag. ``decisions`` says which rule turned an ``auto`` on/off."""

    buffer_memory_ratio: float | None  # fraction of free memory at refit for both ping-pong halves
    buffer_gb: float | None  # or a fixed size (GiB) for both halves together
    alignment_bytes: int
    sleep_level: int  # 1 keeps vLLM weights (CPU backup), 2 drops them (NeMo-RL #2471 failure 3)
    offload_optimizer_for_refit: bool  # optimizer state + grads to CPU during refit (NeMo-RL #3490)
    offload_params_for_generation: bool  # trainer's bf16 params to host memory while vLLM generates
    sync_params_before_refit: bool  # forced param all-gather before export (NeMo-RL #4086)
    dedupe_mtp_embedding: bool  # drop MTP-replicated embedding on last PP stage (NeMo-RL #2471 failure 1)
    per_rank_ipc_metadata: bool  # each producer rank sends its own slicing metadata (SkyRL #1816)
    fp32_params: list[str]  # name patterns (fnmatch) kept fp32 on the wire (SkyRL #1816)
    verify_every: int  # bit-for-bit refit check every N refits (0 = off); rlc.runtime.refit.verify
    transport: str  # "cuda_ipc" | "shm"
    decisions: dict[str, str]  # switch -> why (rule id and reason)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float
    top_p: float
    top_k: int  # -1 = off
    max_tokens: int
    stop: list[str]
    stop_token_ids: list[int]  # besides the tokenizer's EOS


@dataclass(frozen=True)
class SpeculativeDecodingConfig:
    """Speculative decoding in vLLM; :func:`vllm_speculative_config` is what the engine gets."""

    method: str  # "mtp" (the checkpoint's MTP layers draft) | "ngram" (prompt lookup, no weights)
    num_speculative_tokens: int
    prompt_lookup_min: int  # ngram only
    prompt_lookup_max: int  # ngram only


def vllm_speculative_config(spec: SpeculativeDecodingConfig) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for ``spec``: vLLM's generic ``mtp`` method (vLLM >= 0.10 finds the
    checkpoint's MTP module for DeepSeek-V3, Qwen3.5 / Qwen3-Next, GLM-4.5 and Nemotron-H), or ``ngram`` with
    its n-gram window."""
    out: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "ngram":
        out.update(prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
    return out


@dataclass(frozen=True)
class Fp8RolloutConfig:
    scales: str  # "block" (128x128 block scales, quantized by the trainer) | "tensor" (per matrix, by vLLM); never auto
    pow2_scales: bool  # block scales rounded up to powers of two (vLLM use_ue8m0)


@dataclass(frozen=True)
class MegatronGenerationConfig:
    """Megatron-core inference inside the policy workers (``generation.backend: megatron``), every ``auto``
    settled by the compiler (the rule and reason are in ``refit.decisions``)."""

    mode: str  # "shared" (generate on the training model) | "dedicated" (a second model, refit by swap)
    transformer_impl: str  # "transformer_engine" | "inference_optimized" (of the generating model)
    kv_cache: str  # "recompute" | "offload" | "persist" (megatron-core KVCacheManagementMode)
    block_size_tokens: int
    max_tokens: int | None  # None = megatron-core's default
    max_requests: int | None  # None = as many as the KV pool has blocks
    refit_backend: str  # "nccl" | "gloo": swap_model_weights' copy service (dedicated)
    reset_router_num_groups: bool  # moe_router_num_groups 1 -> None for the inference-optimized router


@dataclass(frozen=True)
class GenerationConfig:
    backend: str  # "vllm" | "megatron"
    vllm_version: str  # the version the plan assumed (recipe, or the calibration entry's); checked at start
    enforce_eager: bool
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None  # fixed KV cache (vLLM kv_cache_memory_bytes); None = by utilization
    precision: str  # "auto" (model.dtype) | "fp8"
    fp8: Fp8RolloutConfig  # FP8 rollouts (with precision fp8)
    max_model_len: int
    sampling: SamplingConfig
    speculative_decoding: SpeculativeDecodingConfig | None  # None = off
    vllm_kwargs: dict[str, Any]  # engine options handed to vllm.LLM unchanged (none that rlc sets itself)
    megatron: MegatronGenerationConfig | None  # backend "megatron" only (None with vLLM)


@dataclass(frozen=True)
class OptimizerConfig:
    name: str  # "adam" | "sgd"
    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float


@dataclass(frozen=True)
class LRScheduleConfig:
    name: str  # "constant" | "cosine" | "linear"
    warmup_steps: int
    warmup_start_lr: float  # the warm-up rises linearly from this to training.optimizer.lr


@dataclass(frozen=True)
class TrainingConfig:
    optimizer: OptimizerConfig
    lr_schedule: LRScheduleConfig
    grad_clip: float
    micro_batch_size: int
    logprob_batch_size: int  # sequences per micro-batch of the logprob passes (the policy's and the reference's)
    global_batch_size: int
    use_distributed_optimizer: bool
    overlap_param_gather: bool
    overlap_grad_reduce: bool
    grad_reduce_in_fp32: bool  # Megatron DDP's main_grad buffers in fp32 (4 B/param) instead of the param dtype
    optimizer_cpu_offload: bool
    optimizer_offload_fraction: float
    offload_reference_policy: bool  # the reference policy in pinned host memory, on the GPU for its logprob pass only
    activation_checkpointing: str  # "none" | "selective" | "full"
    max_sequence_length: int
    seed: int
    use_precision_aware_optimizer: bool  # fp32 masters live in the optimizer state (TE FusedAdam)
    mtp_loss_scale: float  # weight of the MTP block's next-next-token loss in the RL step (0 = policy loss only)
    fp8: Fp8TrainingConfig
    moe: MoeConfig
    sequence_packing: SequencePackingConfig
    router_replay: RouterReplayConfig  # vLLM's routes of each rollout token replayed in the trainer (MoE)
    megatron_kwargs: dict[str, Any]  # Megatron provider options set unchanged (none that rlc sets itself)


@dataclass(frozen=True)
class Fp8TrainingConfig:
    enabled: bool
    format: str  # "e4m3" | "hybrid"
    recipe: str  # "tensorwise" | "delayed" | "blockwise" | "mxfp8"
    param_gather: bool


@dataclass(frozen=True)
class MoeConfig:
    token_dispatcher: str  # "alltoall" | "allgather" | "flex"
    deepep: bool
    router_dtype: str  # "fp32" | "fp64" | "auto"


@dataclass(frozen=True)
class SequencePackingConfig:
    enabled: bool
    algorithm: str  # a bin-packing algorithm of rlc.runtime.policy.bin_packing
    train_mb_tokens: int  # token budget of a packed micro batch, train pass
    logprob_mb_tokens: int  # token budget of a packed micro batch, logprob passes


@dataclass(frozen=True)
class RouterReplayConfig:
    enabled: bool  # vLLM returns each token's routed experts; Megatron's RouterReplay replays them


@dataclass(frozen=True)
class DynamicSamplingConfig:
    enabled: bool
    max_gen_batches: int
    batch_multiplier: float


@dataclass(frozen=True)
class GrpoConfig:
    prompts_per_step: int
    generations_per_prompt: int
    max_steps: int
    normalize_advantages: bool  # divide by the group's std
    leave_one_out: bool  # baseline excludes the sample itself
    dynamic_sampling: DynamicSamplingConfig
    max_gen_kl: float  # stop the run when gen-KL exceeds this (0 disables)
    seed: int


@dataclass(frozen=True)
class LossConfig:
    ratio_clip_low: float
    ratio_clip_high: float
    kl_penalty: float  # 0 = no reference model
    kl_estimator: str  # "k1" | "k2" | "k3"
    token_level: bool  # average over all tokens of the batch (True) or per sequence first
    clip_ratio_c: float | None  # dual-clip constant (> 1) for negative advantages; None = off
    max_log_ratio: float  # |log(new / old)| is clamped to this before exp
    importance_sampling_correction: bool  # weight tokens by min(exp(old - gen logprob), cap)
    importance_sampling_cap: float


@dataclass(frozen=True)
class DataConfig:
    train_path: str
    val_path: str | None
    prompt_key: str
    answer_key: str
    prompt_template: str  # Python str.format template with {prompt}
    max_prompt_length: int
    shuffle: bool


@dataclass(frozen=True)
class RewardConfig:
    function: str  # built-in name ("math", "exact_match", "first_char") or "module:function"
    kwargs: dict[str, Any]
    failure_reward: float  # reward of a sample on which the function raises or returns a non-number


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool
    dir: str
    every_steps: int
    keep_last: int
    resume: bool
    resume_changed_recipe: bool  # resume even from a checkpoint another experiment wrote


@dataclass(frozen=True)
class LoggingConfig:
    dir: str
    jsonl: bool
    tensorboard: bool
    progress_bar: bool


@dataclass(frozen=True)
class RuntimeConfig:
    version: int
    name: str
    model: ModelConfig
    cluster: ClusterConfig
    train_parallel: TrainParallelConfig
    generation_parallel: GenerationParallelConfig
    colocated: bool
    refit: RefitConfig
    generation: GenerationConfig
    training: TrainingConfig
    grpo: GrpoConfig
    loss: LossConfig
    data: DataConfig
    reward: RewardConfig
    checkpointing: CheckpointConfig
    logging: LoggingConfig
    env: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- (de)serialisation


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _convert(value: Any, tp: Any, path: str) -> Any:
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise RuntimeConfigError(f"{path}: must not be null")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            raise RuntimeConfigError(f"{path}: expected a list, got {type(value).__name__}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RuntimeConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise RuntimeConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise RuntimeConfigError(f"{path or '<root>'}: expected a mapping, got {type(data).__name__}")
    hints = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise RuntimeConfigError(
            f"unknown key(s) {', '.join(where + k for k in unknown)}: this runtime does not know them; "
            "recompile the bundle with the rlc that runs it"
        )
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name not in data:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise RuntimeConfigError(f"{sub}: missing; recompile the bundle (runtime.yaml must be fully resolved)")
        kwargs[name] = _convert(data[name], hints[name], sub)
    return cls(**kwargs)


T = typing.TypeVar("T")


def section_from_dict(cls: type[T], data: Any, path: str) -> T:
    """One section (any of the dataclasses above) from a mapping, with the same strict checks."""
    built: T = _build(cls, data, path)
    return built


def runtime_config_from_dict(data: dict[str, Any]) -> RuntimeConfig:
    """Build a ``RuntimeConfig`` from a mapping; unknown or missing keys raise ``RuntimeConfigError``."""
    cfg = _build(RuntimeConfig, data, "")
    if cfg.version != RUNTIME_CONFIG_VERSION:
        raise RuntimeConfigError(
            f"version: runtime.yaml is version {cfg.version}, this runtime reads {RUNTIME_CONFIG_VERSION}; "
            "recompile the bundle"
        )
    out_of_range = range_problems(data)
    if out_of_range:
        raise RuntimeConfigError("; ".join(out_of_range))
    return cfg


def runtime_config_to_dict(cfg: RuntimeConfig) -> dict[str, Any]:
    """The plain-data form written to ``runtime.yaml``."""
    return dataclasses.asdict(cfg)


def load_runtime_config(path: str | Path) -> RuntimeConfig:
    """Read ``runtime.yaml`` (:func:`rlc.contract.runtime_file.read_runtime_yaml`) into a ``RuntimeConfig``."""
    return runtime_config_from_dict(read_runtime_yaml(path))
