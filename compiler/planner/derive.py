"""Derive the calibration constants of an entry from its measurements and the reference layout.

Some constants in ``calibration.yaml`` are a measured figure minus first-principles figures of the
same configuration (e.g. the Megatron residual = "after offload" measured − bf16 params − fp32
master shard of the worst stage). :func:`derive_constants` recomputes them with the planner's own
accounting, so the stored values can be checked (tests/planner/test_calibration_table.py) and refit
when the accounting or the measurements change.
"""
from __future__ import annotations

from typing import Any

from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.calibration import Calibration
from rlc.compiler.planner.layout import generation_layout, train_layout
from rlc.compiler.catalog.gpus import gpu_spec
from rlc.compiler.planner.memory import DTYPE_BYTES, _stage_figures, nvls_items
from rlc.compiler.planner.plan import GIB
from rlc.compiler.planner.shards import megatron_stage_shards, vllm_stage_shards
from rlc.compiler.recipe_types import Recipe


def derive_constants(measured: dict[str, Any], recipe: Recipe, facts: ModelFacts, gpu_memory_gib: float,
                     cal: Calibration) -> dict[str, Any]:
    """Constants implied by ``measured`` on the reference ``recipe`` (GiB).

    ``measured`` keys (all GiB, NeMo-RL #2471 values in the shipped table): ``after_offload`` (Megatron
    allocated after the optimizer offload), ``megatron_process``, ``megatron_allocated``,
    ``megatron_fragmentation`` (the staging-site OOM at ``stack_ratio``), ``vllm_process`` (sleep
    level 1, graphs on), ``vllm_asleep`` (vLLM's residue at sleep level 2 with ``enforce_eager``),
    ``fragmentation`` (ratio -> GiB at the staging site). The process figures include NCCL's NVLS
    buffers of the reference layout; the contexts are stored without them (the planner adds them per
    layout, ``nccl.py``).
    """
    tl, gl = train_layout(recipe), generation_layout(recipe)
    bpp = DTYPE_BYTES[recipe.model.dtype]
    mega, vllm = megatron_stage_shards(facts, tl), vllm_stage_shards(facts, gl)
    if mega is None or vllm is None:
        raise ValueError(f"reference model {facts.model_id}: per-GPU shards need facts it lacks ({facts.unknown})")
    figs = [_stage_figures(s, tl, recipe, bpp) for s in mega]
    worst = max(figs, key=lambda f: f["params_bytes"] + f["master_bytes"])
    resident_fp = (worst["params_bytes"] + worst["master_bytes"]) / GIB
    vllm_weights = max(s.params for s in vllm) * bpp / GIB
    trainer_nvls, vllm_nvls = (sum(i.gib or 0.0 for i in items)
                               for items in nvls_items(recipe, facts, gpu_spec(recipe.cluster.gpu)))
    process_context = measured["megatron_process"] - measured["megatron_allocated"] - measured["megatron_fragmentation"]
    context = process_context - trainer_nvls
    residual = measured["after_offload"] - resident_fp
    vllm_base = measured["vllm_asleep"] - vllm_nvls
    graphs = measured["vllm_process"] - vllm_base - vllm_nvls - vllm_weights
    free = gpu_memory_gib - measured["after_offload"] - process_context - measured["vllm_process"]
    largest_name, largest_bytes = facts.largest_export_tensor(bpp)
    if largest_bytes is None:
        raise ValueError(f"reference model {facts.model_id}: largest export tensor unknown ({largest_name})")
    largest = largest_bytes / GIB
    ratio = measured["stack_ratio"]
    overhead = measured["megatron_allocated"] - measured["after_offload"] - ratio * free - largest
    headroom = {r: (free * r / 2 - largest) / largest for r in measured["fragmentation"]}
    return {
        "megatron_context_gib": context,
        "vllm_base_gib": vllm_base,
        "trainer_nvls_gib": trainer_nvls,
        "vllm_nvls_gib": vllm_nvls,
        "megatron_refit_residual_gib": residual,
        "vllm_cuda_graph_gib": graphs,
        "export_staging_overhead_gib": overhead,
        "fragmentation_headroom": headroom,
        "free_at_refit_gib": free,
        "worst_stage": worst["stage"],
        "vllm_weights_gib": vllm_weights,
    }
