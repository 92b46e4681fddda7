"""Tensor specs and wire-dtype selection (pure Python, no torch).

A ``TensorSpec`` is what the planner and the manifest reason about: name, shape, dtype (as a
string such as ``"bfloat16"``) and the byte count that follows from them. The producer turns the
exporter's specs into *wire* specs with ``wire_specs``: fp32 parameters named by
``refit.fp32_params`` (router ``e_score_correction_bias``, expert bias) stay fp32 on the wire,
because a bf16 ULP at their magnitude (~25-57) erases the per-expert offsets (std ~7e-4) and
corrupts routing (SkyRL #1816); FP8 tensors (weights the trainer quantized for FP8 rollouts) travel as
they are; every other floating tensor travels in the export dtype; integer and bool tensors keep their
own dtype.
"""
from __future__ import annotations

import fnmatch
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from rlc.runtime.refit.errors import RefitPlanError

#: Bytes per element of every dtype the refit wire carries (torch names without the ``torch.``).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOATING_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
#: Already quantized: never cast to the export dtype on the wire.
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "long": "int64", "int": "int32"}


def normalize_dtype(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bf16"``-free canonical names -> ``"bfloat16"``."""
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch.") :]
    text = _ALIASES.get(text, text)
    if text not in DTYPE_SIZES:
        raise RefitPlanError(
            f"dtype {dtype!r} is not supported on the refit wire; supported: {', '.join(sorted(DTYPE_SIZES))}"
        )
    return text


@dataclass(frozen=True)
class TensorSpec:
    """One exported tensor: HF name, shape, dtype name. ``nbytes`` follows from shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if any(d < 0 for d in self.shape):
            raise RefitPlanError(f"tensor {self.name!r}: negative dimension in shape {list(self.shape)}")

    # Computed once per spec: a 30B MoE refit asks for the byte counts of ~19,000 specs per refit.
    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def with_dtype(self, dtype: str) -> "TensorSpec":
        return TensorSpec(self.name, self.shape, dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TensorSpec":
        return cls(str(data["name"]), tuple(data["shape"]), str(data["dtype"]))

    @classmethod
    def from_tensor(cls, name: str, tensor: Any) -> "TensorSpec":
        """Spec of a torch tensor (duck-typed: ``.shape`` and ``.dtype``)."""
        return cls(name, tuple(tensor.shape), normalize_dtype(tensor.dtype))


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """True when ``name`` matches one of the fnmatch ``patterns`` (case-sensitive)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def wire_dtype(name: str, source_dtype: str, export_dtype: str, fp32_patterns: Sequence[str]) -> str:
    """The dtype a tensor travels in: fp32 for ``fp32_patterns``, its own for non-floats and FP8, else export."""
    source_dtype = normalize_dtype(source_dtype)
    if source_dtype not in FLOATING_DTYPES or source_dtype in FP8_DTYPES:
        return source_dtype
    if matches_any(name, fp32_patterns):
        return "float32"
    return normalize_dtype(export_dtype)


def wire_specs(specs: Sequence[TensorSpec], export_dtype: str, fp32_patterns: Sequence[str]) -> list[TensorSpec]:
    """Map exporter specs to wire specs (see module docstring); names must be unique."""
    seen: set[str] = set()
    out = []
    for s in specs:
        if s.name in seen:
            raise RefitPlanError(
                f"tensor {s.name!r} appears twice in the export list; each name must be exported once "
                "per producer rank (NeMo-RL #2471: MTP-shared embedding replicated on the last PP stage -> "
                "refit.dedupe_mtp_embedding)"
            )
        seen.add(s.name)
        out.append(s.with_dtype(wire_dtype(s.name, s.dtype, export_dtype, fp32_patterns)))
    return out


def specs_from_named_tensors(named_tensors: Iterable[tuple[str, Any]]) -> list[TensorSpec]:
    """Export list from one pass over an exporter (e.g. ``export_hf_weights``), in its order.

    Each tensor is dropped before the next is requested, so the pass needs no more memory than
    a refit. Run it once at setup and hand the result to ``RefitProducer.prepare``.
    """
    specs = []
    for name, tensor in named_tensors:
        specs.append(TensorSpec.from_tensor(name, tensor))
        del tensor
    return specs


def specs_to_json(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    return [s.to_dict() for s in specs]


def specs_from_json(data: Sequence[dict[str, Any]]) -> list[TensorSpec]:
    return [TensorSpec.from_dict(d) for d in data]


def format_bytes(n: int | float) -> str:
    """Human-readable GiB/MiB/KiB for error messages and tables."""
    n = float(n)
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"
