"""Zero-copy views (``refit.zero_copy_views``), the producer's side: which trainer storages its consumer has mapped,
and whether a tensor can be read in place.

A view of one of the trainer's parameters need not be packed into the refit buffers: the consumer maps the storage
it lives in (once) and reads it at a byte offset. :class:`SharedStorages` is the producer's table of those
mappings, by the storage's address and size: a storage seen for the first time is shared (its handle goes to the
consumer in a ``Share`` message), one the trainer re-allocated is a new storage and is shared again, and at the end
of a refit the consumer keeps the mappings this refit read (or none, when the trainer frees its parameters after the
refit) and closes the others.
"""
from __future__ import annotations

from typing import Any

import torch

from rlc.runtime.refit.buffers import BufferBackend
from rlc.runtime.refit.protocol import StorageRef
from rlc.runtime.refit.sources import is_plain_tensor


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


__all__ = ["SharedStorages", "why_not_zero_copy"]
