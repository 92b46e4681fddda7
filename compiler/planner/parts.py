"""The parts both memory plans are built from: the vLLM backend's (``memory.py``) and megatron-core inference's
(``mcore_memory.py``): Megatron's bytes per pipeline stage, the reference policy's items, NCCL's NVLS buffers, the
layout the plan records."""
from __future__ import annotations

from typing import Any

from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.calibration import Calibration
from rlc.compiler.planner.layout import GenerationLayout, TrainLayout, generation_layout, train_layout
from rlc.compiler.planner.nccl import (generation_communicators, nvls_memory, nvls_settings,
                                       trainer_communicators)
from rlc.compiler.planner.plan import Item, gib
from rlc.compiler.planner.residency import MegatronResident
from rlc.compiler.planner.shards import StageShard
from rlc.compiler.recipe_types import Recipe

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
OPTIMIZER_BYTES = {"master": 4, "moments": 8}  # fp32 master copy; Adam exp_avg + exp_avg_sq
FP32_GRAD_BYTES = 4  # Megatron DDP's main_grad buffers with grad_reduce_in_fp32
#: FP8 training (``training.fp8``): Transformer Engine keeps, between steps, an FP8 copy of every linear layer's
#: weight and one of its transpose (the backward pass multiplies by the transpose), 1 byte each per parameter;
#: measured on an H200 at 0.86 GiB for Qwen3-0.6B's 0.44 B linear parameters (blockwise). With
#: ``training.fp8.param_gather`` the FP8 weights are the parameters themselves and nothing extra is counted.
FP8_TRAIN_WEIGHT_COPY_BYTES = 2
FP8_WEIGHTS_LABEL = "FP8 weight copies (Transformer Engine)"
FP8_WEIGHTS_NOTE = ("training.fp8: an FP8 copy of each linear layer's weight and of its transpose, kept between "
                    "steps, 2 B per linear-layer parameter")


# --------------------------------------------------------------------------- Megatron per stage


def grad_bytes_per_param(recipe: Recipe, bpp: int) -> int:
    """Bytes per parameter of Megatron's gradient buffers: fp32 with ``training.grad_reduce_in_fp32``
    (megatron-core's ``group_params_for_buffers``: ``grad_dtype = torch.float if grad_reduce_in_fp32 else
    param.dtype``), else the parameter dtype's ``bpp``."""
    return FP32_GRAD_BYTES if recipe.training.grad_reduce_in_fp32 else bpp


def grads_note(recipe: Recipe, bpp: int) -> str:
    """How the plan counts the gradient buffers, for the plan's items."""
    per_param = grad_bytes_per_param(recipe, bpp)
    if recipe.training.grad_reduce_in_fp32:
        return f"fp32, {per_param} B/param (training.grad_reduce_in_fp32)"
    return f"{per_param} B/param in the model dtype (training.grad_reduce_in_fp32 off)"


def _stage_figures(shard: StageShard, layout: TrainLayout, recipe: Recipe, bpp: int) -> dict[str, Any]:
    distributed = recipe.training.use_distributed_optimizer
    dense_div = layout.dense_optimizer_shards if distributed else 1
    expert_div = layout.expert_dp if distributed else 1
    sharded = shard.dense / dense_div + shard.expert / expert_div  # optimizer-state elements on this GPU
    return {
        "stage": shard.stage,
        "layers": shard.layers,
        "mtp_blocks": shard.mtp_blocks,
        "vocab_copies": shard.vocab_copies,
        "params": shard.params,
        "params_bytes": shard.params * bpp,
        "grads_bytes": shard.params * grad_bytes_per_param(recipe, bpp),
        "master_bytes": int(sharded * OPTIMIZER_BYTES["master"]),
        "moments_bytes": int(sharded * OPTIMIZER_BYTES["moments"]),
        "fp8_weight_bytes": shard.linear_params * fp8_weight_copy_bytes(recipe),
    }


def fp8_weight_copy_bytes(recipe: Recipe) -> int:
    """Bytes per linear-layer parameter of the trainer's FP8 weight copies: 0 without FP8 training or with
    ``training.fp8.param_gather``."""
    fp8 = recipe.training.fp8
    return FP8_TRAIN_WEIGHT_COPY_BYTES if fp8.enabled and not fp8.param_gather else 0


REFERENCE_LABEL = "reference policy params (bf16)"
REFERENCE_NOTE = ("loss.kl_penalty > 0: the runtime keeps the frozen reference policy on the GPU "
                  "(training.offload_reference_policy moves it to host memory)")
#: The plan's label of each tensor group :func:`_megatron_bytes` returns, in the order the plans list them, and the
#: note a group always carries (the phases add their own to the parameters and the reference policy).
HELD_LABELS = {"params": "Megatron params (bf16)", "master": "optimizer fp32 master", "grads": "Megatron grads",
               "moments": "optimizer Adam moments", "reference": REFERENCE_LABEL, "fp8_weights": FP8_WEIGHTS_LABEL}
HELD_NOTES = {"fp8_weights": FP8_WEIGHTS_NOTE}


def _megatron_bytes(fig: dict[str, Any], where: MegatronResident, cal: Calibration) -> dict[str, int]:
    """Megatron's GPU allocations on one stage in a phase, by item (from the residency table)."""
    items = {"params": int(fig["params_bytes"] * where.params)}
    if where.master:
        items["master"] = int(fig["master_bytes"] * where.master)
    if where.grads:
        items["grads"] = int(fig["grads_bytes"] * where.grads)
    if where.moments:
        items["moments"] = int(fig["moments_bytes"] * where.moments)
    if where.reference:
        items["reference"] = int(fig["params_bytes"] * where.reference)
    if fig["fp8_weight_bytes"]:
        # module state, not parameters: no offload of the trainer's parameters, grads or optimizer moves it
        items["fp8_weights"] = fig["fp8_weight_bytes"]
    return items


# --------------------------------------------------------------------------- NCCL, layout


#: ``Item.source`` of NCCL's NVLS buffers (first principles, ``nccl.py``).
NVLS_SOURCE = "nccl:nvls"


def train_state_items(held: dict[str, int], recipe: Recipe, bpp: int, where: MegatronResident,
                      cal: Calibration) -> list[Item]:
    """The train step's trainer state: params, grads, optimizer master and moments, the resident reference policy
    and the CPU-offload staging (``held``: ``_megatron_bytes`` of one pipeline stage)."""
    items = [
        Item("Megatron params", gib(held.get("params", 0)), "megatron", "params"),
        Item("Megatron grads", gib(held.get("grads", 0)), "megatron", "params", grads_note(recipe, bpp)),
        Item("optimizer fp32 master", gib(held.get("master", 0)), "megatron", "params"),
        Item("optimizer Adam moments", gib(held.get("moments", 0)), "megatron", "params"),
    ]
    if "reference" in held:
        items.append(Item(REFERENCE_LABEL, gib(held["reference"]), "megatron", "params", REFERENCE_NOTE))
    if "fp8_weights" in held:
        items.append(Item(HELD_LABELS["fp8_weights"], gib(held["fp8_weights"]), "megatron", "params",
                          HELD_NOTES["fp8_weights"]))
    if where.cpu_offload_staging:
        items.append(Item("CPU-offload staging", cal.megatron_cpu_offload_extra_gib, "megatron",
                          "calibration:megatron_cpu_offload_extra_gib"))
    return items


def nvls_items(recipe: Recipe, facts: ModelFacts, gpu: Any) -> tuple[list[Item], list[Item]]:
    """NCCL NVLS buffers of the trainer and of vLLM on one GPU, as plan items (none where there are none
    to keep or to save)."""
    settings = nvls_settings(recipe.cluster.env)
    per_node = recipe.cluster.gpus_per_node
    out = []
    trainer = trainer_communicators(train_layout(recipe), per_node, recipe.training.use_distributed_optimizer,
                                    moe=facts.is_moe is not False)
    for owner, comms in (("megatron", trainer),
                         ("vllm", generation_communicators(generation_layout(recipe), per_node))):
        mem = nvls_memory(comms, gpu.arch, gpu.nvlink_multicast, settings)
        label = "NCCL NVLS buffers (" + ("trainer" if owner == "megatron" else "vLLM") + ")"
        out.append([Item(label, gib(mem.bytes), owner, NVLS_SOURCE, mem.note)] if mem.communicators else [])
    return out[0], out[1]


def _layout_dict(tl: TrainLayout, gl: GenerationLayout, moe: bool) -> dict[str, Any]:
    return {
        "world": tl.world,
        "moe": moe,  # expert parallelism means something only for a model with experts
        "train": {"tp": tl.tp, "pp": tl.pp, "cp": tl.cp, "ep": tl.ep, "etp": tl.etp, "vpp": tl.vpp,
                  "dp": tl.dp, "expert_dp": tl.expert_dp, "first": tl.first, "last": tl.last},
        "generation": {"tp": gl.tp, "pp": gl.pp, "ep": gl.ep, "dp": gl.dp, "expert_shards": gl.expert_shards},
    }


def _missing(facts: ModelFacts) -> str:
    return ", ".join(facts.unknown) or "more architecture facts"
