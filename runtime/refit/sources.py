"""What an exporter may hand the producer besides a plain tensor, and strided views relative to a base tensor.

The producer packs every exported tensor into its IPC buffer with one copy. Two kinds of export are cheaper to
write straight into that buffer than to build first:

* :class:`StackedParts`: equally shaped tensors stacked along a new first dimension (a MoE layer's experts held
  as separate parameters, ``refit.fused_transfer``): one ``torch.stack(out=)``;
* :class:`RowsOf`: rows of one 2-D tensor in a given order (q, k or v out of Megatron's interleaved QKV weight,
  ``refit.direct_export``): one ``torch.index_select(out=)``.

:class:`View` is a strided view written down relative to its base tensor (offset, sizes, strides), so that it can
be rebuilt on the same tensor later, or on another tensor of the same layout: the replayed load records vLLM's
copies this way, the direct export the views Megatron-Bridge's conversion returns.
"""
from __future__ import annotations

import bisect
from typing import Any, Generic, Iterable, NamedTuple, Sequence, TypeVar

import torch


class View(NamedTuple):
    """A strided view relative to a base tensor: ``base.as_strided(size, stride, base.storage_offset() + offset)``."""

    offset: int  # elements, from the base's storage offset
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, view: torch.Tensor, base: torch.Tensor) -> "View":
        return cls(int(view.storage_offset()) - int(base.storage_offset()), tuple(view.shape), tuple(view.stride()))

    def on(self, base: torch.Tensor) -> torch.Tensor:
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)

    def extent(self) -> tuple[int, int]:
        """``[first, last + 1)`` element offsets the view can touch (its hull; empty views give ``(o, o)``)."""
        if any(s == 0 for s in self.size):
            return self.offset, self.offset
        reach = sum((s - 1) * abs(st) for s, st in zip(self.size, self.stride))
        low = self.offset - sum((s - 1) * abs(st) for s, st in zip(self.size, self.stride) if st < 0)
        return low, low + reach + 1


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` device addresses ``t`` can touch."""
    low, high = View(int(t.storage_offset()), tuple(t.shape), tuple(t.stride())).extent()
    base = t.untyped_storage().data_ptr()
    size = t.element_size()
    return base + low * size, base + high * size


def is_plain_tensor(t: Any) -> bool:
    """A tensor whose storage holds its values as they are: not a wrapper subclass (Transformer Engine's FP8 weights,
    a DTensor), which Bridge dequantizes or gathers and whose storage is not its values."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


K = TypeVar("K")


class Region(NamedTuple, Generic[K]):
    """One tensor of a :class:`TensorsByAddress` and the device addresses it spans."""

    start: int
    end: int
    key: K
    tensor: torch.Tensor


class TensorsByAddress(Generic[K]):
    """Tensors (a model's parameters, the trainer's) by the addresses they span, to find the one a view is taken
    from: one bisect, since tensors do not overlap (a tensor nested in another is looked up a few steps back)."""

    def __init__(self, items: Iterable[tuple[K, torch.Tensor]]) -> None:
        regions = []
        for key, t in items:
            if t.device.type != "meta" and t.numel():
                regions.append(Region(*byte_range(t), key, t))
        regions.sort(key=lambda r: (r.start, r.end))
        self.regions: list[Region[K]] = regions
        self._starts = [r.start for r in regions]

    def containing(self, view: torch.Tensor) -> Region[K] | None:
        """The tensor (of ``view``'s dtype, device and storage) whose bytes hold every byte ``view`` can touch."""
        if view.numel() == 0:
            return None
        start, end = byte_range(view)
        i = bisect.bisect_right(self._starts, start) - 1
        for r in reversed(self.regions[max(0, i - 7):i + 1]):
            if r.start <= start and end <= r.end and r.tensor.dtype == view.dtype and r.tensor.device == view.device \
                    and r.tensor.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
                return r
        return None

    def overlapping(self, view: torch.Tensor) -> list[Region[K]]:
        """Every tensor (on ``view``'s device) whose bytes ``view``'s bytes overlap."""
        if view.numel() == 0:
            return []
        start, end = byte_range(view)
        return [r for r in self.regions if r.start < end and start < r.end and r.tensor.device == view.device]


class StackedParts:
    """Equally shaped tensors to be stacked along a new first dimension, by the producer, into its buffer."""

    def __init__(self, parts: Sequence[torch.Tensor], *, check: bool = True) -> None:
        """``check``: that every part has the first part's shape, dtype and device (skipped where the parts were
        cut to one layout already)."""
        if not parts:
            raise ValueError("StackedParts needs at least one tensor")
        first = parts[0]
        if check and any(p.shape != first.shape or p.dtype != first.dtype or p.device != first.device for p in parts):
            raise ValueError("StackedParts: every part must have the first part's shape, dtype and device")
        self.parts = list(parts)
        self.shape = torch.Size((len(parts), *first.shape))
        self.dtype = first.dtype
        self.device = first.device

    def copy_into(self, out: torch.Tensor) -> None:
        """Write the stacked tensor into ``out`` (one kernel when the dtypes agree)."""
        if out.dtype == self.dtype and out.is_contiguous():
            torch.stack([p.detach() for p in self.parts], dim=0, out=out)
        else:
            out.copy_(self.materialize())

    def materialize(self) -> torch.Tensor:
        return torch.stack([p.detach() for p in self.parts], dim=0)


class RowsOf:
    """Rows ``index`` of the 2-D tensor ``base``, in that order: a ``[len(index), columns]`` tensor the producer
    gathers straight into its buffer."""

    def __init__(self, base: torch.Tensor, index: torch.Tensor) -> None:
        if base.dim() != 2 or index.dim() != 1 or index.dtype != torch.int64 or index.device != base.device:
            raise ValueError("RowsOf needs a 2-D tensor and a 1-D int64 index on its device")
        self.base = base.detach()
        self.index = index
        self.shape = torch.Size((int(index.numel()), int(base.shape[1])))
        self.dtype = base.dtype
        self.device = base.device

    def copy_into(self, out: torch.Tensor) -> None:
        """Gather the rows into ``out`` (one kernel when the dtypes agree)."""
        if out.dtype == self.dtype and out.is_contiguous():
            torch.index_select(self.base, 0, self.index, out=out)
        else:
            out.copy_(self.materialize())

    def materialize(self) -> torch.Tensor:
        return torch.index_select(self.base, 0, self.index)


def copy_export(out: torch.Tensor, tensor: Any) -> None:
    """The producer's pack of one exported tensor (a tensor, :class:`StackedParts` or :class:`RowsOf`) into its
    buffer view."""
    if isinstance(tensor, (StackedParts, RowsOf)):
        tensor.copy_into(out)
    else:
        out.copy_(tensor.detach())


def materialize(tensor: Any) -> torch.Tensor:
    """A plain tensor for whatever an exporter yielded (``StackedParts`` are stacked, ``RowsOf`` gathered)."""
    return tensor.materialize() if isinstance(tensor, (StackedParts, RowsOf)) else tensor


__all__ = ["Region", "RowsOf", "StackedParts", "TensorsByAddress", "View", "byte_range", "copy_export", "is_plain_tensor",
           "materialize"]
