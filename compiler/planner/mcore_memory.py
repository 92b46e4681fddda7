"""The memory plan with ``generation.backend: megatron``: megatron-core's engine inside the trainer's process.

What this backend holds per GPU, phase by phase (the worst pipeline stage), instead of vLLM's pool, sleep
residue and IPC buffer:

* every phase: the trainer's process context and residual (``megatron_context_gib``, ``megatron_refit_residual_gib``)
  and what the engine adds to the process beyond its KV pool, weights and activations
  (``megatron_engine_context_gib``: the inference path's CUDA modules, the dedicated model's communicators and
  its buffers the swap does not write; measured, not modelled). Suspending the engine frees the KV pool only.
* ``train``: the trainer as with vLLM (parameters, gradients, optimizer state, reference policy), plus the KV
  pool with ``generation.megatron.kv_cache: persist`` (megatron-core keeps it through suspend), the step's saved
  activations of one micro batch (``passes.train_activations``, an estimate), the loss's fp32 logits and what the
  allocator still holds of the step's workspaces (``megatron_train_workspace_gib``). The dedicated inference
  model's weights are not there: the runtime frees their storage after each rollout and the swap writes every
  parameter and persistent buffer again.
* ``logprob``: the trainer as the refit left it with its bf16 parameters back and the reference policy's, the
  engine suspended, and the fp32 logits of one logprob micro batch (as with vLLM).
* ``generate``: the trainer as the refit left it (shared: its bf16 parameters are what generates; dedicated:
  less what ``refit.offload_params_for_generation`` moved to host memory), the dedicated model's weights, the
  KV pool (exactly ``generation.kv_cache_memory_bytes``, a fixed pool), the engine's activations for
  ``max_tokens`` tokens and the sampled rows' logits, and its bookkeeping tensors (megatron-core's layout).
* ``refit``: dedicated only, the swap's peak: the trainer after the refit offload plus both weight copies
  (with the trainer's layout every piece is a same-GPU copy, no staging). Shared mode moves no bytes.

The engine runs eager: CUDA graphs are not planned (the bundled runtime does not capture them for this backend).
Host memory: what the refit offload moves (as with vLLM), and the KV pool's backup with ``kv_cache: offload``.
The engine's activation and logits figures are first-principles estimates; the two calibrated constants come
from ``tests/gpu/test_mcore_generation.py --case dedicated`` (``mcore_fit.py`` derives them from its record).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from rlc.compiler.mcore_generation import KvPool, inference_model, kv_pool, speculative_tokens
from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.calibration import Calibration
from rlc.compiler.planner.host import host_plan
from rlc.compiler.planner.layout import TrainLayout, generation_layout, train_layout
from rlc.compiler.planner.parts import (DTYPE_BYTES, HELD_LABELS, HELD_NOTES, REFERENCE_LABEL, _layout_dict,
                                        _megatron_bytes, _missing, _stage_figures, nvls_items, train_state_items)
from rlc.compiler.planner.passes import (LOSS_LOGITS_LABEL, forward_working_set, logits_bytes as token_logits_bytes,
                                         logits_note, last_stage_loss, logprob_fix, logprob_microbatch_tokens,
                                         train_activations)
from rlc.compiler.planner.plan import Check, Item, MemoryPlan, Phase, gib
from rlc.compiler.planner.residency import PhaseResidency, VllmResident, residency
from rlc.compiler.planner.shards import megatron_stage_shards
from rlc.compiler.planner.vllm_sleep import planned_vllm_version, sleep_semantics
from rlc.compiler.recipe_types import Recipe

OWNER = "megatron-inference"
ENGINE_CONTEXT_LABEL = "Megatron inference engine (process)"
SAVED_ACTIVATIONS_LABEL = "saved activations (one micro batch)"
#: Working set per token of one eager forward step, in hidden-sized activations (residual stream, norm, QKV,
#: attention output, projections) plus the MLP's intermediate activations counted apart.
HIDDEN_ACTIVATIONS = 6
MLP_ACTIVATIONS = 3
#: Logits of the sampled rows: the model's output (model dtype), its fp32 copy and the log-softmax (fp32).
LOGIT_BYTES = 2 + 4 + 4


def _no_vllm(table: dict[str, PhaseResidency]) -> dict[str, PhaseResidency]:
    """The residency table with nothing of vLLM anywhere (no engine of its own, no host copy)."""
    none = VllmResident(False, "generation.backend megatron: no vLLM engine")
    return {name: dataclasses.replace(p, vllm=none, host=dataclasses.replace(p.host, vllm_weights=0.0))
            for name, p in table.items()}


def engine_activation_bytes(recipe: Recipe, facts: ModelFacts, max_tokens: int) -> Optional[int]:
    """One eager forward step of ``max_tokens`` tokens: hidden-sized and MLP activations (model dtype)."""
    if facts.hidden is None:
        return None
    ffn = facts.dense_intermediate or 0
    if facts.num_experts:
        ffn = max(ffn, (facts.experts_per_tok or 1) * (facts.moe_intermediate or 0))
    tp = recipe.parallelism.generation.tp
    bpp = 2 if recipe.model.dtype != "float32" else 4
    return max_tokens * (HIDDEN_ACTIVATIONS * facts.hidden + MLP_ACTIVATIONS * ffn // tp) * bpp


def logits_bytes(recipe: Recipe, facts: ModelFacts, rows: int) -> Optional[int]:
    """Logits of the rows sampled in one step (last token of each request; vocabulary split over TP)."""
    if facts.vocab is None:
        return None
    return rows * facts.vocab * LOGIT_BYTES // recipe.parallelism.generation.tp


#: megatron-core 0.19's per-step bookkeeping on the GPU, bytes (``DynamicInferenceContext.initialize_all_tensors``,
#: ``ContextGPUView``, ``TextGenerationController._init_dynamic_sampling_tensors``; the rest of its bookkeeping is
#: pinned host memory): per token of ``max_tokens`` three int64 and three int32 fields; per request of
#: ``max_requests`` seven 4-byte request fields, the flash-attention metadata (query and KV lengths and their
#: cumulative sums: four int32), the active logit indices and their identity (two int32 per logit row), the sampled
#: tokens (int64); per request and KV block of a full-length request the block table (int32). Allocated when the
#: engine resumes and freed when it suspends (``kv_cache: recompute``).
BOOKKEEPING_TOKEN_BYTES = 3 * 8 + 3 * 4
BOOKKEEPING_REQUEST_BYTES = 7 * 4 + 4 * 4 + 8
BOOKKEEPING_LOGIT_ROW_BYTES = 2 * 4
BOOKKEEPING_BLOCK_BYTES = 4
#: with MTP speculative decoding: per request and speculative token the sampled and accepted tokens (int64 each),
#: per request the accepted counts, the last accepted indices and the MTP token and position ids (int64 each), per
#: token the MTP row indices (int64)
SPECULATIVE_REQUEST_BYTES = 2 * 8
SPECULATIVE_FIXED_REQUEST_BYTES = 4 * 8
SPECULATIVE_TOKEN_BYTES = 8


def bookkeeping_bytes(pool: KvPool, speculative: int) -> int:
    """The engine's bookkeeping tensors on the GPU while it is awake (see :data:`BOOKKEEPING_TOKEN_BYTES`)."""
    rows = pool.max_requests * (speculative + 1)
    blocks = pool.max_requests * pool.blocks_per_request
    total = (BOOKKEEPING_TOKEN_BYTES * pool.max_tokens + BOOKKEEPING_REQUEST_BYTES * pool.max_requests
             + BOOKKEEPING_LOGIT_ROW_BYTES * rows + BOOKKEEPING_BLOCK_BYTES * blocks)
    if speculative:
        total += (SPECULATIVE_REQUEST_BYTES * speculative * pool.max_requests
                  + SPECULATIVE_FIXED_REQUEST_BYTES * pool.max_requests + SPECULATIVE_TOKEN_BYTES * pool.max_tokens)
    return total


@dataclass(frozen=True)
class InferenceShard:
    """The dedicated inference model on one GPU (its worst pipeline stage) in the inference layout."""

    layout: str
    params_bytes: int
    resharded: bool
    #: the share of the shard's bytes that other GPUs send at a swap (0 with the trainer's layout)
    remote_fraction: float

    @property
    def staging_bytes(self) -> int:
        return int(self.params_bytes * self.remote_fraction)


def inference_layout(recipe: Recipe) -> TrainLayout:
    """``parallelism.generation`` as a Megatron layout: no context or virtual pipeline parallelism, no sequence
    parallelism; expert TP is the trainer's with the trainer's layout, else the inference TP (megatron-core's
    default; the runtime's ``rlc.runtime.generation.megatron_engine.inference_expert_tp``)."""
    tl, g = train_layout(recipe), recipe.parallelism.generation
    same = (g.tp, g.pp, g.ep) == (tl.tp, tl.pp, tl.ep) and tl.cp == 1
    return dataclasses.replace(tl, tp=g.tp, pp=g.pp, ep=g.ep, cp=1, vpp=1, etp=tl.etp if same else g.tp,
                               first=tl.first if same else None, last=tl.last if same else None,
                               sequence_parallel=tl.sequence_parallel and g.tp > 1)


def inference_shard(recipe: Recipe, facts: ModelFacts, bpp: int) -> Optional[InferenceShard]:
    """The inference model's weights per GPU in its own layout, and how much of them a swap receives from
    other GPUs (each dense piece split ``train TP / inference TP`` ways, each expert ``train EP / inference
    EP`` ways: the GPU's own trainer holds one of those pieces); None when model facts are missing."""
    tl, il = train_layout(recipe), inference_layout(recipe)
    shards = megatron_stage_shards(facts, il)
    if shards is None:
        return None
    params = max(s.params for s in shards) * bpp
    resharded = (il.tp, il.pp, il.ep) != (tl.tp, tl.pp, tl.ep) or tl.cp > 1
    local = min(1.0, (il.tp / tl.tp) * (il.ep / tl.ep) * (il.pp / tl.pp)) if resharded else 1.0
    return InferenceShard(f"TP{il.tp} PP{il.pp} EP{il.ep}", params, resharded, 1.0 - local)


def process_items(recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration) -> list[Item]:
    """What the trainer's process holds in every phase besides tensors the plan counts: its CUDA/NCCL context and
    NVLS buffers, its residual after the first step, and what megatron-core's engine adds to the process."""
    trainer_nvls, _ = nvls_items(recipe, facts, gpu)
    return [
        Item("Megatron context (CUDA/NCCL)", cal.megatron_context_gib, "megatron",
             "calibration:megatron_context_gib"),
        *trainer_nvls,
        Item("Megatron residual", cal.megatron_refit_residual_gib, "megatron",
             "calibration:megatron_refit_residual_gib"),
        Item(ENGINE_CONTEXT_LABEL, cal.megatron_engine_context_gib, OWNER, "calibration:megatron_engine_context_gib",
             "the inference path's CUDA modules and, fitted in dedicated mode, the dedicated model's communicators "
             "and unswapped buffers; suspending the engine frees only its KV pool"),
    ]


def _held_items(held: dict[str, int], generating: bool, dedicated: bool) -> list[Item]:
    """The trainer's tensors on the GPU, by item (``parts._megatron_bytes``)."""
    items = []
    for key, label in HELD_LABELS.items():
        if key in held and (held[key] or key == "params"):
            note = ("what the engine generates with (shared mode)" if generating and key == "params" and not dedicated
                    else "refit.offload_params_for_generation moved them to host memory" if key == "params"
                    and not held[key] else HELD_NOTES.get(key, ""))
            items.append(Item(label, gib(held[key]), "megatron", "params", note))
    return items


def suspended_items(recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration, fig: dict[str, Any],
                    table: dict[str, PhaseResidency], phase: str = "refit") -> list[Item]:
    """The GPU with the engine suspended (its KV pool freed unless it persists, the dedicated weights freed) and
    the trainer as ``phase`` of the residency table has it: the state ``memory/refit_offload`` and
    ``memory/after_sleep`` measure (``phase`` refit), and the logprob pass before its logits (``phase`` logprob)."""
    items = _held_items(_megatron_bytes(fig, table[phase].megatron, cal), False, True)
    if recipe.generation.megatron.kv_cache == "persist":
        items.append(_pool_item(recipe, "kv_cache: persist keeps it on the GPU while the engine is suspended"))
    return items + process_items(recipe, facts, gpu, cal)


def _pool_item(recipe: Recipe, note: str = "megatron-core's fixed pool") -> Item:
    return Item("KV pool (generation.kv_cache_memory_bytes)", gib(recipe.generation.kv_cache_memory_bytes), OWNER,
                "recipe:generation.kv_cache_memory_bytes", note)


def plan_megatron_generation(recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration) -> MemoryPlan:
    """The memory plan of a recipe with ``generation.backend: megatron`` (see the module docstring)."""
    tl, gl = train_layout(recipe), generation_layout(recipe)
    bpp = DTYPE_BYTES[recipe.model.dtype]
    limit = float(gpu.memory_gib)
    model = inference_model(recipe)
    dedicated = model.mode == "dedicated"
    m = recipe.generation.megatron
    plan = MemoryPlan(model_id=facts.model_id, gpu=gpu.name, gpu_memory_gib=limit, calibration_id=cal.id,
                      graph_uncertainty_gib=0.0, layout=_layout_dict(tl, gl, facts.is_moe is not False),
                      backend="megatron")
    if cal.fallback_note:
        plan.notes.append(cal.fallback_note)
    plan.notes.append(f"generation.backend megatron ({model.mode} mode, {model.transformer_impl}): the engine runs "
                      "eager inside each trainer process; CUDA graphs are not planned")
    mega = megatron_stage_shards(facts, tl)
    if mega is None:
        plan.unknown.append("Megatron per-GPU shards: needs " + _missing(facts))
    figs = [_stage_figures(s, tl, recipe, bpp) for s in mega] if mega else []
    plan.stages = figs
    table = _no_vllm(residency(recipe, sleep_semantics(planned_vllm_version(recipe, cal.versions)), cal))
    plan.residency = table
    process = process_items(recipe, facts, gpu, cal)

    pool = kv_pool(recipe, facts)
    pool_gib = gib(recipe.generation.kv_cache_memory_bytes)
    pool_item = _pool_item(recipe)
    max_tokens = pool.max_tokens if pool is not None else (m.max_tokens or 16384)
    rows = pool.max_requests if pool is not None else None
    activations = engine_activation_bytes(recipe, facts, max_tokens)
    logits = logits_bytes(recipe, facts, rows) if rows is not None else None
    spec = speculative_tokens(recipe)
    engine_items = [
        Item("engine activations (one step)", gib(activations), OWNER, "estimate",
             f"{max_tokens} tokens × ({HIDDEN_ACTIVATIONS} × hidden + {MLP_ACTIVATIONS} × MLP width / TP) × dtype"),
        Item("logits of the sampled rows", gib(logits), OWNER, "estimate",
             f"{rows} requests × vocabulary / TP × {LOGIT_BYTES} B (model dtype, fp32, log-softmax)"),
        Item("engine bookkeeping", gib(bookkeeping_bytes(pool, spec)) if pool is not None else None, OWNER,
             "megatron-core",
             f"{BOOKKEEPING_TOKEN_BYTES} B × {max_tokens} tokens + "
             f"{BOOKKEEPING_REQUEST_BYTES + BOOKKEEPING_LOGIT_ROW_BYTES} B × {rows} requests + block table "
             "(megatron-core's context layout)"),
    ]
    plan.mcore = {
        "mode": model.mode, "transformer_impl": model.transformer_impl, "kv_cache": m.kv_cache,
        "weight_sync": "swap_model_weights" if dedicated else "none (shared)",
        "kv_pool": None if pool is None else {
            "bytes": pool.pool_bytes, "block_bytes": pool.block_bytes, "block_tokens": pool.block_tokens,
            "blocks": pool.blocks, "blocks_per_request": pool.blocks_per_request,
            "full_requests": pool.full_requests, "max_requests": pool.max_requests, "max_tokens": pool.max_tokens},
    }
    if not figs:
        return plan
    _train_phase(plan, recipe, facts, tl, figs, table, cal, bpp, process)
    _logprob_phase(plan, recipe, facts, gpu, tl, figs, table, cal)
    # ---- generate: the trainer as the refit left it + the engine
    g_where = table["generate"].megatron
    g_fig = max(figs, key=lambda f: sum(_megatron_bytes(f, g_where, cal).values()))
    g_held = _megatron_bytes(g_fig, g_where, cal)
    inf = inference_shard(recipe, facts, bpp)
    inference_weights = inf.params_bytes if inf is not None else g_fig["params_bytes"]
    if dedicated and inf is not None:
        plan.mcore["inference_model"] = {"layout": inf.layout, "resharded": inf.resharded,
                                         "weights_bytes": inf.params_bytes, "swap_staging_bytes": inf.staging_bytes}
    weights_note = (f"the inference layout's shard ({inf.layout})" if inf is not None and inf.resharded
                    else "the inference layout's shard (the trainer's layout)")
    g_items = _held_items(g_held, True, dedicated)
    if dedicated:
        g_items.append(Item("inference model weights (dedicated)", gib(inference_weights), OWNER, "params",
                            weights_note))
    g_items += [pool_item] + engine_items + process
    plan.phases["generate"] = Phase("generate", "generation (Megatron engine awake)", tuple(g_items), limit,
                                    stage=g_fig["stage"], note="engine activations and logits are estimates")
    g_used = plan.phases["generate"].used_gib
    if g_used is not None:
        plan.checks["mcore_generate_fit"] = Check(
            "mcore_generate_fit", g_used <= limit, limit, g_used,
            f"generation with the Megatron engine needs {g_used:.2f} GiB of {limit:.2f} GiB")
    # ---- refit: the swap's peak (dedicated only)
    if dedicated:
        r_where = table["refit"].megatron
        r_fig = max(figs, key=lambda f: sum(_megatron_bytes(f, r_where, cal).values()))
        if inf is not None and inf.resharded:
            staging = Item("swap staging (upper bound)", gib(inf.staging_bytes), OWNER, "params",
                           f"receive buffers of the pieces other GPUs send ({inf.remote_fraction:.0%} of the shard), "
                           "all posted before the copy runs")
        else:
            staging = Item("swap staging", 0.0, OWNER, "params",
                           "same layout: every piece is a same-GPU copy into the destination")
        r_items = suspended_items(recipe, facts, gpu, cal, r_fig, table) + [
            Item("inference model weights (dedicated)", gib(inference_weights), OWNER, "params",
                 "allocated again before the swap"), staging]
        plan.phases["refit"] = Phase("refit", "refit (swap_model_weights into the inference model)", tuple(r_items),
                                     limit, stage=r_fig["stage"])
        r_used = plan.phases["refit"].used_gib
        if r_used is not None:
            plan.checks["mcore_swap_fit"] = Check("mcore_swap_fit", r_used <= limit, limit, r_used,
                                                  f"the swap needs {r_used:.2f} GiB of {limit:.2f} GiB")
    else:
        plan.notes.append("shared mode: the refit moves no weights (the engine reads the trainer's parameters); "
                          "it syncs them and offloads the optimizer as refit.offload_optimizer_for_refit says")
    # ---- host memory (per node): the refit offload, the KV backup with kv_cache: offload
    host = host_plan(recipe, figs, None, None, table, gpu)
    if m.kv_cache == "offload" and pool_gib is not None:
        per_node = recipe.cluster.gpus_per_node
        host = dataclasses.replace(host, items=host.items + (
            Item("KV pool backup (kv_cache: offload)", pool_gib * per_node, OWNER,
                 "recipe:generation.kv_cache_memory_bytes", f"× {per_node} GPUs"),))
    plan.host = host
    return plan


def _train_phase(plan: MemoryPlan, recipe: Recipe, facts: ModelFacts, tl: TrainLayout, figs: list[dict[str, Any]],
                 table: dict[str, PhaseResidency], cal: Calibration, bpp: int, process: list[Item]) -> None:
    """``train``: the trainer's full state, the step's saved activations and the loss's logits on the stage that
    holds the most, the allocator's workspaces, the KV pool only when it persists."""
    where = table["train"].megatron
    last, loss = last_stage_loss(recipe, facts, tl, figs)

    def stage_items(f: dict[str, Any]) -> list[Item]:
        held = _megatron_bytes(f, where, cal)
        items = train_state_items(held, recipe, bpp, where, cal)
        saved = train_activations(recipe, facts, tl, f["stage"], f["mtp_blocks"])
        items.append(Item(SAVED_ACTIVATIONS_LABEL, gib(None if saved is None else saved.bytes),
                          "megatron", "estimate", "" if saved is None else saved.note))
        if f["stage"] == last:  # an unknown vocabulary leaves the step's total unknown
            items.append(loss or Item(LOSS_LOGITS_LABEL, None, "megatron", "params"))
        return items

    def total(f: dict[str, Any]) -> float:
        return sum(i.gib or 0.0 for i in stage_items(f))

    worst = max(figs, key=total)
    items = stage_items(worst) + [
        Item("train step workspaces", cal.megatron_train_workspace_gib, "megatron",
             "calibration:megatron_train_workspace_gib",
             "what the allocator still holds of the step beyond its activations (first step: library workspaces)")]
    if recipe.generation.megatron.kv_cache == "persist":
        items.append(_pool_item(recipe, "kv_cache: persist keeps it on the GPU while training"))
    if inference_model(recipe).mode == "dedicated":
        items.append(Item("inference model weights (dedicated)", 0.0, OWNER, "params",
                          "storage freed after each rollout; the swap writes every tensor again"))
    plan.phases["train"] = Phase("train", "train step (one micro batch's activations)", tuple(items + process),
                                 plan.gpu_memory_gib, stage=worst["stage"],
                                 note="activations and logits of one micro batch are estimates")
    used, limit = plan.phases["train"].used_gib, plan.gpu_memory_gib
    if used is None:
        return
    # the saved activations are an estimate (an upper bound): the train step errs without them, warns with them
    saved = next(i.gib or 0.0 for i in items if i.label == SAVED_ACTIVATIONS_LABEL)
    certain = used - saved
    plan.checks["train_fit"] = Check("train_fit", certain <= limit, limit, certain,
                                     f"train step before its saved activations: {certain:.2f} GiB of {limit:.2f} GiB")
    plan.checks["train_activations_fit"] = Check(
        "train_activations_fit", used <= limit, limit, used,
        f"train step with one micro batch's saved activations ({saved:.2f} GiB, an estimate): {used:.2f} GiB of "
        f"{limit:.2f} GiB")


def _logprob_phase(plan: MemoryPlan, recipe: Recipe, facts: ModelFacts, gpu: Any, tl: TrainLayout,
                   figs: list[dict[str, Any]], table: dict[str, PhaseResidency], cal: Calibration) -> None:
    """``logprob``: the engine suspended, the trainer as the refit left it with its bf16 parameters back, the
    reference policy on the GPU for its pass, one layer's activations of one logprob micro batch at a time and its
    fp32 logits on the last stage (the reference pass, the worse of the two, where there is a reference)."""
    if facts.vocab is None:
        return
    tokens, how = logprob_microbatch_tokens(recipe, tl)
    logits = token_logits_bytes(tokens, facts.vocab, tl.tp)
    last = max(f["stage"] for f in figs)

    def stage_items(f: dict[str, Any]) -> list[Item]:
        items = suspended_items(recipe, facts, gpu, cal, f, table, "logprob")
        layer = forward_working_set(recipe, facts, tl, f["stage"], tokens)
        items.append(Item("forward working set (one layer)", gib(layer), "megatron", "estimate",
                          f"one layer's activations of {how} at a time (as the train step counts a layer)"))
        if f["stage"] == last:
            items.append(Item("fp32 logits of the logprob pass", gib(logits), "megatron", "params",
                              logits_note(how, facts.vocab or 0, tl.tp)))
        return items

    worst = max(figs, key=lambda f: sum(i.gib or 0.0 for i in stage_items(f)))
    items = stage_items(worst)
    reference = any(i.label == REFERENCE_LABEL for i in items)
    title = "reference logprob pass (engine suspended)" if reference else "logprob pass (engine suspended)"
    limit = plan.gpu_memory_gib
    phase = Phase("logprob", title, tuple(items), limit, stage=worst["stage"],
                  note="the forward working set is an estimate")
    plan.phases["logprob"] = phase
    used = phase.used_gib
    if used is None:
        return
    plan.checks["logprob_fit"] = Check("logprob_fit", used <= limit, limit, used,
                                       f"{title}: {used:.2f} GiB of {limit:.2f} GiB, of which {gib(logits):.2f} GiB "
                                       f"fp32 logits of {how}")
    if used > limit and worst["stage"] == last:
        plan.logprob_fix = logprob_fix(used, limit, logits, recipe, tl)


__all__ = ["BOOKKEEPING_TOKEN_BYTES", "ENGINE_CONTEXT_LABEL", "OWNER", "SAVED_ACTIVATIONS_LABEL", "InferenceShard",
           "bookkeeping_bytes", "engine_activation_bytes", "inference_layout", "inference_shard", "logits_bytes",
           "plan_megatron_generation", "process_items", "suspended_items"]
