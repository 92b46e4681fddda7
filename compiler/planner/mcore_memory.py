"""The memory plan with ``generation.backend: megatron``: megatron-core's engine inside the trainer's process.

What this backend holds per GPU, phase by phase (the worst pipeline stage), instead of vLLM's pool, sleep
residue and IPC buffer:

* ``train``: the trainer as with vLLM (parameters, gradients, optimizer state, reference policy), plus the KV
  pool with ``generation.megatron.kv_cache: persist`` (megatron-core keeps it through suspend). The dedicated
  inference model's weights are not there: the runtime frees their storage after each rollout and the swap
  writes every parameter and persistent buffer again.
* ``generate``: the trainer as the refit left it (shared: its bf16 parameters are what generates; dedicated:
  less what ``refit.offload_params_for_generation`` moved to host memory), the dedicated model's weights, the
  KV pool (exactly ``generation.kv_cache_memory_bytes``, a fixed pool), the engine's activations for
  ``max_tokens`` tokens and the sampled rows' logits, and its bookkeeping tensors.
* ``refit``: dedicated only, the swap's peak: the trainer after the refit offload plus both weight copies
  (with the trainer's layout every piece is a same-GPU copy, no staging). Shared mode moves no bytes.

The engine runs eager: CUDA graphs are not planned (the bundled runtime does not capture them for this backend).
Host memory: what the refit offload moves (as with vLLM), and the KV pool's backup with ``kv_cache: offload``.
The engine's activation, logits and bookkeeping figures are first-principles estimates until a calibration
run measures them (``tests/gpu/test_mcore_generation.py`` records measured memory per phase next to this plan).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from rlc.compiler.mcore_generation import inference_model, kv_pool
from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.calibration import Calibration
from rlc.compiler.planner.host import host_plan
from rlc.compiler.planner.layout import TrainLayout, generation_layout, train_layout
from rlc.compiler.planner.parts import (DTYPE_BYTES, REFERENCE_LABEL, REFERENCE_NOTE, _layout_dict, _megatron_bytes,
                                        _missing, _stage_figures, grads_note, nvls_items)
from rlc.compiler.planner.plan import Check, Item, MemoryPlan, Phase, gib
from rlc.compiler.planner.residency import PhaseResidency, VllmResident, residency
from rlc.compiler.planner.shards import megatron_stage_shards
from rlc.compiler.planner.vllm_sleep import planned_vllm_version, sleep_semantics
from rlc.compiler.recipe_types import Recipe

OWNER = "megatron-inference"
#: The engine's bookkeeping tensors (request metadata, block tables, sampling buffers): an estimate, small next
#: to the pool; replace with a measured constant once a calibration run records it.
CONTEXT_GIB = 0.25
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
    trainer_nvls, _ = nvls_items(recipe, facts, gpu)
    ctx = [Item("Megatron context (CUDA/NCCL)", cal.megatron_context_gib, "megatron",
                "calibration:megatron_context_gib")] + trainer_nvls
    residual = Item("Megatron residual", cal.megatron_refit_residual_gib, "megatron",
                    "calibration:megatron_refit_residual_gib")

    pool = kv_pool(recipe, facts)
    pool_gib = gib(recipe.generation.kv_cache_memory_bytes)
    pool_item = Item("KV pool (generation.kv_cache_memory_bytes)", pool_gib, OWNER,
                     "recipe:generation.kv_cache_memory_bytes", "megatron-core's fixed pool")
    max_tokens = pool.max_tokens if pool is not None else (m.max_tokens or 16384)
    rows = pool.max_requests if pool is not None else None
    activations = engine_activation_bytes(recipe, facts, max_tokens)
    logits = logits_bytes(recipe, facts, rows) if rows is not None else None
    engine_items = [
        Item("engine activations (one step)", gib(activations), OWNER, "estimate",
             f"{max_tokens} tokens × ({HIDDEN_ACTIVATIONS} × hidden + {MLP_ACTIVATIONS} × MLP width / TP) × dtype; "
             "uncalibrated"),
        Item("logits of the sampled rows", gib(logits), OWNER, "estimate",
             f"{rows} requests × vocabulary / TP × {LOGIT_BYTES} B (model dtype, fp32, log-softmax); uncalibrated"),
        Item("engine bookkeeping", CONTEXT_GIB, OWNER, "estimate", "request metadata, block tables; uncalibrated"),
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
    # ---- train: the trainer's full state; the KV pool only when it persists
    t_where = table["train"].megatron
    worst = max(figs, key=lambda f: sum(_megatron_bytes(f, t_where, cal).values()))
    held = _megatron_bytes(worst, t_where, cal)
    items = [
        Item("Megatron params", gib(held.get("params", 0)), "megatron", "params"),
        Item("Megatron grads", gib(held.get("grads", 0)), "megatron", "params", grads_note(recipe, bpp)),
        Item("optimizer fp32 master", gib(held.get("master", 0)), "megatron", "params"),
        Item("optimizer Adam moments", gib(held.get("moments", 0)), "megatron", "params"),
    ]
    if "reference" in held:
        items.append(Item(REFERENCE_LABEL, gib(held["reference"]), "megatron", "params", REFERENCE_NOTE))
    if t_where.cpu_offload_staging:
        items.append(Item("CPU-offload staging", cal.megatron_cpu_offload_extra_gib, "megatron",
                          "calibration:megatron_cpu_offload_extra_gib"))
    if m.kv_cache == "persist":
        items.append(dataclasses.replace(pool_item, note="kv_cache: persist keeps it on the GPU while training"))
    if dedicated:
        items.append(Item("inference model weights (dedicated)", 0.0, OWNER, "params",
                          "storage freed after each rollout; the swap writes every tensor again"))
    plan.phases["train"] = Phase("train", "train step (before activations)", tuple(items + [residual] + ctx), limit,
                                 stage=worst["stage"], note="activations not modelled")
    t_used = plan.phases["train"].used_gib
    if t_used is not None:
        plan.checks["train_fit"] = Check("train_fit", t_used <= limit, limit, t_used,
                                         f"train step before activations: {t_used:.2f} GiB of {limit:.2f} GiB")
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
    g_items = []
    for key, label in (("params", "Megatron params (bf16)"), ("master", "optimizer fp32 master"),
                       ("grads", "Megatron grads"), ("moments", "optimizer Adam moments"),
                       ("reference", REFERENCE_LABEL)):
        if key in g_held and (g_held[key] or key == "params"):
            note = ("what the engine generates with (shared mode)" if key == "params" and not dedicated else
                    "refit.offload_params_for_generation moved them to host memory" if key == "params"
                    and not g_held[key] else "")
            g_items.append(Item(label, gib(g_held[key]), "megatron", "params", note))
    g_items.append(residual)
    if dedicated:
        g_items.append(Item("inference model weights (dedicated)", gib(inference_weights), OWNER, "params",
                            weights_note))
    g_items += [pool_item] + engine_items + ctx
    plan.phases["generate"] = Phase("generate", "generation (Megatron engine awake)", tuple(g_items), limit,
                                    stage=g_fig["stage"], note="engine figures are estimates")
    g_used = plan.phases["generate"].used_gib
    if g_used is not None:
        plan.checks["mcore_generate_fit"] = Check(
            "mcore_generate_fit", g_used <= limit, limit, g_used,
            f"generation with the Megatron engine needs {g_used:.2f} GiB of {limit:.2f} GiB")
    # ---- refit: the swap's peak (dedicated only)
    if dedicated:
        r_where = table["refit"].megatron
        r_fig = max(figs, key=lambda f: sum(_megatron_bytes(f, r_where, cal).values()))
        r_held = _megatron_bytes(r_fig, r_where, cal)
        r_items = [Item(_label(k), gib(v), "megatron", "params") for k, v in r_held.items() if v]
        if inf is not None and inf.resharded:
            staging = Item("swap staging (upper bound)", gib(inf.staging_bytes), OWNER, "params",
                           f"receive buffers of the pieces other GPUs send ({inf.remote_fraction:.0%} of the shard), "
                           "all posted before the copy runs")
        else:
            staging = Item("swap staging", 0.0, OWNER, "params",
                           "same layout: every piece is a same-GPU copy into the destination")
        r_items += [residual, Item("inference model weights (dedicated)", gib(inference_weights), OWNER, "params",
                                   "allocated again before the swap"), staging]
        if m.kv_cache == "persist":
            r_items.append(pool_item)
        r_items += ctx
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


def _label(key: str) -> str:
    return {"params": "Megatron params (bf16)", "master": "optimizer fp32 master", "grads": "Megatron grads",
            "moments": "optimizer Adam moments", "reference": REFERENCE_LABEL_SHORT}.get(key, key)


REFERENCE_LABEL_SHORT = "reference policy params (bf16)"

__all__ = ["CONTEXT_GIB", "OWNER", "InferenceShard", "engine_activation_bytes", "inference_layout", "inference_shard",
           "logits_bytes", "plan_megatron_generation"]
