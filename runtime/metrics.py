"""Per-step metrics: a JSONL file, TensorBoard, a progress line, phase timers and memory samples.

Use::

    metrics = MetricsLogger.from_config(cfg.logging, total_steps=cfg.grpo.max_steps, start_step=resumed,
                                        memory_sampler=cuda_memory_sampler)
    for step in range(resumed + 1, total + 1):
        with metrics.timer("generate"):
            ...
        with metrics.timer("train"):
            ...
        metrics.log(step, {"reward/mean": 0.4, **loss_metrics})
    metrics.close()

- JSONL (``logging.jsonl``): ``<logging.dir>/metrics.jsonl``, one object per ``log`` call, flushed at
  once, with ``step``, ``time`` (unix seconds), the metrics, ``timing/<phase>_s`` and
  ``memory/<phase>/<key>``. Nested dicts flatten to ``a/b``; tensors and numpy scalars become
  numbers; int and float scalars are always kept; NaN/inf are written as the strings ``"nan"``,
  ``"inf"``, ``"-inf"`` so the file stays strict JSON. Appends, so a resumed run continues the file.
- TensorBoard (``logging.tensorboard``): ``<logging.dir>/tensorboard``, scalars only. Needs
  ``torch.utils.tensorboard`` (the ``tensorboard`` package); without it one warning, then the run goes on.
- Progress (``logging.progress_bar``): a tqdm bar on stderr when tqdm is importable, else one line per
  step: ``step 12/100 (12%) | 35.2 s/step | ETA 51m36s | reward/mean=0.53``.
- ``timer(phase)`` adds the elapsed seconds to the next ``log`` (repeated phases in a step add up)
  and, with a ``memory_sampler`` (a callable returning ``{name: number}``, e.g. GiB free/used from
  ``torch.cuda.mem_get_info``), records its sample at the end of each phase.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, TextIO

from rlc.contract.runtime_config import LoggingConfig
from rlc.contract.files import parse_json, read_capped

#: Largest metrics.jsonl :func:`read_metrics` reads back (a line per step: a few KB each).
METRICS_BYTES = 1 << 30

MemorySampler = Callable[[], Mapping[str, float]]

#: Metrics shown on the progress line when present.
DEFAULT_PROGRESS_KEYS = ("reward/mean", "loss/total", "gen_kl", "dynamic_sampling/hit_rate")


def _scalar(value: Any) -> Any:
    """Tensors / numpy scalars -> Python numbers; anything else unchanged."""
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (ValueError, RuntimeError):  # multi-element tensor/array
            return value.tolist() if hasattr(value, "tolist") else value
    return value


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``, with tensors and numpy scalars as Python numbers."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, prefix=f"{name}/"))
        else:
            out[name] = _scalar(value)
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m05s"``, ``65`` -> ``"1m05s"``, ``9.4`` -> ``"9s"``."""
    s = int(round(max(seconds, 0.0)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{sec:02d}s"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{sec}s"


class PhaseTimer:
    """Accumulates per-phase wall time (and memory samples) until ``drain()``."""

    def __init__(self, memory_sampler: MemorySampler | None = None, warn: Callable[[str], None] | None = None) -> None:
        self.memory_sampler = memory_sampler
        self._warn = warn or (lambda msg: warnings.warn(msg, RuntimeWarning, stacklevel=3))
        self._sampler_failed = False
        self._pending: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{phase}_s"
            self._pending[key] = self._pending.get(key, 0.0) + (time.perf_counter() - start)
            self._sample_memory(phase)

    def _sample_memory(self, phase: str) -> None:
        if self.memory_sampler is None or self._sampler_failed:
            return
        try:
            sample = self.memory_sampler()
            for name, value in sample.items():
                self._pending[f"memory/{phase}/{name}"] = float(_scalar(value))
        except Exception as exc:  # a broken sampler must not kill the run: warn once, stop sampling  # noqa: BLE001
            self._sampler_failed = True
            self._warn(f"metrics: memory sampler failed after phase {phase!r} ({exc!r}); memory sampling disabled")

    def seconds(self, phase: str) -> float:
        """Wall time of ``phase`` so far (since the last ``drain``)."""
        return self._pending.get(f"timing/{phase}_s", 0.0)

    def drain(self) -> dict[str, float]:
        out, self._pending = self._pending, {}
        return out


class MetricsLogger:
    """Writes each step's metrics to the sinks enabled in ``logging``; see the module docstring."""

    def __init__(
        self,
        log_dir: str | Path,
        *,
        jsonl: bool = True,
        tensorboard: bool = False,
        progress_bar: bool = True,
        total_steps: int | None = None,
        start_step: int = 0,
        memory_sampler: MemorySampler | None = None,
        progress_keys: tuple[str, ...] = DEFAULT_PROGRESS_KEYS,
        stream: TextIO | None = None,
        use_tqdm: bool | None = None,
    ) -> None:
        self.dir = Path(log_dir)
        self.total_steps = total_steps
        self.start_step = start_step
        self.progress_keys = progress_keys
        self.stream = stream if stream is not None else sys.stderr
        self._warned: set[str] = set()
        self.timer = PhaseTimer(memory_sampler, warn=self._warn_once)
        self._step_times: deque[float] = deque(maxlen=10)
        self._last_log: float = time.monotonic()
        self._steps_logged = 0

        self._jsonl: TextIO | None = None
        if jsonl:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115

        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
            except Exception as exc:  # ImportError, or tensorboard missing underneath torch  # noqa: BLE001
                self._warn_once(
                    f"metrics: logging.tensorboard is on but torch.utils.tensorboard cannot be imported ({exc}); "
                    "install the 'tensorboard' package for TensorBoard logs. Continuing with JSONL only"
                )
            else:
                self._tb = SummaryWriter(
                    log_dir=str(self.dir / "tensorboard"), purge_step=start_step + 1 if start_step else None
                )

        self._bar = None
        self._progress = progress_bar
        if progress_bar and (use_tqdm is None or use_tqdm):
            try:
                from tqdm import tqdm  # noqa: PLC0415
            except ImportError:
                if use_tqdm:
                    raise
            else:
                self._bar = tqdm(
                    total=total_steps, initial=start_step, file=self.stream, unit="step", dynamic_ncols=True
                )

    @classmethod
    def from_config(cls, logging_cfg: LoggingConfig, **kwargs: Any) -> MetricsLogger:
        """Build from a ``LoggingConfig`` (the ``logging`` section of ``runtime.yaml``)."""
        return cls(
            logging_cfg.dir,
            jsonl=logging_cfg.jsonl,
            tensorboard=logging_cfg.tensorboard,
            progress_bar=logging_cfg.progress_bar,
            **kwargs,
        )

    def _warn_once(self, message: str) -> None:
        if message in self._warned:
            return
        self._warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ logging

    def log(self, step: int, metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Record one step: the given metrics plus the timings/memory gathered since the last call."""
        now = time.monotonic()
        self._step_times.append(now - self._last_log)
        self._last_log = now
        self._steps_logged += 1
        record: dict[str, Any] = {"step": step, "time": time.time()}
        record.update(flatten_metrics(metrics or {}))
        record.update(self.timer.drain())
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({k: _json_safe(v) for k, v in record.items()}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key in ("step", "time"):
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, global_step=step)
                elif isinstance(value, bool):
                    self._tb.add_scalar(key, int(value), global_step=step)
            self._tb.flush()
        if self._progress:
            self._show_progress(step, record)
        return record

    def seconds_per_step(self) -> float | None:
        """Mean wall time of the last (up to 10) steps; None before the first step is logged."""
        if not self._step_times:
            return None
        return sum(self._step_times) / len(self._step_times)

    def eta_seconds(self, step: int) -> float | None:
        if self.total_steps is None:
            return None
        per = self.seconds_per_step()
        if per is None:
            return None
        return max(self.total_steps - step, 0) * per

    def progress_line(self, step: int, record: Mapping[str, Any]) -> str:
        """``step 12/100 (12%) | 35.2 s/step | ETA 51m36s | reward/mean=0.53``."""
        parts = []
        if self.total_steps:
            parts.append(f"step {step}/{self.total_steps} ({step / self.total_steps:.0%})")
        else:
            parts.append(f"step {step}")
        per = self.seconds_per_step()
        if per is not None:
            parts.append(f"{per:.1f} s/step")
        eta = self.eta_seconds(step)
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        shown = self._shown_metrics(record)
        if shown:
            parts.append(" ".join(f"{k}={v}" for k, v in shown.items()))
        return " | ".join(parts)

    def _shown_metrics(self, record: Mapping[str, Any]) -> dict[str, str]:
        out = {}
        for key in self.progress_keys:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = f"{value:.4g}"
        return out

    def _show_progress(self, step: int, record: Mapping[str, Any]) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(self._shown_metrics(record), refresh=False)
            self._bar.refresh()
            return
        print(self.progress_line(step, record), file=self.stream, flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class JsonlFile:
    """An append-only JSON-lines log in the run's log folder, opened on the first line written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handle: IO[str] | None = None

    def write(self, record: Mapping[str, Any]) -> None:
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._handle.write(json.dumps(record, default=str) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` back (tests, summaries)."""
    text = read_capped(path, METRICS_BYTES).decode("utf-8")
    return [parse_json(line) for line in text.splitlines() if line.strip()]
