"""What a GRPO step's phases return, and the one recorder that turns it into metrics and records.

Every phase of the driver (``rlc.runtime.driver.GrpoRun``) returns a frozen result: what it produced and what it
measured. :class:`Recorder` is the only place those results become the step's metrics (``metrics.jsonl``), the
calibration records (``calibration.jsonl``: memory per phase for ``rlc calibrate``) and the refit's records
(``refit_ranks.jsonl``: every trainer rank's manifest per refit; ``refit_verify.jsonl``: the bit-exact checks)::

    record.begin_step(step)
    rollout = record.add(run.rollout(step))      # a result goes in, the same result comes out
    ...
    metrics.log(step, record.end_step(timer.drain()))

Pure Python (no torch at import; the reward statistics import it when a rollout is recorded).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import singledispatchmethod
from pathlib import Path
from typing import Any, TypeVar

from rlc.contract.calibration_record import CalibrationRecord, memory_metric_key
from rlc.contract.refit_buffer import GIB, kv_cache_kept_awake
from rlc.contract.runtime_config import RuntimeConfig
from rlc.runtime.metrics import JsonlFile
from rlc.runtime.worker_api import (MegatronSynced, Memory, Offloaded, ParamsMoved, RefitSent, ReplayCheck, Sample,
                                    Slept, TrainBatch, TrainStepResult)

log = logging.getLogger("rlc.runtime.driver")

R = TypeVar("R")


# --------------------------------------------------------------------------- the phases' results


@dataclass(frozen=True)
class Group:
    """One prompt and its generations, with their rewards (scaled, as dynamic sampling and the metrics read them) and
    their shaped rewards (the advantages' baseline; the same list without ``grpo.reward_shaping``)."""

    sample: Any  # rlc.runtime.grpo.data.PromptSample
    prompt_ids: list[int]
    generations: list[Sample]
    rewards: list[float]
    shaped_rewards: list[float]


@dataclass(frozen=True)
class Rollout:
    """The step's prompts, ``n`` generations each, and their rewards (the groups dynamic sampling kept)."""

    groups: list[Group]
    generated_tokens: int  # every token generated this step (discarded groups' too)
    generate_seconds: float  # the engines' generate calls
    scorer_metrics: dict[str, float]  # the reward function's own (failures, ...)
    sampling_metrics: dict[str, float | int]  # dynamic sampling's
    memory: Memory  # GPU 0 after generating

    @property
    def rewards(self) -> list[list[float]]:
        return [g.rewards for g in self.groups]

    @property
    def shaped_rewards(self) -> list[list[float]]:
        return [g.shaped_rewards for g in self.groups]


@dataclass(frozen=True)
class Released:
    """The engines gave their memory to the trainer (vLLM asleep at ``refit.sleep_level``; megatron-core suspended)."""

    step: int
    slept: Slept


@dataclass(frozen=True)
class ParamsOffloaded:
    """``refit.offload_params_for_generation``: the trainer's parameters left the GPUs while the engines generate."""

    moved: list[ParamsMoved]


@dataclass(frozen=True)
class ParamsOnloaded:
    """The trainer's parameters back on the GPUs before its logprob pass."""

    moved: list[ParamsMoved]


@dataclass(frozen=True)
class Packed:
    """The kept groups and their advantages as the trainer's batch."""

    batch: TrainBatch
    unrouted_tokens: float | None  # routing replay: response tokens whose route vLLM did not record (out of the loss)


@dataclass(frozen=True)
class Scored:
    """The trainer's logprobs (and the reference policy's) of the batch, against vLLM's (gen-KL)."""

    batch: TrainBatch  # with old_logprobs (and ref_logprobs)
    kl: dict[str, float]  # gen_kl, gen_logprob_abs_diff_mean, gen_logprob_abs_diff_max
    replay: ReplayCheck | None  # routing replay: what the routers did with vLLM's routes
    memory: Memory

    @property
    def train_tokens(self) -> float:
        return float(self.batch.mask.sum())


@dataclass(frozen=True)
class Trained:
    """The optimizer step(s) on the batch: the output ranks' loss sums and figures."""

    ranks: list[TrainStepResult]
    tokens: float  # the batch's response tokens in the loss
    seconds: float
    memory: Memory


@dataclass(frozen=True)
class Refitted:
    """The trainer's weights in the engines (``rlc.runtime.weight_sync``): what moved, what the trainer's and the
    engines' memory was, and the bit-exact check when ``refit.verify_every`` asked for one."""

    step: int
    kind: str  # vllm-ipc | megatron-shared | megatron-swap
    offloaded: Offloaded  # rank 0 before the transfer (forced parameter sync, optimizer offload)
    transfer_seconds: float
    memory: Memory  # GPU 0 ready to generate
    sent: list[RefitSent] | None = None  # vllm-ipc: every trainer rank's producer report
    received: list[dict[str, Any]] | None = None  # vllm-ipc: every vLLM worker's load report
    synced: list[MegatronSynced] | None = None  # megatron-*: every policy worker's engine
    verify: list[dict[str, Any]] | None = None  # one report per vLLM worker / policy worker, when checked
    sleep_level: int = 0
    weights_awake: bool = False  # refit.keep_weights_awake: only vLLM's KV cache slept
    offload_optimizer: bool = False
    number: int = 0  # this process's refits so far, this one included (the driver counts them)

    @property
    def mismatches(self) -> int:
        return sum(len(r["mismatches"]) for r in self.verify or [])

    @property
    def verified(self) -> bool:
        """The check ran and every worker's report is bit-exact (no difference, nothing left uncompared, something
        compared: ``rlc.runtime.refit.verify.VerifyReport.bit_exact``)."""
        return self.verify is not None and all(r.get("bit_exact", False) for r in self.verify)


# --------------------------------------------------------------------------- the recorder


def merge_train_metrics(results: list[TrainStepResult]) -> dict[str, float]:
    """Combine the output ranks' ``train_step`` results (pure; CPU-tested).

    ``loss/*`` are shares of the global mean (summed over ranks); other per-token metrics are
    token-weighted means; ``ratio_max`` is a max; grad norm and lr are the same on every rank.
    """
    if not results:
        return {}
    out: dict[str, float] = {}
    tokens = sum(r.num_tokens for r in results)
    for r in results:
        for k, v in r.loss_sums.items():
            out[k] = out.get(k, 0.0) + v
    keys = {k for r in results for k in r.weighted_sums}
    for k in keys:
        out[k] = sum(r.weighted_sums.get(k, 0.0) for r in results) / max(tokens, 1.0)
    for r in results:
        for k, v in r.maxes.items():
            out[k] = max(out.get(k, float("-inf")), v)
    out["num_tokens"] = tokens
    out["grad_norm"] = results[0].grad_norm
    out["lr"] = results[0].lr
    out["optimizer_steps"] = results[0].optimizer_steps
    return out


def _calibration_step(step: int) -> bool:
    """The steps whose memory goes into ``calibration.jsonl`` (the first ones, then every 50th)."""
    return step <= 2 or step % 50 == 0


class Recorder:
    """Turns the phases' results into the step's metrics and the run's records (see the module docstring)."""

    def __init__(self, cfg: RuntimeConfig) -> None:
        self.cfg = cfg
        logs = Path(cfg.logging.dir)
        self.calibration = JsonlFile(logs / "calibration.jsonl")
        self.ranks_log = JsonlFile(logs / "refit_ranks.jsonl")  # one line per trainer rank and refit
        self.verify_log = JsonlFile(logs / "refit_verify.jsonl")  # one line per verified worker and refit
        self.versions: dict[str, str] = {}  # the stack's, in every calibration record
        self.step = 0
        self.metrics: dict[str, Any] = {}

    def close(self) -> None:
        for handle in (self.calibration, self.ranks_log, self.verify_log):
            handle.close()

    # ------------------------------------------------------------------ a step

    def begin_step(self, step: int) -> None:
        self.step = step
        self.metrics = {}

    def end_step(self, timings: dict[str, float]) -> dict[str, Any]:
        """The step's metrics with its phases' wall times."""
        return {**self.metrics, **timings}

    @singledispatchmethod
    def add(self, result: Any) -> Any:
        """Record one phase's result; returns it (``rollout = record.add(run.rollout(step))``)."""
        if result is None:  # a phase that did nothing this step (a switch off)
            return None
        raise TypeError(f"no record of a {type(result).__name__}")

    def memory(self, phase: str, memory: Memory) -> None:
        """GPU 0's free/used GiB at the end of a phase, into the step's metrics."""
        self.metrics[memory_metric_key(phase, "free_gib")] = memory.free_gib
        self.metrics[memory_metric_key(phase, "used_gib")] = memory.used_gib

    @add.register
    def _rollout(self, r: Rollout) -> Rollout:
        from rlc.runtime.grpo.advantages import reward_metrics  # noqa: PLC0415 - torch: the driver's module has none

        m = self.metrics
        m.update(reward_metrics(r.rewards))
        if r.shaped_rewards != r.rewards:  # grpo.reward_shaping changed some
            shaped = [x for row in r.shaped_rewards for x in row]
            m["reward/shaped_mean"] = sum(shaped) / max(len(shaped), 1)
        m.update(r.scorer_metrics)
        m.update(r.sampling_metrics)
        m["throughput/generated_tokens"] = r.generated_tokens
        m["throughput/generate_tokens_per_s"] = r.generated_tokens / max(r.generate_seconds, 1e-9)
        lengths = [len(s.token_ids) for grp in r.groups for s in grp.generations]
        m["response_length/mean"] = sum(lengths) / max(len(lengths), 1)
        m["response_length/max"] = max(lengths) if lengths else 0
        self.memory("generate", r.memory)
        return r

    @add.register
    def _released(self, r: Released) -> Released:
        self.metrics["memory/sleep_freed_gib"] = r.slept.freed_gib
        self.memory("after_sleep", r.slept.memory)
        if _calibration_step(r.step):
            self.calibrate(r.step, "after_sleep", r.slept.memory)
        return r

    @add.register
    def _params_offloaded(self, r: ParamsOffloaded) -> ParamsOffloaded:
        self.metrics["memory/params_offload_freed_gib"] = max(m.bytes for m in r.moved) / GIB
        self.memory("params_offload", r.moved[0].memory)
        return r

    @add.register
    def _params_onloaded(self, r: ParamsOnloaded) -> ParamsOnloaded:
        return r

    @add.register
    def _packed(self, r: Packed) -> Packed:
        if r.unrouted_tokens is not None:
            self.metrics["router_replay/unrouted_tokens"] = r.unrouted_tokens
        return r

    @add.register
    def _scored(self, r: Scored) -> Scored:
        if r.replay is not None:
            self.metrics["router_replay/routes_checked"] = r.replay.routes_checked
            self.metrics["router_replay/routes_mismatched"] = r.replay.routes_mismatched
            self.metrics["router_replay/layers_unarmed"] = r.replay.layers_unarmed
        self.metrics.update(r.kl)
        self.memory("logprobs", r.memory)
        return r

    @add.register
    def _trained(self, r: Trained) -> Trained:
        self.metrics.update(merge_train_metrics(r.ranks))
        self.metrics["throughput/train_tokens"] = r.tokens
        self.metrics["throughput/train_tokens_per_s"] = r.tokens / max(r.seconds, 1e-9)
        self.memory("train", r.memory)
        return r

    @add.register
    def _refitted(self, r: Refitted) -> Refitted:
        m = self.metrics
        self.memory("refit_offload", r.offloaded.memory)
        m["refit/seconds"] = r.transfer_seconds
        if r.sent is not None:
            self._ipc_refit(r, r.sent)
        if r.synced is not None:
            self._megatron_refit(r, r.synced)
        m["refit/synced_params"] = float(r.offloaded.synced_params)
        m["refit/offloaded_optimizer"] = float(r.offloaded.offloaded)
        if r.verify is not None:
            for worker, report in enumerate(r.verify):
                self.verify_log.write({"step": r.step, "worker": worker, **report})
            m["refit/verify_mismatches"] = r.mismatches
            m["refit/verify_params"] = sum(rep["params_compared"] for rep in r.verify)
        self.memory("after_wake", r.memory)
        if _calibration_step(r.step):
            if r.sent is not None:
                r0, total = r.sent[0], r.offloaded.memory.total_gib
                free = r0.free_before_bytes / GIB
                self.calibrate(r.step, "refit_free", Memory(free_gib=free, used_gib=total - free, total_gib=total),
                               extra={"half_gib": r0.half_bytes / GIB, "offload_optimizer": r.offload_optimizer})
                self.calibrate(r.step, "after_wake", r.memory)
            else:
                self.calibrate(r.step, "after_wake", r.memory,
                               extra={"weight_sync": r.kind, "offload_optimizer": r.offload_optimizer})
        if r.step == 0 or r.number <= 1:
            self._log_first_refit(r)
        return r

    def _ipc_refit(self, r: Refitted, sent: list[RefitSent]) -> None:
        for rank, s in enumerate(sent):  # every rank's own manifest: SkyRL #1816 shows by rank, not only on rank 0
            self.ranks_log.write({"step": r.step, "rank": rank, **s.raw})
        r0 = sent[0]
        worst = min(sent, key=lambda s: s.free_before_bytes)  # the tightest GPU decides OOM
        m = self.metrics
        m["refit/bytes"] = r0.bytes
        m["refit/gbps"] = r0.gbps
        m["refit/buckets"] = r0.num_buckets
        m["refit/tensors"] = r0.num_tensors
        m["refit/free_before_gib"] = worst.free_before_bytes / GIB
        m["refit/min_free_gib"] = min(s.min_free_bytes for s in sent) / GIB
        m["refit/half_gib"] = r0.half_bytes / GIB
        m["refit/sleep_level"] = r.sleep_level
        m["refit/weights_awake"] = int(r.weights_awake)
        if any(s.raw.get("zero_copy_tensors") for s in sent):  # refit.zero_copy_views: read in place, every rank
            m["refit/zero_copy_tensors"] = sum(int(s.raw.get("zero_copy_tensors", 0)) for s in sent)
        for key, part, field in (("refit/fused_direct_tensors", "fused", "direct_tensors"),
                                 ("refit/replayed_tensors", "replay", "direct_tensors"),
                                 ("refit/replay_loader_tensors", "replay", "loader_tensors")):
            reports = [w[part] for w in r.received or [] if isinstance(w.get(part), dict)]
            if reports:  # summed over vLLM workers; the refit that records the replay table replays nothing
                m[key] = sum(int(x.get(field, 0)) for x in reports)

    def _megatron_refit(self, r: Refitted, synced: list[MegatronSynced]) -> None:
        for rank, s in enumerate(synced):
            self.ranks_log.write({"step": r.step, "rank": rank, **synced_record(s)})
        s0 = synced[0]
        m = self.metrics
        m["refit/bytes"] = s0.bytes
        m["refit/tensors"] = s0.num_tensors
        m["refit/gbps"] = s0.bytes / 1e9 / max(s0.seconds, 1e-9) if s0.bytes else 0.0
        m["refit/megatron_swap"] = float(r.kind == "megatron-swap")

    def _log_first_refit(self, r: Refitted) -> None:
        if r.sent is not None:
            keys = ("num_tensors", "bytes", "seconds", "gbps", "half_bytes", "free_before_bytes", "fixes")
            log.info("refit %d: %s", r.number, json.dumps({k: r.sent[0].raw.get(k) for k in keys}))
        elif r.synced is not None:
            s0 = r.synced[0]
            log.info("refit %d (%s): %s", r.number, r.kind,
                     json.dumps({"bytes": s0.bytes, "num_tensors": s0.num_tensors, "seconds": s0.seconds}))

    # ------------------------------------------------------------------ calibration records

    def calibrate(self, step: int, phase: str, memory: Memory, extra: dict[str, Any] | None = None) -> None:
        """One memory record of GPU 0 (``rlc.contract.calibration_record``; ``rlc calibrate`` reads them)."""
        cfg = self.cfg
        rec = CalibrationRecord.from_memory(phase, memory.as_dict(), step=step, sleep_level=cfg.refit.sleep_level,
                                            enforce_eager=cfg.generation.enforce_eager,
                                            gpu_type=cfg.cluster.gpu_type, versions=self.versions, worker="rank0",
                                            weights_awake=cfg.refit.keep_weights_awake,
                                            kv_cache_awake=kv_cache_kept_awake(cfg.refit),
                                            extra=extra)
        self.calibration.write(rec.to_dict())

    def started(self, phase: str, memory: Memory) -> None:
        """Memory when a set of workers is up (engines started, trainer set up): a log line and a record."""
        log.info("memory %s: free %.2f GiB, used %.2f GiB", phase, memory.free_gib, memory.used_gib)
        self.calibrate(0, phase, memory)


def synced_record(s: MegatronSynced) -> dict[str, Any]:
    """One policy worker's sync as a line of ``refit_ranks.jsonl``."""
    out: dict[str, Any] = {"kind": s.kind, "bytes": s.bytes, "num_tensors": s.num_tensors, "verify": s.verify}
    if s.swap_s is not None:
        out["swap_s"] = s.swap_s
    out.update(seconds=s.seconds, memory=s.memory.as_dict(), step=s.step)
    return out


__all__ = ["Group", "Packed", "ParamsOffloaded", "ParamsOnloaded", "Recorder", "Refitted", "Released", "Rollout",
           "Scored", "Trained", "merge_train_metrics", "synced_record"]
