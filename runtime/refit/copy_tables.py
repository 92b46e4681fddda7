"""What the consumer's direct-copy tables share (fused expert transfer, replayed load): a table's fingerprint, the
signature of a destination tensor that must not move while a table points at it, and the one call that issues a
bucket's copies."""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Sequence

import torch


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


__all__ = ["copy_all", "digest", "tensor_signature"]
