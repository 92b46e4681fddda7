"""The GPU catalog (``gpus.yaml``): usable memory per ``cluster.gpu`` name, with its source."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from rlc.compiler.catalog.errors import CatalogError
from rlc.compiler.suggest import close_matches
from rlc.compiler.tables import parse_table
from dataclasses import dataclass

_GPUS_FILE = Path(__file__).with_name("gpus.yaml")


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type. ``memory_gib`` is the capacity torch reports (shared by Megatron and vLLM)."""

    name: str
    memory_gib: float
    hbm_gb: int
    arch: str
    nvlink_multicast: bool  # NVSwitch with NVLink multicast: NCCL sets up NVLS buffers
    measured: bool  # True when the figure comes from a field report's torch message (NeMo-RL #2471)
    source: str

    @property
    def memory_bytes(self) -> int:
        return int(round(self.memory_gib * (1 << 30)))


@lru_cache(maxsize=1)
def _table() -> dict[str, GpuSpec]:
    raw = parse_table(_GPUS_FILE.read_text(encoding="utf-8"))
    return {
        name: GpuSpec(
            name=name,
            memory_gib=float(e["memory_gib"]),
            hbm_gb=int(e["hbm_gb"]),
            arch=str(e["arch"]),
            nvlink_multicast=bool(e["nvlink_multicast"]),
            measured=bool(e["measured"]),
            source=str(e["source"]),
        )
        for name, e in raw.items()
    }


def gpu_names() -> list[str]:
    """Every GPU name the catalog knows."""
    return sorted(_table())


def gpu_spec(name: str) -> GpuSpec:
    """The catalog entry for ``name``; unknown names raise :class:`CatalogError` naming close ones."""
    table = _table()
    if name in table:
        return table[name]
    close = close_matches(name, table, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise CatalogError(f"unknown GPU {name!r}{hint} (known: {', '.join(sorted(table))})")
