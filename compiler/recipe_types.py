"""Every recipe key, declared once: the typed recipe, and the source of the schema, the reference
and the ``runtime.yaml`` types.

Each key is one field of a frozen section class below, declared with :func:`~rlc.contract.declare.key`:
its type (the annotation), its description, its default, its limits, and what the runtime does with
it (``runtime=``: nothing, part of the experiment, or free to change between restarts, and why).
``python -m rlc.compiler.declarations`` writes from these declarations, and a test fails while any of
them is stale:

* ``rlc/schemas/recipe.schema.json``: validation, did-you-mean, the defaults, editors' completion;
* ``rlc/contract/runtime_types.py``: the ``runtime.yaml`` types the runtime reads;
* ``docs/reference.md``: the reference for every key.

After validation the compiler fills the schema's defaults (:func:`rlc.compiler.schema.with_defaults`)
and builds a :class:`Recipe` from the filled mapping (:func:`recipe_from_data`); every later stage
(planner, rules, resolver, bundle writer, doctor) reads attributes of it and restates no default. So
the classes state no defaults of their own: a field is ``None`` only where the schema has no default
and the key is optional (``model.checkpoint``, ``parallelism.generation.dp``, ...) or where ``null``
is an allowed value.

Lists become tuples (the recipe is shared by every re-plan of a candidate fix, so nothing may
change it in place). Free-form blocks (``model.overrides``, ``cluster.env``,
``generation.vllm_kwargs``, ``training.megatron_kwargs``, ``reward.kwargs``, ``extensions``) stay
mappings: rlc hands them on without reasoning about their keys. Treat them as read-only.

Values that the schema cannot give as a default because they depend on other keys (the checkpoint
defaulting to ``model.id``, the global batch to one GRPO step's samples, ...) are derived by
properties here, once.
"""
# No ``from __future__ import annotations``: the annotations are evaluated once, as the classes are
# built, instead of compiled from strings the first time the loader asks for them (every command does).
import dataclasses
from typing import Any, Literal, Mapping, Optional, TypeVar, Union

from rlc.compiler.diagnostics import PathPart, parse_path
from rlc.contract.declare import COMPILER, EXPERIMENT, Declared, Reading, convert, key, load, restart, section, settings
from rlc.contract.sequence_packing import default_mb_tokens

T = TypeVar("T")

#: The recipe file's own top-level keys, which are no setting: the loader consumes ``extends``;
#: ``$schema`` is a pointer for editors. Each is ``(the setting it follows in the schema, its node)``.
FILE_KEYS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "$schema": (None, {"type": "string", "description": "Optional JSON-Schema pointer for editors; ignored by rlc."}),
    "extends": ("version", {
        "description": "A recipe to inherit from: a path relative to this file, or the name of a recipe shipped "
                       "with rlc (see `rlc show --list`). Mappings merge key by key; lists and scalars replace. "
                       "Chains may be several levels deep; cycles are reported.",
        "type": "string", "minLength": 1}),
}
NOT_SETTINGS = frozenset(FILE_KEYS)
#: The schema's identity (``$id``) and title.
SCHEMA_ID = "https://rlc.dev/schemas/recipe.schema.json"
SCHEMA_TITLE = "rlc recipe (version 1)"

Switch = Literal["auto", "on", "off"]
Gpu = Literal["h100-80gb", "h100-94gb", "h200-141gb", "h20-96gb", "a100-40gb", "a100-80gb", "b200-180gb",
              "gb200-186gb", "l40s-48gb"]
PackingAlgorithm = Literal["modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle",
                           "concatenative", "modified_ffd"]

# Why a key may change between restarts of one experiment (``runtime=`` of a key), where several share it.
_WHERE = restart("where the run runs")
_TRAIN_LAYOUT = restart("how the trainer is laid out over the GPUs")
_GENERATION_LAYOUT = restart("how vLLM is laid out over the GPUs")
_REFIT = restart("how the weights reach vLLM, not their values")
_ENGINE = restart("the generation engine's speed and memory, not what it samples")
_SPEED = restart("the trainer's speed and memory, not what it computes")
_CHECKPOINTS = restart("the checkpoints' folder and cadence")
_METRICS = restart("where metrics go")


class RecipeTypeError(ValueError):
    """The mapping does not have the shape of a validated recipe (a bug: validate it first)."""


class _Section(Declared):
    """A section of the typed recipe (unhashable: sections hold mappings)."""

    __slots__ = ()
    __hash__ = None  # type: ignore[assignment]


# --------------------------------------------------------------------------- model


@section(runtime="ModelConfig")
class ModelSection(_Section):
    """The policy model. Architecture facts come from the checkpoint's own `config.json` (the `checkpoint` folder, or
    the local Hugging Face cache), the shipped catalog (by `id`) for what it does not state, the Hub for a
    model neither describes, or a local `config.json` (`config`)."""

    id: str = key(
        "Hugging Face model id (e.g. `Qwen/Qwen3.5-397B-A17B`) or a catalog name. A model outside the shipped "
        "catalog is planned from its checkpoint's `config.json` (the `checkpoint` folder, the Hugging Face cache, or "
        "the Hub) or from `config`.",
        min_length=1, runtime=EXPERIMENT, runtime_name="model.name")
    config: Optional[str] = key(
        "Path to a local HF `config.json` (relative to the recipe file that sets it, so a parent's path stays beside "
        "the parent; or absolute). Overrides the catalog, and is how models outside the catalog are planned.",
        min_length=1, runtime=COMPILER)
    overrides: Mapping[str, Any] = key(
        "HF `config.json` keys to add to (or replace in) the model's config, as if the checkpoint's `config.json` "
        "said them: the planner's facts and the model the job builds (the trainer, the reference policy and the "
        "rollout engine) both read the config with them. E.g. a YaRN `rope_scaling` mapping, "
        "`router_aux_loss_coef: 0.0`, `{tie_word_embeddings: false}` when no source states a fact the planner "
        "needs (RLC216), or `num_nextn_predict_layers: 0` / `mtp_num_hidden_layers: 0` to build the trainer "
        "without MTP blocks (vLLM's MTP drafter still loads the checkpoint's). A mapping merges into the config's "
        "mapping of the same key (`text_config: {router_aux_loss_coef: 0.0}` changes one key), and a config that "
        "nests `text_config` gets every other key there too. Applied on top of the config rlc read (the "
        "checkpoint's, the catalog entry, or `config`); every override is named in the plan.",
        default={}, values={"type": ["string", "number", "integer", "boolean", "array", "object", "null"]},
        property_names="^[A-Za-z_][A-Za-z0-9_]*$", runtime=EXPERIMENT)
    checkpoint: Optional[str] = key(
        "HF checkpoint directory the job loads (config.json + safetensors), as seen inside the container, or a Hub "
        "id. Defaults to `id` (only useful when the container has the model cached). rlc reads the model's facts "
        "from its `config.json`: on this machine at that path, or under the host folder a `cluster.container.mounts` "
        "entry binds there; for a Hub id, from the Hugging Face cache.",
        min_length=1, runtime=EXPERIMENT, resolved=True)
    tokenizer: Optional[str] = key(
        "Tokenizer directory or id; defaults to `checkpoint`.",
        min_length=1, runtime=EXPERIMENT, resolved=True)
    dtype: Literal["bfloat16", "float16", "float32"] = key(
        "Parameter dtype of the trainer and the generation engine.",
        default="bfloat16", runtime=EXPERIMENT)
    trust_remote_code: bool = key(
        "Pass `trust_remote_code=True` to HF/vLLM loaders.",
        default=False, runtime=restart("how the checkpoint's code is loaded, not what it holds"))

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

    partition: Optional[str] = key(
        "`#SBATCH --partition`.",
        pattern="^[A-Za-z0-9._,-]+$")
    account: Optional[str] = key(
        "`#SBATCH --account`.",
        pattern="^[A-Za-z0-9._-]+$")
    qos: Optional[str] = key(
        "`#SBATCH --qos`.",
        pattern="^[A-Za-z0-9._-]+$")
    time: str = key(
        "Wall-clock limit, SLURM format (`MM`, `HH:MM:SS`, `D-HH:MM:SS`).",
        default="04:00:00", pattern="^([0-9]+-)?[0-9]+(:[0-9]{2}){0,2}$")
    reservation: Optional[str] = key(
        "`#SBATCH --reservation`.",
        pattern="^[A-Za-z0-9._-]+$")
    exclusive: bool = key(
        "Request whole nodes (`#SBATCH --exclusive`).",
        default=True)
    requeue: bool = key(
        "Let SLURM requeue the job on node failure (`--requeue`); the runtime resumes from the latest checkpoint.",
        default=False)
    job_name: Optional[str] = key(
        "`#SBATCH --job-name`; defaults to `name`.",
        min_length=1, max_length=128)
    extra_flags: tuple[str, ...] = key(
        "More `#SBATCH` options, each one `--flag=value` or `--flag` (e.g. `--constraint=ib`). Each becomes its own "
        "quoted header line.",
        default=[], items={"pattern": "^--[A-Za-z][A-Za-z0-9-]*(=.*)?$"})


@section
class ContainerSection(_Section):
    """The container every task runs in. The bundle mounts its own copy of rlc into it."""

    runtime: Literal["pyxis", "apptainer", "none"] = key(
        "`pyxis` (srun --container-image), `apptainer` (apptainer exec --nv), or `none` (host Python).",
        default="pyxis")
    image: Optional[str] = key(
        "Image reference (Pyxis/enroot URI or `.sqsh` path; Apptainer `.sif` path). Required unless runtime is "
        "`none`.",
        min_length=1)
    workdir: str = key(
        "Working directory inside the container.",
        default="/workspace")
    mount_home: bool = key(
        "Mount the user's home into the container (Pyxis mounts it unless told not to).",
        default=False)
    python: str = key(
        "Python interpreter inside the container (or on the host with `none`).",
        default="python3")
    mounts: tuple[str, ...] = key(
        "Bind mounts, each `src:dst` or `src:dst:ro|rw` with absolute paths and no `,` or `:` inside a path. Every "
        "path the job reads or writes in the container (data, a local checkpoint or tokenizer, checkpoint and "
        "metrics folders, folders on `env.PYTHONPATH`, paths in `reward.kwargs`) must lie inside one of them (or, "
        "for what it only reads, inside `image_paths`); an error names the mount to add. The bundle adds its own "
        "folder and `log_dir`.",
        default=[], items={"minLength": 3})
    image_paths: tuple[str, ...] = key(
        "Folders the image itself holds (absolute paths inside the container, e.g. `/opt/data` for a data set built "
        "into the image): what the job only reads inside one of them needs no mount. What it writes (checkpoints, "
        "metrics) must be on a mount: the image's files are not shared between nodes and are lost when the container "
        "ends.",
        default=[], items={"pattern": "^/"})


@section(runtime="RayConfig")
class RaySection(_Section):
    """Ray cluster that the sbatch script starts across the allocation."""

    port: int = key(
        "GCS port of the Ray head.",
        default=6379, minimum=1024, maximum=65535, runtime=COMPILER)
    node_manager_port: int = key(
        "Raylet port on each node.",
        default=6700, minimum=1024, maximum=65535, runtime=COMPILER)
    object_manager_port: int = key(
        "Object manager port on each node.",
        default=6701, minimum=1024, maximum=65535, runtime=COMPILER)
    dashboard_port: int = key(
        "Dashboard port of the head (0 disables the dashboard).",
        default=0, minimum=0, maximum=65535, runtime=COMPILER)
    min_worker_port: int = key(
        "Lowest port for Ray worker processes.",
        default=20000, minimum=1024, maximum=65535, runtime=COMPILER)
    max_worker_port: int = key(
        "Highest port for Ray worker processes.",
        default=29999, minimum=1024, maximum=65535, runtime=COMPILER)
    join_timeout_s: int = key(
        "Seconds to wait for every GPU to join the Ray cluster before failing the job.",
        default=600, minimum=10, maximum=7200, runtime=_WHERE)


@section(runtime="ClusterConfig")
class ClusterSection(_Section):
    """Where the job runs: SLURM allocation, container, environment and Ray ports."""

    nodes: int = key(
        "Number of SLURM nodes (`#SBATCH --nodes`).",
        minimum=1, maximum=4096, runtime=_WHERE)
    gpus_per_node: int = key(
        "GPUs per node (`#SBATCH --gpus-per-node`).",
        minimum=1, maximum=16, runtime=_WHERE)
    gpu: Gpu = key(
        "GPU type from the shipped catalog; sets the memory the planner works with (e.g. `h100-80gb`, `h200-141gb`, "
        "`a100-80gb`, `b200-180gb`, `gb200-186gb`).",
        runtime=_WHERE, runtime_name="cluster.gpu_type")
    calibration: Optional[str] = key(
        "Memory-planner constants for this GPU and software stack: a file written by `rlc calibrate` (path relative "
        "to this recipe) or the name of a calibration shipped with rlc (e.g. `h200-141gb`). Unset: the shipped table "
        "(measured on h100-80gb; other GPUs fall back to it with RLC217). `rlc plan/validate/compile --calibration "
        "FILE` overrides it.",
        default=None, runtime=COMPILER)
    gpu_type_gres: Optional[str] = key(
        "Optional GRES type name for `--gpus-per-node=TYPE:N` when the cluster types its GPUs (e.g. `h100`). Leave "
        "unset to request untyped GPUs.",
        pattern="^[A-Za-z0-9_-]+$", runtime=COMPILER)
    cpus_per_node: Optional[int] = key(
        "CPUs per node to request (`--cpus-per-task`, one task per node). Unset = SLURM default.",
        minimum=1, maximum=4096, runtime=COMPILER)
    mem_per_node: Optional[str] = key(
        "Memory per node for `--mem` (e.g. `0` for all, `500G`). Unset = SLURM default.",
        pattern="^[0-9]+[KMGT]?$", runtime=COMPILER)
    host_memory_gib: Optional[float] = key(
        "Host (CPU) memory per node in GiB that the job may use. Checked against what sleep level 1 (vLLM's weights "
        "backed up to CPU) and optimizer offload put in host memory. Unset: the GPU catalog's typical node "
        "(`rlc/compiler/catalog/gpus.yaml`), or `mem_per_node` when that names a size.",
        exclusive_minimum=0, maximum=1048576, runtime=COMPILER)
    slurm: SlurmSection
    container: ContainerSection
    env: Mapping[str, Union[str, int, float, bool]] = key(
        "Environment variables for every task (head, workers, driver). Values are strings. `$NAME` and `${NAME}` are "
        "expanded at job start on each node (`PATH: /opt/conda/bin:$PATH` prepends to the container's PATH; an unset "
        "variable is empty; `$$` is a literal `$`); nothing else is expanded. "
        "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` is rejected with colocated vLLM.",
        default={}, values={"type": ["string", "number", "boolean"]}, property_names="^[A-Za-z_][A-Za-z0-9_]*$",
        runtime=restart("the job's environment"), runtime_name="env", runtime_type="dict[str, str]",
        runtime_default=dict)
    log_dir: str = key(
        "Folder for SLURM output and per-job logs (`<log_dir>/<jobid>/`). Must be on a shared filesystem.",
        default="./logs", runtime=_WHERE)
    shared_fs_roots: tuple[str, ...] = key(
        "Shared-filesystem roots (e.g. `/lustre`, `/home`); mount sources outside them get a warning.",
        default=[], items={"pattern": "^/"}, runtime=COMPILER)
    ray: RaySection

    @property
    def world_size(self) -> int:
        """GPUs in the allocation: nodes × gpus_per_node."""
        return self.nodes * self.gpus_per_node


# --------------------------------------------------------------------------- parallelism


@section(runtime="TrainParallelConfig")
class TrainParallelism(_Section):
    """Megatron-core parallelism of the trainer."""

    tp: int = key(
        "Tensor parallel size.",
        default=1, minimum=1, maximum=65536, runtime=_TRAIN_LAYOUT)
    pp: int = key(
        "Pipeline parallel size.",
        default=1, minimum=1, maximum=65536, runtime=_TRAIN_LAYOUT)
    ep: int = key(
        "Expert parallel size (MoE only).",
        default=1, minimum=1, maximum=65536, runtime=_TRAIN_LAYOUT)
    etp: int = key(
        "Expert tensor parallel size (MoE only).",
        default=1, minimum=1, maximum=65536, runtime=_TRAIN_LAYOUT)
    cp: int = key(
        "Context parallel size.",
        default=1, minimum=1, maximum=65536, runtime=_TRAIN_LAYOUT)
    vpp: int = key(
        "Virtual pipeline stages per pipeline rank (1 = none).",
        default=1, minimum=1, maximum=1024, runtime=_TRAIN_LAYOUT)
    sequence_parallel: bool = key(
        "Megatron sequence parallelism (needs tp > 1 to matter).",
        default=False, runtime=_TRAIN_LAYOUT)
    num_layers_in_first_pipeline_stage: Optional[int] = key(
        "Decoder layers on the first pipeline stage (uneven pipelines); unset = even split.",
        minimum=0, maximum=10000, runtime=_TRAIN_LAYOUT)
    num_layers_in_last_pipeline_stage: Optional[int] = key(
        "Decoder layers on the last pipeline stage (uneven pipelines); unset = even split.",
        minimum=0, maximum=10000, runtime=_TRAIN_LAYOUT)


@section(runtime="GenerationParallelConfig")
class GenerationParallelism(_Section):
    """vLLM parallelism of each generation engine."""

    tp: int = key(
        "vLLM tensor parallel size.",
        default=1, minimum=1, maximum=65536, runtime=_GENERATION_LAYOUT)
    pp: int = key(
        "vLLM pipeline parallel size.",
        default=1, minimum=1, maximum=65536, runtime=_GENERATION_LAYOUT)
    ep: int = key(
        "vLLM expert parallel size (1 = off). Must be a multiple of tp and divide the expert count. Shrinks the "
        "per-GPU expert shard vLLM keeps during sleep level 1.",
        default=1, minimum=1, maximum=65536, runtime=_GENERATION_LAYOUT)
    dp: Optional[int] = key(
        "Number of vLLM engines; unset = world size / (tp × pp).",
        minimum=1, maximum=65536, runtime=_GENERATION_LAYOUT, resolved=True)


@section
class ParallelismSection(_Section):
    """How the trainer (Megatron) and the generation engine (vLLM) split the model."""

    train: TrainParallelism = key(runtime_name="train_parallel")
    generation: GenerationParallelism = key(runtime_name="generation_parallel")


# --------------------------------------------------------------------------- refit


@section(runtime="RefitConfig")
class RefitSection(_Section):
    """Moving updated weights from the trainer into vLLM every step. Each fix from the field reports is a switch
    here; `auto` lets the rules decide (the decision is written into runtime.yaml and plan.txt)."""

    buffer_memory_ratio: float = key(
        "Fraction of the free GPU memory at refit used for the IPC buffer; it is split into two ping-pong halves, so "
        "each half is `free × ratio / 2` and must hold the largest exported tensor. Mutually exclusive with "
        "`buffer_gb`.",
        default=0.3, exclusive_minimum=0, maximum=0.9, runtime=_REFIT, runtime_type="float | None")
    buffer_gb: Optional[float] = key(
        "Fixed IPC buffer size in GiB (both halves together) instead of a ratio.",
        exclusive_minimum=0, maximum=1024, runtime=_REFIT)
    alignment_bytes: int = key(
        "Alignment of each tensor inside the buffer.",
        default=256, minimum=1, maximum=1048576, runtime=_REFIT)
    sleep_level: Literal[1, 2] = key(
        "vLLM sleep level after generation. 1 offloads weights to CPU and keeps the weight shard allocation; 2 "
        "discards weights (refit re-streams them anyway) and frees far more memory.",
        default=1, runtime=_REFIT)
    keep_weights_awake: bool = key(
        "vLLM's sleep frees only its KV cache: its weight shard stays on the GPU while the trainer runs, and the "
        "refit writes into it without waking it (no re-mapping of the shard per step: 0.05 s for Qwen3-8B, "
        "0.15 s for Qwen3-30B-A3B on an H200). Costs the shard's memory in the train step, which the planner "
        "counts. `refit.sleep_level` then applies to nothing and must not be 2. vLLM backend only.",
        default=False, runtime=_REFIT)
    wake_kv_during_transfer: bool = key(
        "With `refit.keep_weights_awake`, every vLLM worker maps its KV cache back while the weights arrive (from "
        "the moment the transfer begins) instead of after the transfer, which takes the KV cache's wake-up (0.025 s "
        "for a Qwen3-8B engine at 30 % of an H200) off the refit's critical path. The KV cache then holds its "
        "memory during the transfer: the plan counts it in the refit phase, and the trainer sizes its refit "
        "buffers without it. vLLM backend only.",
        default=False, runtime=_REFIT)
    keep_kv_cache_awake: bool = key(
        "With `refit.keep_weights_awake`, vLLM's KV cache stays on the GPU too: the engine does not sleep between "
        "rollouts, so no refit waits for the KV pool to be mapped back (the driver hands it back cleared: 0.02-0.07 "
        "s for Qwen3-8B's 24.8 GiB pool on an H200, paid again at every step) and no sleep unmaps it; the prefix "
        "cache is still emptied before the next rollout (reset while the trainer runs). Costs the KV pool's memory in every phase (the train step, the logprob pass, the refit), "
        "which the planner counts; a pool sized to the rollout (`generation.kv_cache_memory_bytes`) keeps that "
        "small. verl's `rollout.free_cache_engine: false` is the same choice. Measure a whole step with it: on a "
        "tiny test model (same machine, only this switch changed) the refit got 2 ms faster but generation 13 % "
        "slower, and the step longer. vLLM backend only.",
        default=False, runtime=_REFIT)
    offload_optimizer_for_refit: bool = key(
        "Move optimizer state and gradients to CPU during refit and back afterwards.",
        default=True, runtime=_REFIT)
    offload_params_for_generation: bool = key(
        "Move the trainer's bf16 parameters to host memory after the refit, while vLLM generates, and back before "
        "the trainer's next forward (as NeMo-RL, verl, slime and SkyRL run colocated generation). Frees the "
        "parameter shard for vLLM's pool; costs one host round trip of the shard per step. Needs "
        "`training.use_distributed_optimizer` (Megatron keeps the parameters in one contiguous buffer only then).",
        default=False, runtime=_REFIT)
    sync_params_before_refit: Switch = key(
        "Force a synchronous parameter all-gather before exporting weights. Needed when the distributed optimizer "
        "overlaps its param gather (stale shards otherwise). `auto` turns it on exactly then.",
        default="auto", runtime=_REFIT, runtime_type="bool")
    dedupe_mtp_embedding: Switch = key(
        "Drop the MTP-replicated word embedding on the last pipeline stage so PP rank 0 is its only owner. Needed "
        "for MTP with shared embeddings and pp > 1. `auto` turns it on exactly then.",
        default="auto", runtime=_REFIT, runtime_type="bool")
    per_rank_ipc_metadata: Switch = key(
        "Each trainer rank sends its own buffer slicing metadata with its IPC handle. Turning it off reproduces the "
        "rank-0-metadata bug (correct bytes under wrong names when ranks pack different tensors, e.g. ep > 1 or pp > "
        "1). `auto` = on.",
        default="auto", runtime=_REFIT, runtime_type="bool")
    fp32_params: Union[Literal["auto"], tuple[str, ...]] = key(
        "Parameters kept in fp32 on the wire (name patterns, fnmatch style), or `auto` for the model's known fp32 "
        "parameters (MoE router `e_score_correction_bias`, expert bias).",
        default="auto", items={"minLength": 1}, runtime=_REFIT, runtime_type="list[str]")
    verify_every: int = key(
        "Check refits bit for bit every N refits (0 = never). The trainer writes its export to node-local disk in "
        "shards of about 1 GiB, which the vLLM worker on the same GPU checks as they arrive: it compares the "
        "parameters of each shard's layers with vLLM's own load of the shard; a difference stops the run, naming the "
        "parameters (and the mantissa bits lost when an fp32 parameter crossed in bf16). For debugging a new model "
        "or layout: each check costs one pass of the export through disk and, per GPU, a few shards of host memory "
        "(with FP8 rollouts the vLLM worker gathers the whole export and two CPU copies of its weights).",
        default=0, minimum=0, maximum=1000000, runtime=_REFIT)
    transport: Literal["cuda_ipc", "shm"] = key(
        "`cuda_ipc` (colocated GPUs) or `shm` (CPU shared memory; tests only).",
        default="cuda_ipc", runtime=_REFIT)
    fused_transfer: Switch = key(
        "Move each MoE layer's routed experts as two stacked tensors (gate/up and down, every expert at once) "
        "instead of one tensor per expert and projection, and copy them straight into vLLM's fused expert "
        "parameters (`w13_weight`, `w2_weight`) with one copy per destination (a 30B-A3B layer's 384 "
        "expert tensors become 2). `auto` turns it on for bf16 rollouts of a MoE model whose experts are whole on "
        "one GPU on both sides (trainer EP, ETP and PP 1; vLLM TP, EP and PP 1); `on` also uses it with tensor- or "
        "expert-parallel layouts. vLLM's own `load_weights` still loads everything the direct copies do not "
        "cover, and `refit.verify_every` checks the result against it bit for bit. Not for FP8 rollouts (the "
        "per-expert path runs, and says so). vLLM backend only.",
        default="auto", runtime=_REFIT, runtime_type="bool")
    direct_export: bool = key(
        "On the trainer, export every tensor that Megatron-Bridge's conversion only renames, slices or reorders by "
        "rows as a view of the trainer's parameter (or one row gather, e.g. q, k and v out of Megatron's "
        "interleaved QKV) instead of running Bridge's per-tensor conversion at every refit. Which tensors qualify "
        "is found, and checked bit for bit against Bridge's own export, when the refit pairs; every other tensor "
        "keeps Bridge's export. Trainer TP and PP 1 (other layouts keep Bridge's export, and say so). bf16 "
        "rollouts, vLLM backend only.",
        default=False, runtime=_REFIT)
    zero_copy_views: bool = key(
        "With `refit.direct_export`, the tensors that are contiguous views of the trainer's parameters are not "
        "packed into the refit buffers: vLLM maps the trainer's parameter memory (CUDA IPC, once, and again only "
        "where the trainer moved a parameter) and copies each tensor from where the trainer holds it, one copy "
        "instead of two and no one-off buffer for a tensor larger than a half (the embedding, the LM head). With "
        "`refit.offload_params_for_generation` the mappings are closed after every refit, so the offload still "
        "frees the memory. bf16 rollouts, vLLM backend only.",
        default=False, runtime=_REFIT)
    zero_copy_experts: bool = key(
        "With `refit.zero_copy_views` and `refit.fused_transfer`, a MoE layer's experts held as separate contiguous "
        "parameters on one rank (no expert parallelism) are read in place too, expert by expert, straight into "
        "vLLM's fused expert parameters: one copy of the experts' bytes instead of two, at the cost of describing "
        "and copying every expert's weight on its own (about 12,000 parts per refit for Qwen3-30B-A3B), which "
        "outweighs the copy saved: measured slower on Qwen3-30B-A3B on one H200 (0.235 s against 0.129 s a refit), "
        "so leave it off. bf16 rollouts, vLLM backend only.",
        default=False, runtime=_REFIT)
    replay_load: bool = key(
        "Record vLLM's `load_weights` at the first refit (every copy it makes from an exported tensor into a "
        "parameter) and replay those copies at every later refit, one batched copy call per bucket, instead of "
        "running the loader's per-tensor Python; tensors the loader computes, converts or skips keep the loader. "
        "The recorded table is checked every refit against the export list and vLLM's parameters, and "
        "`refit.verify_every` checks the result bit for bit. bf16 rollouts, vLLM backend only.",
        default=False, runtime=_REFIT)
    keep_buffers_gb: float = key(
        "GiB of refit IPC buffers (both ping-pong halves together) kept allocated, with vLLM's mappings of them, "
        "from one refit to the next: no allocation and no IPC handle per refit while the halves fit. That "
        "memory stays allocated on the trainer's side while vLLM generates; 0 frees the buffers after every "
        "refit. Larger halves and one-off buffers are allocated per refit.",
        default=2, minimum=0, maximum=1024, runtime=_REFIT)


# --------------------------------------------------------------------------- generation


@section(runtime="SamplingConfig")
class SamplingSection(_Section):
    """Sampling parameters for rollouts."""

    temperature: float = key(
        "Sampling temperature (GRPO needs > 0).",
        default=1.0, exclusive_minimum=0, maximum=10, runtime=EXPERIMENT)
    top_p: float = key(
        "Nucleus sampling threshold (1.0 = off): after the temperature, min-p and top-k, keep the most likely tokens "
        "until their probability reaches this mass. The rollout engine reports logprobs of the truncated "
        "distribution, and the trainer scores each sampled token under the same cuts of its own logits (the KL "
        "penalty compares full distributions).",
        default=1.0, exclusive_minimum=0, maximum=1, runtime=EXPERIMENT)
    top_k: int = key(
        "Top-k sampling (-1 = off): keep the k most likely tokens after the temperature and min-p; the trainer "
        "scores under the same cut (see `top_p`).",
        default=-1, minimum=-1, maximum=1048576, runtime=EXPERIMENT)
    min_p: float = key(
        "Min-p sampling (vLLM `min_p`; 0 = off): after the temperature, drop every token less likely than this "
        "fraction of the most likely one. Keeps high-temperature rollouts coherent without a fixed top-k/top-p "
        "cut. Like `top_p` it samples from a truncated distribution, which vLLM's logprobs then describe, and the "
        "trainer scores under the same cut. The Megatron engine has no min-p (`generation.backend: megatron` "
        "refuses it).",
        default=0.0, minimum=0, maximum=1, runtime=EXPERIMENT)
    max_tokens: int = key(
        "Maximum generated tokens per sample.",
        default=1024, minimum=1, maximum=16777216, runtime=EXPERIMENT)
    stop: tuple[str, ...] = key(
        "Stop strings.",
        default=[], runtime=EXPERIMENT)
    stop_token_ids: tuple[int, ...] = key(
        "Token ids that end a sample besides the tokenizer's EOS (vLLM `stop_token_ids`), e.g. a chat template's "
        "end-of-turn token.",
        default=[], unique_items=True, items={"minimum": 0}, runtime=EXPERIMENT)


@section(runtime="SpeculativeDecodingConfig")
class SpeculativeDecodingSection(_Section):
    """Speculative decoding in the rollout engine (vLLM `speculative_config`). Unset or null: off. rlc sets vLLM's
    `speculative_config` from this block (so `generation.vllm_kwargs.speculative_config` is refused) and the
    memory planner counts what it loads: with `mtp` the drafter's weights (the checkpoint's MTP blocks) sit in
    vLLM's weight pool next to the model's shard. Rejection sampling keeps the sampled distribution the target
    model's."""

    method: Literal["mtp", "ngram"] = key(
        "How draft tokens are proposed. `mtp`: the checkpoint's own multi-token-prediction layers draft (vLLM method "
        "`mtp`; DeepSeek-V3, Qwen3.5 / Qwen3-Next, GLM-4.5, Nemotron-H MTP checkpoints); vLLM loads them even when "
        "`model.overrides` switches the trainer's MTP off, and they stay at the checkpoint's weights (the refit does "
        "not update them), so `mtp` needs `refit.sleep_level: 1` (level 2 discards them and nothing writes them "
        "back). `ngram`: prompt lookup, drafting the tokens that followed the latest matching n-gram of the sequence "
        "so far (vLLM method `ngram`, no weights, CPU).",
        runtime=_ENGINE)
    num_speculative_tokens: int = key(
        "Draft tokens proposed per decoding step (vLLM `num_speculative_tokens`). With `mtp`, more tokens than the "
        "checkpoint has MTP layers run its MTP layers again in turn (vLLM warns of a lower acceptance rate).",
        minimum=1, maximum=64, runtime=_ENGINE)
    prompt_lookup_min: int = key(
        "`ngram` only: shortest n-gram that may match (vLLM `prompt_lookup_min`). 2 skips single-token matches, "
        "which propose poorly.",
        default=2, minimum=1, maximum=1024, runtime=_ENGINE)
    prompt_lookup_max: int = key(
        "`ngram` only: longest n-gram tried first (vLLM `prompt_lookup_max`; 4 as in vLLM's n-gram example). Must be "
        "≥ `prompt_lookup_min`.",
        default=4, minimum=1, maximum=1024, runtime=_ENGINE)


@section(runtime="Fp8RolloutConfig")
class Fp8RolloutSection(_Section):
    """FP8 rollouts (used with `generation.precision: fp8`)."""

    scales: Literal["auto", "block", "tensor"] = key(
        "Weight scales of the FP8 engine. `block`: one fp32 scale per 128×128 block (the DeepSeek-V3 checkpoint "
        "format, vLLM `weight_block_size: [128, 128]`); the trainer quantizes with vLLM's own function before the "
        "transfer, so the refit moves 1 byte per weight plus 4 bytes per block, and every quantized projection's "
        "shard on a vLLM rank must be 128-aligned. `tensor`: one scale per weight matrix (vLLM's online "
        "`fp8_per_tensor`); the refit moves `model.dtype` and vLLM quantizes as it loads, because a per-tensor scale "
        "spans the q/k/v (gate/up) projections vLLM fuses and its tensor-parallel slice, which the trainer does not "
        "see. `auto`: block where every quantized projection is 128-aligned on each vLLM rank, else tensor (the "
        "decision and its reason are in `refit.decisions`).",
        default="auto", runtime=EXPERIMENT, resolved=True)
    pow2_scales: bool = key(
        "Round block scales up to powers of two (vLLM's `use_ue8m0`; NeMo-RL `pow2_weight_scaling_factors`). Block "
        "scales only.",
        default=False, runtime=EXPERIMENT)
    keep_bf16: tuple[str, ...] = key(
        "Name fragments of the layers the FP8 engine keeps in `model.dtype` (NeMo-RL "
        "`vllm_cfg.quantization_ignored_layer_kws`): every linear layer (or MoE experts module) whose checkpoint "
        "module name contains one of them, e.g. `model.layers.0.mlp.down_proj` for `mlp` or `down_proj`, is built "
        "unquantized by vLLM and sent unquantized by the refit. For layers whose shapes do not fit 128×128 blocks "
        "or that lose too much in FP8. A fragment must cover every part vLLM fuses into one layer (q/k/v, "
        "gate/up): vLLM refuses a fused layer whose parts differ in precision. The embedding, the LM head, the "
        "norms and the MoE routers stay in `model.dtype` without it.",
        default=[], unique_items=True, items={"minLength": 1}, runtime=EXPERIMENT)


@section(runtime="MegatronGenerationConfig")
class MegatronGenerationSection(_Section):
    """Megatron-core inference (`generation.backend: megatron`); setting any of these with the vLLM backend is an
    error."""

    mode: Literal["auto", "shared", "dedicated"] = key(
        "Which model generates. `shared`: the training model itself (no weights move; the refit only syncs the "
        "trainer's parameters and wakes the engine). `dedicated`: a second model in the inference layout, refit "
        "every step with megatron-core's `swap_model_weights` (the colocated reshard of NeMo-RL PR #3490); with the "
        "trainer's layout every swap is a local copy. `auto`: `shared` when the inference model would equal the "
        "training model (same layout and `transformer_impl`), else `dedicated`; the decision is recorded in "
        "runtime.yaml.",
        default="auto", runtime=_ENGINE, resolved=True)
    transformer_impl: Literal["auto", "transformer_engine", "inference_optimized"] = key(
        "Layer implementation of the generating model. `auto`: the trainer's (Transformer Engine). "
        "`inference_optimized`: megatron-core's inference-optimized layers, which need a dedicated model; "
        "megatron-core 0.19 refuses them for MoE layers with gated linear units (SwiGLU), expert tensor parallelism "
        "or a router not in fp32, needs RMSNorm and no linear biases, and its router cannot do group-limited "
        "routing.",
        default="auto", runtime=_ENGINE, resolved=True)
    router_dtype: Literal["auto", "fp32", "fp64"] = key(
        "Router computation dtype of the generating model (megatron-core `moe_router_dtype`). `auto`: the trainer's "
        "(`training.moe.router_dtype`). Another value makes the inference model differ from the training model, so "
        "it needs a dedicated one, as NeMo-RL merges `mcore_generation_config.moe_router_dtype` over the trainer's "
        "for its dedicated model only; `fp32` lets a trainer that routes in fp64 generate with megatron-core's "
        "inference-optimized MoE layers, which run an fp32 router only.",
        default="auto", runtime=_ENGINE)
    mamba_ssm_states_dtype: Literal["auto", "fp32", "bf16", "fp16"] = key(
        "dtype of the per-request Mamba SSM state megatron-core's engine keeps for a hybrid model "
        "(`MambaInferenceStateConfig.ssm_states_dtype`). `auto`: the model's dtype (megatron-core's default). `fp32` "
        "keeps the recurrent state at full precision through long rollouts, as NeMo-RL's Nemotron-3 Nano recipes "
        "ask (`mamba_inference_ssm_states_dtype: float32`); it doubles the SSM state's share of the pool, which the "
        "plan counts.",
        default="auto", runtime=_ENGINE)
    mamba_conv_states_dtype: Literal["auto", "fp32", "bf16", "fp16"] = key(
        "dtype of the per-request Mamba convolution state (`MambaInferenceStateConfig.conv_states_dtype`). `auto`: "
        "the model's dtype.",
        default="auto", runtime=_ENGINE)
    kv_cache: Literal["recompute", "offload", "persist"] = key(
        "What happens to the KV pool (`generation.kv_cache_memory_bytes`) while the trainer runs (megatron-core "
        "`KVCacheManagementMode`). `recompute`: freed after each rollout and allocated again for the next; "
        "`offload`: copied to host memory and back; `persist`: stays on the GPU through the trainer's passes (the "
        "plan counts it there).",
        default="recompute", runtime=_ENGINE)
    block_size_tokens: int = key(
        "Tokens per KV-cache block (megatron-core `InferenceConfig.block_size_tokens`). A request holds ceil((prompt "
        "+ response) / block) blocks; the pool must hold the blocks of one full-length request plus megatron-core's "
        "dummy block.",
        default=256, minimum=1, maximum=65536, runtime=_ENGINE)
    max_tokens: Optional[int] = key(
        "Tokens per engine step at most, prefill and decode together (megatron-core `InferenceConfig.max_tokens`). "
        "Unset: megatron-core's 16384. Sets the engine's activation and logits memory; a prompt longer than this is "
        "refused (no chunked prefill).",
        minimum=1, maximum=16777216, runtime=_ENGINE)
    max_requests: Optional[int] = key(
        "Requests in one engine step at most (megatron-core `InferenceConfig.max_requests`). Unset: as many as the "
        "KV pool has blocks, rounded down to a multiple of 4. Must not exceed `max_tokens`.",
        minimum=1, maximum=16777216, runtime=_ENGINE)
    refit_backend: Literal["nccl", "gloo"] = key(
        "Copy service of `swap_model_weights` in dedicated mode (megatron-core `refit_method`): `nccl` (same-GPU "
        "pieces become a device copy) or `gloo` (through host memory).",
        default="nccl", runtime=_ENGINE)


@section(runtime="GenerationConfig")
class GenerationSection(_Section):
    """The rollout engine."""

    backend: Literal["vllm", "megatron"] = key(
        "Generation backend. `vllm`: a vLLM engine next to each trainer rank, slept while the trainer runs and refit "
        "over CUDA IPC. `megatron`: megatron-core's dynamic inference engine inside the trainer's own process, on "
        "the training model (`generation.megatron.mode: shared`) or on a second, inference-layout model refit in "
        "process with `swap_model_weights` (`dedicated`), as NeMo-RL's Megatron generation backend (NeMo-RL PR "
        "#3490). With `megatron` the vLLM-only keys (`refit.sleep_level`, the IPC buffer, "
        "`generation.gpu_memory_utilization`, `vllm_version`, `vllm_kwargs`) are errors, and "
        "`generation.kv_cache_memory_bytes` is required.",
        default="vllm", runtime=_ENGINE)
    megatron: MegatronGenerationSection = key(runtime_type="MegatronGenerationConfig | None")
    vllm_version: Optional[str] = key(
        "vLLM version the job's container runs (e.g. `0.17.1`, `0.22.0`). Selects the sleep-mode semantics the "
        "memory planner uses (what stays on the GPU and what goes to host memory at each sleep level) and is "
        "recorded in runtime.yaml; the runtime warns if the installed vLLM differs. Unset: the version of the "
        "planner's calibration entry for `cluster.gpu` (recorded explicitly).",
        pattern="^[0-9]+\\.[0-9]+(\\.[0-9]+)?([.+-][0-9A-Za-z.+-]*)?$", runtime=_ENGINE, resolved=True)
    enforce_eager: bool = key(
        "Disable CUDA graphs. Costs throughput, but CUDA-graph buffers cannot be released by sleep and grow after "
        "the first step.",
        default=False, runtime=_ENGINE)
    gpu_memory_utilization: float = key(
        "Fraction of GPU memory vLLM may use (weights + KV cache) while awake.",
        default=0.6, exclusive_minimum=0, maximum=0.95, runtime=_ENGINE)
    kv_cache_memory_bytes: Optional[int] = key(
        "Fixed KV-cache size in bytes for vLLM (its `kv_cache_memory_bytes`); takes precedence over "
        "`gpu_memory_utilization` for the cache, so the sleep pool no longer grows when a vLLM upgrade profiles "
        "memory differently (NeMo-RL PR #3280). The planner counts weights + this cache instead of the utilization "
        "share. With `generation.backend: megatron` it is required: the size of megatron-core's fixed KV pool "
        "(`InferenceConfig.buffer_size_gb`).",
        minimum=1, maximum=1099511627776, runtime=_ENGINE)
    precision: Literal["auto", "fp8"] = key(
        "Weight precision of the rollout engine: `auto` = `model.dtype`; `fp8` = FP8 rollouts: vLLM holds the linear "
        "layers' weights in float8_e4m3fn (1 byte per parameter) with the scales `generation.fp8` names, and every "
        "refit delivers them quantized exactly as vLLM quantizes a bf16 weight. The embedding, LM head, norms and "
        "MoE routers stay in `model.dtype`.",
        default="auto", runtime=EXPERIMENT)
    fp8: Fp8RolloutSection
    max_model_len: int = key(
        "Maximum prompt + generation length in tokens.",
        default=4096, minimum=16, maximum=16777216, runtime=EXPERIMENT)
    sampling: SamplingSection
    speculative_decoding: Optional[SpeculativeDecodingSection] = key(default=None)
    vllm_kwargs: Mapping[str, Any] = key(
        "vLLM engine options rlc does not reason about (e.g. `enable_prefix_caching`, `max_num_seqs`, "
        "`max_num_batched_tokens`, `kv_cache_dtype`), handed to `vllm.LLM(...)` unchanged and recorded in "
        "runtime.yaml. Options rlc sets from typed keys (parallelism, memory, sleep mode, model, speculative "
        "decoding) are rejected here with the key to use instead.",
        default={}, property_names="^[A-Za-z_][A-Za-z0-9_]*$", runtime=_ENGINE)

    @property
    def drafts_with_mtp(self) -> bool:
        """vLLM's drafter is the checkpoint's MTP layers: weights in vLLM's weight pool that the refit does not
        write, so sleep level 2 (which discards them) is not an option."""
        spec = self.speculative_decoding
        return spec is not None and spec.method == "mtp"


# --------------------------------------------------------------------------- training


@section(runtime="OptimizerConfig")
class OptimizerSection(_Section):
    """Optimizer settings."""

    name: Literal["adam", "sgd"] = key(
        "Optimizer.",
        default="adam", runtime=EXPERIMENT)
    lr: float = key(
        "Peak learning rate.",
        default=1e-06, exclusive_minimum=0, maximum=1, runtime=EXPERIMENT)
    min_lr: float = key(
        "Final learning rate of decaying schedules.",
        default=0.0, minimum=0, maximum=1, runtime=EXPERIMENT)
    weight_decay: float = key(
        "Decoupled weight decay.",
        default=0.01, minimum=0, maximum=10, runtime=EXPERIMENT)
    adam_beta1: float = key(
        "Adam beta1.",
        default=0.9, minimum=0, exclusive_maximum=1, runtime=EXPERIMENT)
    adam_beta2: float = key(
        "Adam beta2.",
        default=0.999, minimum=0, exclusive_maximum=1, runtime=EXPERIMENT)
    adam_eps: float = key(
        "Adam epsilon.",
        default=1e-08, exclusive_minimum=0, maximum=1, runtime=EXPERIMENT)


@section(runtime="LRScheduleConfig")
class LrScheduleSection(_Section):
    """Learning-rate schedule."""

    name: Literal["constant", "cosine", "linear"] = key(
        "Schedule shape after warm-up.",
        default="constant", runtime=EXPERIMENT)
    warmup_steps: int = key(
        "Linear warm-up steps.",
        default=0, minimum=0, maximum=1000000000, runtime=EXPERIMENT)
    warmup_start_lr: float = key(
        "Learning rate the linear warm-up starts from (NeMo-RL / Megatron `lr_warmup_init`); it rises to "
        "`training.optimizer.lr` over `warmup_steps`.",
        default=0.0, minimum=0, maximum=1, runtime=EXPERIMENT)


@section(runtime="Fp8TrainingConfig")
class Fp8Section(_Section):
    """FP8 training (Transformer Engine). Parameters and optimizer state stay in `model.dtype` / fp32; matrix
    multiplies run in FP8."""

    enabled: bool = key(
        "Run linear layers in FP8.",
        default=False, runtime=EXPERIMENT)
    format: Literal["e4m3", "hybrid"] = key(
        "FP8 format: `e4m3` everywhere, or `hybrid` (e4m3 forward, e5m2 gradients).",
        default="e4m3", runtime=EXPERIMENT)
    recipe: Literal["tensorwise", "delayed", "blockwise", "mxfp8"] = key(
        "Scaling recipe: `tensorwise`, `delayed`, `blockwise` (Hopper, DeepSeek-V3 style 128×128 blocks) or `mxfp8` "
        "(Blackwell).",
        default="blockwise", runtime=EXPERIMENT)
    param_gather: bool = key(
        "Keep the distributed optimizer's all-gathered parameters in FP8 (Megatron `fp8_param_gather`).",
        default=False, runtime=EXPERIMENT)


@section(runtime="MoeConfig")
class MoeSection(_Section):
    """Mixture-of-experts execution in the trainer."""

    token_dispatcher: Literal["alltoall", "allgather", "flex"] = key(
        "Megatron MoE token dispatcher: `alltoall`, `allgather`, or `flex` (needed by DeepEP).",
        default="alltoall", runtime=_SPEED)
    deepep: bool = key(
        "Use DeepEP kernels for expert-parallel dispatch (Megatron `moe_enable_deepep`; needs `token_dispatcher: "
        "flex` and DeepEP in the container).",
        default=False, runtime=_SPEED)
    router_dtype: Literal["fp32", "fp64", "auto"] = key(
        "Router computation dtype (Megatron `moe_router_dtype`): `fp32` / `fp64` keep routing stable in low "
        "precision; `auto` keeps the model provider's own setting.",
        default="auto", runtime=_SPEED)


@section(runtime="SequencePackingConfig")
class SequencePackingSection(_Section):
    """Pack several rollouts into one sequence for the train and logprob passes instead of padding each to the
    longest."""

    enabled: bool = key(
        "Pack rollouts (NeMo-RL `policy.sequence_packing.enabled`).",
        default=False, runtime=_SPEED)
    algorithm: PackingAlgorithm = key(
        "Bin-packing algorithm for the packs (NeMo-RL's names; `modified_ffd` is the spelling some NeMo-RL recipes "
        "use for `modified_first_fit_decreasing`).",
        default="modified_first_fit_decreasing", runtime=_SPEED)
    train_mb_tokens: Optional[int] = key(
        "Token budget of a packed micro batch in the train pass (NeMo-RL `policy.sequence_packing.train_mb_tokens`): "
        "sequences are bin-packed into micro batches of at most this many tokens (each sequence padded to the "
        "multiple context and sequence parallelism need). Sets the train pass's activation and logits memory. Unset "
        "= `max_sequence_length × micro_batch_size` (as many tokens as a padded micro batch of full-length "
        "sequences).",
        minimum=1, maximum=1073741824, runtime=_SPEED, resolved=True)
    logprob_mb_tokens: Optional[int] = key(
        "Token budget of a packed micro batch in the logprob passes (old and reference logprobs; NeMo-RL "
        "`policy.sequence_packing.logprob_mb_tokens`). Unset = `max_sequence_length × logprob_batch_size` (NeMo-RL's "
        "default).",
        minimum=1, maximum=1073741824, runtime=_SPEED, resolved=True)


@section(runtime="RouterReplayConfig")
class RouterReplaySection(_Section):
    """Rollout Routing Replay (R3, arXiv 2510.11370) for MoE models: vLLM returns the experts it routed each rollout
    token to (`enable_return_routed_experts`, vLLM PR #28284) and the trainer's logprob, reference and train
    passes route every token to those same experts (Megatron's `RouterReplay`), so the trainer's logprobs are
    computed on the experts that sampled the token."""

    enabled: bool = key(
        "Replay vLLM's routing in the trainer (NeMo-RL `policy.router_replay.enabled`). MoE models only; vLLM 0.22 "
        "without pipeline parallelism in vLLM; the MTP block's router is not replayed (vLLM never runs it on the "
        "rollout's tokens). The rollout batch then carries the routes of every token (N x L x MoE layers x experts "
        "per token, 1 byte each with up to 256 experts), counted in the host memory plan.",
        default=False, runtime=EXPERIMENT)


@section(runtime="TrainingConfig")
class TrainingSection(_Section):
    """The trainer (Megatron-core through Megatron-Bridge)."""

    optimizer: OptimizerSection
    lr_schedule: LrScheduleSection
    grad_clip: float = key(
        "Gradient-norm clip (0 = off).",
        default=1.0, minimum=0, maximum=1000000, runtime=EXPERIMENT)
    micro_batch_size: int = key(
        "Sequences per micro-batch on each data-parallel rank.",
        default=1, minimum=1, maximum=65536, runtime=restart("how the global batch is split"))
    logprob_batch_size: Optional[int] = key(
        "Sequences per micro-batch of the logprob passes on each data-parallel rank: the policy's logprobs before "
        "the update and the reference policy's (NeMo-RL `policy.logprob_batch_size`); unset = `micro_batch_size`. "
        "The pass is forward only, but its largest activation is the fp32 logits over the whole vocabulary, about 2 "
        "× batch × sequence × vocabulary / TP × 4 bytes (the logits and the copy the logprob takes), so this bounds "
        "the pass's memory, which the plan's logprob phase counts. With `sequence_packing` the passes run in packed "
        "micro batches of `sequence_packing.logprob_mb_tokens` tokens instead, whose default is "
        "`max_sequence_length` × this. Batch size changes the numerics of some kernels: with TP ≥ 4 NeMo-RL requires "
        "it equal to `micro_batch_size`, so that the policy's logprobs before the update match those of the train "
        "pass. rlc does not chunk the logits along the sequence (NeMo-RL's `logprob_chunk_size`): the train pass "
        "holds the same logits for one micro-batch and their gradient as well, so chunking the logprob pass alone "
        "never lowers the step's peak; raise `parallelism.train.tp` to split them.",
        minimum=1, maximum=65536, runtime=_SPEED, resolved=True)
    global_batch_size: Optional[int] = key(
        "Sequences per optimizer step across all data-parallel ranks; unset = prompts_per_step × "
        "generations_per_prompt (one optimizer step per GRPO step).",
        minimum=1, maximum=16777216, runtime=EXPERIMENT, resolved=True)
    use_distributed_optimizer: bool = key(
        "Shard optimizer state over data-parallel ranks (Megatron distributed optimizer).",
        default=True, runtime=_SPEED)
    use_precision_aware_optimizer: bool = key(
        "Megatron's precision-aware optimizer (NeMo-RL's default with Megatron): the fp32 master weights live in the "
        "optimizer state (TE FusedAdam) instead of a separate fp32 copy of the parameters, so offloading the "
        "optimizer before refit also moves them off the GPU. Needs `use_distributed_optimizer`.",
        default=False, runtime=_SPEED)
    overlap_param_gather: bool = key(
        "Overlap the distributed optimizer's parameter all-gather with the next forward.",
        default=False, runtime=_SPEED)
    grad_reduce_in_fp32: bool = key(
        "Megatron's `grad_reduce_in_fp32`: the DDP gradient buffers (`main_grad`) are fp32 and gradients are reduced "
        "in fp32. Costs 4 bytes per parameter of gradient buffer instead of 2 (bf16) wherever the grads are held: on "
        "the GPU in the train step (and at the refit and while generating unless `refit.offload_optimizer_for_refit` "
        "moves them), in host memory where they are offloaded. Frameworks differ: NeMo-RL's examples set it false "
        "and Megatron-LM's `--accumulate-allreduce-grads-in-fp32` is off unless given; verl and SkyRL turn it on. "
        "Default true: what the bundled runtime has run.",
        default=True, runtime=_SPEED)
    overlap_grad_reduce: bool = key(
        "Overlap gradient reduce-scatter with backward.",
        default=False, runtime=_SPEED)
    optimizer_cpu_offload: bool = key(
        "Megatron's hybrid CPU optimizer offload. Measured to raise post-step GPU residency with colocated MoE "
        "(12.72 → 15.86 GB); prefer `refit.offload_optimizer_for_refit`.",
        default=False, runtime=_SPEED)
    optimizer_offload_fraction: float = key(
        "Fraction of optimizer state offloaded when `optimizer_cpu_offload` is on.",
        default=1.0, minimum=0, maximum=1, runtime=_SPEED)
    offload_copies_gradients: bool = key(
        "What the trainer's offload does with Megatron's gradient buffers. false (default): they are freed and "
        "rebuilt zeroed when the trainer comes back (Megatron-core's `offload_grad_buffers` / `offload_to_cpu`, as "
        "the bundled runtime, NeMo-RL and verl offload), so they take no host memory. true: they are copied to host "
        "memory with everything else the trainer allocated (torch_memory_saver with CPU backup, as slime and vime "
        "offload); the planner then counts them in the host plan, so a translated slime or vime recipe plans the "
        "host memory it needs there. The bundled runtime always frees them, and compiles either way: between the "
        "optimizer step and the next step's zero_grad the gradient buffers hold nothing the run reads again, so a "
        "copy would cost host memory and transfer time for no effect on training. With true its host memory is lower "
        "than the plan by the copy's size (`rlc validate` says how much).",
        default=False, runtime=COMPILER)
    offload_reference_policy: bool = key(
        "With `loss.kl_penalty` > 0: keep the frozen reference policy in pinned host memory and bring it to the GPU "
        "only for its logprob pass (NeMo-RL keeps it as a CPU state dict; verl's `ref.megatron.param_offload`, slime "
        "and SkyRL offload it too). The bundled runtime copies its weights once into pinned blocks whose sizes are "
        "powers of two (so PyTorch's pinned allocator rounds nothing up), frees them on the GPU, and for each "
        "reference logprob pass allocates them again, copies them in and frees them after; the trainer's weights, "
        "gradients and optimizer state are not touched. The plan counts the copy in host memory and the weights on "
        "the GPU only in the logprob phase, next to the trainer's.",
        default=False, runtime=_SPEED)
    mtp_loss_scale: float = key(
        "Weight of the multi-token-prediction block's loss in each training step, for models with MTP layers "
        "(DeepSeek-V3, Qwen3.5, GLM-4.5). Megatron's own default is 0.1, which in RL adds a next-next-token "
        "cross-entropy on the model's own rollouts to the policy gradient; verl's MTP guide reports that only this "
        "setting (MTP loss on all parameters at 0.1) changes RL training results noticeably. 0 (default) trains the "
        "policy loss only; the MTP weights then stay as loaded and are still refit to vLLM.",
        default=0.0, minimum=0, maximum=10, runtime=EXPERIMENT)
    activation_checkpointing: Literal["none", "selective", "full"] = key(
        "Activation recomputation granularity.",
        default="none", runtime=_SPEED)
    max_sequence_length: Optional[int] = key(
        "Longest prompt + response the trainer packs; unset = generation.max_model_len.",
        minimum=16, maximum=16777216, runtime=EXPERIMENT, resolved=True)
    seed: int = key(
        "Trainer random seed.",
        default=1234, minimum=0, maximum=4294967295, runtime=EXPERIMENT)
    fp8: Fp8Section
    moe: MoeSection
    sequence_packing: SequencePackingSection
    router_replay: RouterReplaySection
    megatron_kwargs: Mapping[str, Any] = key(
        "Megatron model-config options rlc does not reason about (e.g. `apply_rope_fusion`, "
        "`bias_activation_fusion`, `moe_permute_fusion`, `defer_fp32_logits`), set on the Megatron-Bridge model "
        "provider unchanged and recorded in runtime.yaml. Options rlc sets from typed keys (parallelism, dtype, "
        "recompute, FP8, MoE dispatcher) are rejected here with the key to use instead.",
        default={}, property_names="^[A-Za-z_][A-Za-z0-9_]*$", runtime=_SPEED)


# --------------------------------------------------------------------------- algorithm, data, outputs


@section(runtime="DynamicSamplingConfig")
class DynamicSamplingSection(_Section):
    """Drop groups whose rewards are all equal and generate more until the step is full."""

    enabled: bool = key(
        "Turn dynamic sampling on.",
        default=False, runtime=EXPERIMENT)
    max_gen_batches: int = key(
        "Generation batches allowed per step before giving up (the error quotes the measured hit rate).",
        default=10, minimum=1, maximum=10000, runtime=EXPERIMENT)
    batch_multiplier: float = key(
        "Prompts generated per batch, as a multiple of prompts_per_step. Needs dynamic sampling.",
        default=1, minimum=1, maximum=1000, runtime=EXPERIMENT)


@section(runtime="RewardScalingConfig")
class RewardScalingSection(_Section):
    """A linear map of the rewards before anything else reads them (NeMo-RL `grpo.reward_scaling`): each reward is
    clamped to [`source_min`, `source_max`] and mapped onto [`target_min`, `target_max`]; e.g. a 0/1 verifier becomes
    −1/+1 with `target_min: -1`."""

    enabled: bool = key(
        "Turn the scaling on.",
        default=False, runtime=EXPERIMENT)
    source_min: float = key(
        "Low end of the reward function's range (lower rewards are clamped to it).",
        default=0.0, minimum=-1000000, maximum=1000000, runtime=EXPERIMENT)
    source_max: float = key(
        "High end of the reward function's range (higher rewards are clamped to it).",
        default=1.0, minimum=-1000000, maximum=1000000, runtime=EXPERIMENT)
    target_min: float = key(
        "What `source_min` becomes.",
        default=0.0, minimum=-1000000, maximum=1000000, runtime=EXPERIMENT)
    target_max: float = key(
        "What `source_max` becomes.",
        default=1.0, minimum=-1000000, maximum=1000000, runtime=EXPERIMENT)


@section(runtime="RewardShapingConfig")
class RewardShapingSection(_Section):
    """Length penalties added to the (scaled) rewards (NeMo-RL `grpo.reward_shaping`). DAPO's soft overlong
    punishment (arXiv 2503.14476): a response longer than `max_response_length − overlong_buffer_length` tokens loses
    `overlong_buffer_penalty` × (its excess ÷ `overlong_buffer_length`). Or, with `stop_properly_penalty_coef`, the
    reward of a response cut at the token limit is multiplied by it instead. Dynamic sampling keeps or drops a group
    by its rewards before the penalty, and with dynamic sampling the advantages are divided by that spread too, as
    NeMo-RL does; the baseline is the penalised rewards' mean."""

    enabled: bool = key(
        "Turn the shaping on.",
        default=False, runtime=EXPERIMENT)
    overlong_buffer_length: int = key(
        "Tokens before `max_response_length` over which the penalty grows from 0 to `overlong_buffer_penalty`.",
        default=128, minimum=1, maximum=16777216, runtime=EXPERIMENT)
    overlong_buffer_penalty: float = key(
        "Penalty at `max_response_length` tokens (it keeps growing beyond).",
        default=1.0, minimum=0, maximum=1000000, runtime=EXPERIMENT)
    max_response_length: Optional[int] = key(
        "The length the penalty is measured against; null: `generation.sampling.max_tokens`.",
        default=None, minimum=1, maximum=16777216, runtime=EXPERIMENT)
    stop_properly_penalty_coef: Optional[float] = key(
        "Multiply the reward of a response that hit the token limit (finish reason `length`) by this, in [0, 1], "
        "instead of the overlong penalty; null: the overlong penalty.",
        default=None, minimum=0, maximum=1, runtime=EXPERIMENT)


@section(runtime="GrpoConfig")
class GrpoSection(_Section):
    """The GRPO algorithm."""

    prompts_per_step: int = key(
        "Prompts (groups) per GRPO step.",
        default=32, minimum=1, maximum=1048576, runtime=EXPERIMENT)
    generations_per_prompt: int = key(
        "Samples per prompt (the group size).",
        default=8, minimum=2, maximum=4096, runtime=EXPERIMENT)
    max_steps: int = key(
        "GRPO steps to run.",
        default=100, minimum=1, maximum=1000000000, runtime=restart("how long the run goes"))
    normalize_advantages: bool = key(
        "Divide advantages by the group's reward standard deviation (Bessel-corrected, + 1e-6). With `leave_one_out: "
        "true` the result is mean-baseline GRPO scaled by G/(G−1) (G = generations_per_prompt), not RLOO: the "
        "leave-one-out advantage is G/(G−1)·(r − mean) and the same std divides it.",
        default=True, runtime=EXPERIMENT)
    leave_one_out: bool = key(
        "Baseline each sample with the mean reward of the other samples of its group (RLOO when "
        "`normalize_advantages: false`; see `normalize_advantages` for the two together).",
        default=False, runtime=EXPERIMENT)
    dynamic_sampling: DynamicSamplingSection
    reward_scaling: RewardScalingSection
    reward_shaping: RewardShapingSection
    max_gen_kl: float = key(
        "Stop the run when the KL between vLLM's sampling logprobs and the trainer's logprobs on the generated "
        "tokens exceeds this (0 = never). Catches wrong or stale weights after refit.",
        default=0.05, minimum=0, maximum=1000, runtime=restart("when the run stops"))
    seed: int = key(
        "Seed for prompt order and sampling.",
        default=42, minimum=0, maximum=4294967295, runtime=EXPERIMENT)

    @property
    def samples_per_step(self) -> int:
        """Rollouts of one GRPO step: prompts_per_step × generations_per_prompt."""
        return self.prompts_per_step * self.generations_per_prompt


@section(runtime="LossConfig")
class LossSection(_Section):
    """The clipped policy-gradient loss. Its logged `approx_kl` is the k3 estimate of KL(old ‖ new), (ratio − 1) −
    log ratio averaged over the tokens, from the policy before the update to the one being trained."""

    ratio_clip_low: float = key(
        "Lower clip of the importance ratio (ratio ≥ 1 − low).",
        default=0.2, minimum=0, maximum=1, runtime=EXPERIMENT)
    ratio_clip_high: float = key(
        "Upper clip of the importance ratio (ratio ≤ 1 + high); larger than low for asymmetric \"clip-higher\".",
        default=0.2, minimum=0, maximum=10, runtime=EXPERIMENT)
    kl_penalty: float = key(
        "Coefficient of the KL penalty to the reference policy (0 = no reference model).",
        default=0.0, minimum=0, maximum=1000, runtime=EXPERIMENT)
    kl_estimator: Literal["k1", "k2", "k3"] = key(
        "Estimator of KL(policy ‖ reference) for the penalty (Schulman's k1 = log-ratio, k2 = squared log-ratio / 2, "
        "k3 = unbiased low-variance, non-negative).",
        default="k3", runtime=EXPERIMENT)
    kl_weighting: Literal["none", "sampling", "on_policy"] = key(
        "How each token's KL estimate is weighted before it is averaged. `none`: as it is (the estimator's own "
        "gradient; verl's KL loss). `sampling`: by exp(logπ − sg(logπ)), of value 1, so the gradient also has the "
        "score-function term KL·∇logπ of drawing the tokens from the policy being trained (NeMo-RL since its PR "
        "#2506; arXiv 2506.09477). `on_policy`: by exp(logπ − log π_engine), the importance weight from the rollout "
        "engine's distribution that sampled the tokens to the trainer's, with the same score-function term "
        "(NeMo-RL `use_on_policy_kl_approximation`). Only with `kl_penalty` > 0.",
        default="none", runtime=EXPERIMENT)
    kl_clamp: Optional[float] = key(
        "Bound on each token's weighted KL term, ±`kl_clamp` (NeMo-RL `kl_output_clamp_value`, 10 by default): a "
        "token the reference finds far less likely than the policy cannot dominate the penalty, and a clamped "
        "token has no KL gradient. null: no bound.",
        default=None, exclusive_minimum=0, maximum=1000000, runtime=EXPERIMENT)
    token_level: bool = key(
        "Average the loss over all tokens of the batch (true) or per sequence first (false).",
        default=True, runtime=EXPERIMENT)
    clip_ratio_c: Optional[float] = key(
        "Dual-clip constant for negative advantages (verl's `clip_ratio_c`, Ye et al. 2020): where A < 0 the "
        "per-token loss is capped at −c·A, so a ratio far above 1 on a bad token cannot make the loss unbounded. "
        "Must be > 1 (verl uses 3.0); null turns dual-clip off.",
        default=None, exclusive_minimum=1, maximum=1000, runtime=EXPERIMENT)
    max_log_ratio: float = key(
        "Bound on |log(new/old)| before the importance ratio is exponentiated, so a token whose logprobs diverged "
        "cannot overflow the ratio to inf (verl clamps at 20).",
        default=20.0, exclusive_minimum=0, maximum=80, runtime=EXPERIMENT)
    force_on_policy_ratio: bool = key(
        "Take the policy ratio as exactly 1, exp(logπ − sg(logπ)), instead of against the logprobs of the policy "
        "before the update (NeMo-RL `force_on_policy_ratio`): with one optimizer step per GRPO step the two differ "
        "only by the numerics of two passes, and no clip applies. Needs `training.global_batch_size` = "
        "`grpo.prompts_per_step` × `grpo.generations_per_prompt` (RLC309).",
        default=False, runtime=EXPERIMENT)
    importance_sampling_correction: bool = key(
        "Weight each token's policy loss by the truncated importance ratio between the trainer's and the rollout "
        "engine's probability of the sampled token, min(exp(trainer − vLLM logprob), `importance_sampling_cap`), "
        "correcting the mismatch between the two engines (NeMo-RL `use_importance_sampling_correction`).",
        default=False, runtime=EXPERIMENT)
    importance_sampling_cap: float = key(
        "Upper bound of the importance weight (truncated importance sampling).",
        default=2.0, exclusive_minimum=0, maximum=1000, runtime=EXPERIMENT)


@section(runtime="DataConfig")
class DataSection(_Section):
    """Prompts."""

    train: str = key(
        "Training prompts, JSONL (one object per line), path as seen inside the container.",
        min_length=1, runtime=EXPERIMENT, runtime_name="data.train_path")
    val: Optional[str] = key(
        "Validation prompts, JSONL.",
        min_length=1, runtime=restart("validation only"), runtime_name="data.val_path")
    prompt_key: str = key(
        "JSONL field holding the prompt.",
        default="prompt", runtime=EXPERIMENT)
    answer_key: str = key(
        "JSONL field holding the reference answer given to the reward.",
        default="answer", runtime=EXPERIMENT)
    prompt_template: str = key(
        "Template applied to each prompt; `{prompt}` is replaced by the prompt text.",
        default="{prompt}", pattern="\\{prompt\\}", runtime=EXPERIMENT)
    chat_template: Optional[str] = key(
        "How a prompt becomes the model's input. null: the text of `prompt_template` as it is, tokenized with the "
        "tokenizer's special tokens (a base model's completion). `default`: the tokenizer's own chat template, "
        "with `system_prompt` (if any) and the text as the user's turn, and the assistant's turn opened "
        "(`add_generation_prompt`), tokenized without adding special tokens, as NeMo-RL's math data processor "
        "does. Any other text: that Jinja chat template, used the same way.",
        default=None, min_length=1, runtime=EXPERIMENT)
    chat_template_kwargs: Mapping[str, Any] = key(
        "Keyword arguments of the chat template (`apply_chat_template`), e.g. `enable_thinking: false` for Qwen3's "
        "(NeMo-RL `policy.tokenizer.chat_template_kwargs`). Needs `chat_template`.",
        default={}, runtime=EXPERIMENT, runtime_default=dict)
    system_prompt: Optional[str] = key(
        "A system turn before every prompt. Needs `chat_template`.",
        default=None, min_length=1, runtime=EXPERIMENT)
    max_prompt_length: int = key(
        "Prompts longer than this many tokens are skipped.",
        default=1024, minimum=1, maximum=16777216, runtime=EXPERIMENT)
    shuffle: bool = key(
        "Shuffle prompts each epoch (seeded by grpo.seed).",
        default=True, runtime=EXPERIMENT)


@section(runtime="RewardConfig")
class RewardSection(_Section):
    """How completions are scored."""

    function: str = key(
        "Built-in reward (`math`, alias `gsm8k`: reasoning-aware numeric answer, where after the thinking the last "
        "`\\boxed{}` wins, then the last `#### n`, then the last number; `exact_match`; `prefix_match`; "
        "`first_char`) or `package.module:function` importable inside the container.",
        default="math",
        pattern="^(math|gsm8k|exact_match|prefix_match|first_char|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$",
        runtime=EXPERIMENT)
    failure_reward: float = key(
        "Reward given to a sample on which the reward function raises or returns a non-finite or non-numeric value. "
        "The run goes on; the metrics count such samples (`reward/failures`) and the log shows one example per step.",
        default=0.0, minimum=-1000000, maximum=1000000, runtime=EXPERIMENT)
    kwargs: Mapping[str, Any] = key(
        "Keyword arguments passed to the reward function.",
        default={}, runtime=EXPERIMENT)


@section(runtime="CheckpointConfig")
class CheckpointingSection(_Section):
    """Checkpoints; the runtime resumes from the latest on start (SLURM requeue continues the run)."""

    enabled: bool = key(
        "Save checkpoints.",
        default=True, runtime=_CHECKPOINTS)
    dir: Optional[str] = key(
        "Checkpoint folder (shared filesystem); default `<log_dir>/checkpoints/<name>`.",
        min_length=1, runtime=_CHECKPOINTS, resolved=True)
    every_steps: int = key(
        "Save every this many GRPO steps.",
        default=50, minimum=1, maximum=1000000000, runtime=_CHECKPOINTS)
    keep_last: int = key(
        "Checkpoints kept (older ones are deleted).",
        default=2, minimum=1, maximum=100000, runtime=_CHECKPOINTS)
    resume: bool = key(
        "Resume from the latest complete checkpoint on start, if the same experiment wrote it (see "
        "`resume_changed_recipe`).",
        default=True, runtime=_CHECKPOINTS)
    resume_changed_recipe: bool = key(
        "Resume even from a checkpoint written under a different experiment: a recipe whose model (tokenizer and MTP "
        "layers included), data, reward, loss, optimizer, fp8 training, rollout precision (`generation.precision`, "
        "`generation.fp8`), routing replay, sampling and context length (`generation.max_model_len`), GRPO settings "
        "(all but `grpo.max_steps`) or `extensions` differ from this one's. Off, such a resume is refused and the "
        "differing keys are named; turn it on only to change an experiment mid-run on purpose.",
        default=False, runtime=_CHECKPOINTS)


@section(runtime="LoggingConfig")
class LoggingSection(_Section):
    """Metrics and logs."""

    dir: Optional[str] = key(
        "Metrics folder; default `<log_dir>/metrics/<name>`.",
        min_length=1, runtime=_METRICS, resolved=True)
    jsonl: bool = key(
        "Write one JSON object per step to `metrics.jsonl`.",
        default=True, runtime=_METRICS)
    tensorboard: bool = key(
        "Write TensorBoard events (needs the tensorboard package in the container).",
        default=True, runtime=_METRICS)
    progress_bar: bool = key(
        "Show a progress bar with ETA on the driver.",
        default=True, runtime=_METRICS)


@section
class LintIgnore(_Section):
    """One silenced warning."""

    rule: str = key(
        "Rule id, e.g. `RLC301`.",
        pattern="^RLC[0-9]{3}$")
    reason: str = key(
        "Why this warning does not apply.",
        min_length=3)


@section
class LintSection(_Section):
    """Lint settings for this recipe."""

    ignore: tuple[LintIgnore, ...] = key(
        "Warnings to silence, each with a reason. Errors cannot be silenced.",
        default=[])


# --------------------------------------------------------------------------- the recipe


@section(runtime="RuntimeConfig")
class Recipe(_Section):
    """A declarative GRPO post-training recipe: which model, on which cluster, with which parallelism, and how
    weights move from the Megatron trainer to the colocated vLLM engine ("refit"). `rlc compile` turns a
    recipe into a launch bundle. Every key is documented here; this schema is the reference."""

    version: Literal[1] = key(
        "Recipe format version. This rlc reads version 1.", runtime=COMPILER)
    name: str = key(
        "Run name; used for the SLURM job name (unless `cluster.slurm.job_name` is set), log folders and "
        "checkpoints.",
        default="rlc-run", pattern="^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        runtime=restart("the run's label (its folders come from checkpointing.dir)"))
    description: str = key(
        "Free text shown in `rlc plan` and the bundle README.",
        default="", runtime=COMPILER)
    model: ModelSection
    cluster: ClusterSection
    parallelism: ParallelismSection
    colocated: bool = key(
        "Trainer and generation engine share the same GPUs (sleep/wake around each phase).",
        default=True, runtime=restart("where each engine runs"))
    refit: RefitSection
    generation: GenerationSection
    training: TrainingSection
    grpo: GrpoSection
    loss: LossSection
    data: DataSection
    reward: RewardSection
    checkpointing: CheckpointingSection
    logging: LoggingSection
    lint: LintSection
    extensions: Mapping[str, Any] = key(
        "Free-form settings for custom code (reward functions, plugins). The only place unknown keys are allowed.",
        default={}, runtime=EXPERIMENT, runtime_default=dict)

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
    def longest_rollout(self) -> int:
        """The longest sample the engine can give: a prompt of at most ``data.max_prompt_length`` tokens (longer ones
        are skipped) and ``generation.sampling.max_tokens`` sampled, the two together at most
        ``generation.max_model_len`` (the engine stops there)."""
        return min(self.data.max_prompt_length + self.generation.sampling.max_tokens, self.generation.max_model_len)

    @property
    def longest_sequence(self) -> int:
        """The longest sequence a rollout can give the trainer: :attr:`longest_rollout`, at most
        :attr:`max_sequence_length`."""
        return min(self.max_sequence_length, self.longest_rollout)

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


_READING = Reading(
    error=RecipeTypeError,
    unknown=lambda path, extra: (f"{path or 'recipe'}: no typed field for {', '.join(extra)} "
                                 "(the schema and rlc.compiler.recipe_types disagree)"),
    missing=lambda where: (f"{where}: missing; the typed recipe is built from a recipe the schema accepted, "
                           "with its defaults filled (rlc.compiler.schema.with_defaults)"),
    not_a_mapping=lambda path, value: f"{path or 'recipe'}: expected a mapping, got {type(value).__name__}",
    as_written=False, top_level_ignored=NOT_SETTINGS)


def recipe_from_data(data: Mapping[str, Any]) -> Recipe:
    """The typed recipe of ``data``: a recipe the schema accepted, with its defaults filled."""
    return load(Recipe, data, "", _READING)


def section_from_data(cls: type[T], data: Mapping[str, Any], path: str) -> T:
    """One typed section (e.g. :class:`ClusterSection` at ``cluster``) from its filled mapping,
    for stages that run when only that part of the recipe passed the schema."""
    return load(cls, data, path, _READING)


def with_value(recipe: T, path: str, value: Any) -> T:
    """``recipe`` (or a section) with the setting at dotted key ``path`` replaced by ``value``.

    The sections on the path are rebuilt, everything else is shared: the planner re-plans a
    recipe once per candidate fix. A list value is stored as a tuple, as the builder does.
    """
    return _replaced(recipe, list(parse_path(path)), value, path)


def _replaced(node: Any, parts: list[PathPart], value: Any, path: str) -> Any:
    head, rest = parts[0], parts[1:]
    fields = typed_fields(type(node)) if isinstance(node, _Section) else {}
    if not isinstance(head, str) or head not in fields:
        raise RecipeTypeError(f"{path}: not a setting of the typed recipe")
    new = _replaced(getattr(node, head), rest, value, path) if rest else convert(fields[head], value, path, _READING)
    return dataclasses.replace(node, **{head: new})


def typed_fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation of a typed-recipe class."""
    return {name: tp for name, tp, _ in settings(cls)}


__all__ = ["FILE_KEYS", "NOT_SETTINGS", "CheckpointingSection", "ClusterSection", "ContainerSection", "DataSection",
           "DynamicSamplingSection", "Fp8RolloutSection", "Fp8Section", "GenerationParallelism", "GenerationSection",
           "Gpu", "GrpoSection", "LintIgnore", "LintSection", "LoggingSection", "LossSection", "LrScheduleSection",
           "MegatronGenerationSection", "ModelSection", "MoeSection", "OptimizerSection", "PackingAlgorithm",
           "ParallelismSection", "RaySection", "Recipe", "RecipeTypeError", "RefitSection", "RewardSection",
           "SamplingSection", "SequencePackingSection", "SlurmSection", "SpeculativeDecodingSection", "Switch",
           "TrainParallelism", "TrainingSection", "recipe_from_data", "section_from_data", "typed_fields",
           "with_value"]
