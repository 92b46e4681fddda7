"""Whether a value is valid under the recipe schema, answered without importing ``jsonschema``.

``jsonschema`` stays the validator whose errors rlc reports (:mod:`rlc.compiler.schema`), but importing
it costs more than every other step of ``rlc validate`` on a valid recipe. :func:`is_valid` answers
the one question asked first, "is there any error?", for the JSON Schema keywords the recipe schema
uses, with ``jsonschema``'s semantics (``rlc``'s integer and number types included: an integer is no
boolean, a number is finite); only a recipe with an error imports ``jsonschema`` to describe it.

A keyword it does not know makes it answer ``None`` ("ask jsonschema"), never a guess;
``tests/compiler/test_schema_check.py`` compares both on thousands of valid and broken recipes.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any


class _Unknown(Exception):
    """A keyword this checker does not implement: the caller asks jsonschema."""


#: Keywords that never make a value invalid (annotations).
_ANNOTATIONS = frozenset({"description", "default", "title", "$schema", "$id", "$comment", "examples",
                          "deprecated", "readOnly", "writeOnly"})


def _unbool(value: Any) -> Any:
    return ("bool", value) if isinstance(value, bool) else value


def _equal(one: Any, two: Any) -> bool:
    """``jsonschema._utils.equal``: JSON equality (``True`` is not ``1``; lists and mappings by item)."""
    if one is two:
        return True
    if isinstance(one, str) or isinstance(two, str):
        return bool(one == two)
    if isinstance(one, Sequence) and isinstance(two, Sequence):
        return len(one) == len(two) and all(_equal(a, b) for a, b in zip(one, two))
    if isinstance(one, Mapping) and isinstance(two, Mapping):
        return len(one) == len(two) and all(k in two and _equal(v, two[k]) for k, v in one.items())
    return bool(_unbool(one) == _unbool(two))


def _is_type(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        if isinstance(value, float):
            return math.isfinite(value)
        return isinstance(value, int) and not isinstance(value, bool)
    raise _Unknown(f"type {name!r}")


def _valid(node: Any, value: Any) -> bool:
    if node is True:
        return True
    if node is False:
        return False
    if not isinstance(node, dict):
        raise _Unknown(f"schema {node!r}")
    for keyword, arg in node.items():
        if keyword in _ANNOTATIONS:
            continue
        check = _CHECKS.get(keyword)
        if check is None:
            raise _Unknown(keyword)
        if not check(arg, value, node):
            return False
    return True


def _type(arg: Any, value: Any, node: dict[str, Any]) -> bool:
    return any(_is_type(value, t) for t in ([arg] if isinstance(arg, str) else arg))


def _properties(arg: dict[str, Any], value: Any, node: dict[str, Any]) -> bool:
    return not isinstance(value, dict) or all(_valid(sub, value[k]) for k, sub in arg.items() if k in value)


def _additional(arg: Any, value: Any, node: dict[str, Any]) -> bool:
    if not isinstance(value, dict):
        return True
    known = node.get("properties", {})
    patterns = "|".join(node.get("patternProperties", {}))
    extras = [k for k in value if k not in known and not (patterns and re.search(patterns, k))]
    if arg is False:
        return not extras
    return all(_valid(arg, value[k]) for k in extras)


def _pattern_properties(arg: dict[str, Any], value: Any, node: dict[str, Any]) -> bool:
    if not isinstance(value, dict):
        return True
    return all(_valid(sub, v) for pattern, sub in arg.items() for k, v in value.items() if re.search(pattern, k))


def _unique(arg: Any, value: Any, node: dict[str, Any]) -> bool:
    if not arg or not isinstance(value, list):
        return True
    return not any(_equal(a, b) for i, a in enumerate(value) for b in value[i + 1:])


def _number(test: Any) -> Any:
    return lambda arg, value, node: not _is_type(value, "number") or test(value, arg)


def _string(test: Any) -> Any:
    return lambda arg, value, node: not isinstance(value, str) or test(value, arg)


def _array(test: Any) -> Any:
    return lambda arg, value, node: not isinstance(value, list) or test(value, arg)


def _one_of(arg: list[Any], value: Any, node: dict[str, Any]) -> bool:
    return sum(1 for sub in arg if _valid(sub, value)) == 1


_CHECKS: dict[str, Any] = {
    "type": _type,
    "enum": lambda arg, value, node: any(_equal(each, value) for each in arg),
    "const": lambda arg, value, node: _equal(value, arg),
    "properties": _properties,
    "additionalProperties": _additional,
    "patternProperties": _pattern_properties,
    "required": lambda arg, value, node: not isinstance(value, dict) or all(k in value for k in arg),
    "propertyNames": lambda arg, value, node: not isinstance(value, dict) or all(_valid(arg, k) for k in value),
    "items": _array(lambda value, arg: all(_valid(arg, v) for v in value)),
    "minItems": _array(lambda value, arg: len(value) >= arg),
    "maxItems": _array(lambda value, arg: len(value) <= arg),
    "uniqueItems": _unique,
    "minimum": _number(lambda value, arg: value >= arg),
    "maximum": _number(lambda value, arg: value <= arg),
    "exclusiveMinimum": _number(lambda value, arg: value > arg),
    "exclusiveMaximum": _number(lambda value, arg: value < arg),
    "minLength": _string(lambda value, arg: len(value) >= arg),
    "maxLength": _string(lambda value, arg: len(value) <= arg),
    "pattern": _string(lambda value, arg: re.search(arg, value) is not None),
    "oneOf": _one_of,
    "anyOf": lambda arg, value, node: any(_valid(sub, value) for sub in arg),
    "allOf": lambda arg, value, node: all(_valid(sub, value) for sub in arg),
    "not": lambda arg, value, node: not _valid(arg, value),
}


def is_valid(schema: dict[str, Any], value: Any) -> bool | None:
    """True when ``value`` has no error under ``schema``, False when it has one, None when the schema
    uses a keyword this checker leaves to ``jsonschema``."""
    try:
        return _valid(schema, value)
    except _Unknown:
        return None
    except RecursionError:
        return None
