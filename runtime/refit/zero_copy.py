"""Zero-copy views (``refit.zero_copy_views``): which trainer storages the consumer has mapped and whether a tensor
can be read in place (the producer's side), and a stacked tensor read in place part by part (the consumer's).

A view of one of the trainer's parameters need not be packed into the refit buffers: the consumer maps the storage
it lives in (once) and reads it at a byte offset. :class:`SharedStorages` is the producer's table of those
mappings, by the storage's address and size: a storage seen for the first time is shared (its handle goes to the
consumer in a ``Share`` message), one the trainer re-allocated is a new storage and is shared again, and at the end
of a refit the consumer keeps the mappings this refit read (or none, when the trainer frees its parameters after the
refit) and closes the others.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from rlc.runtime.refit.buffers import BufferBackend
from rlc.runtime.refit.protocol import StorageRef
from rlc.runtime.refit.sources import StackedParts, is_plain_tensor


def why_not_zero_copy(tensor: Any, dtype: str, device: torch.device) -> str | None:
    """Why ``tensor`` cannot be read in place, as ``dtype``, by a consumer on ``device`` (None: it can)."""
    if not is_plain_tensor(tensor):
        return f"it is a {type(tensor).__name__}, not a plain tensor"
    if tensor.device != device:
        return f"it is on {tensor.device}, not on {device}"
    if not tensor.is_contiguous():
        return "it is not contiguous"
    if str(tensor.dtype).removeprefix("torch.") != dtype:
        return f"it is {tensor.dtype}, and travels as {dtype}"
    return None


class SharedStorages:
    """The trainer storages the consumer has mapped, by (address, bytes), and the ids both ends know them by."""

    def __init__(self, backend: BufferBackend, *, keep: bool) -> None:
        """``keep``: the consumer keeps its mappings from one refit to the next (no new handle per refit); False
        closes them at the end of every refit, for a trainer that frees its parameters after it (memory that is
        still mapped cannot be given back)."""
        self.backend = backend
        self.keep = keep
        self._ids: dict[tuple[int, int], int] = {}
        self._next = 0

    def id_of(self, tensor: torch.Tensor) -> tuple[int, StorageRef | None, bytes | None]:
        """The id of ``tensor``'s storage; for a storage the consumer has not mapped, also the ``Share`` reference
        and handle payload to send it before the first bucket that reads from it."""
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        sid = self._ids.get(key)
        if sid is not None:
            return sid, None, None
        nbytes, payload = self.backend.share(tensor)
        sid, self._next = self._next, self._next + 1
        self._ids[key] = sid
        return sid, StorageRef(sid, nbytes, self.backend.name, self.backend.device_key), payload

    def end_refit(self, used: set[int]) -> list[int]:
        """The ids the consumer keeps mapped after a refit that read ``used``; the others are forgotten here (the
        consumer closes them)."""
        kept = used if self.keep else set()
        self._ids = {key: sid for key, sid in self._ids.items() if sid in kept}
        return sorted(kept)

    def clear(self) -> None:
        self._ids = {}


class StackedViews(StackedParts):
    """A stacked tensor read in place part by part (a MoE layer's experts, each a separate trainer parameter): what
    the consumer hands a loader that takes them (the fused transfer's) for a stacked zero-copy entry. Besides what a
    :class:`~rlc.runtime.refit.sources.StackedParts` has (``shape``, ``dtype``, the stack assembled), it offers
    what those copies ask of a tensor: ``narrow`` along any dimension (the first selects parts), one part by index,
    and the per-part copies into a destination of the same shape. Its parts are views of one manifest-checked
    entry, or slices of them, so they are not checked again."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        super().__init__(parts, check=False)

    def narrow(self, dim: int, start: int, length: int) -> "StackedViews":
        if dim == 0:
            return StackedViews(self.parts[start:start + length])
        return StackedViews([p.narrow(dim - 1, start, length) for p in self.parts])

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.parts[index]

    def copies_into(self, dst: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(destination, source)`` of each part, for a ``dst`` shaped like this stack."""
        if tuple(dst.shape) != tuple(self.shape):
            raise ValueError(f"a stack of {list(self.shape)} copied into {list(dst.shape)}")
        return list(zip(dst.unbind(0), self.parts))


__all__ = ["SharedStorages", "StackedViews", "why_not_zero_copy"]
