"""What a finished run measured: its calibration records and per-step memory samples.

A run folder is the runtime's log folder (``logging.dir``): ``calibration.jsonl`` (records in the
contract's format, :mod:`rlc.contract.calibration_record`) and ``metrics.jsonl`` (one line per
step, with ``memory/<phase>/used_gib`` samples). :func:`read_run` reads both, typed; a malformed
line raises ``CalibrationError`` naming the file and line.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlc.compiler.files import JsonError, parse_json, read_text_capped
from rlc.compiler.planner.calibration import CalibrationError, parse_record
from rlc.contract.calibration_record import STEP_MEMORY_PHASES, CalibrationRecord, memory_metric_key

#: Largest run record file (metrics JSONL of a long run) read by `rlc calibrate`.
RUN_FILE_BYTES = 1 << 30

CALIBRATION_LOG = "calibration.jsonl"
METRICS_LOG = "metrics.jsonl"
#: The step metric with the GiB that ``sleep`` handed back to the device.
SLEEP_FREED_KEY = "memory/sleep_freed_gib"


@dataclass(frozen=True)
class RunMeasurements:
    """One run folder, read."""

    path: Path
    records: tuple[CalibrationRecord, ...]
    step_used_gib: dict[str, tuple[float, ...]]  # step phase -> device used GiB, one value per step
    sleep_freed_gib: tuple[float, ...]  # per step

    @property
    def gpu_type(self) -> str:
        return self.records[0].gpu_type

    @property
    def versions(self) -> dict[str, str]:
        return dict(self.records[0].versions)

    def used(self, phase: str, *, min_step: int = 0) -> list[float]:
        """``used_gib`` of every record of ``phase`` taken at step >= ``min_step``."""
        return [r.used_gib for r in self.records if r.phase == phase and r.step >= min_step]

    def first(self, phase: str) -> Optional[CalibrationRecord]:
        return next((r for r in self.records if r.phase == phase), None)

    def step_median(self, phase: str) -> Optional[float]:
        values = self.step_used_gib.get(phase, ())
        return statistics.median(values) if values else None


def _lines(path: Path) -> list[tuple[int, str]]:
    try:
        text = read_text_capped(path, RUN_FILE_BYTES)
    except UnicodeDecodeError:
        raise CalibrationError(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def read_run(run_dir: str | Path) -> RunMeasurements:
    """Read ``calibration.jsonl`` and ``metrics.jsonl`` of one run folder."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise CalibrationError(f"{folder}: not a folder (give the run's log folder, logging.dir)")
    cal_path, metrics_path = folder / CALIBRATION_LOG, folder / METRICS_LOG
    records = []
    for n, line in _lines(cal_path):
        try:
            records.append(parse_record(line))
        except CalibrationError as exc:
            raise CalibrationError(f"{cal_path}:{n}: {exc}") from None
    if not records:
        raise CalibrationError(f"{cal_path}: no calibration records")
    used: dict[str, list[float]] = {phase: [] for phase in STEP_MEMORY_PHASES}
    freed: list[float] = []
    if metrics_path.exists():
        for n, line in _lines(metrics_path):
            try:
                row = parse_json(line)
            except JsonError as exc:
                raise CalibrationError(f"{metrics_path}:{n}: {exc}") from None
            if not isinstance(row, dict):
                raise CalibrationError(f"{metrics_path}:{n}: a metrics line is a JSON object")
            for phase in STEP_MEMORY_PHASES:
                value = row.get(memory_metric_key(phase, "used_gib"))
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    used[phase].append(float(value))
            if isinstance(row.get(SLEEP_FREED_KEY), (int, float)):
                freed.append(float(row[SLEEP_FREED_KEY]))
    return RunMeasurements(folder, tuple(records), {k: tuple(v) for k, v in used.items() if v}, tuple(freed))
