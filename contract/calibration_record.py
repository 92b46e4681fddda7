"""The memory record the runtime writes (``calibration.jsonl``) and ``rlc calibrate`` reads.

One JSON object per line. The runtime builds a :class:`CalibrationRecord` and writes
:meth:`CalibrationRecord.to_json`; the compiler reads each line with
:meth:`CalibrationRecord.from_json`. Both sides import this module, so the key names, the phase
names and the checks cannot drift apart.

Memory figures are GiB as the CUDA driver reports them for the whole device (``free_gib``,
``used_gib``, ``total_gib``) plus the writing process's torch allocator (``torch_*_gib``) when known.

The runtime also samples device memory at the end of every step's phases into ``metrics.jsonl``
under :func:`memory_metric_key` (``memory/<phase>/used_gib``); :data:`STEP_MEMORY_PHASES` names them.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Mapping

from rlc.contract.files import JsonError, parse_json

KIND = "calibration"

#: Phases a calibration record may name, and what the device holds at that moment.
PHASES: dict[str, str] = {
    "vllm_started": "vLLM engines started and awake (weights, KV cache, CUDA graphs), before the trainer loads",
    "policy_started": "Megatron model and optimizer built, vLLM asleep",
    "refit_free": "device free memory when the refit buffer is sized (trainer offloaded, vLLM asleep)",
    "after_wake": "vLLM awake again after a refit (weights + KV cache), trainer offloaded",
    "after_initial_refit": "after the first refit, before step 1",
    "after_sleep": "vLLM asleep after a rollout, trainer about to compute logprobs",
    "megatron_engine_started": "generation.backend megatron: the policy workers' inference engines built and "
                               "suspended (the dedicated model's weights freed), before the first refit",
}

#: Phases the runtime samples into ``metrics.jsonl`` every step (``memory/<phase>/{free,used}_gib``).
STEP_MEMORY_PHASES: dict[str, str] = {
    "params_offload": "before the rollout: the trainer's bf16 parameters moved to host memory "
                      "(refit.offload_params_for_generation)",
    "generate": "end of the rollout: vLLM awake, trainer offloaded",
    "after_sleep": "vLLM asleep, before the trainer's logprobs",
    "logprobs": "after the trainer's logprob pass",
    "train": "after the optimizer step(s): trainer weights, grads and optimizer state resident",
    "refit_offload": "trainer's optimizer state offloaded for refit",
    "after_wake": "vLLM awake after the refit",
}

#: ``sleep_level`` 0: a record taken while vLLM was never put to sleep.
SLEEP_LEVELS = (0, 1, 2)


class CalibrationRecordError(ValueError):
    """A calibration record that does not match this format (the message names the key)."""


def memory_metric_key(phase: str, figure: str) -> str:
    """The ``metrics.jsonl`` key of a step's memory sample, e.g. ``memory/train/used_gib``."""
    if phase not in STEP_MEMORY_PHASES:
        raise CalibrationRecordError(f"memory phase {phase!r} not in {', '.join(STEP_MEMORY_PHASES)}")
    if figure not in ("free_gib", "used_gib"):
        raise CalibrationRecordError(f"memory figure {figure!r} must be free_gib or used_gib")
    return f"memory/{phase}/{figure}"


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalibrationRecordError(f"calibration record: {key!r} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or value < 0:
        raise CalibrationRecordError(f"calibration record: {key!r} must be a number >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class CalibrationRecord:
    """Device memory at one phase of a run, with the settings and versions that shaped it."""

    phase: str
    step: int
    free_gib: float
    used_gib: float
    total_gib: float
    sleep_level: int
    enforce_eager: bool
    gpu_type: str  # catalog GPU name, e.g. "h200-141gb" (cluster.gpu_type in runtime.yaml)
    versions: dict[str, str]  # distribution -> version (torch, vllm, megatron-core, ...)
    worker: str = ""
    #: ``refit.keep_weights_awake``: only vLLM's KV cache slept, so ``after_sleep`` includes its weights
    weights_awake: bool = False
    #: ``refit.keep_kv_cache_awake``: vLLM did not sleep at all, so ``after_sleep`` includes its KV cache too
    kv_cache_awake: bool = False
    torch_allocated_gib: float | None = None
    torch_reserved_gib: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # phase-specific figures (half_gib, ...)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise CalibrationRecordError(
                f"calibration record: phase {self.phase!r} not in {', '.join(PHASES)}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise CalibrationRecordError(f"calibration record: 'step' must be an integer >= 0, got {self.step!r}")
        for key in ("free_gib", "used_gib", "total_gib"):
            _number(getattr(self, key), key)
        for key in ("torch_allocated_gib", "torch_reserved_gib"):
            if getattr(self, key) is not None:
                _number(getattr(self, key), key)
        if self.sleep_level not in SLEEP_LEVELS or isinstance(self.sleep_level, bool):
            raise CalibrationRecordError(
                f"calibration record: 'sleep_level' must be one of {SLEEP_LEVELS}, got {self.sleep_level!r}")
        for key in ("weights_awake", "kv_cache_awake"):
            if not isinstance(getattr(self, key), bool):
                raise CalibrationRecordError(
                    f"calibration record: {key!r} must be true or false, got {getattr(self, key)!r}")
        if not isinstance(self.enforce_eager, bool):
            raise CalibrationRecordError(
                f"calibration record: 'enforce_eager' must be true or false, got {self.enforce_eager!r}")
        if not isinstance(self.gpu_type, str) or not self.gpu_type:
            raise CalibrationRecordError("calibration record: 'gpu_type' must name the GPU (e.g. h200-141gb)")
        if not isinstance(self.versions, dict) or not all(isinstance(v, str) for v in self.versions.values()):
            raise CalibrationRecordError("calibration record: 'versions' must map library -> version string")
        clash = set(self.extra) & _KEYS
        if clash:
            raise CalibrationRecordError(f"calibration record: extra figures reuse record keys {sorted(clash)}")

    @classmethod
    def from_memory(cls, phase: str, memory: Mapping[str, float], *, step: int, sleep_level: int,
                    enforce_eager: bool, gpu_type: str, versions: Mapping[str, str], worker: str = "",
                    weights_awake: bool = False, kv_cache_awake: bool = False,
                    extra: Mapping[str, Any] | None = None) -> "CalibrationRecord":
        """A record from a memory snapshot (``free_gib``/``used_gib``/``total_gib`` [+ ``torch_*_gib``])."""
        def gib(key: str) -> float:
            if key not in memory:
                raise CalibrationRecordError(f"memory snapshot for phase {phase!r} lacks {key!r}")
            return round(float(memory[key]), 4)

        def optional(key: str) -> float | None:
            return round(float(memory[key]), 4) if key in memory else None

        return cls(phase=phase, step=step, free_gib=gib("free_gib"), used_gib=gib("used_gib"),
                   total_gib=gib("total_gib"), sleep_level=sleep_level, enforce_eager=enforce_eager,
                   gpu_type=gpu_type, versions=dict(versions), worker=worker, weights_awake=weights_awake,
                   kv_cache_awake=kv_cache_awake,
                   torch_allocated_gib=optional("torch_allocated_gib"),
                   torch_reserved_gib=optional("torch_reserved_gib"), extra=dict(extra or {}))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: ``kind`` first, the fields, then the extra figures at top level."""
        out: dict[str, Any] = {"kind": KIND}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = dict(value) if isinstance(value, dict) else value
        out.update(self.extra)
        return out

    def to_json(self) -> str:
        """One line of ``calibration.jsonl`` (no trailing newline)."""
        return json.dumps(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CalibrationRecord":
        """Parse one record; a missing or mistyped key raises :class:`CalibrationRecordError` naming it."""
        if not isinstance(data, Mapping):
            raise CalibrationRecordError("a calibration record is a JSON object")
        if data.get("kind") != KIND:
            raise CalibrationRecordError(f"calibration record: 'kind' must be {KIND!r}, got {data.get('kind')!r}")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise CalibrationRecordError(f"calibration record: missing {', '.join(repr(k) for k in missing)}")
        kwargs = {k: data[k] for k in _KEYS if k in data}
        extra = {k: v for k, v in data.items() if k not in _KEYS and k != "kind"}
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json(cls, line: str) -> "CalibrationRecord":
        """Parse one line of ``calibration.jsonl``."""
        try:
            data = parse_json(line)
        except JsonError as exc:
            raise CalibrationRecordError(f"calibration record is {exc}") from None
        return cls.from_dict(data)


_KEYS = frozenset(f.name for f in fields(CalibrationRecord) if f.name != "extra")
_REQUIRED = tuple(f.name for f in fields(CalibrationRecord)
                  if f.default is MISSING and f.default_factory is MISSING)
