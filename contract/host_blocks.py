"""Pinned host blocks of a weight copy kept in host memory, used by the runtime (allocation) and the planner
(host memory prediction).

PyTorch's pinned-memory allocator rounds every allocation up to the next power of two
(``c10::llvm::PowerOf2Ceil`` in aten/src/ATen/core/CachingHostAllocator.h), so one pinned tensor per
weight, or one for all of them, can take up to twice the bytes it holds. A copy laid out in blocks
that are themselves powers of two is not rounded: :func:`pinned_blocks` splits the bytes, rounded up to
:data:`GRANULE`, into the powers of two of their binary representation (largest first). The copy then
takes :func:`pinned_bytes` of host memory, less than :data:`GRANULE` above the bytes it holds, in at
most ``log2(bytes / GRANULE) + 1`` allocations.
"""
from __future__ import annotations

GRANULE = 2 << 20  # 2 MiB: the smallest block; the copy is rounded up to a multiple of it


def pinned_blocks(nbytes: int, granule: int = GRANULE) -> list[int]:
    """Block sizes (bytes, each a power of two, largest first) that hold ``nbytes``; none for 0."""
    if nbytes < 0:
        raise ValueError(f"pinned_blocks: {nbytes} bytes")
    if granule < 1 or granule & (granule - 1):
        raise ValueError(f"pinned_blocks: the granule ({granule}) must be a power of two")
    units = -(-nbytes // granule)
    return [granule << bit for bit in range(units.bit_length() - 1, -1, -1) if units >> bit & 1]


def pinned_bytes(nbytes: int, granule: int = GRANULE) -> int:
    """Host memory of a copy of ``nbytes`` in :func:`pinned_blocks`."""
    return sum(pinned_blocks(nbytes, granule))


__all__ = ["GRANULE", "pinned_blocks", "pinned_bytes"]
