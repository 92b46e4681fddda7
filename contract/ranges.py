"""Every number in ``runtime.yaml`` in range, checked where the runtime reads it.

``rlc compile`` writes ``runtime.yaml`` from a recipe the schema accepted, but the runtime also reads
one edited by hand or changed at start (``python -m rlc.runtime runtime.yaml grpo.max_steps=-5``
used to start a run of -5 steps). The ranges come from one place, the recipe schema
(``rlc/schemas/recipe.schema.json``, shipped with rlc): a ``runtime.yaml`` key takes the range of
the recipe key it is resolved from (each ``runtime.yaml`` field names it, :data:`RECIPE_KEYS`). The few
numbers the compiler derives, with no recipe key of their own, declare their range
(:data:`DERIVED`). A test checks that every number the runtime reads has one or the other.

Pure Python (the schema is read as JSON, without ``jsonschema``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from functools import lru_cache
from typing import Any

from rlc.contract.declare import settings
from rlc.contract.runtime_types import RuntimeConfig
from rlc.schemas import RECIPE_SCHEMA

Bound = tuple[float | None, float | None]  # (minimum, maximum), both inclusive; None: unbounded there


def _declared() -> tuple[dict[str, str], dict[str, Bound]]:
    """From the ``runtime.yaml`` types' declarations: the recipe key each key is resolved from, and the
    range of each number the compiler derives."""
    sources: dict[str, str] = {}
    derived: dict[str, Bound] = {}

    def walk(cls: type, prefix: str) -> None:
        for name, tp, meta in settings(cls):
            path = f"{prefix}.{name}" if prefix else name
            if meta.get("recipe") is not None:
                sources[path] = meta["recipe"]
            elif {tp, *typing.get_args(tp)} & {int, float}:
                derived[path] = meta["range"]
            for inner in (tp, *typing.get_args(tp)):
                if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                    walk(inner, path)

    walk(RuntimeConfig, "")
    return sources, derived


#: ``runtime.yaml`` key -> the recipe key it is resolved from (where that key's range lives).
RECIPE_KEYS, _DERIVED = _declared()
#: Numbers the compiler derives (no recipe key of their own): their ranges, from their declarations;
#: ``refit.alignment_bytes`` keeps the wider range runtimes have always read.
DERIVED: dict[str, Bound] = {**_DERIVED, "refit.alignment_bytes": (1, 1 << 30)}


@lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    text = RECIPE_SCHEMA.read_text(encoding="utf-8")
    data = json.loads(text)
    assert isinstance(data, dict)
    return data


def _branches(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for key in ("oneOf", "anyOf", "allOf"):
        out.extend(sub for sub in node.get(key, []) if isinstance(sub, dict))
    return out


def _numeric(node: dict[str, Any]) -> bool:
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types or ())
    return bool(types & {"integer", "number"}) or any(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in [node.get("const"), *node.get("enum", [])])


@lru_cache(maxsize=1)
def schema_ranges() -> dict[str, tuple[dict[str, Any], ...]]:
    """Recipe key path (``a.b``, list items as ``a.b[]``) -> the numeric schema nodes allowed there."""
    found: dict[str, list[dict[str, Any]]] = {}

    def walk(node: dict[str, Any], path: str) -> None:
        for branch in _branches(node):
            if path and _numeric(branch):
                found.setdefault(path, []).append(branch)
            for key, sub in branch.get("properties", {}).items():
                walk(sub, f"{path}.{key}" if path else key)
            if isinstance(branch.get("items"), dict):
                walk(branch["items"], f"{path}[]")

    walk(_schema(), "")
    return {k: tuple(v) for k, v in found.items()}


def _in_node(value: float, node: dict[str, Any]) -> bool:
    if "const" in node:
        return bool(value == node["const"])
    if "enum" in node:
        return value in node["enum"]
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types or ())
    if types == {"integer"} or types == {"integer", "null"}:
        if not float(value).is_integer():
            return False
    if "minimum" in node and value < node["minimum"]:
        return False
    if "maximum" in node and value > node["maximum"]:
        return False
    if "exclusiveMinimum" in node and value <= node["exclusiveMinimum"]:
        return False
    if "exclusiveMaximum" in node and value >= node["exclusiveMaximum"]:
        return False
    return True


def _describe(nodes: tuple[dict[str, Any], ...]) -> str:
    parts = []
    for node in nodes:
        if "const" in node:
            parts.append(repr(node["const"]))
        elif "enum" in node:
            parts.append(" or ".join(repr(v) for v in node["enum"] if not isinstance(v, str)))
        else:
            low = (f">= {node['minimum']}" if "minimum" in node else
                   f"> {node['exclusiveMinimum']}" if "exclusiveMinimum" in node else "")
            high = (f"<= {node['maximum']}" if "maximum" in node else
                    f"< {node['exclusiveMaximum']}" if "exclusiveMaximum" in node else "")
            parts.append(" and ".join(p for p in (low, high) if p) or "any number")
    return "; or ".join(p for p in parts if p)


def recipe_key(runtime_key: str) -> str:
    """The recipe key a ``runtime.yaml`` key (``train_parallel.tp``) is resolved from."""
    base, brackets, _ = runtime_key.partition("[")
    return RECIPE_KEYS.get(base, base) + ("[]" if brackets else "")


def range_of(runtime_key: str) -> tuple[dict[str, Any], ...] | None:
    """The schema nodes (or a :data:`DERIVED` bound as one) that give ``runtime_key`` its range."""
    if runtime_key in DERIVED:
        low, high = DERIVED[runtime_key]
        node: dict[str, Any] = {}
        if low is not None:
            node["minimum"] = low
        if high is not None:
            node["maximum"] = high
        return (node,)
    return schema_ranges().get(recipe_key(runtime_key))


def range_problems(data: Any) -> list[str]:
    """``key: value is out of range: allowed ...`` for every number of a ``runtime.yaml`` mapping
    outside its range (non-finite numbers included); numbers under free-form mappings are not
    checked (``env``, ``extensions``, ``*_kwargs``)."""
    problems: list[str] = []

    def walk(node: Any, path: str, list_item: bool = False) -> None:
        if isinstance(node, dict):
            nodes = range_of(path) if path else None
            if nodes is None and path and not schema_has_object(recipe_key(path)):
                return  # a free-form mapping
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        elif isinstance(node, list):
            for item in node:
                walk(item, f"{path}[]", True)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            if isinstance(node, float) and not math.isfinite(node):
                problems.append(f"{path}: {node!r} is not a finite number")
                return
            nodes = range_of(path)
            if nodes and not any(_in_node(node, n) for n in nodes):
                problems.append(f"{path}: {node!r} is out of range: allowed {_describe(nodes)}")

    walk(data, "")
    return problems


def declared_default(runtime_key: str) -> tuple[bool, Any]:
    """``(True, default)`` of the recipe key a ``runtime.yaml`` key is resolved from, as the schema
    declares it; ``(False, None)`` for a key without one (derived, or below a free-form mapping)."""
    if runtime_key not in RECIPE_KEYS:
        return False, None
    node: Any = _schema()
    for part in RECIPE_KEYS[runtime_key].split("."):
        node = node.get("properties", {}).get(part)
        if not isinstance(node, dict):
            return False, None
    return ("default" in node), node.get("default")


@lru_cache(maxsize=None)
def schema_has_object(recipe_path: str) -> bool:
    """Whether the schema describes the keys under ``recipe_path`` (False for free-form mappings)."""
    node: Any = _schema()
    for part in recipe_path.split("."):
        nxt = None
        for branch in _branches(node):
            props = branch.get("properties", {})
            if part in props:
                nxt = props[part]
                break
        if nxt is None:
            return False
        node = nxt
    return any("properties" in b for b in _branches(node))
