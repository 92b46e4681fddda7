"""The driver's order of phases with ``refit.offload_params_for_generation`` (CPU).

The phases that need GPUs (rollout, the trainer's passes, the refit) are replaced by recorders; the
offload and onload run the driver's own code through ``PolicyGroup`` over a worker group whose workers
answer as ``MegatronPolicyWorker.offload_params`` / ``onload_params`` do.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlc.contract.runtime_config import load_runtime_config
from rlc.runtime import workers as W
from rlc.runtime.driver import GrpoRun
from rlc.runtime.recorder import Group, Packed, Released, Rollout, Scored, Trained
from rlc.runtime.worker_api import Memory, ParamsMoved, Sample, Slept
from rlc.runtime.worker_groups import PolicyGroup

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
MEM = Memory(free_gib=100.0, used_gib=40.0, total_gib=140.0)


@pytest.fixture(autouse=True)
def _answers_are_the_refs(monkeypatch):
    monkeypatch.setattr(W, "wait_all", lambda pending, what: [p.ref for p in pending])


class _Actor:
    """A policy worker's Ray handle, answered at once the way ``MegatronPolicyWorker`` answers these methods."""

    def __init__(self, workers: AnsweringWorkers, rank: int) -> None:
        self.workers, self.rank = workers, rank

    def __getattr__(self, method: str) -> Any:
        if method.startswith("__"):
            raise AttributeError(method)
        return SimpleNamespace(remote=lambda *args: self.workers.answer(self.rank, method))


class AnsweringWorkers:
    def __init__(self, log: list[str], ranks: int = 2) -> None:
        self.log = log
        self.offloaded = False
        self.moves = False
        self.group = W.WorkerGroup("policy", [_Actor(self, r) for r in range(ranks)])

    def answer(self, rank: int, method: str) -> Any:
        if method == "memory":
            return MEM
        assert method in ("offload_params", "onload_params"), method
        if rank == 0:
            self.log.append(method)
            self.moves = (method == "offload_params") != self.offloaded
            self.offloaded = method == "offload_params"
        used = 20.0 if self.offloaded else 27.5
        return ParamsMoved(bytes=(int(7.5 * GIB) + rank) if self.moves else 0, seconds=0.01,
                           memory=Memory(free_gib=140.0 - used, used_gib=used, total_gib=140.0))


class RecordingRun(GrpoRun):
    def __init__(self, cfg: Any, log: list[str]) -> None:
        super().__init__(cfg)
        self.log = log
        self.logged: list[dict] = []
        self._policy = PolicyGroup(AnsweringWorkers(log).group)

    def start_workers(self) -> None:
        self.log.append("start")

    def resume(self) -> int:
        return 0

    def open_logs(self, start_step: int) -> None:
        run = self

        class Metrics:
            def log(self, step: int, metrics: dict) -> None:
                run.logged.append(dict(metrics))

        self._metrics = Metrics()  # type: ignore[assignment]

    def refit(self, step: int) -> Any:
        self.log.append("refit")

    def rollout(self, step: int) -> Rollout:
        self.log.append("rollout")
        sample = Sample(token_ids=[3], logprobs=[-0.1], text="3", finish_reason="stop")
        return Rollout(groups=[Group(None, [1, 2], [sample, sample], [0.0, 1.0], [0.0, 1.0])], generated_tokens=2,
                       generate_seconds=0.1, scorer_metrics={}, sampling_metrics={}, memory=MEM)

    def release_generation(self, step: int) -> Released:
        self.log.append("sleep")
        return Released(step, Slept(freed_gib=1.0, memory=MEM))

    def pack(self, rollout: Rollout, advantages: list[list[float]]) -> Packed:
        return Packed(batch=None, unrouted_tokens=None)  # type: ignore[arg-type]

    def trainer_logprobs(self, step: int, batch: Any) -> Scored:
        self.log.append("logprobs")
        return Scored(batch, {"gen_kl": 0.0}, None, MEM)

    def train(self, step: int, batch: Any) -> Trained:
        self.log.append("train")
        return Trained([], 0.0, 0.1, MEM)

    def checkpoint(self, step: int) -> None:
        self.log.append("checkpoint")


def _run(tmp_path: Path, on: bool) -> RecordingRun:
    cfg = load_runtime_config(ROOT / "tests" / "gpu" / "tiny_runtime.yaml")
    cfg = dataclasses.replace(
        cfg, refit=dataclasses.replace(cfg.refit, offload_params_for_generation=on),
        grpo=dataclasses.replace(cfg.grpo, max_steps=2),
        logging=dataclasses.replace(cfg.logging, dir=str(tmp_path / "logs")),
        checkpointing=dataclasses.replace(cfg.checkpointing, every_steps=1))
    log: list[str] = []
    run = RecordingRun(cfg, log)
    run.run()
    return run


def test_params_leave_after_the_refit_and_checkpoint_and_return_before_the_logprob_pass(tmp_path):
    run = _run(tmp_path, on=True)
    step = ["offload_params", "rollout", "sleep", "onload_params", "logprobs", "train", "refit", "checkpoint"]
    assert run.log == ["start", "refit"] + step + step


def test_the_freed_memory_is_in_the_step_metrics(tmp_path):
    run = _run(tmp_path, on=True)
    first = run.logged[0]
    assert first["memory/params_offload_freed_gib"] == pytest.approx((7.5 * GIB + 1) / GIB)
    assert first["memory/params_offload/used_gib"] == 20.0
    assert "timing/params_offload_s" in first and "timing/params_onload_s" in first


def test_off_by_default_nothing_moves(tmp_path):
    run = _run(tmp_path, on=False)
    assert "offload_params" not in run.log and "onload_params" not in run.log
    assert not any(k.startswith("memory/params_offload") for m in run.logged for k in m)
