"""The parallel layout a recipe asks for: world size, data-parallel sizes, pipeline stages.

Shared by the memory planner and the layout rules so both see the same stage split. Everything
here is integer arithmetic on the typed recipe and, for the stage split, the
model's layer count; nothing is validated here (the RLC1xx rules do that), so a layout that does
not divide evenly still gets a best-effort split (floors, remainder to the first stages).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlc.compiler.recipe_types import Recipe


@dataclass(frozen=True)
class TrainLayout:
    """Megatron-core parallelism of the trainer."""

    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    vpp: int
    first: Optional[int]  # num_layers_in_first_pipeline_stage
    last: Optional[int]  # num_layers_in_last_pipeline_stage
    sequence_parallel: bool

    @property
    def dp(self) -> int:
        """Data-parallel size: world / (TP × PP × CP) (floored if it does not divide)."""
        return max(1, self.world // (self.tp * self.pp * self.cp))

    @property
    def dense_optimizer_shards(self) -> int:
        """Ranks the distributed optimizer shards a dense parameter over (DP × CP)."""
        return max(1, self.world // (self.tp * self.pp))

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: world / (EP × ETP × PP)."""
        return max(1, self.world // (self.ep * self.etp * self.pp))

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Decoder layers on each pipeline stage, honouring first/last-stage overrides."""
        pp = self.pp
        if pp == 1:
            return [num_layers]
        counts: list[Optional[int]] = [None] * pp
        rest, free = num_layers, pp
        # An override larger than the layers left is taken as what is left (RLC104 reports it): the
        # split never names a layer the model does not have.
        if self.first is not None:
            first = counts[0] = min(max(self.first, 0), rest)
            rest -= first
            free -= 1
        if self.last is not None:
            last = counts[-1] = min(max(self.last, 0), rest)
            rest -= last
            free -= 1
        if free:
            base, extra = divmod(max(rest, 0), free)
            middle = [base + (1 if i < extra else 0) for i in range(free)]
            it = iter(middle)
            counts = [c if c is not None else next(it) for c in counts]
        return [int(c or 0) for c in counts]

    def stage_layers(self, num_layers: int) -> list[list[int]]:
        """Global layer indices held by each pipeline stage (virtual stages interleaved).

        With ``vpp`` virtual stages, stage ``s`` holds model chunks ``s, s + pp, s + 2pp, ...``;
        each stage's layers are split evenly over its chunks (Megatron requires divisibility).
        """
        counts = self.stage_layer_counts(num_layers)
        v = max(1, self.vpp)
        # Only the chunks that hold layers (at most one per layer), in model order (chunk k of every
        # stage, then k + 1): never PP × VPP entries, which a recipe can make billions of.
        chunks: list[tuple[int, int, int]] = []  # (chunk, stage, layers)
        for s, n in enumerate(counts):
            base, extra = divmod(n, v)
            for k in range(min(v, n)):
                chunks.append((k, s, base + (1 if k < extra else 0)))
        chunks.sort()
        out: list[list[int]] = [[] for _ in counts]
        index = 0
        for _k, s, n in chunks:
            out[s].extend(range(index, index + n))
            index += n
        return out


@dataclass(frozen=True)
class GenerationLayout:
    """vLLM parallelism. ``ep`` is the expert-sharding degree across TP × (EP / TP) ranks."""

    world: int
    tp: int
    pp: int
    ep: int
    dp: int  # engines (recipe value, or world / (tp × pp))

    @property
    def expert_shards(self) -> int:
        """How many GPUs split each layer's routed experts: EP when on, else TP (experts TP-sharded)."""
        return self.ep if self.ep > 1 else self.tp

    @property
    def attention_dp(self) -> int:
        """Data-parallel attention replicas inside one EP group (EP / TP)."""
        return max(1, self.ep // self.tp) if self.ep > 1 else 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def stage_layers(self, num_layers: int) -> list[list[int]]:
        """vLLM's even pipeline split (remainder to the first stages)."""
        base, extra = divmod(num_layers, self.pp)
        out, index = [], 0
        for s in range(self.pp):
            n = base + (1 if s < extra else 0)
            out.append(list(range(index, index + n)))
            index += n
        return out


def world_size(recipe: Recipe) -> int:
    return recipe.cluster.world_size


def train_layout(recipe: Recipe) -> TrainLayout:
    t = recipe.parallelism.train
    return TrainLayout(
        world=world_size(recipe), tp=t.tp, pp=t.pp, cp=t.cp, ep=t.ep, etp=t.etp, vpp=t.vpp,
        first=t.num_layers_in_first_pipeline_stage, last=t.num_layers_in_last_pipeline_stage,
        sequence_parallel=t.sequence_parallel,
    )


def generation_layout(recipe: Recipe) -> GenerationLayout:
    """vLLM's layout; ``parallelism.generation.dp`` unset means world / (TP × PP) engines."""
    g = recipe.parallelism.generation
    world = world_size(recipe)
    dp = g.dp if g.dp is not None else max(1, world // (g.tp * g.pp))
    return GenerationLayout(world=world, tp=g.tp, pp=g.pp, ep=g.ep, dp=dp)
