"""Small helpers on recipe trees (nested dicts addressed by dotted key paths)."""
from __future__ import annotations

from typing import Any


def with_value(tree: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``tree`` with the dotted ``path`` set to ``value`` (missing mappings created), ``tree`` unchanged.

    The mappings on the path are copied, everything else is shared with ``tree``: treat both as
    read-only values (the planner re-plans a recipe once per candidate fix).
    """
    out = dict(tree)
    node = out
    *parents, leaf = path.split(".")
    for part in parents:
        child = node.get(part)
        node[part] = dict(child) if isinstance(child, dict) else {}
        node = node[part]
    node[leaf] = value
    return out
