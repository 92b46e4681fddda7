"""What the driver and its workers say to each other: the workers' methods (two protocols) and their answers.

The driver runs a worker method by reference (``group.call(PolicyWorkerApi.setup, master, steps)``, see
``rlc.runtime.workers.WorkerGroup``): the reference names the method the Ray actor runs, and the type checker
checks the arguments and the answer against the protocol. ``MegatronPolicyWorker`` (with its megatron-core
inference methods) implements :class:`PolicyWorkerApi`, ``VllmGenerationWorker`` :class:`GenerationWorkerApi`;
a CPU test holds the classes to the protocols method by method, and every call the driver makes to them.

Every answer is a frozen dataclass of plain data (numbers, strings, lists, CPU tensors) that Ray carries as it is;
the only mappings left are the refit engine's own reports (``rlc.runtime.refit``), which the driver logs whole.

Pure Python: no torch, ray or vllm at import (the tensors in :class:`TrainBatch` are torch tensors at run time).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

#: The key of the routes in the trainer's batch mapping (``rlc.runtime.policy.routes``).
ROUTES_KEY = "routed_experts"


# --------------------------------------------------------------------------- who a worker is, its memory


@dataclass(frozen=True)
class WorkerInfo:
    """Identity of one worker, for logs and failure messages."""

    role: str  # "policy" | "generation"
    rank: int  # trainer rank, or engine index
    node_ip: str = "?"
    hostname: str = "?"
    pid: int = 0
    gpu_ids: list[Any] = field(default_factory=list)  # Ray's GPU ids (physical index on the node)
    gpu_uuid: str = "?"
    bundle: int = -1

    def describe(self) -> str:
        gpus = ",".join(str(g) for g in self.gpu_ids) or "?"
        return (
            f"{self.role} worker {self.rank} (node {self.node_ip} / {self.hostname}, GPU {gpus}, "
            f"uuid {self.gpu_uuid}, pid {self.pid}, bundle {self.bundle})"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Memory:
    """GPU memory seen by one worker (GiB): the device's free/used/total, its own torch allocator."""

    free_gib: float
    used_gib: float
    total_gib: float
    torch_allocated_gib: float | None = None
    torch_reserved_gib: float | None = None

    def as_dict(self) -> dict[str, float]:
        out = {"free_gib": self.free_gib, "used_gib": self.used_gib, "total_gib": self.total_gib}
        if self.torch_allocated_gib is not None:
            out["torch_allocated_gib"] = self.torch_allocated_gib
        if self.torch_reserved_gib is not None:
            out["torch_reserved_gib"] = self.torch_reserved_gib
        return out


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Sample:
    """One generation of a prompt: its tokens (the EOS that ended it included) and their logprobs under the
    generating engine, the decoded text and why it stopped (``stop`` | ``length``)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    #: routing replay: vLLM's routes of the completion reduced to the MoE layers (``rlc.runtime.policy.routes``;
    #: a numpy array ``[rows, M, K]``), or None where vLLM returned none
    routed_experts: Any = None


@dataclass(frozen=True)
class TrainBatch:
    """One step's rollouts as the trainer reads them (``rlc.runtime.policy.batches.pack_rollouts``): N samples of
    prompt + response padded to one length L. The logprob passes fill ``old_logprobs`` (and ``ref_logprobs``)."""

    tokens: torch.Tensor  # int64 [N, L]
    mask: torch.Tensor  # float32 [N, L-1]: 1 where position j predicts a response token
    gen_logprobs: torch.Tensor  # float32 [N, L-1]: the generating engine's logprobs of those tokens
    advantages: torch.Tensor  # float32 [N]
    lengths: torch.Tensor  # int64 [N]: prompt + response tokens
    routes: torch.Tensor | None = None  # routing replay: int16 [N, L-1, M, K]
    old_logprobs: torch.Tensor | None = None  # float32 [N, L-1]: the trainer's, before the update
    ref_logprobs: torch.Tensor | None = None  # float32 [N, L-1]: the reference policy's (a KL penalty)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The mapping the trainer's micro-batching splits by rows (the fields that are set)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        if "routes" in out:
            out[ROUTES_KEY] = out.pop("routes")
        return out


# --------------------------------------------------------------------------- answers


@dataclass(frozen=True)
class RankCoords:
    """Where one trainer rank sits in the parallel layout (``setup``'s answer)."""

    rank: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    is_last_stage: bool
    is_output: bool  # last pipeline stage, TP rank 0, CP rank 0: its outputs are the batch's
    memory: Memory
    params_local: int = 0
    setup_s: float = 0.0
    gc_frozen_objects: int = 0  # objects moved out of the garbage collector's walks once set up (gc.freeze)


@dataclass(frozen=True)
class EngineStarted:
    """A generation engine up (vLLM's, or megatron-core's in a policy worker)."""

    seconds: float
    memory: Memory
    eos_token_id: int | None
    moe_layers: list[int] | None = None  # routing replay: decoder layers whose routes vLLM records
    memory_before: Memory | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # megatron-core's engine: mode, KV pool, attention


@dataclass(frozen=True)
class Generated:
    """``n`` samples for each prompt of one engine, in the prompts' order."""

    samples: list[list[Sample]]
    seconds: float
    memory: Memory


@dataclass(frozen=True)
class Slept:
    """An engine that gave its memory back (vLLM asleep at a level, megatron-core's engine suspended)."""

    freed_gib: float
    memory: Memory
    memory_before: Memory | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Woke:
    """vLLM awake again for ``tags`` (``weights``, ``kv_cache``; None: both)."""

    memory: Memory
    tags: list[str] | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Offloaded:
    """The trainer before a refit: forced parameter sync and optimizer offload, as configured."""

    synced_params: bool
    offloaded: bool
    seconds: float
    memory: Memory


@dataclass(frozen=True)
class ParamsMoved:
    """The trainer's bf16 parameter buffers moved to host memory or back (``refit.offload_params_for_generation``)."""

    bytes: int  # moved by this call (0: they were already where asked)
    seconds: float
    memory: Memory  # after the move


@dataclass(frozen=True)
class TrainStepResult:
    """An output rank's share of one GRPO update (``recorder.merge_train_metrics`` combines the ranks')."""

    loss_sums: dict[str, float]  # loss/* already normalised by the global count: summed over ranks
    weighted_sums: dict[str, float]  # other per-token metrics times their tokens
    maxes: dict[str, float]
    num_tokens: float
    grad_norm: float
    lr: float
    optimizer_steps: int
    train_s: float


@dataclass(frozen=True)
class ReplayCheck:
    """Routing replay in one logprob pass: (token, MoE layer) pairs whose routing the trainer's routers returned,
    how many of them differ from the replayed (vLLM's) experts, and router calls that found no route armed."""

    routes_checked: int
    routes_mismatched: int
    layers_unarmed: int


@dataclass(frozen=True)
class RefitSent:
    """One trainer rank's refit: what it sent and the memory it had (``raw``: the refit engine's whole report)."""

    bytes: int
    gbps: float
    num_buckets: int
    num_tensors: int
    half_bytes: int
    free_before_bytes: int
    min_free_bytes: int
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def of(cls, report: dict[str, Any]) -> RefitSent:
        """From the producer's report (``rlc.runtime.refit.producer``; the refit engine speaks in mappings)."""
        return cls(int(report["bytes"]), float(report["gbps"]), int(report["num_buckets"]),
                   int(report["num_tensors"]), int(report["half_bytes"]), int(report["free_before_bytes"]),
                   int(report["min_free_bytes"]), dict(report))


@dataclass(frozen=True)
class MegatronSynced:
    """One policy worker's engine after a sync: what moved (0 bytes in shared mode) and its memory."""

    kind: str  # "megatron-shared" | "megatron-swap"
    seconds: float
    bytes: int
    num_tensors: int
    memory: Memory
    step: int
    swap_s: float | None = None  # dedicated mode: swap_model_weights alone
    verify: dict[str, Any] | None = None  # the bit-exact check of a swap (refit.verify_every), if it ran


@dataclass(frozen=True)
class ExportWritten:
    """A trainer rank's refit export written for the bit-exact check (``refit.verify_every``), in shards that the
    vLLM worker on the same GPU read and deleted as they came (``rlc.runtime.refit.verify_stream``)."""

    directory: str
    shards: int
    tensors: int
    bytes: int
    largest_shard_bytes: int
    #: The most shard files on disk at once (the writer's own count, at most ``max_pending`` + the one it adds).
    most_pending: int
    seconds: float


@dataclass(frozen=True)
class CheckpointIO:
    """A checkpoint saved or loaded by one trainer rank."""

    seconds: float
    opt_steps: int


# --------------------------------------------------------------------------- the workers' methods


class PolicyWorkerApi(Protocol):
    """A Megatron policy worker, one per GPU (``rlc.runtime.policy.megatron_worker.MegatronPolicyWorker``)."""

    def info(self) -> WorkerInfo: ...

    def master_address(self) -> tuple[str, int]: ...

    def setup(self, master: tuple[str, int], total_opt_steps: int) -> RankCoords: ...

    def memory(self) -> Memory: ...

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor | None: ...

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None: ...

    def router_replay_layers(self) -> list[int]: ...

    def router_replay_check(self) -> ReplayCheck: ...

    def train_step(self, batch: TrainBatch, step: int) -> TrainStepResult | None: ...

    def offload_params(self) -> ParamsMoved: ...

    def onload_params(self) -> ParamsMoved: ...

    def refit_prepare(self, session: str, local_rank: int, local_world: int,
                      timeout_s: float = 600.0) -> dict[str, Any]: ...

    def refit_offload(self) -> Offloaded: ...

    def refit_send(self) -> RefitSent: ...

    def refit_dump_export(self, export_dir: str) -> ExportWritten: ...

    def save_checkpoint(self, path: str) -> CheckpointIO: ...

    def load_checkpoint(self, path: str) -> CheckpointIO: ...

    # megatron-core inference in the policy worker (generation.backend: megatron)

    def mg_start(self) -> EngineStarted: ...

    def mg_sync(self, step: int, verify: bool = False) -> MegatronSynced: ...

    def mg_generate(self, prompt_token_ids: list[list[int]], n: int) -> Generated: ...

    def mg_release(self, step: int) -> Slept: ...

    def shutdown(self) -> None: ...


class GenerationWorkerApi(Protocol):
    """A vLLM engine (``rlc.runtime.generation.vllm_worker.VllmGenerationWorker``)."""

    def info(self) -> WorkerInfo: ...

    def start(self, engine_overrides: dict[str, Any] | None = None) -> EngineStarted: ...

    def generate(self, prompt_token_ids: list[list[int]], n: int) -> Generated: ...

    def sleep(self, level: int) -> Slept: ...

    def sleep_kv_cache(self) -> Slept: ...

    def stay_awake(self) -> Slept: ...

    def wake_up(self, tags: list[str] | None = None) -> Woke: ...

    def reset_prefix_cache(self) -> bool: ...

    def refit_prepare(self, session: str, timeout_s: float = 600.0) -> list[dict[str, Any]]: ...

    def refit_receive(self) -> list[dict[str, Any]]: ...

    def refit_verify(self, export_dir: str) -> list[dict[str, Any]]: ...

    def shutdown(self) -> None: ...


__all__ = ["CheckpointIO", "EngineStarted", "ExportWritten", "Generated", "GenerationWorkerApi", "MegatronSynced",
           "Memory", "Offloaded", "ParamsMoved", "PolicyWorkerApi", "ROUTES_KEY", "RankCoords", "RefitSent",
           "ReplayCheck", "Sample", "Slept", "TrainBatch", "TrainStepResult", "WorkerInfo", "Woke"]
