"""Where each slice of the model lives in the trainer's grid and in the dedicated inference model's grid
(``generation.backend: megatron``, dedicated mode, an inference layout other than the trainer's).

Pure Python (no torch): the rank arithmetic megatron-core's groups follow, stated once so that the bundled
runtime's checks and the CPU tests read the same rules.

* Grids. The trainer's groups come from ``parallel_state.initialize_model_parallel`` and the inference model's
  from ``megatron.core.inference.shards.build_inference_pg_collection``; with one pipeline stage and no context
  parallelism both order the dense grid tensor-parallel fastest, then data-parallel (``tp-cp-dp-pp``), and the
  expert grid expert-TP fastest, then expert-parallel, then expert-data-parallel (``tp-ep-dp-pp``).
* Tensor-parallel slices. A parameter split over ``world`` ranks along its ``partition_dim`` with
  ``partition_stride`` ``s`` (2 for a gated MLP's ``linear_fc1``: each rank holds its part of the gate, then its
  part of the up projection) is ``world * s`` equal segments of the full tensor; rank ``r`` holds segments
  ``r, r + world, ..., r + (s - 1) * world`` in that order (megatron-core's ``_emit_lcm_block_ops``).
* Experts. Expert parallelism gives EP rank ``e`` the ``num_experts / ep`` experts from ``e * num_experts / ep``;
  a grouped-GEMM expert tensor ``weightK`` / ``biasK`` (local index ``K``) is global expert
  ``e * num_experts / ep + K`` (megatron-core's ``assign_ep_resolved_name_inplace``).
* Replicas. Each data-parallel group of the inference grid's model-parallel ranks is one inference replica. The
  bundled runtime drives megatron-core's engine without its data-parallel coordinator, so every replica is one
  GPU (inference TP = PP = EP = 1): replica ``i`` is rank ``i``, it generates the ``i``-th share of the prompts,
  and the driver joins the shares in replica order (the prompts' order).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_EXPERT_PARAM = re.compile(r"^(weight|bias)(\d+)$")


@dataclass(frozen=True)
class Grid:
    """One model's layout over ``world`` GPUs (one pipeline stage, no context parallelism)."""

    world: int
    tp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        for name in ("world", "tp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.world % self.tp:
            raise ValueError(f"world {self.world} is not a multiple of TP {self.tp}")
        if self.world % (self.ep * self.etp):
            raise ValueError(f"world {self.world} is not a multiple of EP {self.ep} x expert TP {self.etp}")

    @property
    def dp(self) -> int:
        """Dense data-parallel size (the number of model replicas)."""
        return self.world // self.tp

    @property
    def expert_dp(self) -> int:
        return self.world // (self.ep * self.etp)

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def tp_group(self, rank: int) -> list[int]:
        start = rank - self.tp_rank(rank)
        return list(range(start, start + self.tp))

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def dp_group(self, rank: int) -> list[int]:
        return [self.tp_rank(rank) + self.tp * d for d in range(self.dp)]

    def ep_rank(self, rank: int) -> int:
        return (rank // self.etp) % self.ep

    def ep_group(self, rank: int) -> list[int]:
        base = rank - self.etp * self.ep_rank(rank)
        return [base + self.etp * e for e in range(self.ep)]

    def experts(self, rank: int, num_experts: int) -> list[int]:
        """The global experts ``rank`` holds."""
        per = experts_per_rank(num_experts, self.ep)
        first = self.ep_rank(rank) * per
        return list(range(first, first + per))


def experts_per_rank(num_experts: int, ep: int) -> int:
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over EP {ep}")
    return num_experts // ep


# --------------------------------------------------------------------------- tensor-parallel slices


@dataclass(frozen=True)
class Segment:
    """``length`` elements from ``start`` along the partition dimension of the full tensor."""

    start: int
    length: int


def segments(full_len: int, world: int, stride: int = 1) -> list[list[Segment]]:
    """For each of ``world`` ranks, the segments of the full tensor it holds, in its local order."""
    parts = world * max(1, stride)
    if full_len % parts:
        raise ValueError(f"a partition dimension of {full_len} does not split into {world} ranks x stride {stride}")
    unit = full_len // parts
    return [[Segment((r + k * world) * unit, unit) for k in range(max(1, stride))] for r in range(world)]


@dataclass(frozen=True)
class Piece:
    """One copy of a reshard: ``length`` elements from offset ``src_offset`` of source TP rank ``src`` (its
    local tensor) to offset ``dst_offset`` of the destination's local tensor."""

    src: int
    src_offset: int
    dst_offset: int
    length: int


def tp_pieces(full_len: int, src_world: int, src_stride: int, dst_world: int, dst_stride: int,
              dst_rank: int) -> list[Piece]:
    """What destination TP rank ``dst_rank`` receives, from which source TP rank, in destination order."""
    src_segs = segments(full_len, src_world, src_stride)
    owners = [(seg.start, seg.length, r, sum(s.length for s in src_segs[r][:k]))
              for r in range(src_world) for k, seg in enumerate(src_segs[r])]
    owners.sort()
    pieces: list[Piece] = []
    dst_off = 0
    for seg in segments(full_len, dst_world, dst_stride)[dst_rank]:
        pos, end = seg.start, seg.start + seg.length
        for start, length, r, local in owners:
            lo, hi = max(pos, start), min(end, start + length)
            if lo < hi:
                pieces.append(Piece(r, local + lo - start, dst_off + lo - seg.start, hi - lo))
        dst_off += seg.length
    return _merged(pieces)


def _merged(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (last is not None and last.src == p.src and last.src_offset + last.length == p.src_offset
                and last.dst_offset + last.length == p.dst_offset):
            out[-1] = Piece(last.src, last.src_offset, last.dst_offset, last.length + p.length)
        else:
            out.append(p)
    return out


# --------------------------------------------------------------------------- experts


def expert_index(name: str) -> int | None:
    """The local expert index of a grouped-GEMM expert tensor's name (``...experts.linear_fc1.weight3`` -> 3)."""
    for part in name.split("."):
        m = _EXPERT_PARAM.match(part)
        if m is not None:
            return int(m.group(2))
    return None


def global_expert_name(name: str, ep_rank: int, num_experts: int, ep: int) -> str:
    """``name`` with its local expert index replaced by the global one (unchanged for a non-expert name)."""
    local = expert_index(name)
    if local is None:
        return name
    glob = ep_rank * experts_per_rank(num_experts, ep) + local
    return ".".join(f"{m.group(1)}{glob}" if (m := _EXPERT_PARAM.match(p)) else p for p in name.split("."))


# --------------------------------------------------------------------------- replicas and prompts


def prompt_chunks(num_prompts: int, engines: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each engine's share of the prompts: equal shares of ``ceil(n / engines)`` in engine
    order (the last shares may be short or empty); joining the engines' results in engine order gives back the
    prompts' order."""
    if engines < 1:
        raise ValueError(f"{engines} engines: need at least one")
    per = (num_prompts + engines - 1) // engines
    return [(min(e * per, num_prompts), min((e + 1) * per, num_prompts)) for e in range(engines)]


@dataclass(frozen=True)
class ReshardLayout:
    """The trainer's grid and the inference grid on the same GPUs."""

    train: Grid
    inference: Grid

    def __post_init__(self) -> None:
        if self.train.world != self.inference.world:
            raise ValueError(f"the trainer has {self.train.world} GPUs, the inference grid {self.inference.world}")

    @property
    def replicas(self) -> int:
        return self.inference.dp

    @property
    def direct(self) -> bool:
        """Every inference replica is one GPU (what megatron-core's engine runs without its coordinator)."""
        return self.inference.tp == 1 and self.inference.ep == 1 and self.inference.etp == 1

    def replica_of(self, rank: int) -> int:
        return self.inference.dp_rank(rank)

    def describe(self, rank: int, num_experts: int | None = None) -> dict[str, object]:
        """What ``rank`` holds in each grid (for the log and the tests)."""
        t, g = self.train, self.inference
        out: dict[str, object] = {
            "train": {"tp_rank": t.tp_rank(rank), "tp_group": t.tp_group(rank), "dp_group": t.dp_group(rank)},
            "inference": {"tp_rank": g.tp_rank(rank), "tp_group": g.tp_group(rank), "dp_group": g.dp_group(rank),
                          "replica": self.replica_of(rank)},
        }
        if num_experts:
            out["train"]["experts"] = t.experts(rank, num_experts)  # type: ignore[index]
            out["inference"]["experts"] = g.experts(rank, num_experts)  # type: ignore[index]
        return out


__all__ = ["Grid", "Piece", "ReshardLayout", "Segment", "experts_per_rank", "expert_index", "global_expert_name",
           "prompt_chunks", "segments", "tp_pieces"]
