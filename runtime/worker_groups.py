"""The driver's view of its workers: one typed method per remote call, typed results.

:class:`PolicyGroup` (one Megatron rank per GPU) and :class:`GenerationGroup` (one vLLM engine
per data-parallel rank) wrap a :class:`~rlc.runtime.workers.WorkerGroup`. Each method names the
worker method it runs once, here, and turns the worker's plain-data answer into a dataclass, so the
driver reads attributes instead of method-name strings and dictionary keys. A worker that dies or
raises still ends the call with the ``WorkerFailure`` of ``WorkerGroup``.

Pure Python (no ray, no torch at import): the results' parsing is CPU-tested.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlc.runtime.workers import WorkerGroup, WorkerInfo


@dataclass(frozen=True)
class Memory:
    """GPU memory seen by one worker (GiB): the device's free/used/total, its own torch allocator."""

    free_gib: float
    used_gib: float
    total_gib: float
    torch_allocated_gib: float | None = None
    torch_reserved_gib: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Memory:
        return cls(float(d["free_gib"]), float(d["used_gib"]), float(d["total_gib"]),
                   d.get("torch_allocated_gib"), d.get("torch_reserved_gib"))

    def as_dict(self) -> dict[str, float]:
        out = {"free_gib": self.free_gib, "used_gib": self.used_gib, "total_gib": self.total_gib}
        if self.torch_allocated_gib is not None:
            out["torch_allocated_gib"] = self.torch_allocated_gib
        if self.torch_reserved_gib is not None:
            out["torch_reserved_gib"] = self.torch_reserved_gib
        return out


@dataclass(frozen=True)
class EngineStarted:
    seconds: float
    memory: Memory
    eos_token_id: int | None
    moe_layers: list[int] | None = None  # routing replay: decoder layers whose routes vLLM records


@dataclass(frozen=True)
class Slept:
    freed_gib: float
    memory: Memory


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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamsMoved:
        return cls(int(d["bytes"]), float(d["seconds"]), Memory.from_dict(d["memory"]))


@dataclass(frozen=True)
class RankCoords:
    """Where one trainer rank sits in the parallel layout (from ``setup``)."""

    rank: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    is_last_stage: bool
    is_output: bool  # last pipeline stage and TP rank 0: its outputs are the batch's
    memory: Memory


@dataclass(frozen=True)
class RefitSent:
    """One trainer rank's refit: what it sent and the memory it had (``raw`` keeps every figure)."""

    bytes: int
    gbps: float
    num_buckets: int
    num_tensors: int
    half_bytes: int
    free_before_bytes: int
    min_free_bytes: int
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RefitSent:
        return cls(int(d["bytes"]), float(d["gbps"]), int(d["num_buckets"]), int(d["num_tensors"]),
                   int(d["half_bytes"]), int(d["free_before_bytes"]), int(d["min_free_bytes"]), dict(d))


@dataclass(frozen=True)
class ReplayCheck:
    """Routing replay in one logprob pass: (token, MoE layer) pairs whose routing the trainer's routers returned,
    how many of them differ from the replayed (vLLM's) experts, and router calls that found no route armed."""

    routes_checked: int
    routes_mismatched: int
    layers_unarmed: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplayCheck:
        return cls(int(d["routes_checked"]), int(d["routes_mismatched"]), int(d["layers_unarmed"]))


class _TypedGroup:
    """A ``WorkerGroup`` with typed methods; ``describe`` names each worker (role, rank, node, GPU)."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group
        self.infos: list[WorkerInfo] = []

    def __len__(self) -> int:
        return len(self.group)

    def describe(self) -> list[WorkerInfo]:
        self.infos = [WorkerInfo(**d) for d in self.group.call("info")]
        self.group.infos = self.infos
        return self.infos


class PolicyGroup(_TypedGroup):
    """The Megatron policy ranks, one per GPU."""

    def master_address(self) -> tuple[str, int]:
        host, port = self.group.call("master_address", ranks=[0])[0]
        return str(host), int(port)

    def setup(self, master: tuple[str, int], total_optimizer_steps: int) -> list[RankCoords]:
        out = []
        for d in self.group.call("setup", tuple(master), total_optimizer_steps):
            out.append(RankCoords(int(d["rank"]), int(d["dp_rank"]), int(d["dp_size"]), int(d["tp_rank"]),
                                  int(d["pp_rank"]), bool(d["is_last_stage"]), bool(d["is_output"]),
                                  Memory.from_dict(d["memory"])))
        return out

    def memory(self, rank: int = 0) -> Memory:
        return Memory.from_dict(self.group.call("memory", ranks=[rank])[0])

    def compute_logprobs(self, batch_ref: Any) -> list[Any]:
        return self.group.call("compute_logprobs", batch_ref)

    def compute_ref_logprobs(self, batch_ref: Any) -> list[Any]:
        return self.group.call("compute_ref_logprobs", batch_ref)

    def router_replay_layers(self) -> list[list[int]]:
        """Each rank's view of the model's MoE decoder layers (routing replay; the same list on every rank)."""
        return [list(x) for x in self.group.call("router_replay_layers")]

    def router_replay_check(self) -> ReplayCheck:
        """What the last logprob pass's routers did with the replayed routes, summed over the ranks."""
        checks = [ReplayCheck.from_dict(d) for d in self.group.call("router_replay_check")]
        return ReplayCheck(sum(c.routes_checked for c in checks), sum(c.routes_mismatched for c in checks),
                           sum(c.layers_unarmed for c in checks))

    def train_step(self, batch_ref: Any, step: int) -> list[dict[str, Any]]:
        """The output ranks' loss sums and figures (other ranks return nothing)."""
        return [r for r in self.group.call("train_step", batch_ref, step) if r is not None]

    def refit_offload(self) -> list[Offloaded]:
        return [Offloaded(bool(d["synced_params"]), bool(d["offloaded"]), float(d["seconds"]),
                          Memory.from_dict(d["memory"])) for d in self.group.call("refit_offload")]

    def offload_params(self) -> list[ParamsMoved]:
        return [ParamsMoved.from_dict(d) for d in self.group.call("offload_params")]

    def onload_params(self) -> list[ParamsMoved]:
        return [ParamsMoved.from_dict(d) for d in self.group.call("onload_params")]

    def submit_refit_prepare(self, session: str, local_ranks: list[int], gpus_per_node: int) -> list[tuple[int, Any]]:
        return [(r, self.group.actors[r].refit_prepare.remote(session, local_ranks[r], gpus_per_node))
                for r in range(len(self.group))]

    def submit_refit_send(self) -> list[tuple[int, Any]]:
        return self.group.submit("refit_send")

    def dump_export(self, export_dir: str) -> None:
        """Every rank writes what the last refit sent (collective: the export gathers across ranks)."""
        self.group.call("refit_dump_export", export_dir)

    def save_checkpoint(self, folder: str) -> None:
        self.group.call("save_checkpoint", folder)

    def load_checkpoint(self, folder: str) -> None:
        self.group.call("load_checkpoint", folder)


class GenerationGroup(_TypedGroup):
    """The vLLM engines, one per generation data-parallel rank."""

    def start(self) -> list[EngineStarted]:
        return [EngineStarted(float(d["start_s"]), Memory.from_dict(d["memory"]), d["eos_token_id"],
                              d.get("moe_layers"))
                for d in self.group.call("start")]

    def generate(self, chunks: list[tuple[int, list[list[int]]]], n: int) -> list[dict[str, Any]]:
        """``chunks``: (engine, prompts); returns each engine's ``{"samples": ...}`` in that order."""
        refs = [(e, self.group.actors[e].generate.remote(prompts, n)) for e, prompts in chunks]
        return self.group.wait(refs, "generate")

    def sleep(self, level: int) -> list[Slept]:
        return [Slept(float(d["freed_gib"]), Memory.from_dict(d["memory"])) for d in self.group.call("sleep", level)]

    def wake_up(self, tags: list[str]) -> list[Memory]:
        return [Memory.from_dict(d["memory"]) for d in self.group.call("wake_up", tags)]

    def reset_prefix_cache(self) -> None:
        self.group.call("reset_prefix_cache")

    def submit_refit_prepare(self, session: str) -> list[tuple[int, Any]]:
        return self.group.submit("refit_prepare", session)

    def submit_refit_receive(self) -> list[tuple[int, Any]]:
        return self.group.submit("refit_receive")

    def verify_refit(self, export_dir: str) -> list[dict[str, Any]]:
        """One bit-exact comparison report per vLLM worker (every engine's workers, in order)."""
        return [r for engine in self.group.call("refit_verify", export_dir) for r in engine]
