"""The memory planner: per-GPU memory in each phase of a colocated GRPO step, and the refit math.

Phases (worst GPU of each; a GPU hosts one Megatron rank and one vLLM rank):

* ``train``: Megatron params + grads (fp32 with ``training.grad_reduce_in_fp32``, else the param dtype:
  ``grad_bytes_per_param``) + optimizer state (fp32 master + 2 Adam moments = 12 B/param,
  sharded over DP × CP for dense and over expert-DP for expert parameters with the distributed
  optimizer) + its process context; vLLM asleep. Activations are not modelled.
* ``generate``: vLLM awake at ``gpu_memory_utilization`` (weights + KV cache + activations) plus
  CUDA-graph buffers; Megatron offloaded (context + residual).
* ``logprob``: the logprob passes (vLLM asleep): Megatron as the refit left it with its bf16 params back,
  the reference policy's params (with a KL penalty, swapped in with ``training.offload_reference_policy``)
  and the fp32 logits of ``training.logprob_batch_size`` sequences.
* ``refit``: Megatron after ``offload_optimizer_for_refit`` + vLLM's sleep residue; the free memory
  there sizes the IPC buffer: per side = free × ratio / 2 (or ``buffer_gb`` / 2), which must hold the
  largest exported tensor.
* ``stack``: the export staging site. After both buffer halves are allocated the exporter holds the
  gathered pieces of the largest tensor and ``torch.stack`` needs it again:
  ``free_at_stack = free − 2 × per_side − gathered − staging overhead − fragmentation ≥ largest``.

Parameter bytes are first principles (``rlc.compiler.model``); contexts, residues, the staging
overhead and fragmentation come from the calibration table (``calibration.yaml``); NCCL's NVLS buffers
are first principles too (``nccl.py``: per communicator, from the layout and ``cluster.env``), and the
calibration's contexts are net of them.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from rlc.contract import refit_buffer
from rlc.compiler.model import ModelFacts
from rlc.compiler.recipe_types import Recipe, with_value
from rlc.compiler.planner.calibration import Calibration, calibration_for
from rlc.compiler.planner.fp8_keep import kept_share
from rlc.compiler.planner.layout import GenerationLayout, TrainLayout, generation_layout, train_layout
from rlc.compiler.planner.mcore_memory import plan_megatron_generation
from rlc.compiler.planner.parts import (DTYPE_BYTES, HELD_LABELS, HELD_NOTES, REFERENCE_NOTE,
                                        _layout_dict, _megatron_bytes, _missing, _stage_figures, nvls_items,
                                        train_state_items)
from rlc.compiler.planner.host import host_plan
from rlc.compiler.planner.passes import (last_stage_loss, logits_bytes, logits_copies, logits_note, logprob_fix,
                                         logprob_microbatch_tokens, train_microbatch_tokens)
from rlc.compiler.planner.pinned_copy import pinned_copy_bytes, vllm_stage_tensors
from rlc.compiler.planner.verify_host import verify_check_items
from rlc.compiler.planner.replay import gpu_item as replay_gpu_item, host_items as replay_host_items, replay_memory
from rlc.compiler.planner.vllm_kv import kv_bytes_per_token
from rlc.compiler.planner.plan import GIB, Check, Fix, Item, MemoryPlan, Phase, RefitMath, gib, gib_bytes
from rlc.compiler.planner.refit_math import (FP8_RELOAD_COPY_HALVES, buffer_math, kept_buffer_items, refit_facts,
                                             reload_copy_halves, wire_tensor)
from rlc.compiler.planner.residency import KvCacheResident, MegatronResident, PhaseResidency, VllmResident, residency
from rlc.compiler.planner.shards import StageShard, megatron_stage_shards, vllm_stage_shards
from rlc.compiler.planner.vllm_sleep import SleepSemantics, planned_vllm_version, sleep_semantics

NO_OP_GIB = 0.01  # a lever that frees less memory at the refit than this changes nothing there


# --------------------------------------------------------------------------- Megatron per stage


REFERENCE_SWAPPED_NOTE = ("training.offload_reference_policy: copied in from pinned host memory for the reference "
                          "logprob pass, freed after it")

#: the plan item of vLLM's weight shard (on the GPU at the refit; in the train step when its level keeps it there
#: or with refit.keep_weights_awake)
VLLM_SHARD_LABEL = "vLLM weight shard"


def _megatron_refit_bytes(fig: dict[str, Any], where: MegatronResident, cal: Calibration) -> dict[str, int]:
    """Megatron's allocations at refit on one stage, by item."""
    items = _megatron_bytes(fig, where, cal)
    items["residual"] = gib_bytes(cal.megatron_refit_residual_gib)
    if where.cpu_offload_staging:
        items["cpu_offload_extra"] = gib_bytes(cal.megatron_cpu_offload_extra_gib)
    return items


_REFIT_LABELS = {**{key: (label, "params") for key, label in HELD_LABELS.items()},
                 "residual": ("Megatron residual", "calibration:megatron_refit_residual_gib"),
                 "cpu_offload_extra": ("CPU-offload staging", "calibration:megatron_cpu_offload_extra_gib")}
PARAMS_RESIDENT_NOTE = ("refit.offload_params_for_generation is off: the bundled runtime keeps them on the GPU "
                        "while vLLM generates")


def _megatron_items(held: dict[str, int], ctx: Sequence[Item], generating: bool = False,
                    reference_note: str = REFERENCE_NOTE) -> list[Item]:
    """Plan items of Megatron's allocations after the refit (``_megatron_refit_bytes``) and its context items.

    ``generating``: the same trainer state while vLLM generates; the bf16 params (if still there) say why.
    """
    items = []
    for key, value in held.items():
        if generating and key == "params" and not value:
            continue  # moved to host memory by refit.offload_params_for_generation
        label, source = _REFIT_LABELS[key]
        note = (reference_note if key == "reference" else PARAMS_RESIDENT_NOTE if generating and key == "params"
                else HELD_NOTES.get(key, ""))
        items.append(Item(label, gib(value), "megatron", source, note))
    return items + list(ctx)


# --------------------------------------------------------------------------- vLLM


def _vllm_shard_bytes(shard: StageShard, precision: str, bpp: int, kept: float = 0.0) -> int:
    """vLLM's weight bytes on one GPU of a stage. FP8 generation stores the linear layers (attention,
    MLP, experts) in 1 byte; the embedding and ``lm_head`` stay in the model dtype (vLLM's Fp8Config
    quantizes LinearBase and FusedMoE layers; VocabParallelEmbedding / ParallelLMHead keep the
    unquantized method), as do the norms and the MoE router, which are not counted apart (small).
    ``kept``: the share of the linear weights ``generation.fp8.keep_bf16`` keeps in the model dtype
    (:func:`rlc.compiler.planner.fp8_keep.kept_share`), counted as spread over the GPUs as the linear weights are."""
    if precision != "fp8":
        return shard.params * bpp
    linear = shard.linear_params
    kept_params = int(round(linear * kept))
    return (linear - kept_params) * 1 + kept_params * bpp + shard.vocab_params * bpp


DRAFTER_LABEL = "vLLM MTP drafter (speculative decoding)"


@dataclass(frozen=True)
class VllmWeights:
    """vLLM's weight bytes on its worst GPU: the model's shard and the MTP drafter's blocks on it (0 without
    MTP speculative decoding, or when the worst GPU is not on vLLM's last pipeline stage)."""

    shard: int
    drafter: int
    drafter_blocks: int  # MTP blocks the drafter loads (checkpoint's count; 0: no MTP drafter)

    @property
    def total(self) -> int:
        return self.shard + self.drafter


def drafter_blocks(recipe: Recipe, facts: ModelFacts) -> Optional[int]:
    """MTP blocks vLLM's drafter loads: the checkpoint's (``model.overrides`` that build the trainer without MTP
    do not change them) with ``generation.speculative_decoding.method: mtp``, else 0; ``None`` when unknown."""
    return facts.checkpoint_mtp_num_layers if recipe.generation.drafts_with_mtp else 0


def vllm_weights(recipe: Recipe, facts: ModelFacts) -> tuple[Optional[VllmWeights], Optional[str]]:
    """vLLM's weights on its worst GPU, and what is not counted for want of facts (the drafter, or all)."""
    gl = generation_layout(recipe)
    bpp = DTYPE_BYTES[recipe.model.dtype]
    plain = vllm_stage_shards(facts, gl)
    if plain is None:
        return None, "vLLM weight shard: needs " + _missing(facts)
    blocks = drafter_blocks(recipe, facts)
    kept = kept_share(recipe, facts)
    with_drafter = vllm_stage_shards(facts, gl, blocks) if blocks else plain
    if blocks is None or with_drafter is None:
        missing = "the checkpoint's MTP layer count" if blocks is None else "the MTP layer kinds"
        shard = max(_vllm_shard_bytes(s, recipe.generation.precision, bpp, kept) for s in plain)
        return VllmWeights(shard, 0, 0), f"{DRAFTER_LABEL}: needs {missing}"
    worst = max(
        range(len(with_drafter)),
        key=lambda i: _vllm_shard_bytes(with_drafter[i], recipe.generation.precision, bpp, kept),
    )
    shard = _vllm_shard_bytes(plain[worst], recipe.generation.precision, bpp, kept)
    total = _vllm_shard_bytes(with_drafter[worst], recipe.generation.precision, bpp, kept)
    return VllmWeights(shard, total - shard, with_drafter[worst].mtp_blocks), None


def vllm_host_copy(recipe: Recipe, facts: ModelFacts) -> Optional[int]:
    """Host bytes of sleep level 1's weight copy on vLLM's worst GPU: each allocation of its weight pool
    in a pinned block rounded up to a power of two (``pinned_copy.py``); ``None`` when the shard is unknown."""
    # layers kept in the model dtype (generation.fp8.keep_bf16) are counted as if every linear layer were kept
    precision = "auto" if kept_share(recipe, facts) else recipe.generation.precision
    return _host_copy(facts, generation_layout(recipe), drafter_blocks(recipe, facts), precision,
                      DTYPE_BYTES[recipe.model.dtype])


@lru_cache(maxsize=256)
def _host_copy(facts: ModelFacts, gl: GenerationLayout, blocks: Optional[int], precision: str,
               bpp: int) -> Optional[int]:
    """:func:`vllm_host_copy` for the values it depends on (``rlc lint`` and the planner's what-if fixes
    ask for the same layouts many times)."""
    shards = vllm_stage_shards(facts, gl, blocks or 0) if blocks is not None else None
    shards = shards or vllm_stage_shards(facts, gl)
    if shards is None or facts.num_layers is None:
        return None
    linear = 1 if precision == "fp8" else bpp
    stages = gl.stage_layers(facts.num_layers)
    copies = []
    for shard, layers in zip(shards, stages):
        total = _vllm_shard_bytes(shard, precision, bpp)
        tensors = vllm_stage_tensors(facts, gl, layers, shard.vocab_copies, linear, bpp)
        copies.append(total if tensors is None else pinned_copy_bytes(tensors, total))
    return max(copies)


def vllm_asleep_items(recipe: Recipe, facts: ModelFacts, weights: Optional[VllmWeights], cal: Calibration,
                      gpu: Any) -> list[Item]:
    """vLLM's GPU memory while asleep (the train step), by the planned vLLM version's sleep semantics."""
    sleep = sleep_semantics(planned_vllm_version(recipe, cal.versions))
    return _vllm_residue(recipe, weights, residency(recipe, sleep, cal)["train"].vllm, cal,
                         nvls_items(recipe, facts, gpu)[1], float(gpu.memory_gib))


def kv_and_activations_gib(recipe: Recipe, weights: Optional[VllmWeights], limit: float) -> Optional[float]:
    """What vLLM's ``gpu_memory_utilization`` budget of a ``limit`` GiB GPU leaves beside its weights (KV cache and
    activations), when the weights are known; negative when they do not fit the budget."""
    if weights is None:
        return None
    return float(recipe.generation.gpu_memory_utilization) * limit - weights.total / GIB


def _vllm_kv_cache(recipe: Recipe, weights: Optional[VllmWeights], kv: KvCacheResident, limit: float) -> Item:
    """vLLM's KV cache outside generation (``VllmResident.kv_cache``): ``generation.kv_cache_memory_bytes``, or the
    ``generation`` budget less the weights where nothing fixes it (an upper bound)."""
    kv_bytes = recipe.generation.kv_cache_memory_bytes
    if kv_bytes is not None:
        return Item(kv.label, int(kv_bytes) / GIB, "vllm", "recipe:generation.kv_cache_memory_bytes", kv.why)
    left = kv_and_activations_gib(recipe, weights, limit)
    return Item(kv.label, None if left is None else max(left, 0.0), "vllm", "recipe:generation.gpu_memory_utilization",
                kv.why + "; the budget less the weights (KV cache and activations)")


def _vllm_residue(recipe: Recipe, weights: Optional[VllmWeights], where: VllmResident,
                  cal: Calibration, nvls: Sequence[Item], limit: float) -> list[Item]:
    """vLLM's GPU memory outside generation: the weight shard where it stays, its KV cache where it stays (see
    :mod:`~rlc.compiler.planner.residency`), contexts, NVLS buffers, CUDA graphs."""
    items = []
    if where.weights:
        items.append(Item(VLLM_SHARD_LABEL, gib(None if weights is None else weights.shard), "vllm", "params",
                          where.why))
        if weights is not None and weights.drafter:
            items.append(Item(DRAFTER_LABEL, gib(weights.drafter), "vllm", "params",
                              f"{weights.drafter_blocks} MTP block(s) of the checkpoint in vLLM's weight pool, "
                              "embedding and lm_head shared with the model"))
    if where.kv_cache:
        items.append(_vllm_kv_cache(recipe, weights, where.kv_cache, limit))
    items.append(Item("vLLM contexts + non-pool buffers", cal.vllm_base_gib, "vllm", "calibration:vllm_base_gib"))
    items.extend(nvls)
    if not recipe.generation.enforce_eager:
        items.append(Item("vLLM CUDA graphs", cal.vllm_cuda_graph_gib, "vllm", "calibration:vllm_cuda_graph_gib",
                          "non-releasable, after step 1 (enforce_eager off)"))
    return items


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class _PlanInputs:
    """What every phase of the plan is computed from: the layouts, Megatron's figures per pipeline stage, vLLM's
    weights, the residency table and the items every phase shares (the header of :func:`_core_plan`)."""

    recipe: Recipe
    facts: ModelFacts
    gpu: Any
    cal: Calibration
    tl: TrainLayout
    bpp: int
    limit: float
    figs: list[dict[str, Any]]  # Megatron per pipeline stage (empty when the facts do not give the shards)
    weights: Optional[VllmWeights]
    sleep: SleepSemantics
    table: dict[str, PhaseResidency]
    vllm_nvls: list[Item]
    ctx: list[Item]  # Megatron's context and its NVLS buffers, in every phase
    residual: Item
    kept: tuple[Item, ...] = ()  # the IPC halves refit.keep_buffers_gb keeps, outside the refit

    @property
    def v_weights(self) -> Optional[int]:
        """Everything in vLLM's weight pool (bytes), when known."""
        return None if self.weights is None else self.weights.total


def _core_plan(recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration) -> MemoryPlan:
    """The plan of the vLLM backend, phase by phase (what :func:`plan_memory` returns before its fixes)."""
    plan, s = _plan_inputs(recipe, facts, gpu, cal)
    base = _refit_base(s)
    s = dataclasses.replace(s, kept=tuple(kept_buffer_items(recipe, base.math if base is not None else None)))
    _train_phase(plan, s)
    _generate_phase(plan, s)
    _train_checks(plan, s)
    if s.figs:
        _logprob_phase(plan, recipe, facts, s.figs, s.table["logprob"], cal, [*s.ctx, *s.kept], s.weights,
                       s.vllm_nvls, s.sleep, s.tl)
    _host_memory(plan, s)
    _refit_phases(plan, s, base)
    return plan


def _plan_inputs(recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration) -> tuple[MemoryPlan, _PlanInputs]:
    """The plan's header (layout, notes, the unknowns of the facts) and the inputs of its phases."""
    tl, gl = train_layout(recipe), generation_layout(recipe)
    bpp = DTYPE_BYTES[recipe.model.dtype]
    limit = float(gpu.memory_gib)
    plan = MemoryPlan(model_id=facts.model_id, gpu=gpu.name, gpu_memory_gib=limit, calibration_id=cal.id,
                      graph_uncertainty_gib=cal.vllm_cuda_graph_uncertainty_gib,
                      layout=_layout_dict(tl, gl, facts.is_moe is not False))
    if cal.fallback_note:
        plan.notes.append(cal.fallback_note)
    plan.notes.extend(n for n in facts.notes if "layer order" in n or "evenly mixed" in n)

    mega = megatron_stage_shards(facts, tl)
    if mega is None:
        plan.unknown.append("Megatron per-GPU shards: needs " + _missing(facts))
    weights, weights_unknown = vllm_weights(recipe, facts)
    if weights_unknown:
        plan.unknown.append(weights_unknown)
    figs = [_stage_figures(s, tl, recipe, bpp) for s in mega] if mega else []
    plan.stages = figs
    plan.vllm_weights_gib = gib(None if weights is None else weights.total)
    plan.vllm_drafter_gib = gib(weights.drafter) if weights is not None and weights.drafter else None
    sleep = sleep_semantics(planned_vllm_version(recipe, cal.versions))
    plan.vllm_version = planned_vllm_version(recipe, cal.versions)
    plan.sleep_label = sleep.label
    table = residency(recipe, sleep, cal)
    plan.residency = table
    trainer_nvls, vllm_nvls = nvls_items(recipe, facts, gpu)
    ctx = [Item("Megatron context (CUDA/NCCL)", cal.megatron_context_gib, "megatron",
                "calibration:megatron_context_gib")] + trainer_nvls
    residual = Item("Megatron residual", cal.megatron_refit_residual_gib, "megatron",
                    "calibration:megatron_refit_residual_gib")
    return plan, _PlanInputs(recipe=recipe, facts=facts, gpu=gpu, cal=cal, tl=tl, bpp=bpp, limit=limit, figs=figs,
                             weights=weights, sleep=sleep, table=table, vllm_nvls=vllm_nvls, ctx=ctx,
                             residual=residual)


def _train_phase(plan: MemoryPlan, s: _PlanInputs) -> None:
    """``train``: the train step with the loss's fp32 logits on the last pipeline stage, before its other activations,
    on the stage that holds the most."""
    recipe, cal, figs = s.recipe, s.cal, s.figs
    if not figs:
        return
    where = s.table["train"].megatron
    last, loss = last_stage_loss(recipe, s.facts, s.tl, figs)

    def stage_items(f: dict[str, Any]) -> list[Item]:
        items = train_state_items(_megatron_bytes(f, where, cal), recipe, s.bpp, where, cal)
        return items + [loss] if loss is not None and f["stage"] == last else items

    worst = max(figs, key=lambda f: sum(i.gib or 0.0 for i in stage_items(f)))
    items = stage_items(worst)
    replay = replay_memory(recipe, s.facts, worst["layers"], s.tl, train_microbatch_tokens(recipe, s.tl))
    if replay is not None:
        items.append(replay_gpu_item(replay, recipe))
    residue = _vllm_residue(recipe, s.weights, s.table["train"].vllm, cal, s.vllm_nvls, s.limit)
    plan.phases["train"] = Phase("train", "train step (with the loss's logits, before other activations)",
                                 tuple(items + [s.residual] + s.ctx + list(s.kept) + residue),
                                 s.limit, stage=worst["stage"], note="other activations not modelled")
    if where.cpu_offload_staging:
        on_gpu = dataclasses.replace(where, master=1.0, moments=1.0, cpu_offload_staging=False)
        megatron = max(sum(_megatron_bytes(f, on_gpu, cal).values()) for f in figs)
        plan.train_gib_without_cpu_offload = megatron / GIB + sum(
            i.gib or 0.0 for i in [s.residual, *s.ctx, *s.kept, *residue])


def _generate_phase(plan: MemoryPlan, s: _PlanInputs) -> None:
    """``generate``: vLLM awake at its budget beside the trainer as the refit left it; the checks that vLLM's
    weights fit its budget and that the phase fits the GPU."""
    generation, cal, limit, v_weights = s.recipe.generation, s.cal, s.limit, s.v_weights
    util = float(generation.gpu_memory_utilization)
    kv_bytes = generation.kv_cache_memory_bytes
    if kv_bytes is not None and v_weights is not None:
        pool = (v_weights + int(kv_bytes)) / GIB
        g_items = [Item("vLLM weights + KV cache (kv_cache_memory_bytes)", pool, "vllm",
                        "recipe:generation.kv_cache_memory_bytes", "activations not counted")]
    else:
        g_items = [Item("vLLM pool (weights + KV cache + activations)", util * limit, "vllm",
                        "recipe:generation.gpu_memory_utilization")]
    if cal.vllm_awake_extra_gib:
        g_items.append(Item("vLLM outside its budget", cal.vllm_awake_extra_gib, "vllm",
                            "calibration:vllm_awake_extra_gib"))
    if not generation.enforce_eager:
        g_items.append(Item("vLLM CUDA graphs", cal.vllm_cuda_graph_gib, "vllm", "calibration:vllm_cuda_graph_gib"))
    g_items += s.vllm_nvls
    g_stage = None
    if s.figs:
        # the trainer as the refit left it, less what refit.offload_params_for_generation moved to the host
        g_where = s.table["generate"].megatron
        g_fig, g_held = max(((f, _megatron_refit_bytes(f, g_where, cal)) for f in s.figs),
                            key=lambda t: sum(t[1].values()))
        g_stage = g_fig["stage"]
        g_items += _megatron_items(g_held, s.ctx, generating=True)
    else:
        g_items += s.ctx + [dataclasses.replace(s.residual, label="Megatron residual (offloaded)")]
    g_items += s.kept
    plan.phases["generate"] = Phase("generate", "generation (vLLM awake)", tuple(g_items), limit, stage=g_stage)
    kv = kv_and_activations_gib(s.recipe, s.weights, limit)
    if kv is not None and v_weights is not None and kv_bytes is None:
        drafter = f" (with the MTP drafter's {plan.vllm_drafter_gib:.2f})" if plan.vllm_drafter_gib else ""
        plan.checks["generate_fit"] = Check(
            "generate_fit", kv > 0, util * limit, v_weights / GIB,
            f"vLLM weight shard {v_weights / GIB:.2f} GiB{drafter} vs. gpu_memory_utilization {util:g} × "
            f"{limit:.2f} GiB = {util * limit:.2f} GiB (leaves {kv:.2f} GiB for KV cache and activations)")
    used = plan.phases["generate"].used_gib
    if used is not None and used > limit:
        plan.checks["generate_total"] = Check("generate_total", False, limit, used,
                                              f"generation needs {used:.2f} GiB of {limit:.2f} GiB")
    request = _one_request_check(s, util * limit if kv_bytes is None else None)
    if request is not None:
        plan.checks["generate_kv_request"] = request


def _one_request_check(s: _PlanInputs, budget_gib: Optional[float]) -> Optional[Check]:
    """vLLM's KV cache holds one request of ``max_model_len`` tokens: at least the KV bytes of that request
    (:func:`~rlc.compiler.planner.vllm_kv.kv_bytes_per_token`, a lower bound) against at most what vLLM can give its
    cache (``kv_cache_memory_bytes``, else the budget ``budget_gib`` less the weights: an upper bound, activations
    not taken off). None when a fact is missing or the KV cache is not sized this way."""
    per_token = kv_bytes_per_token(s.recipe, s.facts)
    if per_token is None:
        return None
    kv_bytes = s.recipe.generation.kv_cache_memory_bytes
    if kv_bytes is not None:
        have, where = int(kv_bytes) / GIB, f"generation.kv_cache_memory_bytes {int(kv_bytes) / GIB:.2f} GiB"
    elif budget_gib is not None and s.v_weights is not None:
        have = budget_gib - s.v_weights / GIB
        where = (f"gpu_memory_utilization {float(s.recipe.generation.gpu_memory_utilization):g} × {s.limit:.2f} GiB "
                 f"less the weight shard {s.v_weights / GIB:.2f} GiB = {have:.2f} GiB at most")
    else:
        return None
    tokens = s.recipe.generation.max_model_len
    need = tokens * per_token / GIB
    return Check("generate_kv_request", need <= have, have, need,
                 f"one request of generation.max_model_len {tokens} tokens needs {need:.2f} GiB of vLLM KV cache per "
                 f"GPU ({per_token} bytes a token at least), and {where}")


def _train_checks(plan: MemoryPlan, s: _PlanInputs) -> None:
    """The train step fits the GPU, now and after step 1 (``train_late``)."""
    if "train" not in plan.phases:
        return
    limit = s.limit
    t_used = plan.phases["train"].used_gib
    if t_used is not None:
        plan.checks["train_fit"] = Check("train_fit", t_used <= limit, limit, t_used,
                                         f"train step with the loss's logits, before other activations: "
                                         f"{t_used:.2f} GiB of {limit:.2f} GiB")
    _late_train(plan, s.recipe, s.facts, s.sleep, s.tl)


def _host_memory(plan: MemoryPlan, s: _PlanInputs) -> None:
    """Host memory per node: pinned copies, offloaded state, routing replay's host buffers, the refit check."""
    recipe = s.recipe
    replay = replay_memory(recipe, s.facts, max((f["layers"] for f in s.figs), default=0), s.tl,
                           train_microbatch_tokens(recipe, s.tl))
    extra: dict[str, list[Item]] = {}
    if replay is not None:
        extra = {phase: list(items) for phase, items in replay_host_items(replay, recipe, s.table).items()}
    check = verify_check_items(recipe, s.facts, s.v_weights, s.bpp)
    if check and "refit" in s.table:
        extra.setdefault("refit", []).extend(check)
    plan.host = host_plan(recipe, s.figs, s.v_weights, vllm_host_copy(recipe, s.facts), s.table, s.gpu,
                          extra=extra or None)


@dataclass(frozen=True)
class _RefitBase:
    """The refit phase before the IPC buffer and the buffer math at its free memory (None where unknown, with
    why in ``unknown``): computed before the other phases, which hold the halves ``refit.keep_buffers_gb`` keeps."""

    phase: Phase
    math: Optional[RefitMath] = None
    unknown: Optional[str] = None


def _refit_base(s: _PlanInputs) -> Optional[_RefitBase]:
    """The free memory that sizes the IPC buffer, and the buffer math there."""
    recipe, facts, cal, limit, bpp = s.recipe, s.facts, s.cal, s.limit, s.bpp
    if not s.figs:
        return None
    where = s.table["refit"].megatron
    refit_items_by_stage = [(f, _megatron_refit_bytes(f, where, cal)) for f in s.figs]
    worst_f, worst_items = max(refit_items_by_stage, key=lambda t: sum(t[1].values()))
    r_items = tuple(_megatron_items(worst_items, s.ctx) + _vllm_residue(recipe, s.weights, s.table["refit"].vllm,
                                                                        cal, s.vllm_nvls, limit))
    phase = Phase("refit", "refit (before the IPC buffer)", r_items, limit, stage=worst_f["stage"])
    base = _RefitBase(phase)
    if phase.free_gib is None:
        return dataclasses.replace(base, unknown="free memory at refit: needs the vLLM weight shard")
    name, largest = refit_facts(recipe, facts).largest_export_tensor(bpp)
    if largest is None:
        return dataclasses.replace(base, unknown=f"largest exported tensor: {name}")
    math = buffer_math(int(phase.free_gib * GIB), recipe, name, largest, s.tl, cal, wire_tensor(recipe, facts, bpp))
    return dataclasses.replace(base, math=math)


def _refit_phases(plan: MemoryPlan, s: _PlanInputs, base: Optional[_RefitBase]) -> None:
    """``refit`` (the free memory that sizes the IPC buffer, and the buffer check) and ``stack`` (the export
    staging site: ``torch.stack`` of the largest tensor after both halves exist)."""
    recipe, cal, limit = s.recipe, s.cal, s.limit
    if base is None:
        return
    plan.phases["refit"] = base.phase
    if base.math is None:
        plan.unknown.append(base.unknown or "refit math")
        return
    math, r_items, stage = base.math, base.phase.items, base.phase.stage
    free, name, largest = math.free_at_refit, math.largest_name, math.largest
    plan.refit = math
    plan.phases["refit"] = Phase("refit", base.phase.title, r_items, limit, stage=stage,
                                 request=Item("IPC buffer (2 halves)", gib(2 * math.per_side), "refit",
                                              "recipe:refit", math.buffer_source))
    s_items = list(r_items) + [
        Item("IPC buffer (2 halves)", gib(2 * math.per_side), "refit", "recipe:refit", math.buffer_source),
        Item("gathered pieces of the largest tensor", gib(math.gathered), "refit", "params", name),
        Item("export staging overhead", cal.export_staging_overhead_gib, "refit",
             "calibration:export_staging_overhead_gib"),
        Item("allocator fragmentation", gib(math.fragmentation), "refit", "calibration:fragmentation_points",
             f"half {math.headroom_fraction:+.1%} over the largest tensor"),
    ]
    if math.reload_copies:
        s_items.append(Item("vLLM FP8 reload: bucket copies", gib(math.reload_copies), "refit", "recipe:refit",
                            f"{FP8_RELOAD_COPY_HALVES} × per side: a layer spanning two buckets keeps both copies"))
    plan.phases["stack"] = Phase("stack", "export staging site (torch.stack of the largest tensor)",
                                 tuple(s_items), limit, stage=stage,
                                 request=Item("torch.stack of the largest tensor", gib(largest), "refit", "params",
                                              name))
    wire_name, on_wire = math.wire
    on_the_wire = " on the wire" if math.wire_largest is not None else ""
    plan.checks["buffer"] = Check(
        "buffer", refit_buffer.half_holds(math.per_side, on_wire), gib(math.per_side), gib(on_wire),
        f"per side = {math.buffer_source} / 2 = {gib(math.per_side):.2f} GiB vs. largest tensor{on_the_wire} "
        f"{wire_name} {gib(on_wire):.2f} GiB ({on_wire} bytes)")
    reached = refit_buffer.half_holds(math.per_side, on_wire)
    plan.checks["stack"] = Check(
        "stack", (math.free_at_stack >= largest) if reached else None, gib(math.free_at_stack), gib(largest),
        ("not reached: the half cannot hold the tensor, the transfer fails before the staging site; " if not reached
         else "") +
        f"free at stack = {gib(free):.2f} − {2 + reload_copy_halves(recipe)} × {gib(math.per_side):.2f} − "
        f"{gib(math.gathered):.2f} (gathered) − "
        f"{cal.export_staging_overhead_gib:.2f} (staging) − {gib(math.fragmentation):.2f} (fragmentation) = "
        f"{gib(math.free_at_stack):.2f} GiB vs. {gib(largest):.2f} GiB for torch.stack")


def _late_train(plan: MemoryPlan, recipe: Recipe, facts: ModelFacts, sleep: SleepSemantics,
                tl: TrainLayout) -> None:
    """The train phase once vLLM's after-sleep residue has grown as reported for this vLLM version."""
    growth = sleep.residue_growth
    train = plan.phases["train"]
    if growth is None or not _growth_applies(recipe, facts, sleep) or facts.vocab is None or train.used_gib is None:
        return
    items = train.items + (_growth_item(growth),)
    late = Phase("train_late", "train step once the vLLM residue has grown (step 2 on)", items, train.limit_gib,
                 stage=train.stage, note="other activations not modelled")
    plan.phases["train_late"] = late
    plan.residue_growth_recorded = growth.recorded_for(plan.vllm_version or growth.versions[0])
    used = late.used_gib
    if used is None:
        return
    plan.checks["train_late_fit"] = Check(
        "train_late_fit", used <= late.limit_gib, late.limit_gib, used,
        f"train step from step 2: {train.used_gib:.2f} GiB (with the loss's fp32 logits and log-softmax) + "
        f"{growth.growth_gib:.2f} GiB vLLM residue growth ({growth.series()}) = {used:.2f} GiB "
        f"of {late.limit_gib:.2f} GiB")


def _growth_item(growth: Any) -> Item:
    return Item("vLLM residue growth over steps", growth.growth_gib, "vllm", "records:vllm_sleep.residue_growth",
                f"after-sleep residue {growth.series()} ({growth.source.split(' (')[0]})")


def _growth_applies(recipe: Recipe, facts: ModelFacts, sleep: SleepSemantics) -> bool:
    growth = sleep.residue_growth
    return growth is not None and recipe.colocated and not (growth.moe_only and not facts.is_moe)


def _logprob_phase(plan: MemoryPlan, recipe: Recipe, facts: ModelFacts, figs: Sequence[dict[str, Any]],
                   where: PhaseResidency, cal: Calibration, ctx: Sequence[Item], weights: Optional[VllmWeights],
                   vllm_nvls: Sequence[Item], sleep: SleepSemantics, tl: TrainLayout) -> None:
    """The logprob passes (vLLM asleep): the trainer as the refit left it with its bf16 parameters back, the
    reference policy's parameters (swapped in from host memory with ``training.offload_reference_policy``), and
    the fp32 logits of ``training.logprob_batch_size`` sequences on the last pipeline stage. The reference pass
    is the worse of the two passes (the policy's has no reference on the GPU), so this is its peak. Where this
    vLLM version's after-sleep residue grows, ``logprob_late`` is the same pass from step 2 on (as ``train_late``
    is for the train step)."""
    if facts.vocab is None:
        return
    tokens, how = logprob_microbatch_tokens(recipe, tl)
    copies = logits_copies(recipe, loss=False)
    logits = logits_bytes(tokens, facts.vocab, tl.tp, copies)
    last = max(f["stage"] for f in figs)

    def stage_bytes(f: dict[str, Any]) -> tuple[dict[str, int], int]:
        held = _megatron_refit_bytes(f, where.megatron, cal)
        return held, sum(held.values()) + (logits if f["stage"] == last else 0)

    worst = max(figs, key=lambda f: stage_bytes(f)[1])
    held, _ = stage_bytes(worst)
    note = REFERENCE_SWAPPED_NOTE if recipe.training.offload_reference_policy else REFERENCE_NOTE
    limit = float(plan.gpu_memory_gib)
    items = _megatron_items(held, ctx, reference_note=note) + _vllm_residue(recipe, weights, where.vllm, cal,
                                                                             vllm_nvls, limit)
    if worst["stage"] == last:
        items.append(Item("fp32 logits of the logprob pass", gib(logits), "megatron", "params",
                          logits_note(how, facts.vocab, tl.tp, copies)))
    title = "reference logprob pass (vLLM asleep)" if "reference" in held else "logprob pass (vLLM asleep)"
    phase = Phase("logprob", title, tuple(items), limit, stage=worst["stage"], note="other activations not modelled")
    plan.phases["logprob"] = phase
    used = phase.used_gib
    if used is None:
        return
    of_which = f"of which {gib(logits):.2f} GiB fp32 logits of {how}"
    plan.checks["logprob_fit"] = Check("logprob_fit", used <= limit, limit, used,
                                       f"{title}: {used:.2f} GiB of {limit:.2f} GiB, {of_which}")
    growth = sleep.residue_growth
    if growth is None or not _growth_applies(recipe, facts, sleep):
        if used > limit and worst["stage"] == last:
            plan.logprob_fix = logprob_fix(used, limit, logits, recipe, tl)
        return
    late = Phase("logprob_late", f"{title} once the vLLM residue has grown (step 2 on)",
                 phase.items + (_growth_item(growth),), limit, stage=worst["stage"],
                 note="other activations not modelled")
    plan.phases["logprob_late"] = late
    plan.residue_growth_recorded = growth.recorded_for(plan.vllm_version or growth.versions[0])
    late_used = late.used_gib or 0.0
    plan.checks["logprob_late_fit"] = Check(
        "logprob_late_fit", late_used <= limit, limit, late_used,
        f"{title} from step 2: {used:.2f} GiB + {growth.growth_gib:.2f} GiB vLLM residue growth ({growth.series()}) "
        f"= {late_used:.2f} GiB of {limit:.2f} GiB, {of_which}")
    if late_used > limit and worst["stage"] == last:  # a batch that fits from step 2 on fits at step 1 too
        plan.logprob_fix = logprob_fix(late_used, limit, logits, recipe, tl)


# --------------------------------------------------------------------------- fixes


def _levers(recipe: Recipe, facts: ModelFacts, gpu: Any) -> list[tuple[str, Any, int, str]]:
    """Candidate levers: (recipe key, new value, cost, description)."""
    out: list[tuple[str, Any, int, str]] = []
    refit, gen, training = recipe.refit, recipe.generation, recipe.training
    if any(i.gib for items in nvls_items(recipe, facts, gpu) for i in items):
        # NeMo-RL's DeepSeek-V3 and Qwen3-235B performance scripts: "disable NVLS to avoid OOM issue"
        out.append(("cluster.env", {**recipe.cluster.env, "NCCL_NVLS_ENABLE": "0"}, 1,
                    "NCCL_NVLS_ENABLE: \"0\" in cluster.env (NCCL's NVLink SHARP collectives off)"))
    if refit.sleep_level == 1 and not gen.drafts_with_mtp:  # level 2 would discard the MTP drafter (RLC314)
        out.append(("refit.sleep_level", 2, 1, "sleep_level: 2"))
    if not refit.offload_optimizer_for_refit:
        out.append(("refit.offload_optimizer_for_refit", True, 1, "offload_optimizer_for_refit: true"))
    if recipe.loss.kl_penalty > 0 and not training.offload_reference_policy:
        out.append(("training.offload_reference_policy", True, 1,
                    "offload_reference_policy: true (the reference policy in host memory, on the GPU for its pass)"))
    if training.optimizer_cpu_offload:
        out.append(("training.optimizer_cpu_offload", False, 1, "optimizer_cpu_offload: false"))
    gl = generation_layout(recipe)
    experts = facts.num_experts or 0
    if experts:
        new_ep = gl.ep * 2 if gl.ep > 1 else gl.tp * 2
        if experts % new_ep == 0 and new_ep % gl.tp == 0 and gl.world % (new_ep * gl.pp) == 0:
            out.append(("parallelism.generation.ep", new_ep, 2,
                        f"generation EP {new_ep} halves the expert shard"))
    if not gen.enforce_eager:
        out.append(("generation.enforce_eager", True, 3, "enforce_eager: true (costs ~30–40% generation throughput)"))
    return out


def _window_text(window: Optional[tuple[float, float]]) -> str:
    if window is None:
        return "not enough alone"
    return f"then buffer_memory_ratio {window[0]:.3f}–{window[1]:.3f} passes both checks"


def _newly_failing(base: MemoryPlan, alt: MemoryPlan) -> str:
    """What the re-planned ``alt`` overfills that ``base`` did not (the train step, generation), or ''."""
    for name, what in (("train_fit", "the train step"), ("generate_fit", "vLLM's pool"),
                       ("generate_total", "generation"), ("logprob_fit", "the logprob pass")):
        before, after = base.checks.get(name), alt.checks.get(name)
        if after is not None and after.ok is False and (before is None or before.ok is not False):
            return f"{what} then needs {after.need_gib:.2f} of {after.have_gib:.2f} GiB"
    return ""


def _fixes(base: MemoryPlan, recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration) -> list[Fix]:
    math = base.refit
    if math is None:
        return []
    fixes: list[Fix] = []
    using_gb = recipe.refit.buffer_gb is not None
    if math.ratio_window:
        lo, hi = math.ratio_window
        if using_gb:
            text = (f"use buffer_memory_ratio {lo:.3f}–{hi:.3f} instead of buffer_gb "
                    f"(or buffer_gb {lo * math.free_at_refit / GIB:.2f}–{hi * math.free_at_refit / GIB:.2f})")
        elif math.per_side < math.largest:
            text = f"buffer_memory_ratio ≥ {lo:.3f} (the staging site allows up to {hi:.3f})"
        else:
            text = f"buffer_memory_ratio ≤ {hi:.3f} (the half needs ≥ {lo:.3f})"
        fixes.append(Fix("refit.buffer_memory_ratio", round(lo if math.per_side < math.largest else hi, 3),
                         text, 0.0, True, 0))
    cumulative = recipe
    applied: list[str] = []
    for key, value, cost, desc in _levers(recipe, facts, gpu):
        alt = _core_plan(with_value(recipe, key, value), facts, gpu, cal)
        if alt.refit is None:
            continue
        freed = (alt.refit.free_at_refit - math.free_at_refit) / GIB
        if abs(freed) < NO_OP_GIB:
            continue  # e.g. sleep_level 2: the refit wakes the weights at either level
        window = alt.refit.ratio_window
        broken = _newly_failing(base, alt)
        if broken:
            # a lever that frees memory at the refit by overfilling another phase is not a fix
            fixes.append(Fix(key, value, f"{desc}: frees ≈ {freed:.1f} GiB at the refit, but {broken}", freed,
                             False, cost))
            continue
        fixes.append(Fix(key, value, f"{desc}: frees ≈ {freed:.1f} GiB; {_window_text(window)}", freed,
                         window is not None, cost))
        cumulative = with_value(cumulative, key, value)
        applied.append(desc.split(" (")[0])
    if applied and not any(f.sufficient for f in fixes):
        alt = _core_plan(cumulative, facts, gpu, cal)
        if alt.refit is not None:
            freed = (alt.refit.free_at_refit - math.free_at_refit) / GIB
            window = alt.refit.ratio_window
            fixes.append(Fix("+".join(k for k, *_ in _levers(recipe, facts, gpu)), None,
                             f"all of {', '.join(applied)}: frees ≈ {freed:.1f} GiB; {_window_text(window)}",
                             freed, window is not None, 4))
    fixes.sort(key=lambda f: (not f.sufficient, f.cost))
    return fixes


def plan_memory(recipe: Recipe, facts: ModelFacts, gpu: Any,
                calibration: Optional[Sequence[Calibration]] = None) -> MemoryPlan:
    """The memory plan of the typed ``recipe`` for ``facts`` on ``gpu`` (a GpuSpec).

    ``calibration`` is the table to take the constants from (a ``--calibration`` or
    ``cluster.calibration`` file); the shipped table when None.
    """
    cal = calibration_for(gpu.name, table=calibration)
    if recipe.generation.backend == "megatron":
        return plan_megatron_generation(recipe, facts, gpu, cal)
    plan = _core_plan(recipe, facts, gpu, cal)
    checks = plan.checks
    failing = any(checks.get(k) is not None and checks[k].ok is False for k in ("buffer", "stack"))
    tight = plan.refit is not None and plan.refit.tolerance_gib is not None and \
        plan.refit.tolerance_gib < cal.vllm_cuda_graph_uncertainty_gib
    if failing or tight:
        plan.fixes = _fixes(plan, recipe, facts, gpu, cal)
    late = checks.get("train_late_fit")
    if late is not None and late.ok is False:
        plan.late_fix = _wider_tp(recipe, facts, gpu, cal)
    over = checks.get("generate_total")
    if over is not None and over.ok is False:
        plan.generate_fix = _params_offload(plan, recipe, facts, gpu, cal)
    return plan


def _params_offload(base: MemoryPlan, recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration) -> Optional[Fix]:
    """``refit.offload_params_for_generation: true``, re-planned, where generation overfills the GPU with
    the trainer's bf16 parameters resident. ``None`` when the switch is already on."""
    if recipe.refit.offload_params_for_generation:
        return None
    key = "refit.offload_params_for_generation"
    alt = _core_plan(with_value(recipe, key, True), facts, gpu, cal).phases["generate"]
    used, base_used = alt.used_gib, base.phases["generate"].used_gib
    if used is None or base_used is None:
        return None
    fits = used <= alt.limit_gib
    text = (f"{key}: true moves the trainer's bf16 parameters to host memory while vLLM generates: "
            f"frees {base_used - used:.2f} GiB, generation then needs {used:.2f} of {alt.limit_gib:.2f} GiB")
    if not recipe.training.use_distributed_optimizer:
        text += " (needs training.use_distributed_optimizer: true)"
    return Fix(key, True, text, base_used - used, fits, 1)


def _wider_tp(recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration) -> Optional[Fix]:
    """Twice the trainer TP (sequence parallel on, ETP 1), re-planned: it splits the dense weights and the
    loss's vocabulary logits (the fix of NeMo-RL #2619). ``None`` when the layout cannot take it."""
    tl = train_layout(recipe)
    tp = tl.tp * 2
    if tl.world % (tp * tl.pp * tl.cp) or (facts.heads and facts.heads % tp):
        return None
    alt = recipe
    for key, value in (("parallelism.train.tp", tp), ("parallelism.train.sequence_parallel", True),
                       ("parallelism.train.etp", 1)):
        alt = with_value(alt, key, value)
    check = _core_plan(alt, facts, gpu, cal).checks.get("train_late_fit")
    if check is None or check.have_gib is None or check.need_gib is None:
        return None
    margin = check.have_gib - check.need_gib
    return Fix("parallelism.train.tp", tp,
               f"parallelism.train.tp: {tp} with sequence_parallel: true and etp: 1 (then {margin:+.2f} GiB)",
               margin, bool(check.ok), 2)
