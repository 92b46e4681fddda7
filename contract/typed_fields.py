"""Resolved field annotations of a dataclass, worked out once per class.

The runtime config classes and the typed recipe both declare ``from __future__ import annotations``,
so their annotations are strings; ``typing.get_type_hints`` evaluates every one of them on each call.
Building a runtime config (and one per recipe in ``rlc lint``) asks for the same few classes thousands
of times, so both sides read them through :func:`field_types`.
"""
from __future__ import annotations

import typing
from typing import Any

_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, computed on the first call for ``cls`` and kept."""
    found = _FIELD_TYPES.get(cls)
    if found is None:
        found = _FIELD_TYPES[cls] = typing.get_type_hints(cls)
    return found
