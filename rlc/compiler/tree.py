"""Small helpers on recipe trees (nested dicts addressed by dotted key paths)."""
from __future__ import annotations

import copy
from typing import Any


def with_value(tree: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``tree`` with the dotted ``path`` set to ``value`` (missing mappings created)."""
    out = copy.deepcopy(tree)
    node = out
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out
