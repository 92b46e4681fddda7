"""What the consumer's direct-copy tables share (fused expert transfer, replayed load): a table's fingerprint, the
signature of a destination tensor that must not move while a table points at it, and the one call that issues a
bucket's copies."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch

from rlc.runtime.refit.zero_copy import StackedViews

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


def digest(items: Iterable[Any]) -> str:
    """A short stable hash of ``items``' reprs (what a table was built from, for logs and checks)."""
    h = hashlib.sha256()
    for item in items:
        h.update(repr(item).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def tensor_signature(t: torch.Tensor) -> tuple[Any, ...]:
    """Where a destination tensor is and how it is laid out: a table built against it is valid while this holds."""
    return (str(t.device), t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype))


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair: the same-dtype pairs in one ``torch._foreach_copy_`` call, converting ones
    one by one."""
    same = [(d, s) for d, s in zip(dsts, srcs) if d.dtype == s.dtype]
    with torch.no_grad():
        if same:
            torch._foreach_copy_([d for d, _ in same], [s for _, s in same])
        if len(same) < len(dsts):
            for d, s in zip(dsts, srcs):
                if d.dtype != s.dtype:
                    d.copy_(s)


class CopyOp(Protocol):
    """One direct copy of a route: ``dst`` (a view of an engine parameter) <- ``source(tensor)``."""

    @property
    def dst(self) -> torch.Tensor: ...

    def source(self, tensor: torch.Tensor) -> torch.Tensor: ...


class Routed(Protocol):
    """Where one wire tensor goes: its copies and their bytes."""

    @property
    def ops(self) -> Sequence[CopyOp]: ...

    @property
    def nbytes(self) -> int: ...


@dataclass
class CopyStats:
    direct_tensors: int = 0  # wire tensors copied straight into the engine's parameters
    direct_copies: int = 0
    direct_bytes: int = 0
    loader_tensors: int = 0  # tensors handed to the engine's load_weights
    loader_calls: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class DirectCopyLoader:
    """``load_weights`` for the consumer: the routed tensors of a bucket as direct copies in one call, the engine's
    loader for the rest (``fallback`` says what the loader gets for a tensor without a route). A routed tensor may
    be a :class:`~rlc.runtime.refit.zero_copy.StackedViews` (a stack read in place part by part) where the routes'
    copies slice it along its first dimension (:attr:`takes_stacked_views`)."""

    stats: CopyStats
    #: whether the consumer may hand it stacks read in place part by part (else it stacks them first)
    takes_stacked_views = False

    def __init__(self, load_weights: LoadWeights, routes: Mapping[str, Routed]) -> None:
        self.load_weights = load_weights
        self.routes = routes
        self.stats = CopyStats()

    def fallback(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(name, tensor)]

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        rest: list[tuple[str, torch.Tensor]] = []
        s = self.stats
        for name, tensor in weights:
            route = self.routes.get(name)
            if route is None:
                rest.extend(self.fallback(name, tensor))
                continue
            for op in route.ops:
                src = op.source(tensor)
                if isinstance(src, StackedViews):  # read in place, part by part: one copy per part
                    for dst, part in src.copies_into(op.dst):
                        dsts.append(dst)
                        srcs.append(part)
                    s.direct_copies += len(src.parts)
                else:
                    dsts.append(op.dst)
                    srcs.append(src)
                    s.direct_copies += 1
            s.direct_tensors += 1
            s.direct_bytes += route.nbytes
        copy_all(dsts, srcs)  # the bucket's direct copies in one call
        del srcs
        if rest:
            s.loader_tensors += len(rest)
            s.loader_calls += 1
            self.load_weights(rest)


__all__ = ["CopyOp", "CopyStats", "DirectCopyLoader", "LoadWeights", "Routed", "copy_all", "digest",
           "tensor_signature"]
