"""The typed recipe: frozen dataclasses built once from a recipe the schema accepted.

The schema (``rlc/schemas/recipe.schema.json``) is the one source of every default. After
validation the compiler fills those defaults (:func:`rlc.compiler.schema.with_defaults`) and
builds a :class:`Recipe` from the filled mapping (:func:`recipe_from_data`); every later stage
(planner, rules, resolver, bundle writer, doctor) reads attributes of it and restates no default.

So the classes here state no defaults either: every field is required, and a field is ``None``
only where the schema has no default and the key is optional (``model.checkpoint``,
``parallelism.generation.dp``, ...) or where ``null`` is an allowed value. A test walks the schema
and these classes together, so a key added to one and not the other fails CI.

Lists become tuples (the recipe is shared by every re-plan of a candidate fix, so nothing may
change it in place). Free-form blocks (``model.overrides``, ``cluster.env``,
``generation.vllm_kwargs``, ``training.megatron_kwargs``, ``reward.kwargs``, ``extensions``) stay
mappings: rlc hands them on without reasoning about their keys. Treat them as read-only.

Values that the schema cannot give as a default because they depend on other keys (the checkpoint
defaulting to ``model.id``, the global batch to one GRPO step's samples, ...) are derived by
properties here, once.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, TypeVar, Union

from rlc.compiler.diagnostics import PathPart, parse_path
from rlc.contract.sequence_packing import default_mb_tokens
from rlc.contract.typed_fields import field_types

T = TypeVar("T")

#: Top-level recipe keys that are no recipe setting: the loader consumes ``extends``; ``$schema``
#: is a pointer for editors.
NOT_SETTINGS = frozenset({"$schema", "extends"})

Switch = Literal["auto", "on", "off"]


class RecipeTypeError(ValueError):
    """The mapping does not have the shape of a validated recipe (a bug: validate it first)."""


class _Section:
    """``repr`` and ``==`` of the typed-recipe classes, by their fields.

    Written once here instead of generated per class: ``dataclass`` compiles each generated method
    separately, and with ~30 classes that was half of this module's import time, which every
    ``rlc validate`` and ``rlc lint`` pays."""

    __slots__ = ()

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))  # type: ignore[arg-type]

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))  # type: ignore[arg-type]
        return f"{type(self).__name__}({inner})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Section)
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]  # sections hold mappings


#: Frozen dataclass whose repr and equality come from :class:`_Section`.
section = dataclass(frozen=True, repr=False, eq=False)


# --------------------------------------------------------------------------- model


@section
class ModelSection(_Section):
    """The policy model."""

    id: str
    """Hugging Face model id or catalog name."""
    config: Optional[str]
    """Local HF ``config.json`` to take the architecture facts from (None: the shipped catalog)."""
    overrides: Mapping[str, Any]
    """HF ``config.json`` keys replacing the catalog's facts (free-form)."""
    checkpoint: Optional[str]
    """Checkpoint directory the job loads; None means the model id (see :attr:`checkpoint_path`)."""
    tokenizer: Optional[str]
    """Tokenizer directory or id; None means the checkpoint (see :attr:`tokenizer_path`)."""
    dtype: Literal["bfloat16", "float16", "float32"]
    """Parameter dtype of trainer and generation engine."""
    trust_remote_code: bool
    """Pass ``trust_remote_code=True`` to HF/vLLM loaders."""

    @property
    def checkpoint_path(self) -> str:
        """The checkpoint the job loads: ``checkpoint``, else the model id."""
        return self.id if self.checkpoint is None else self.checkpoint

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer the job loads: ``tokenizer``, else the checkpoint."""
        return self.checkpoint_path if self.tokenizer is None else self.tokenizer


# --------------------------------------------------------------------------- cluster


@section
class SlurmSection(_Section):
    """SLURM submission options."""

    partition: Optional[str]
    """``#SBATCH --partition`` (None: the cluster's default)."""
    account: Optional[str]
    """``#SBATCH --account``."""
    qos: Optional[str]
    """``#SBATCH --qos``."""
    time: str
    """Wall-clock limit in SLURM's format."""
    reservation: Optional[str]
    """``#SBATCH --reservation``."""
    exclusive: bool
    """Request whole nodes."""
    requeue: bool
    """Let SLURM requeue the job on node failure (the runtime resumes from its checkpoint)."""
    job_name: Optional[str]
    """``#SBATCH --job-name``; None means the recipe's ``name``."""
    extra_flags: tuple[str, ...]
    """More ``#SBATCH`` options, each ``--flag`` or ``--flag=value``."""


@section
class ContainerSection(_Section):
    """The container every task runs in."""

    runtime: Literal["pyxis", "apptainer", "none"]
    """Container runtime (``none``: host Python)."""
    image: Optional[str]
    """Image reference (required unless ``runtime`` is ``none``; the bundle checks say so)."""
    workdir: str
    """Working directory inside the container."""
    mount_home: bool
    """Mount the user's home into the container."""
    python: str
    """Python interpreter inside the container."""
    mounts: tuple[str, ...]
    """Bind mounts, each ``src:dst`` or ``src:dst:ro|rw``."""
    image_paths: tuple[str, ...]
    """Folders the image holds (paths the job only reads there need no mount)."""


@section
class RaySection(_Section):
    """The Ray cluster the sbatch script starts across the allocation."""

    port: int
    """GCS port of the head."""
    node_manager_port: int
    """Raylet port on each node."""
    object_manager_port: int
    """Object manager port on each node."""
    dashboard_port: int
    """Dashboard port of the head (0: no dashboard)."""
    min_worker_port: int
    """Lowest port of Ray worker processes."""
    max_worker_port: int
    """Highest port of Ray worker processes."""
    join_timeout_s: int
    """Seconds to wait for every GPU to join before failing the job."""


@section
class ClusterSection(_Section):
    """Where the job runs: allocation, container, environment, Ray."""

    nodes: int
    """SLURM nodes."""
    gpus_per_node: int
    """GPUs per node."""
    gpu: str
    """GPU type from the shipped catalog."""
    calibration: Optional[str]
    """Planner calibration file or shipped name (None: the shipped table)."""
    gpu_type_gres: Optional[str]
    """GRES type for ``--gpus-per-node=TYPE:N`` (None: untyped)."""
    cpus_per_node: Optional[int]
    """``--cpus-per-task`` (None: not requested)."""
    mem_per_node: Optional[str]
    """``--mem`` (None: not requested)."""
    host_memory_gib: Optional[float]
    """Host memory per node the job may use (None: from ``mem_per_node`` or the GPU's typical node)."""
    slurm: SlurmSection
    """SLURM submission options."""
    container: ContainerSection
    """The container."""
    env: Mapping[str, Union[str, int, float, bool]]
    """Environment of every task (free-form)."""
    log_dir: str
    """Folder of SLURM output and per-job logs (relative: to where ``rlc compile`` runs)."""
    shared_fs_roots: tuple[str, ...]
    """Shared-filesystem roots; a mount source outside them warns."""
    ray: RaySection
    """Ray ports and join timeout."""

    @property
    def world_size(self) -> int:
        """GPUs in the allocation: nodes × gpus_per_node."""
        return self.nodes * self.gpus_per_node


# --------------------------------------------------------------------------- parallelism


@section
class TrainParallelism(_Section):
    """Megatron-core parallelism of the trainer."""

    tp: int
    """Tensor parallel size."""
    pp: int
    """Pipeline parallel size."""
    ep: int
    """Expert parallel size."""
    etp: int
    """Expert tensor parallel size."""
    cp: int
    """Context parallel size."""
    vpp: int
    """Virtual pipeline stages per pipeline rank (1: none)."""
    sequence_parallel: bool
    """Megatron sequence parallelism."""
    num_layers_in_first_pipeline_stage: Optional[int]
    """Layers on the first stage of an uneven pipeline (None: even split)."""
    num_layers_in_last_pipeline_stage: Optional[int]
    """Layers on the last stage of an uneven pipeline (None: even split)."""


@section
class GenerationParallelism(_Section):
    """vLLM parallelism of each generation engine."""

    tp: int
    """vLLM tensor parallel size."""
    pp: int
    """vLLM pipeline parallel size."""
    ep: int
    """vLLM expert parallel size (1: off)."""
    dp: Optional[int]
    """vLLM engines (None: world / (tp × pp); ``planner.layout.generation_layout`` derives it)."""


@section
class ParallelismSection(_Section):
    """How trainer and generation engine split the model."""

    train: TrainParallelism
    """The trainer's layout."""
    generation: GenerationParallelism
    """The generation engine's layout."""


# --------------------------------------------------------------------------- refit


@section
class RefitSection(_Section):
    """Moving updated weights from the trainer into vLLM every step."""

    buffer_memory_ratio: float
    """Fraction of free memory at refit for both ping-pong halves (unused when ``buffer_gb`` is set)."""
    buffer_gb: Optional[float]
    """Fixed size of both halves together in GiB (None: sized by the ratio)."""
    alignment_bytes: int
    """Alignment of each tensor in the buffer."""
    sleep_level: Literal[1, 2]
    """vLLM sleep level after generation."""
    offload_optimizer_for_refit: bool
    """Optimizer state and grads to host memory during the refit."""
    offload_params_for_generation: bool
    """The trainer's bf16 parameters to host memory from the end of the refit to the next logprob pass."""
    sync_params_before_refit: Switch
    """Synchronous parameter all-gather before the export (``auto``: the rules decide)."""
    dedupe_mtp_embedding: Switch
    """Drop the MTP-replicated embedding on the last pipeline stage (``auto``: the rules decide)."""
    per_rank_ipc_metadata: Switch
    """Every trainer rank sends its own slicing metadata (``auto``: the rules decide)."""
    fp32_params: Union[Literal["auto"], tuple[str, ...]]
    """Parameter name patterns kept fp32 on the wire, or ``auto`` (the model's known ones)."""
    verify_every: int
    """Bit-for-bit refit check every N refits (0: never)."""
    transport: Literal["cuda_ipc", "shm"]
    """Buffer transport."""


# --------------------------------------------------------------------------- generation


@section
class SamplingSection(_Section):
    """Sampling parameters of rollouts."""

    temperature: float
    """Sampling temperature."""
    top_p: float
    """Nucleus threshold (1: off)."""
    top_k: int
    """Top-k (-1: off)."""
    max_tokens: int
    """Generated tokens per sample at most."""
    stop: tuple[str, ...]
    """Stop strings."""
    stop_token_ids: tuple[int, ...]
    """Token ids that end a sample besides EOS."""


@section
class SpeculativeDecodingSection(_Section):
    """Speculative decoding in the rollout engine (vLLM ``speculative_config``)."""

    method: Literal["mtp", "ngram"]
    """``mtp``: the checkpoint's MTP layers draft; ``ngram``: prompt lookup (no weights)."""
    num_speculative_tokens: int
    """Draft tokens proposed per decoding step."""
    prompt_lookup_min: int
    """``ngram``: shortest n-gram that may match."""
    prompt_lookup_max: int
    """``ngram``: longest n-gram tried first."""


@section
class Fp8RolloutSection(_Section):
    """FP8 rollouts (``generation.precision: fp8``)."""

    scales: Literal["auto", "block", "tensor"]
    """``block``: 128×128 block scales, quantized by the trainer; ``tensor``: one scale per matrix, by vLLM;
    ``auto``: block where the layout keeps every projection 128-aligned (``rlc.compiler.planner.fp8_layout``)."""
    pow2_scales: bool
    """Block scales rounded up to powers of two."""


@section
class MegatronGenerationSection(_Section):
    """Megatron-core inference (``generation.backend: megatron``)."""

    mode: Literal["auto", "shared", "dedicated"]
    """Generate on the training model (``shared``) or on a second model refit by swap (``dedicated``)."""
    transformer_impl: Literal["auto", "transformer_engine", "inference_optimized"]
    """Layer implementation of the generating model (``auto``: the trainer's)."""
    kv_cache: Literal["recompute", "offload", "persist"]
    """What happens to the KV pool while the trainer runs."""
    block_size_tokens: int
    """Tokens per KV-cache block."""
    max_tokens: Optional[int]
    """Tokens per engine step at most (None: megatron-core's default)."""
    max_requests: Optional[int]
    """Requests per engine step at most (None: as many as the pool has blocks)."""
    refit_backend: Literal["nccl", "gloo"]
    """Copy service of ``swap_model_weights`` in dedicated mode."""


@section
class GenerationSection(_Section):
    """The rollout engine."""

    backend: Literal["vllm", "megatron"]
    """Generation backend."""
    megatron: MegatronGenerationSection
    """Megatron-core inference settings (``backend: megatron``)."""
    vllm_version: Optional[str]
    """vLLM version of the job's container (None: the calibration entry's)."""
    enforce_eager: bool
    """Disable CUDA graphs."""
    gpu_memory_utilization: float
    """Fraction of GPU memory vLLM may use while awake."""
    kv_cache_memory_bytes: Optional[int]
    """Fixed KV-cache size (None: sized by ``gpu_memory_utilization``)."""
    precision: Literal["auto", "fp8"]
    """Rollout weight precision (``auto``: ``model.dtype``)."""
    fp8: Fp8RolloutSection
    """FP8 rollouts (with ``precision: fp8``)."""
    max_model_len: int
    """Prompt + generation tokens at most."""
    sampling: SamplingSection
    """Sampling parameters."""
    speculative_decoding: Optional[SpeculativeDecodingSection]
    """Speculative decoding (None: off)."""
    vllm_kwargs: Mapping[str, Any]
    """vLLM engine options handed on unchanged (free-form)."""

    @property
    def drafts_with_mtp(self) -> bool:
        """vLLM's drafter is the checkpoint's MTP layers: weights in vLLM's weight pool that the refit does not
        write, so sleep level 2 (which discards them) is not an option."""
        spec = self.speculative_decoding
        return spec is not None and spec.method == "mtp"


# --------------------------------------------------------------------------- training


@section
class OptimizerSection(_Section):
    """Optimizer settings."""

    name: Literal["adam", "sgd"]
    """Optimizer."""
    lr: float
    """Peak learning rate."""
    min_lr: float
    """Final learning rate of decaying schedules."""
    weight_decay: float
    """Decoupled weight decay."""
    adam_beta1: float
    """Adam beta1."""
    adam_beta2: float
    """Adam beta2."""
    adam_eps: float
    """Adam epsilon."""


@section
class LrScheduleSection(_Section):
    """Learning-rate schedule."""

    name: Literal["constant", "cosine", "linear"]
    """Shape after warm-up."""
    warmup_steps: int
    """Linear warm-up steps."""
    warmup_start_lr: float
    """Learning rate the warm-up starts from."""


@section
class Fp8Section(_Section):
    """FP8 training (Transformer Engine)."""

    enabled: bool
    """Run linear layers in FP8."""
    format: Literal["e4m3", "hybrid"]
    """FP8 format."""
    recipe: Literal["tensorwise", "delayed", "blockwise", "mxfp8"]
    """Scaling recipe."""
    param_gather: bool
    """Keep all-gathered parameters in FP8."""


@section
class MoeSection(_Section):
    """Mixture-of-experts execution in the trainer."""

    token_dispatcher: Literal["alltoall", "allgather", "flex"]
    """Megatron token dispatcher."""
    deepep: bool
    """DeepEP kernels (needs the flex dispatcher)."""
    router_dtype: Literal["fp32", "fp64", "auto"]
    """Router computation dtype (``auto``: the model provider's)."""


@section
class SequencePackingSection(_Section):
    """Packing rollouts into one sequence instead of padding."""

    enabled: bool
    """Pack rollouts."""
    algorithm: str
    """Bin-packing algorithm (NeMo-RL's names)."""
    train_mb_tokens: Optional[int]
    """Token budget of a packed train micro batch (None: see :attr:`Recipe.train_mb_tokens`)."""
    logprob_mb_tokens: Optional[int]
    """Token budget of a packed logprob micro batch (None: see :attr:`Recipe.logprob_mb_tokens`)."""


@section
class RouterReplaySection(_Section):
    """Rollout Routing Replay: the trainer routes each token to the experts vLLM routed it to."""

    enabled: bool
    """Replay vLLM's routing in the trainer's logprob, reference and train passes (MoE models)."""


@section
class TrainingSection(_Section):
    """The trainer (Megatron-core through Megatron-Bridge)."""

    optimizer: OptimizerSection
    """Optimizer settings."""
    lr_schedule: LrScheduleSection
    """Learning-rate schedule."""
    grad_clip: float
    """Gradient-norm clip (0: off)."""
    micro_batch_size: int
    """Sequences per micro-batch on each data-parallel rank."""
    logprob_batch_size: Optional[int]
    """Sequences per micro-batch of the logprob passes (None: ``micro_batch_size``; see
    :attr:`Recipe.logprob_batch_size`)."""
    global_batch_size: Optional[int]
    """Sequences per optimizer step (None: one GRPO step's samples; see :attr:`Recipe.global_batch_size`)."""
    use_distributed_optimizer: bool
    """Shard optimizer state over data-parallel ranks."""
    use_precision_aware_optimizer: bool
    """fp32 master weights live in the optimizer state (TE FusedAdam)."""
    overlap_param_gather: bool
    """Overlap the parameter all-gather with the next forward."""
    grad_reduce_in_fp32: bool
    """fp32 gradient buffers and reduction (4 B/param of grads instead of the param dtype's)."""
    overlap_grad_reduce: bool
    """Overlap the gradient reduce-scatter with backward."""
    optimizer_cpu_offload: bool
    """Megatron's hybrid CPU optimizer."""
    optimizer_offload_fraction: float
    """Share of the optimizer state offloaded with ``optimizer_cpu_offload``."""
    offload_copies_gradients: bool
    """The trainer's offload copies the gradient buffers to host memory (else it frees them)."""
    offload_reference_policy: bool
    """Keep the KL penalty's reference policy in pinned host memory, on the GPU only for its logprob pass."""
    mtp_loss_scale: float
    """Weight of the MTP block's loss (0: policy loss only)."""
    activation_checkpointing: Literal["none", "selective", "full"]
    """Activation recomputation granularity."""
    max_sequence_length: Optional[int]
    """Longest prompt + response the trainer packs (None: ``generation.max_model_len``)."""
    seed: int
    """Trainer random seed."""
    fp8: Fp8Section
    """FP8 training."""
    moe: MoeSection
    """MoE execution."""
    sequence_packing: SequencePackingSection
    """Sequence packing."""
    router_replay: RouterReplaySection
    """Rollout Routing Replay (MoE)."""
    megatron_kwargs: Mapping[str, Any]
    """Megatron options handed on unchanged (free-form)."""


# --------------------------------------------------------------------------- algorithm, data, outputs


@section
class DynamicSamplingSection(_Section):
    """Dropping groups whose rewards are all equal and generating more."""

    enabled: bool
    """Turn dynamic sampling on."""
    max_gen_batches: int
    """Generation batches per step before giving up."""
    batch_multiplier: float
    """Prompts per batch as a multiple of ``prompts_per_step``."""


@section
class GrpoSection(_Section):
    """The GRPO algorithm."""

    prompts_per_step: int
    """Prompts (groups) per step."""
    generations_per_prompt: int
    """Samples per prompt (group size)."""
    max_steps: int
    """GRPO steps to run."""
    normalize_advantages: bool
    """Divide advantages by the group's reward std."""
    leave_one_out: bool
    """Baseline each sample with the mean of the others of its group."""
    dynamic_sampling: DynamicSamplingSection
    """Dynamic sampling."""
    max_gen_kl: float
    """Stop when vLLM's and the trainer's logprobs diverge more than this (0: never)."""
    seed: int
    """Seed of prompt order and sampling."""

    @property
    def samples_per_step(self) -> int:
        """Rollouts of one GRPO step: prompts_per_step × generations_per_prompt."""
        return self.prompts_per_step * self.generations_per_prompt


@section
class LossSection(_Section):
    """The clipped policy-gradient loss."""

    ratio_clip_low: float
    """Lower clip of the importance ratio."""
    ratio_clip_high: float
    """Upper clip of the importance ratio."""
    kl_penalty: float
    """KL penalty to the reference policy (0: no reference model)."""
    kl_estimator: Literal["k1", "k2", "k3"]
    """KL estimator."""
    token_level: bool
    """Average over all tokens of the batch (else per sequence first)."""
    clip_ratio_c: Optional[float]
    """Dual-clip constant for negative advantages (None: off)."""
    max_log_ratio: float
    """Clamp of |log(new / old)| before exponentiating."""
    importance_sampling_correction: bool
    """Weight tokens by the truncated trainer/rollout probability ratio."""
    importance_sampling_cap: float
    """Upper bound of that weight."""


@section
class DataSection(_Section):
    """Prompts."""

    train: str
    """Training prompts (JSONL)."""
    val: Optional[str]
    """Validation prompts (None: none)."""
    prompt_key: str
    """JSONL field of the prompt."""
    answer_key: str
    """JSONL field of the reference answer."""
    prompt_template: str
    """Template around each prompt (``{prompt}``)."""
    max_prompt_length: int
    """Longer prompts (tokens) are skipped."""
    shuffle: bool
    """Shuffle prompts each epoch."""


@section
class RewardSection(_Section):
    """How completions are scored."""

    function: str
    """Built-in reward name or ``module:function``."""
    failure_reward: float
    """Reward of a sample the function fails on."""
    kwargs: Mapping[str, Any]
    """Keyword arguments of the function (free-form)."""


@section
class CheckpointingSection(_Section):
    """Checkpoints and resuming."""

    enabled: bool
    """Save checkpoints."""
    dir: Optional[str]
    """Checkpoint folder (None: ``<log_dir>/checkpoints/<name>``, derived by the resolver)."""
    every_steps: int
    """Save every this many steps."""
    keep_last: int
    """Checkpoints kept."""
    resume: bool
    """Resume from the latest complete checkpoint of the same experiment."""
    resume_changed_recipe: bool
    """Resume even from another experiment's checkpoint."""


@section
class LoggingSection(_Section):
    """Metrics and logs."""

    dir: Optional[str]
    """Metrics folder (None: ``<log_dir>/metrics/<name>``, derived by the resolver)."""
    jsonl: bool
    """One JSON object per step in ``metrics.jsonl``."""
    tensorboard: bool
    """TensorBoard events."""
    progress_bar: bool
    """Progress bar on the driver."""


@section
class LintIgnore(_Section):
    """One silenced warning."""

    rule: str
    """Rule id."""
    reason: str
    """Why the warning does not apply."""


@section
class LintSection(_Section):
    """Lint settings of this recipe."""

    ignore: tuple[LintIgnore, ...]
    """Warnings to silence, each with a reason."""


# --------------------------------------------------------------------------- the recipe


@section
class Recipe(_Section):
    """A recipe the schema accepted, with every schema default filled."""

    version: int
    """Recipe format version."""
    name: str
    """Run name (job name, log and checkpoint folders)."""
    description: str
    """Free text for ``rlc plan`` and the bundle README."""
    model: ModelSection
    """The policy model."""
    cluster: ClusterSection
    """Where the job runs."""
    parallelism: ParallelismSection
    """How the model is split."""
    colocated: bool
    """Trainer and generation engine share the GPUs."""
    refit: RefitSection
    """Weights from trainer to vLLM."""
    generation: GenerationSection
    """The rollout engine."""
    training: TrainingSection
    """The trainer."""
    grpo: GrpoSection
    """The algorithm."""
    loss: LossSection
    """The loss."""
    data: DataSection
    """Prompts."""
    reward: RewardSection
    """Scoring."""
    checkpointing: CheckpointingSection
    """Checkpoints."""
    logging: LoggingSection
    """Metrics and logs."""
    lint: LintSection
    """Lint settings."""
    extensions: Mapping[str, Any]
    """Free-form settings for custom code."""

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: ``training.global_batch_size``, else one GRPO step's samples."""
        stated = self.training.global_batch_size
        return self.grpo.samples_per_step if stated is None else stated

    @property
    def logprob_batch_size(self) -> int:
        """Sequences per micro-batch of the logprob passes: ``training.logprob_batch_size``, else
        ``training.micro_batch_size``."""
        stated = self.training.logprob_batch_size
        return self.training.micro_batch_size if stated is None else stated

    @property
    def max_sequence_length(self) -> int:
        """The trainer's sequence length: ``training.max_sequence_length``, else ``generation.max_model_len``."""
        stated = self.training.max_sequence_length
        return self.generation.max_model_len if stated is None else stated

    @property
    def train_mb_tokens(self) -> int:
        """Packed train micro batch budget: ``training.sequence_packing.train_mb_tokens``, else
        ``max_sequence_length × micro_batch_size``."""
        stated = self.training.sequence_packing.train_mb_tokens
        return default_mb_tokens(self.max_sequence_length, self.training.micro_batch_size) if stated is None else stated

    @property
    def logprob_mb_tokens(self) -> int:
        """Packed logprob micro batch budget: ``training.sequence_packing.logprob_mb_tokens``, else
        ``max_sequence_length × logprob_batch_size`` (NeMo-RL's default)."""
        stated = self.training.sequence_packing.logprob_mb_tokens
        return default_mb_tokens(self.max_sequence_length, self.logprob_batch_size) if stated is None else stated


# --------------------------------------------------------------------------- building


_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, resolved type) of each field of a typed-recipe class, worked out once per class."""
    found = _FIELDS.get(cls)
    if found is None:
        hints = field_types(cls)
        found = _FIELDS[cls] = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
    return found


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) is Union and type(None) in typing.get_args(tp)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


#: Field types that take the filled value as it is (scalars, literals, free-form mappings), found once.
_PLAIN: dict[Any, bool] = {}


def _is_plain(tp: Any) -> bool:
    """True when ``_convert`` returns a value of type ``tp`` unchanged (no section, list or union in it)."""
    plain = _PLAIN.get(tp)
    if plain is None:
        origin = typing.get_origin(tp)
        plain = _PLAIN[tp] = origin is not Union and origin is not tuple and not _is_section(tp)
    return plain


def _convert(tp: Any, value: Any, path: str) -> Any:
    """``value`` (from the filled mapping) as the field type ``tp`` wants it."""
    if value is None or _is_plain(tp):
        return value
    origin = typing.get_origin(tp)
    if origin is Union:  # Optional[X], or alternatives such as 'auto' | a list
        for alternative in typing.get_args(tp):
            if (typing.get_origin(alternative) is tuple and isinstance(value, (list, tuple))) or \
                    (_is_section(alternative) and isinstance(value, Mapping)):
                return _convert(alternative, value, path)
        return value
    if _is_section(tp):
        if not isinstance(value, Mapping):
            raise RecipeTypeError(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin is tuple:
        item = typing.get_args(tp)[0]
        if not isinstance(value, (list, tuple)):
            raise RecipeTypeError(f"{path}: expected a list, got {type(value).__name__}")
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    return value


def _build(cls: type[T], data: Mapping[str, Any], path: str) -> T:
    values: dict[str, Any] = {}
    for name, tp in _fields(cls):
        if name in data:
            value = data[name]
            values[name] = value if value is None or _is_plain(tp) else \
                _convert(tp, value, f"{path}.{name}" if path else name)
        elif _optional(tp):
            values[name] = None  # an optional key without a schema default, left unset
        else:
            where = f"{path}.{name}" if path else name
            raise RecipeTypeError(f"{where}: missing; the typed recipe is built from a recipe the schema "
                                  "accepted, with its defaults filled (rlc.compiler.schema.with_defaults)")
    extra = set(data) - set(values) - (NOT_SETTINGS if not path else set())
    if extra:
        raise RecipeTypeError(f"{path or 'recipe'}: no typed field for {', '.join(sorted(extra))} "
                              "(the schema and rlc.compiler.recipe_types disagree)")
    return cls(**values)


def recipe_from_data(data: Mapping[str, Any]) -> Recipe:
    """The typed recipe of ``data``: a recipe the schema accepted, with its defaults filled."""
    return _build(Recipe, data, "")


def section_from_data(cls: type[T], data: Mapping[str, Any], path: str) -> T:
    """One typed section (e.g. :class:`ClusterSection` at ``cluster``) from its filled mapping,
    for stages that run when only that part of the recipe passed the schema."""
    return _build(cls, data, path)


def with_value(recipe: T, path: str, value: Any) -> T:
    """``recipe`` (or a section) with the setting at dotted key ``path`` replaced by ``value``.

    The sections on the path are rebuilt, everything else is shared: the planner re-plans a
    recipe once per candidate fix. A list value is stored as a tuple, as the builder does.
    """
    return _replaced(recipe, list(parse_path(path)), value, path)


def _replaced(node: Any, parts: list[PathPart], value: Any, path: str) -> Any:
    head, rest = parts[0], parts[1:]
    if not _is_section(type(node)) or not isinstance(head, str) or head not in dict(_fields(type(node))):
        raise RecipeTypeError(f"{path}: not a setting of the typed recipe")
    if rest:
        new = _replaced(getattr(node, head), rest, value, path)
    else:
        tp = dict(_fields(type(node)))[head]
        new = _convert(tp, value, path)
    return dataclasses.replace(node, **{head: new})


def typed_fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation of a typed-recipe class (for the schema parity test)."""
    return dict(_fields(cls))


__all__ = ["NOT_SETTINGS", "CheckpointingSection", "ClusterSection", "ContainerSection", "DataSection",
           "DynamicSamplingSection", "Fp8RolloutSection", "Fp8Section", "GenerationParallelism", "GenerationSection", "GrpoSection",
           "LintIgnore", "LintSection", "LoggingSection", "LossSection", "LrScheduleSection", "MegatronGenerationSection",
           "ModelSection",
           "MoeSection", "OptimizerSection", "ParallelismSection", "RaySection", "Recipe", "RecipeTypeError",
           "RefitSection", "RewardSection", "SamplingSection", "SequencePackingSection", "SlurmSection",
           "SpeculativeDecodingSection", "Switch", "TrainParallelism", "TrainingSection", "recipe_from_data",
           "section_from_data", "typed_fields", "with_value"]
