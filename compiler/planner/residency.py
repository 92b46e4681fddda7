"""What is resident where in each phase of a colocated GRPO step: one small typed table.

The memory planner stacks bytes; this module decides *which* blocks are on the GPU and which are in
host memory in each phase, from the recipe's switches, the vLLM version's sleep semantics
(``vllm_sleep.py``) and the calibration entry:

=========  ===========================================  ==========================================
phase      Megatron on the GPU                          vLLM on the GPU
=========  ===========================================  ==========================================
train      params, grads, fp32 master + Adam moments    weight shard only if the sleep level keeps
           (less the ``optimizer_cpu_offload`` share)   it on the GPU in this vLLM version, or with
                                                        ``refit.keep_weights_awake`` (KV-only sleep);
                                                        its KV cache too with ``refit.keep_kv_cache_awake``
refit      params; fp32 master unless it moved with     weight shard if the level has it back at
           the optimizer state (precision-aware         the refit; contexts; CUDA graphs (eager off);
           optimizer, or no offload); grads + moments   the KV cache with ``refit.keep_kv_cache_awake``
                                                        or ``refit.wake_kv_during_transfer``
           only without ``offload_optimizer_for_refit``
generate   as the refit left it, less the bf16 params   awake (its pool is counted apart)
           with ``refit.offload_params_for_generation``
logprob    as the refit left it, bf16 params back; the      as in the train phase (asleep)
           reference policy's params (loss.kl_penalty)
=========  ===========================================  ==========================================

With ``loss.kl_penalty > 0`` the runtime builds a frozen reference policy with the same parallel layout
as the trainer and keeps its bf16 parameters on the GPU in every phase, so every phase carries a second
copy of the stage's parameters; with ``training.offload_reference_policy`` (as NeMo-RL, verl, slime and
SkyRL run) that copy is in host memory instead, and on the GPU only for the reference's logprob pass,
next to the trainer as the refit left it (the ``logprob`` phase).

The trainer stays as the refit left it until its next logprob pass: the bundled runtime onloads the
optimizer state only in the train step. ``refit.offload_params_for_generation`` moves the bf16
parameters to host memory after the refit (Megatron's parameter buffers, so the distributed optimizer)
and back before the logprob pass, as NeMo-RL, verl, slime and SkyRL do before they generate.

Host memory (per GPU): the weight copy of sleep level 1 unless the weights are kept awake (pinned;
PyTorch's pinned-memory cache keeps the pages after wake-up, so it counts through the refit), and
whatever Megatron state the offloads moved there: the optimizer state; the gradient buffers only
with ``training.offload_copies_gradients`` (Megatron's own offload frees them: storage resized to 0
and zeroed on reload); with ``training.optimizer_cpu_offload`` the CPU optimizer's fp32 copy of each
offloaded shard's gradient (Megatron's ``HybridDeviceOptimizer`` keeps it between steps).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from rlc.compiler.planner.calibration import Calibration
from rlc.compiler.planner.vllm_sleep import SleepSemantics
from rlc.compiler.recipe_types import Recipe
from rlc.contract.refit_buffer import kv_cache_kept_awake


@dataclass(frozen=True)
class KvCacheResident:
    """vLLM's KV cache on the GPU outside generation: the plan's line for it, and the switch that put it there."""

    label: str
    why: str


#: in the train, refit and logprob phases
KV_KEPT_AWAKE = KvCacheResident("vLLM KV cache (kept awake)", "refit.keep_kv_cache_awake: vLLM's KV cache never sleeps")
#: in the refit phase only
KV_WOKEN_DURING_TRANSFER = KvCacheResident("vLLM KV cache (woken during the transfer)",
                                           "refit.wake_kv_during_transfer: mapped back while the weights arrive")


@dataclass(frozen=True)
class MegatronResident:
    """Fractions (0..1) of each Megatron block on the GPU."""

    params: float
    grads: float
    master: float  # fp32 master weights
    moments: float  # Adam exp_avg + exp_avg_sq
    cpu_offload_staging: bool  # the extra residency optimizer_cpu_offload leaves (calibration)
    reference: float = 0.0  # the frozen reference policy's bf16 params (loss.kl_penalty > 0), per stage


@dataclass(frozen=True)
class VllmResident:
    """Whether vLLM's weight shard is on the GPU in a phase, and why; and its KV cache where a switch keeps it there
    (None: asleep, or, while generating, counted apart as vLLM's pool)."""

    weights: bool
    why: str  # which sleep-level fact decided ``weights``
    kv_cache: Optional[KvCacheResident] = None  # vLLM's KV cache on the GPU in this phase, and why


@dataclass(frozen=True)
class HostResident:
    """Fractions of each block held in host memory (per GPU) in a phase."""

    vllm_weights: float
    grads: float
    master: float
    moments: float
    reference: float = 0.0  # the reference policy's bf16 params with training.offload_reference_policy
    params: float = 0.0  # the trainer's bf16 params with refit.offload_params_for_generation (generate)
    #: the CPU optimizer's fp32 gradients (a share of the fp32 master's size): Megatron's HybridDeviceOptimizer
    #: keeps a host copy of every offloaded shard's gradient from its first step on
    cpu_optimizer_grads: float = 0.0


@dataclass(frozen=True)
class PhaseResidency:
    """What is resident where in one phase: Megatron's and vLLM's blocks on the GPU, the rest in host memory."""

    phase: str
    megatron: MegatronResident
    vllm: VllmResident
    host: HostResident


def residency(recipe: Recipe, sleep: SleepSemantics, cal: Calibration) -> dict[str, PhaseResidency]:
    """The residency table of ``recipe`` for the ``train``, ``refit`` and ``generate`` phases."""
    refit, training = recipe.refit, recipe.training
    level_no = refit.sleep_level
    level = sleep.level(level_no)
    cpu_offload = training.optimizer_cpu_offload
    off = float(training.optimizer_offload_fraction) if cpu_offload else 0.0
    offload_for_refit = refit.offload_optimizer_for_refit
    precision_aware = training.use_precision_aware_optimizer
    awake = refit.keep_weights_awake  # only the KV cache sleeps: the shard is on the GPU in every phase
    # the KV cache on the GPU outside generation: never asleep, or mapped back from inside the transfer
    kv_awake = KV_KEPT_AWAKE if kv_cache_kept_awake(refit) else None
    kv_at_refit = kv_awake or (KV_WOKEN_DURING_TRANSFER if awake and refit.wake_kv_during_transfer else None)
    host_copy = 1.0 if level.host_copy and not awake else 0.0
    with_reference = recipe.loss.kl_penalty > 0
    reference = 1.0 if with_reference and not training.offload_reference_policy else 0.0
    reference_host = 1.0 if with_reference and training.offload_reference_policy else 0.0

    train = PhaseResidency(
        "train",
        MegatronResident(params=1.0, grads=1.0, master=1.0 - off, moments=1.0 - off, cpu_offload_staging=cpu_offload,
                         reference=reference),
        VllmResident(True, "refit.keep_weights_awake: only the KV cache sleeps, the weight shard stays on the GPU",
                     kv_awake)
        if awake else
        VllmResident(level.gpu_asleep, f"sleep level {level_no} ({sleep.label}): weight shard "
                     + ("stays on the GPU" if level.gpu_asleep else "off the GPU") + " while asleep"),
        HostResident(vllm_weights=host_copy, grads=0.0, master=off, moments=off, reference=reference_host,
                     cpu_optimizer_grads=off),
    )
    if offload_for_refit:
        # the optimizer state goes to the host; the fp32 master goes with it when it *is* optimizer
        # state (precision-aware optimizer), else it stays (the distributed optimizer's fp32 shard)
        master_stays = cal.megatron_master_params_stay_at_refit and not precision_aware
        mega = MegatronResident(params=1.0, grads=0.0, master=1.0 if master_stays else 0.0, moments=0.0,
                                cpu_offload_staging=cpu_offload, reference=reference)
        # Megatron's buffer offload frees the gradient buffers (rebuilt zeroed); only a full backup copies them
        grads_host = 1.0 if training.offload_copies_gradients else 0.0
        host = HostResident(vllm_weights=host_copy, grads=grads_host, master=0.0 if master_stays else 1.0,
                            moments=1.0, reference=reference_host, cpu_optimizer_grads=off)
    else:
        mega = MegatronResident(params=1.0, grads=1.0, master=1.0, moments=1.0, cpu_offload_staging=cpu_offload,
                                reference=reference)
        host = HostResident(vllm_weights=host_copy, grads=0.0, master=off, moments=off, reference=reference_host,
                            cpu_optimizer_grads=off)
    refit_phase = PhaseResidency(
        "refit", mega,
        VllmResident(True, "refit.keep_weights_awake: the weight shard never left the GPU", kv_at_refit) if awake else
        VllmResident(level.gpu_at_refit, f"sleep level {level_no} ({sleep.label}): weight shard "
                     + ("on the GPU" if level.gpu_at_refit else "not on the GPU") + " at the refit"),
        host,
    )
    params_off = 1.0 if refit.offload_params_for_generation else 0.0
    generate = PhaseResidency(
        # the CPU-offload staging residue was measured before the refit only (NeMo-RL #2471): not counted here
        "generate", dataclasses.replace(mega, params=1.0 - params_off, cpu_offload_staging=False),
        VllmResident(True, "generating: vLLM is awake (its weights are in its pool)"),
        dataclasses.replace(host, params=params_off),
    )
    # the logprob passes come after the refit and generation: the trainer as the refit left it, its bf16
    # parameters back on the GPU, and the reference policy on the GPU for its pass (swapped in from host
    # memory with training.offload_reference_policy, whose pinned copy stays there)
    logprob = PhaseResidency(
        "logprob", dataclasses.replace(mega, params=1.0, reference=1.0 if with_reference else 0.0),
        train.vllm, host,
    )
    return {"train": train, "refit": refit_phase, "generate": generate, "logprob": logprob}


__all__ = ["KV_KEPT_AWAKE", "KV_WOKEN_DURING_TRANSFER", "HostResident", "KvCacheResident", "MegatronResident",
           "PhaseResidency", "VllmResident", "residency"]
