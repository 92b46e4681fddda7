"""The weight synchronizer: the one place every refit goes through (driver side; no torch at import).

The driver calls ``prepare()`` once when the workers exist and ``sync(step, verify)`` for every refit (the initial
one and one after every train step); the synchronizer owns everything between "the trainer has new weights" and
"the engines generate with them", including the optional bit-exact check (``refit.verify_every``), and answers
with a :class:`~rlc.runtime.recorder.Refitted` that the driver's recorder turns into metrics and records;
``check(done)`` then stops the run on a check that found a difference. The driver owns staleness
(``GrpoRun.refits_done``: which refits are checked), as NeMo-RL's loop does since its Megatron backend joined the
weight synchronizer (NeMo-RL PR #3490).

* :class:`VllmIpcSync` (``vllm-ipc``): the trainer's refit offload, vLLM wakes its weights, the export streams
  over CUDA IPC into them, vLLM wakes its KV cache and resets the prefix cache.
* :class:`MegatronInProcessSync` (``megatron-shared`` / ``megatron-swap``): the trainer's refit offload, then
  each policy worker readies its engine: shared mode generates on the training model (nothing moves; the
  parameters are synced and the forward pre-hooks stay off while it generates); dedicated mode copies every
  parameter and persistent buffer into the inference model with megatron-core's ``swap_model_weights``.

Which one runs is the compiler's decision (``refit.decisions.weight_sync`` with the Megatron backend).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from typing import Any, Protocol

from rlc.contract.runtime_config import RuntimeConfig
from rlc.runtime import workers
from rlc.runtime.metrics import PhaseTimer
from rlc.runtime.recorder import Refitted
from rlc.runtime.worker_groups import GenerationGroup, PolicyGroup

log = logging.getLogger("rlc.runtime.driver")


class WeightSync(Protocol):
    """What the driver calls for every refit (see the module docstring)."""

    kind: str

    def prepare(self) -> dict[str, Any]: ...

    def sync(self, step: int, verify: bool) -> Refitted: ...

    def check(self, done: Refitted) -> None: ...


def make_weight_sync(cfg: RuntimeConfig, policy: PolicyGroup, generation: GenerationGroup | None, session: str,
                     timer: PhaseTimer) -> WeightSync:
    """The synchronizer of ``cfg``'s generation backend (``generation``: the vLLM engines, None with megatron)."""
    gen = cfg.generation
    if gen.backend == "megatron":
        if gen.megatron is None:
            raise ValueError("generation.backend megatron without generation.megatron in runtime.yaml; recompile")
        return MegatronInProcessSync(cfg, policy, timer)
    if generation is None:
        raise ValueError("generation.backend vllm without vLLM engines (a driver bug)")
    return VllmIpcSync(cfg, policy, generation, session, timer)


# --------------------------------------------------------------------------- vLLM: CUDA IPC


class VllmIpcSync:
    """Trainer weights -> vLLM through the refit engine (``rlc.runtime.refit``)."""

    kind = "vllm-ipc"

    def __init__(self, cfg: RuntimeConfig, policy: PolicyGroup, generation: GenerationGroup, session: str,
                 timer: PhaseTimer) -> None:
        self.cfg, self.policy, self.generation, self.session, self.timer = cfg, policy, generation, session, timer

    def prepare(self) -> dict[str, Any]:
        """Pair every trainer rank with the vLLM worker on its GPU (both sides at once)."""
        gpn = self.cfg.cluster.gpus_per_node
        node_rank: dict[str, int] = {}
        local = []
        for info in self.policy.infos:
            local.append(node_rank.get(info.node_ip, 0))
            node_rank[info.node_ip] = local[-1] + 1
        pending: list[workers.Pending[Any]] = [*self.policy.submit_refit_prepare(self.session, local, gpn),
                                               *self.generation.submit_refit_prepare(self.session)]
        res = workers.wait_all(pending, "refit prepare")
        log.info("refit paired: %s", json.dumps(res[0]))
        return dict(res[0])

    def sync(self, step: int, verify: bool) -> Refitted:
        """Trainer weights -> vLLM: offload/sync (trainer), wake weights (unless kept awake), stream, wake KV, reset
        cache; then, when ``verify``, every vLLM worker compares its parameters with vLLM's own load of the
        trainer's export."""
        timer = self.timer
        with timer("refit"):
            offloaded = self.policy.refit_offload()[0]
            if not self.cfg.refit.keep_weights_awake:  # else the weights never left the GPU
                with timer("wake_weights"):
                    self.generation.wake_up(["weights"])
            with timer("refit_transfer"):
                pending: list[workers.Pending[Any]] = [*self.policy.submit_refit_send(),
                                                       *self.generation.submit_refit_receive()]
                results = workers.wait_all(pending, "refit")
            sent = results[: len(self.policy)]
            received = [w for engine in results[len(self.policy):] for w in engine]
            # nothing left to map where the refit woke it (refit.wake_kv_during_transfer) or it never slept
            # (refit.keep_kv_cache_awake); the prefix cache holds the old weights' keys and values either way
            with timer("wake_kv"):
                woke = self.generation.wake_up(["kv_cache"])[0]
                self.generation.reset_prefix_cache()
        transfer = timer.seconds("refit_transfer")
        reports = self._verify(step) if verify else None
        refit = self.cfg.refit
        return Refitted(step=step, kind=self.kind, offloaded=offloaded, transfer_seconds=transfer, memory=woke.memory,
                        sent=sent, received=received, verify=reports, sleep_level=refit.sleep_level,
                        weights_awake=refit.keep_weights_awake,
                        offload_optimizer=refit.offload_optimizer_for_refit)

    def _verify(self, step: int) -> list[dict[str, Any]]:
        """``refit.verify_every``: every vLLM worker's report of its parameters against vLLM's own load of the
        trainer's export, which crosses in shards while both sides run (``rlc.runtime.refit.verify_stream``)."""
        export_dir = os.path.join(tempfile.gettempdir(), f"rlc-verify-{self.session}-{step}")
        with self.timer("refit_verify"):
            pending: list[workers.Pending[Any]] = [*self.policy.submit_dump_export(export_dir),
                                                   *self.generation.submit_verify_refit(export_dir)]
            results = workers.wait_all(pending, "refit verify")
        with contextlib.suppress(OSError):  # empty once every reader has taken its shards
            os.rmdir(export_dir)
        return [r for engine in results[len(self.policy):] for r in engine]

    def check(self, done: Refitted) -> None:
        """A check that found a difference (or compared nothing) stops the run."""
        if done.verify is None:
            return
        from rlc.runtime.refit.verify import RefitVerifyError, verify_error_text  # noqa: PLC0415 - torch

        if not done.verified:
            raise RefitVerifyError(verify_error_text(done.step, done.verify))
        log.info("refit %d verified bit-exact: %d parameters on %d vLLM workers", done.step,
                 sum(r["params_compared"] for r in done.verify), len(done.verify))


# --------------------------------------------------------------------------- Megatron: in process


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


#: The report of a swap that was to be checked and came back without one.
UNCHECKED = {"params_compared": 0, "mismatches": [], "bytes_compared": 0, "fp32_params": [], "bit_exact": False}


class MegatronInProcessSync:
    """The trainer's refit offload, then every policy worker readies its engine (``mg_sync``)."""

    def __init__(self, cfg: RuntimeConfig, policy: PolicyGroup, timer: PhaseTimer) -> None:
        self.cfg, self.policy, self.timer = cfg, policy, timer
        m = cfg.generation.megatron
        self.mode = m.mode if m is not None else "shared"
        self.kind = "megatron-swap" if self.mode == "dedicated" else "megatron-shared"

    def prepare(self) -> dict[str, Any]:
        """Nothing to pair: the engines (and the dedicated model's swap plan) are built by ``backend.start()``."""
        return {"kind": self.kind}

    def sync(self, step: int, verify: bool) -> Refitted:
        """The trainer's refit offload, then each worker's engine ready (``verify``: a dedicated model's swap is
        checked bit for bit; shared mode has nothing to compare, the engine reads the trainer's tensors)."""
        verify = verify and self.mode == "dedicated"
        with self.timer("refit"):
            offloaded = self.policy.refit_offload()[0]
            with self.timer("refit_transfer"):
                synced = self.policy.mg_sync(step, verify)
        reports = [dict(s.verify) if s.verify is not None else dict(UNCHECKED) for s in synced] if verify else None
        return Refitted(step=step, kind=self.kind, offloaded=offloaded,
                        transfer_seconds=self.timer.seconds("refit_transfer"), memory=synced[0].memory,
                        synced=synced, verify=reports, sleep_level=self.cfg.refit.sleep_level,
                        offload_optimizer=self.cfg.refit.offload_optimizer_for_refit)

    def check(self, done: Refitted) -> None:
        """A swap that left the inference model different from the trainer stops the run."""
        if done.verify is None:
            return
        from rlc.runtime.refit.verify import RefitVerifyError  # noqa: PLC0415 - torch

        if not done.verified:
            raise RefitVerifyError(swap_verify_error_text(done.step, done.verify))
        log.info("swap %d verified bit-exact: %d tensors on %d ranks (%d fp32)", done.step,
                 sum(r["params_compared"] for r in done.verify), len(done.verify),
                 len(done.verify[0]["fp32_params"]))


__all__ = ["MegatronInProcessSync", "UNCHECKED", "VllmIpcSync", "WeightSync", "make_weight_sync",
           "swap_verify_error_text"]
