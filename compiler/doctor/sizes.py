"""Memory sizes as logs write them (``8.00 GiB``, ``6.76 GB``, ``8589934592``) -> bytes."""
from __future__ import annotations

import re

_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
SIZE = r"[0-9]+(?:\.[0-9]+)?\s*(?:[KMGT]i?B|B)"
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
GIB = 1 << 30


def parse_size(text: str) -> int:
    """``"8.00 GiB"`` -> 8589934592; a bare number is bytes. Raises ``ValueError`` on anything else."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a memory size: {text!r}")
    unit = (m.group(2) or "B").lower()
    return int(float(m.group(1)) * _UNITS[unit])


def gib(nbytes: float) -> str:
    """Bytes as ``12.34 GiB``."""
    return f"{nbytes / GIB:.2f} GiB"
