"""The weight synchronizer: the one place every refit goes through (driver side; no torch at import).

The driver calls ``prepare()`` once when the workers exist and ``sync(step)`` for every refit (the initial one
and one after every train step); the synchronizer owns everything between "the trainer has new weights" and
"the engines generate with them", including its metrics and the optional bit-exact check
(``refit.verify_every``). The driver owns staleness (``GrpoRun.refits_done``), as NeMo-RL's loop does since
its Megatron backend joined the weight synchronizer (NeMo-RL PR #3490).

* :class:`VllmIpcSync` (``vllm-ipc``): the trainer's refit offload, vLLM wakes its weights, the export streams
  over CUDA IPC into them, vLLM wakes its KV cache and resets the prefix cache.
* :class:`MegatronInProcessSync` (``megatron-shared`` / ``megatron-swap``): the trainer's refit offload, then
  each policy worker readies its engine: shared mode generates on the training model (nothing moves; the
  parameters are synced and the forward pre-hooks stay off while it generates); dedicated mode copies every
  parameter and persistent buffer into the inference model with megatron-core's ``swap_model_weights``.

Which one runs is the compiler's decision (``refit.decisions.weight_sync`` with the Megatron backend).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rlc.contract.refit_buffer import GIB
from rlc.runtime.worker_groups import Memory, RefitSent

if TYPE_CHECKING:
    from rlc.runtime.driver import GrpoRun

log = logging.getLogger("rlc.runtime.driver")


class WeightSync(Protocol):
    """What the driver calls for every refit (see the module docstring)."""

    kind: str

    def prepare(self) -> dict[str, Any]: ...

    def sync(self, step: int) -> None: ...


def make_weight_sync(run: GrpoRun) -> WeightSync:
    """The synchronizer of ``run``'s generation backend."""
    gen = run.cfg.generation
    if gen.backend == "megatron":
        if gen.megatron is None:
            raise ValueError("generation.backend megatron without generation.megatron in runtime.yaml; recompile")
        return MegatronInProcessSync(run)
    return VllmIpcSync(run)


# --------------------------------------------------------------------------- vLLM: CUDA IPC


class VllmIpcSync:
    """Trainer weights -> vLLM through the refit engine (``rlc.runtime.refit``)."""

    kind = "vllm-ipc"

    def __init__(self, run: GrpoRun) -> None:
        self.run = run

    def prepare(self) -> dict[str, Any]:
        """Pair every trainer rank with the vLLM worker on its GPU (both sides at once)."""
        from rlc.runtime.workers import wait_all  # noqa: PLC0415

        run = self.run
        gpn = run.cfg.cluster.gpus_per_node
        node_rank: dict[str, int] = {}
        local = []
        for info in run.policy.infos:
            local.append(node_rank.get(info.node_ip, 0))
            node_rank[info.node_ip] = local[-1] + 1
        pending = [(run.policy.group, r, ref) for r, ref in run.policy.submit_refit_prepare(run.session, local, gpn)]
        pending += [(run.generation.group, e, ref) for e, ref in run.generation.submit_refit_prepare(run.session)]
        res = wait_all(pending, "refit prepare")
        log.info("refit paired: %s", json.dumps(res[0]))
        return dict(res[0])

    def sync(self, step: int) -> None:
        """Trainer weights -> vLLM: offload/sync (trainer), wake weights, stream, wake KV, reset cache."""
        from rlc.runtime.workers import wait_all  # noqa: PLC0415

        run = self.run
        cfg = run.cfg
        with run.timer("refit"):
            offloaded = run.policy.refit_offload()[0]
            run.sample_memory("refit_offload", offloaded.memory)
            with run.timer("wake_weights"):
                run.generation.wake_up(["weights"])
            with run.timer("refit_transfer"):
                pending = [(run.policy.group, i, r) for i, r in run.policy.submit_refit_send()]
                pending += [(run.generation.group, i, r) for i, r in run.generation.submit_refit_receive()]
                results = wait_all(pending, "refit")
            sent = [RefitSent.from_dict(r) for r in results[: len(run.policy)]]
            with run.timer("wake_kv"):
                woke = run.generation.wake_up(["kv_cache"])[0]
                run.generation.reset_prefix_cache()
        run.log_refit_ranks(step, sent)
        r0 = sent[0]
        worst = min(sent, key=lambda r: r.free_before_bytes)  # the tightest GPU decides OOM
        m = run.step_metrics
        m["refit/seconds"] = run.timer.seconds("refit_transfer")
        m["refit/bytes"] = r0.bytes
        m["refit/gbps"] = r0.gbps
        m["refit/buckets"] = r0.num_buckets
        m["refit/tensors"] = r0.num_tensors
        m["refit/free_before_gib"] = worst.free_before_bytes / GIB
        m["refit/min_free_gib"] = min(r.min_free_bytes for r in sent) / GIB
        m["refit/half_gib"] = r0.half_bytes / GIB
        m["refit/sleep_level"] = cfg.refit.sleep_level
        m["refit/synced_params"] = float(offloaded.synced_params)
        m["refit/offloaded_optimizer"] = float(offloaded.offloaded)
        if cfg.refit.verify_every and run.refits_done % cfg.refit.verify_every == 0:
            self.verify(step)
        run.refits_done += 1
        run.sample_memory("after_wake", woke)
        if step <= 2 or step % 50 == 0:
            total = offloaded.memory.total_gib
            run.log_calibration(step, "refit_free", Memory(free_gib=r0.free_before_bytes / GIB,
                                                           used_gib=total - r0.free_before_bytes / GIB,
                                                           total_gib=total),
                                extra={"half_gib": r0.half_bytes / GIB,
                                       "offload_optimizer": cfg.refit.offload_optimizer_for_refit})
            run.log_calibration(step, "after_wake", woke)
        if step == 0 or run.refits_done <= 1:
            keys = ("num_tensors", "bytes", "seconds", "gbps", "half_bytes", "free_before_bytes", "fixes")
            log.info("refit %d: %s", run.refits_done, json.dumps({k: r0.raw.get(k) for k in keys}))

    def verify(self, step: int) -> None:
        """``refit.verify_every``: every vLLM worker checks its parameters bit for bit against vLLM's own
        load of the trainer's export (``rlc.runtime.refit.verify``); a difference stops the run."""
        import tempfile  # noqa: PLC0415

        from rlc.runtime.refit.verify import RefitVerifyError, verify_error_text  # noqa: PLC0415

        run = self.run
        export_dir = os.path.join(tempfile.gettempdir(), f"rlc-verify-{run.session}")
        with run.timer("refit_verify"):
            run.policy.dump_export(export_dir)
            reports = run.generation.verify_refit(export_dir)
        for worker, report in enumerate(reports):
            run.verify_log.write({"step": step, "worker": worker, **report})
        mismatches = sum(len(r["mismatches"]) for r in reports)
        run.step_metrics["refit/verify_mismatches"] = mismatches
        run.step_metrics["refit/verify_params"] = sum(r["params_compared"] for r in reports)
        if mismatches or not all(r["params_compared"] for r in reports):
            raise RefitVerifyError(verify_error_text(step, reports))
        log.info("refit %d verified bit-exact: %d parameters on %d vLLM workers", step,
                 sum(r["params_compared"] for r in reports), len(reports))


# --------------------------------------------------------------------------- Megatron: in process


@dataclass(frozen=True)
class MegatronSynced:
    """One policy worker's engine after a sync: what moved (0 bytes in shared mode) and its memory."""

    kind: str
    seconds: float
    bytes: int
    num_tensors: int
    memory: Memory
    verify: dict[str, Any] | None = None  # the bit-exact check of a swap (refit.verify_every), if it ran
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MegatronSynced:
        return cls(str(d["kind"]), float(d["seconds"]), int(d["bytes"]), int(d["num_tensors"]),
                   Memory.from_dict(d["memory"]), d.get("verify"), dict(d))


def swap_verify_error_text(step: int, reports: list[dict[str, Any]]) -> str:
    """The message that stops a run whose swap left the inference model different from the trainer."""
    lines = [f"refit {step} is not bit-exact: the inference model's tensors differ from the trainer's after "
             "swap_model_weights"]
    for rank, r in enumerate(reports):
        for m in r["mismatches"][:6]:
            how = (f"rounded to bf16, {m['mantissa_bits_lost']} mantissa bits lost" if m["rounded_to_bf16"]
                   else f"max |diff| {m['max_abs_diff']:.3g}")
            lines.append(f"  rank {rank}: {m['name']} ({m['dtype']}, {m['elements_differing']} elements): {how}")
    if any(m["rounded_to_bf16"] for r in reports for m in r["mismatches"]):
        lines.append("an fp32 tensor (the MoE router's expert_bias) reached the inference model in bf16: "
                     "megatron-core keeps the destination buffer's dtype from the trainer's at the first swap")
    return "\n".join(lines)


class MegatronInProcessSync:
    """The trainer's refit offload, then every policy worker readies its engine (``mg_sync``)."""

    def __init__(self, run: GrpoRun) -> None:
        self.run = run
        m = run.cfg.generation.megatron
        self.mode = m.mode if m is not None else "shared"
        self.kind = "megatron-swap" if self.mode == "dedicated" else "megatron-shared"

    def prepare(self) -> dict[str, Any]:
        """Nothing to pair: the engines (and the dedicated model's swap plan) are built by ``backend.start()``."""
        return {"kind": self.kind}

    def _verify_due(self) -> bool:
        every = self.run.cfg.refit.verify_every
        return bool(self.mode == "dedicated" and every and self.run.refits_done % every == 0)

    def sync(self, step: int) -> None:
        from rlc.runtime.refit.verify import RefitVerifyError  # noqa: PLC0415

        run = self.run
        verify = self._verify_due()
        with run.timer("refit"):
            offloaded = run.policy.refit_offload()[0]
            run.sample_memory("refit_offload", offloaded.memory)
            with run.timer("refit_transfer"):
                synced = [MegatronSynced.from_dict(d) for d in run.policy.group.call("mg_sync", step, verify)]
        s0 = synced[0]
        m = run.step_metrics
        m["refit/seconds"] = run.timer.seconds("refit_transfer")
        m["refit/bytes"] = s0.bytes
        m["refit/tensors"] = s0.num_tensors
        m["refit/gbps"] = s0.bytes / 1e9 / max(s0.seconds, 1e-9) if s0.bytes else 0.0
        m["refit/synced_params"] = float(offloaded.synced_params)
        m["refit/offloaded_optimizer"] = float(offloaded.offloaded)
        m["refit/megatron_swap"] = float(self.kind == "megatron-swap")
        for rank, s in enumerate(synced):
            run.ranks_log.write({"step": step, "rank": rank, **s.raw})
        if verify:
            reports = [s.verify or {"params_compared": 0, "mismatches": [], "bytes_compared": 0, "fp32_params": [],
                                    "bit_exact": False} for s in synced]
            for rank, report in enumerate(reports):
                run.verify_log.write({"step": step, "worker": rank, **report})
            mismatches = sum(len(r["mismatches"]) for r in reports)
            m["refit/verify_mismatches"] = mismatches
            m["refit/verify_params"] = sum(r["params_compared"] for r in reports)
            if mismatches or not all(r["params_compared"] for r in reports):
                raise RefitVerifyError(swap_verify_error_text(step, reports))
            log.info("swap %d verified bit-exact: %d tensors on %d ranks (%d fp32)", step,
                     sum(r["params_compared"] for r in reports), len(reports), len(reports[0]["fp32_params"]))
        run.refits_done += 1
        run.sample_memory("after_wake", s0.memory)
        if step <= 2 or step % 50 == 0:
            run.log_calibration(step, "after_wake", s0.memory,
                                extra={"weight_sync": self.kind,
                                       "offload_optimizer": run.cfg.refit.offload_optimizer_for_refit})
        if step == 0 or run.refits_done <= 1:
            log.info("refit %d (%s): %s", run.refits_done, self.kind,
                     json.dumps({k: s0.raw.get(k) for k in ("bytes", "num_tensors", "seconds")}))


__all__ = ["MegatronInProcessSync", "MegatronSynced", "VllmIpcSync", "WeightSync", "make_weight_sync",
           "swap_verify_error_text"]
