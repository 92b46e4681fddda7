"""vLLM sleep-mode semantics per vLLM version (``vllm_sleep.yaml``), typed.

Which vLLM version a recipe plans against: ``generation.vllm_version``, else the vLLM version of the
calibration entry the planner uses for the GPU (:func:`planned_vllm_version`). The resolver records
the same value in runtime.yaml, so the plan and the bundle name one version.

For a version, :func:`sleep_semantics` gives, per sleep level, where the weight shard is while the
engine sleeps (the train step), at the refit, and whether sleeping keeps a host-memory copy; and,
where one was reported, the residue growth over steps (runtime calibration records, per step).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from rlc.compiler.recipe_types import Recipe
from rlc.contract.calibration_record import CalibrationRecord, CalibrationRecordError
from rlc.compiler.tables import parse_table

SLEEP_FILE = Path(__file__).with_name("vllm_sleep.yaml")


class SleepTableError(ValueError):
    """``vllm_sleep.yaml`` does not match its documented format."""


@dataclass(frozen=True)
class SleepLevel:
    """What one sleep level does with vLLM's weight shard."""

    gpu_asleep: bool  # the shard stays on the GPU while the engine sleeps (train step)
    gpu_at_refit: bool  # the shard is on the GPU when the refit buffer is sized
    host_copy: bool  # sleeping keeps a copy of the shard in host memory (pinned)
    source: str


@dataclass(frozen=True)
class ResidueGrowth:
    """vLLM memory still in use after sleep, per step, from runtime calibration records."""

    used_gib_by_step: tuple[tuple[int, float], ...]  # (step, device GiB in use after sleep), sorted
    moe_only: bool  # reported for MoE models only
    source: str
    versions: tuple[str, ...] = ()  # the vLLM versions the records were taken on

    def recorded_for(self, version: str) -> bool:
        """Whether the records were taken on ``version``'s release series (same major.minor); the entry
        carries the growth to later versions too, where it is a projection."""
        series = {version_key(v)[:2] for v in self.versions}
        return version_key(version)[:2] in series

    @property
    def first_gib(self) -> float:
        return self.used_gib_by_step[0][1]

    @property
    def peak_gib(self) -> float:
        return max(used for _, used in self.used_gib_by_step)

    @property
    def growth_gib(self) -> float:
        """How much the after-sleep residue grew from the first sleep to its peak."""
        return self.peak_gib - self.first_gib

    def series(self) -> str:
        return " → ".join(f"{used:g}" for _, used in self.used_gib_by_step) + " GiB"


@dataclass(frozen=True)
class SleepSemantics:
    """Sleep-mode semantics of the vLLM versions from ``since`` to the next entry."""

    since: str
    label: str
    levels: dict[int, SleepLevel]
    residue_growth: Optional[ResidueGrowth] = None

    def level(self, n: int) -> SleepLevel:
        if n not in self.levels:
            raise SleepTableError(f"vllm_sleep.yaml: entry {self.since} has no sleep level {n}")
        return self.levels[n]


def version_key(version: str) -> tuple[int, ...]:
    """``"0.17.1"`` -> ``(0, 17, 1)`` (anything after the numbers, e.g. ``+cu130``, is ignored)."""
    m = re.match(r"^(\d+(?:\.\d+)*)", str(version).strip())
    if not m:
        raise SleepTableError(f"not a version: {version!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def after_sleep_series(records: Iterable[CalibrationRecord]) -> tuple[tuple[int, float], ...]:
    """(step, device GiB in use) of the ``after_sleep`` records — the runtime writes one per step."""
    return tuple(sorted((r.step, r.used_gib) for r in records if r.phase == "after_sleep"))


def _records(path: Path) -> list[CalibrationRecord]:
    """A shipped series: runtime calibration records (``calibration.jsonl`` format), read with the
    contract's own parser."""
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(CalibrationRecord.from_json(line))
            except CalibrationRecordError as exc:
                raise SleepTableError(f"{path.name}:{n}: {exc}") from None
    if not after_sleep_series(records):
        raise SleepTableError(f"{path.name}: no after_sleep records")
    return records


def _growth(raw: Optional[Mapping[str, Any]]) -> Optional[ResidueGrowth]:
    if not raw:
        return None
    records = _records(SLEEP_FILE.with_name(str(raw["records"])))
    versions = tuple(sorted({str(r.versions["vllm"]) for r in records if r.versions.get("vllm")}))
    return ResidueGrowth(used_gib_by_step=after_sleep_series(records), moe_only=bool(raw.get("moe_only", False)),
                         source=" ".join(str(raw["source"]).split()), versions=versions)


@lru_cache(maxsize=1)
def load_sleep_table() -> tuple[SleepSemantics, ...]:
    """Every entry of ``vllm_sleep.yaml``, sorted by ``since``."""
    raw = parse_table(SLEEP_FILE.read_text(encoding="utf-8"))
    if not isinstance(raw, dict) or raw.get("format") != 1 or not raw.get("entries"):
        raise SleepTableError("vllm_sleep.yaml must have format: 1 and a non-empty entries list")
    out = []
    for e in raw["entries"]:
        levels = {int(n): SleepLevel(gpu_asleep=bool(v["gpu_asleep"]), gpu_at_refit=bool(v["gpu_at_refit"]),
                                     host_copy=bool(v["host_copy"]), source=" ".join(str(v["source"]).split()))
                  for n, v in e["levels"].items()}
        if set(levels) != {1, 2}:
            raise SleepTableError(f"vllm_sleep.yaml: entry {e.get('since')} must give levels 1 and 2")
        out.append(SleepSemantics(since=str(e["since"]), label=str(e["label"]), levels=levels,
                                  residue_growth=_growth(e.get("residue_growth"))))
    return tuple(sorted(out, key=lambda s: version_key(s.since)))


def sleep_semantics(version: str) -> SleepSemantics:
    """The entry that applies to vLLM ``version`` (the earliest entry for older versions)."""
    table = load_sleep_table()
    key = version_key(version)
    chosen = table[0]
    for entry in table:
        if version_key(entry.since) <= key:
            chosen = entry
    return chosen


def planned_vllm_version(recipe: Recipe, calibration_versions: Mapping[str, str]) -> str:
    """``generation.vllm_version``, else the calibration entry's vLLM version."""
    stated = recipe.generation.vllm_version
    if stated:
        return str(stated)
    version = calibration_versions.get("vllm")
    if not version:
        raise SleepTableError("the calibration entry names no vLLM version")
    return str(version)


__all__ = ["after_sleep_series", "ResidueGrowth", "SleepLevel", "SleepSemantics", "SleepTableError", "load_sleep_table",
           "planned_vllm_version", "sleep_semantics", "version_key"]
