"""What the NeMo-RL importer produces: the rlc values it mapped, the NeMo-RL keys it left out and why, the rlc
keys the user still has to set (the mapping in ``mapping.py`` and the key groups in ``training_keys.py`` fill
them in)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Unmappable(ValueError):
    """A NeMo-RL value rlc cannot express; the message says why."""


@dataclass(frozen=True)
class MappedValue:
    """One rlc key, its value, the NeMo-RL keys it came from and a note on the translation."""

    target: str
    value: Any
    sources: tuple[str, ...]
    note: str = ""


@dataclass(frozen=True)
class Unmapped:
    """A NeMo-RL key left out of the recipe, with its value and why."""

    key: str
    value: Any
    reason: str
    inactive: bool = False  # part of a NeMo-RL component this config turns off
    #: what leaving it out does (effects.py): "changes" the experiment, "none", "default" (NeMo-RL's own
    #: default or unset); "" until the mapper classifies it
    effect: str = ""


@dataclass(frozen=True)
class MissingKey:
    """An rlc key NeMo-RL configs do not carry: the user sets it with ``--set``."""

    key: str
    why: str
    example: str


@dataclass
class Mapping:
    values: list[MappedValue] = field(default_factory=list)
    unmapped: list[Unmapped] = field(default_factory=list)
    missing: list[MissingKey] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # translation choices worth reading
    # NeMo-RL keys read but not written as a value of their own, and why (null = rlc default, a flag
    # implied by another key, a value equal to the one already written)
    implied: dict[str, str] = field(default_factory=dict)
