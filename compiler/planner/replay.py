"""Memory of routing replay (``training.router_replay``): the routes every rollout token carries.

The rollout batch holds ``routed_experts [N, L-1, M, K]`` (``rlc.runtime.policy.routes``): M MoE layers × K experts
per token, 1 byte per id with up to 256 experts, else 2. On the host the driver keeps the step's per-sample
routes and the packed batch until the next step replaces them (2 copies in every phase); while the trainer's
passes run, Ray's object store holds one more and every trainer process deserializes the whole batch before taking
its data-parallel shard: ``gpus_per_node + 3`` copies on the node that holds the driver (the worst) then.

On the GPU each micro batch's routes become int64 indices (megatron-core's ``RouterReplay`` gathers with them):
``micro_batch_size × L`` tokens (packed: the micro batch's token budget ÷ CP) ``× M_stage × K × 8`` bytes (÷ TP
with sequence parallelism), next to the 1-byte copy they came from. With recompute
(``activation_checkpointing: full``) the replay keeps every micro batch in flight until its backward pass
re-routes it: up to PP of them under 1F1B; otherwise only the current one.

vLLM's own share is not counted: a pinned buffer of ``max_num_batched_tokens × decoder layers × K`` int32 on
each GPU (megabytes) and, in the engine's process, one byte per KV-cache slot × decoder layers × K.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.layout import TrainLayout
from rlc.compiler.planner.plan import GIB, Item
from rlc.compiler.recipe_types import Recipe

INDEX_BYTES = 8  # int64 indices of torch.gather


def id_bytes(num_experts: int) -> int:
    """Bytes of one expert id in the rollout batch (uint8 up to 256 experts, else int16)."""
    return 1 if num_experts <= 256 else 2


@dataclass(frozen=True)
class ReplayMemory:
    """The routes' bytes: the rollout batch (one copy) and one GPU's micro batches in flight."""

    batch_bytes: int
    gpu_bytes: int
    moe_layers: int
    stage_moe_layers: int
    topk: int
    in_flight: int
    mb_tokens: str  # how a micro batch's tokens were counted


def replay_memory(recipe: Recipe, facts: ModelFacts, stage_layers: int, tl: TrainLayout,
                  mb_tokens: tuple[int, str]) -> Optional[ReplayMemory]:
    """``None`` without routing replay or when the model facts lack the expert count, top-k or layers.
    ``stage_layers``: decoder layers on the worst pipeline stage; ``mb_tokens``: the tokens of one train micro
    batch on one GPU and how they were counted (``memory.train_microbatch_tokens``)."""
    if not recipe.training.router_replay.enabled or not facts.num_experts or not facts.experts_per_tok:
        return None
    moe = facts.moe_layer_indices()
    layers = len(moe) if moe is not None else facts.num_layers
    if layers is None:
        return None
    k, seq = facts.experts_per_tok, recipe.max_sequence_length
    stage = min(layers, stage_layers)
    in_flight = tl.pp if recipe.training.activation_checkpointing == "full" else 1
    sp = tl.tp if tl.sequence_parallel and tl.tp > 1 else 1  # each TP rank routes its share of the sequence
    per_token = id_bytes(facts.num_experts)
    batch = recipe.grpo.samples_per_step * seq * layers * k * per_token
    tokens, how = mb_tokens
    mb = tokens * stage * k // sp
    return ReplayMemory(batch_bytes=batch, gpu_bytes=mb * (INDEX_BYTES * in_flight + per_token), moe_layers=layers,
                        stage_moe_layers=stage, topk=k, in_flight=in_flight, mb_tokens=how)


def gpu_item(mem: ReplayMemory, recipe: Recipe) -> Item:
    return Item("routing replay indices", mem.gpu_bytes / GIB, "megatron", "params",
                f"{mem.mb_tokens} × {mem.stage_moe_layers} "
                f"MoE layers × {mem.topk} experts × int64, {mem.in_flight} micro batch(es) in flight "
                "(training.router_replay)")


def host_items(mem: ReplayMemory, recipe: Recipe, phases: Iterable[str]) -> dict[str, list[Item]]:
    """Per phase, the routes on the node that holds the driver: the driver's two copies (the step's per-sample
    routes and the packed batch, kept until the next step replaces them) in every phase, and in ``train`` also
    the object store's copy and each trainer process's."""
    out = {}
    for phase in phases:
        copies = 2 + (recipe.cluster.gpus_per_node + 1 if phase == "train" else 0)
        where = "driver, object store, each trainer process" if phase == "train" else "the driver's rollouts and batch"
        out[phase] = [Item("routing replay routes (rollout batch)", mem.batch_bytes * copies / GIB, "host", "params",
                           f"{recipe.grpo.samples_per_step} rollouts × {recipe.max_sequence_length} tokens × "
                           f"{mem.moe_layers} MoE layers × {mem.topk} experts: {mem.batch_bytes / GIB:.2f} GiB × "
                           f"{copies} copies ({where})")]
    return out


__all__ = ["ReplayMemory", "gpu_item", "host_items", "id_bytes", "replay_memory"]
