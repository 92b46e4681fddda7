"""The driver's view of its workers: one typed method per remote call, typed answers.

:class:`PolicyGroup` (one Megatron rank per GPU) and :class:`GenerationGroup` (one vLLM engine per
data-parallel rank) wrap a :class:`~rlc.runtime.workers.WorkerGroup` of workers implementing
``PolicyWorkerApi`` / ``GenerationWorkerApi`` (``rlc.runtime.worker_api``); each method runs one worker method
by reference and returns its answers as the workers give them (frozen dataclasses), combined where the driver
wants one answer for the group. A worker that dies or raises still ends the call with the ``WorkerFailure``
of ``WorkerGroup``.

Pure Python (no ray, no torch at import).
"""
from __future__ import annotations

from typing import Any

from rlc.runtime.worker_api import (CheckpointIO, EngineStarted, ExportWritten, Generated, GenerationWorkerApi,
                                    MegatronSynced, Memory, Offloaded, ParamsMoved, PolicyWorkerApi, RankCoords,
                                    RefitSent, ReplayCheck, Slept, TrainBatch, TrainStepResult, WorkerInfo, Woke)
from rlc.runtime import workers
from rlc.runtime.workers import Pending, WorkerGroup


class PolicyGroup:
    """The Megatron policy ranks, one per GPU."""

    def __init__(self, group: WorkerGroup[PolicyWorkerApi]) -> None:
        self.group = group
        self.infos: list[WorkerInfo] = []

    def __len__(self) -> int:
        return len(self.group)

    def describe(self) -> list[WorkerInfo]:
        """Each worker's identity (role, rank, node, GPU), kept for failure messages."""
        self.infos = self.group.call(PolicyWorkerApi.info)
        self.group.infos = self.infos
        return self.infos

    def master_address(self) -> tuple[str, int]:
        host, port = self.group.call_on(0, PolicyWorkerApi.master_address)
        return str(host), int(port)

    def setup(self, master: tuple[str, int], total_optimizer_steps: int) -> list[RankCoords]:
        return self.group.call(PolicyWorkerApi.setup, (str(master[0]), int(master[1])), total_optimizer_steps)

    def memory(self, rank: int = 0) -> Memory:
        return self.group.call_on(rank, PolicyWorkerApi.memory)

    def compute_logprobs(self, batch_ref: TrainBatch) -> list[Any]:
        """Every rank's logprobs of the batch (tensors on the output ranks); ``batch_ref``: the batch in Ray's
        object store."""
        return self.group.call(PolicyWorkerApi.compute_logprobs, batch_ref)

    def compute_ref_logprobs(self, batch_ref: TrainBatch) -> list[Any]:
        return self.group.call(PolicyWorkerApi.compute_ref_logprobs, batch_ref)

    def router_replay_layers(self) -> list[list[int]]:
        """Each rank's view of the model's MoE decoder layers (routing replay; the same list on every rank)."""
        return [list(x) for x in self.group.call(PolicyWorkerApi.router_replay_layers)]

    def router_replay_check(self) -> ReplayCheck:
        """What the last logprob pass's routers did with the replayed routes, summed over the ranks."""
        checks = self.group.call(PolicyWorkerApi.router_replay_check)
        return ReplayCheck(sum(c.routes_checked for c in checks), sum(c.routes_mismatched for c in checks),
                           sum(c.layers_unarmed for c in checks))

    def train_step(self, batch_ref: TrainBatch, step: int) -> list[TrainStepResult]:
        """The output ranks' loss sums and figures (other ranks return nothing)."""
        return [r for r in self.group.call(PolicyWorkerApi.train_step, batch_ref, step) if r is not None]

    def refit_offload(self) -> list[Offloaded]:
        return self.group.call(PolicyWorkerApi.refit_offload)

    def offload_params(self) -> list[ParamsMoved]:
        return self.group.call(PolicyWorkerApi.offload_params)

    def onload_params(self) -> list[ParamsMoved]:
        return self.group.call(PolicyWorkerApi.onload_params)

    def submit_refit_prepare(self, session: str, local_ranks: list[int],
                             gpus_per_node: int) -> list[Pending[dict[str, Any]]]:
        return [self.group.submit_to(r, PolicyWorkerApi.refit_prepare, session, local_ranks[r], gpus_per_node)
                for r in range(len(self.group))]

    def submit_refit_send(self) -> list[Pending[RefitSent]]:
        return self.group.submit(PolicyWorkerApi.refit_send)

    def submit_dump_export(self, export_dir: str) -> list[Pending[ExportWritten]]:
        """Every rank writes what the last refit sent, in shards the vLLM workers read meanwhile (collective: the
        export gathers across ranks)."""
        return self.group.submit(PolicyWorkerApi.refit_dump_export, export_dir)

    def save_checkpoint(self, folder: str) -> list[CheckpointIO]:
        return self.group.call(PolicyWorkerApi.save_checkpoint, folder)

    def load_checkpoint(self, folder: str) -> list[CheckpointIO]:
        return self.group.call(PolicyWorkerApi.load_checkpoint, folder)

    # megatron-core inference in the policy workers (generation.backend: megatron)

    def mg_start(self) -> list[EngineStarted]:
        return self.group.call(PolicyWorkerApi.mg_start)

    def mg_generate(self, chunks: list[tuple[int, list[list[int]]]], n: int) -> list[Generated]:
        """``chunks``: (trainer rank, prompts); each rank's samples in that order."""
        return workers.wait_all(
            [self.group.submit_to(r, PolicyWorkerApi.mg_generate, prompts, n) for r, prompts in chunks], "generate")

    def mg_release(self, step: int) -> list[Slept]:
        return self.group.call(PolicyWorkerApi.mg_release, step)

    def mg_sync(self, step: int, verify: bool) -> list[MegatronSynced]:
        return self.group.call(PolicyWorkerApi.mg_sync, step, verify)


class GenerationGroup:
    """The vLLM engines, one per generation data-parallel rank."""

    def __init__(self, group: WorkerGroup[GenerationWorkerApi]) -> None:
        self.group = group
        self.infos: list[WorkerInfo] = []

    def __len__(self) -> int:
        return len(self.group)

    def describe(self) -> list[WorkerInfo]:
        """Each engine's identity (role, rank, node, GPU), kept for failure messages."""
        self.infos = self.group.call(GenerationWorkerApi.info)
        self.group.infos = self.infos
        return self.infos

    def start(self) -> list[EngineStarted]:
        return self.group.call(GenerationWorkerApi.start)

    def generate(self, chunks: list[tuple[int, list[list[int]]]], n: int) -> list[Generated]:
        """``chunks``: (engine, prompts); each engine's samples in that order."""
        return workers.wait_all(
            [self.group.submit_to(e, GenerationWorkerApi.generate, prompts, n) for e, prompts in chunks], "generate")

    def sleep(self, level: int) -> list[Slept]:
        return self.group.call(GenerationWorkerApi.sleep, level)

    def sleep_kv_cache(self) -> list[Slept]:
        return self.group.call(GenerationWorkerApi.sleep_kv_cache)

    def stay_awake(self) -> list[Slept]:
        return self.group.call(GenerationWorkerApi.stay_awake)

    def wake_up(self, tags: list[str]) -> list[Woke]:
        return self.group.call(GenerationWorkerApi.wake_up, tags)

    def reset_prefix_cache(self) -> None:
        self.group.call(GenerationWorkerApi.reset_prefix_cache)

    def submit_refit_prepare(self, session: str) -> list[Pending[list[dict[str, Any]]]]:
        return self.group.submit(GenerationWorkerApi.refit_prepare, session)

    def submit_refit_receive(self) -> list[Pending[list[dict[str, Any]]]]:
        return self.group.submit(GenerationWorkerApi.refit_receive)

    def submit_verify_refit(self, export_dir: str) -> list[Pending[list[dict[str, Any]]]]:
        """Per engine, one bit-exact comparison report per vLLM worker, against the export the trainer ranks write
        to ``export_dir`` meanwhile."""
        return self.group.submit(GenerationWorkerApi.refit_verify, export_dir)
