"""Frozen weights kept in pinned host memory and put on the GPU only while a pass reads them
(``training.offload_reference_policy``: the KL penalty's reference policy).

The mechanism is megatron-core's own offload of its DDP parameter buffers (``offload_to_cpu`` /
``reload_from_cpu``, which :mod:`rlc.runtime.policy.param_offload` uses for the trainer): the module and
its parameters stay as they are, each parameter's storage is resized to 0 bytes to free it and resized
back and filled from the host copy to restore it, so every parameter and view of it is valid again
without touching the module. The reference policy has no DDP buffers (it is not trained), so the same
two steps run on its parameters' storages directly:

* setup: one host copy of every storage, made once; then the storages are freed;
* :meth:`HostWeights.swap_in`: allocate each storage again and copy its bytes from the host copy;
* :meth:`HostWeights.swap_out`: free the storages (the weights are frozen: nothing is copied back).

The host copy is laid out in pinned blocks whose sizes are powers of two (:mod:`rlc.contract.host_blocks`),
so PyTorch's pinned allocator, which rounds every allocation up to a power of two, adds nothing: the
copy takes the bytes the planner counts for it. Storages are packed end to end through the blocks; a
storage that straddles two blocks is copied in two pieces (:func:`segments`).

Nothing here knows about Megatron: any tensors work, on any device (the CPU tests use CPU tensors).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from rlc.contract.host_blocks import GRANULE, pinned_blocks


@dataclass(frozen=True)
class Segment:
    """One contiguous piece of a storage's bytes and where it lives in the host copy."""

    storage: int  # index into the storages
    storage_offset: int  # byte offset in the storage
    block: int  # index into the host blocks
    block_offset: int  # byte offset in the block
    nbytes: int


def segments(sizes: Sequence[int], blocks: Sequence[int]) -> list[Segment]:
    """Storages of ``sizes`` bytes laid end to end through host blocks of ``blocks`` bytes: the pieces, in
    order. Every byte of every storage is in exactly one piece; a storage crossing a block boundary is
    split there. The blocks must hold the storages."""
    if sum(sizes) > sum(blocks):
        raise ValueError(f"host blocks of {sum(blocks)} bytes cannot hold {sum(sizes)} bytes of storages")
    out: list[Segment] = []
    block, block_offset = 0, 0
    for index, size in enumerate(sizes):
        done = 0
        while done < size:
            if block_offset == blocks[block]:
                block, block_offset = block + 1, 0
                continue
            n = min(size - done, blocks[block] - block_offset)
            out.append(Segment(index, done, block, block_offset, n))
            done += n
            block_offset += n
    return out


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages of ``tensors``, each once (tensors that share one, e.g. views, count it once), in the
    order first seen; empty storages are left out."""
    seen: set[tuple[str, int]] = set()
    out = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        out.append(storage)
    return out


def _bytes_of(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the first ``nbytes`` of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostWeights:
    """The storages of ``tensors``, copied once into host blocks and freed; :meth:`swap_in` brings them back,
    :meth:`swap_out` frees them again. ``pin``: page-locked host blocks (default: when the tensors are on a
    CUDA device), so the copies run at full PCIe/NVLink-C2C speed."""

    def __init__(self, tensors: Iterable[torch.Tensor], *, pin: bool | None = None, granule: int = GRANULE) -> None:
        self.storages = unique_storages(tensors)
        self.sizes = [s.nbytes() for s in self.storages]
        devices = {s.device for s in self.storages}
        if len(devices) > 1:
            raise ValueError(f"HostWeights: the tensors are on several devices ({sorted(map(str, devices))})")
        self.device = devices.pop() if devices else torch.device("cpu")
        pin = self.device.type == "cuda" if pin is None else pin
        self.blocks = [torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=pin)
                       for n in pinned_blocks(sum(self.sizes), granule)]
        self.segments = segments(self.sizes, [b.numel() for b in self.blocks])
        self.resident = [True] * len(self.storages)
        views = [_bytes_of(s, n) for s, n in zip(self.storages, self.sizes)]
        for seg in self.segments:
            self.blocks[seg.block][seg.block_offset:seg.block_offset + seg.nbytes].copy_(
                views[seg.storage][seg.storage_offset:seg.storage_offset + seg.nbytes], non_blocking=pin)
        _synchronize(self.device)  # the copies have landed before the storages are freed
        self.swap_out()

    @property
    def host_bytes(self) -> int:
        """Host memory of the copy (its pinned blocks)."""
        return sum(b.numel() for b in self.blocks)

    @property
    def nbytes(self) -> int:
        """Bytes of the storages (on the device when swapped in)."""
        return sum(self.sizes)

    @property
    def device_bytes(self) -> int:
        """Bytes of the storages on the device now."""
        return sum(n for n, on in zip(self.sizes, self.resident) if on)

    def swap_in(self) -> int:
        """Allocate every freed storage and copy its bytes back; returns the bytes brought to the device."""
        moved = 0
        views: dict[int, torch.Tensor] = {}
        for index, (storage, size) in enumerate(zip(self.storages, self.sizes)):
            if self.resident[index]:
                continue
            storage.resize_(size)
            views[index] = _bytes_of(storage, size)
            moved += size
        for seg in self.segments:
            if seg.storage in views:
                views[seg.storage][seg.storage_offset:seg.storage_offset + seg.nbytes].copy_(
                    self.blocks[seg.block][seg.block_offset:seg.block_offset + seg.nbytes], non_blocking=True)
        _synchronize(self.device)  # the weights are there before anything reads them
        for index in views:
            self.resident[index] = True
        return moved

    def swap_out(self) -> int:
        """Free every storage (the host copy keeps the weights); returns the bytes freed on the device."""
        _synchronize(self.device)  # whatever read the weights has finished
        freed = 0
        for index, storage in enumerate(self.storages):
            if self.resident[index]:
                storage.resize_(0)
                self.resident[index] = False
                freed += self.sizes[index]
        return freed


__all__ = ["HostWeights", "Segment", "segments", "unique_storages"]
