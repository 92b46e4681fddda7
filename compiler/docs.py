"""Render the recipe reference (``docs/reference.md``) from the JSON Schema.

``rlc schema --markdown`` prints it; a test keeps ``docs/reference.md`` equal to it. One section
per mapping (``## cluster.slurm``), one table row per key: type and allowed values, default,
description. Written by hand because the schema-to-docs generators on PyPI produce HTML or need
a docs toolchain; this is ~100 lines of string formatting over a schema we control.
"""
from __future__ import annotations

import json
from typing import Any

PathPart = str

HEADER = """\
<!-- Generated from the key declarations in rlc/compiler/recipe_types.py (through rlc/schemas/recipe.schema.json,
     `rlc schema --markdown`). Do not edit by hand; run `python -m rlc.compiler.declarations` after changing one. -->
"""


def _code(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    return f"`{text}`" if text != "" else '`""`'


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(node: dict[str, Any]) -> str:
    alternatives = node.get("oneOf") or node.get("anyOf")
    if alternatives:
        return " or ".join(_type(sub) for sub in alternatives)
    if "const" in node:
        return _code(node["const"])
    if "enum" in node:
        return " \\| ".join(_code(v) for v in node["enum"])
    kind = node.get("type")
    if isinstance(kind, list):
        text = " or ".join(kind)
    elif kind == "array":
        items = node.get("items")
        text = f"list of {_type(items)}" if isinstance(items, dict) else "list"
    elif kind == "object":
        text = "mapping"
    else:
        text = kind or "any"
    limits = []
    for key, op in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<")):
        if key in node:
            limits.append(f"{op} {node[key]}")
    if "minLength" in node and node["minLength"] > 0:
        limits.append("non-empty" if node["minLength"] == 1 else f"≥ {node['minLength']} chars")
    if "maxLength" in node:
        limits.append(f"≤ {node['maxLength']} chars")
    if "pattern" in node:
        limits.append(f"pattern `{node['pattern']}`")
    return text + (f" ({', '.join(limits)})" if limits else "")


def _objects(node: dict[str, Any], path: tuple[PathPart, ...]) -> list[tuple[tuple[PathPart, ...], dict[str, Any]]]:
    """Every mapping with declared keys, depth first, schema order."""
    out = []
    if node.get("properties"):
        out.append((path, node))
        for key, sub in node["properties"].items():
            out.extend(_objects(sub, path + (key,)))
    items = node.get("items")
    if isinstance(items, dict):
        out.extend(_objects(items, path + ("[]",)))
    return out


def render_markdown(schema: dict[str, Any]) -> str:
    """The Markdown reference for ``schema``."""
    lines = [HEADER, f"# {schema.get('title', 'Recipe reference')}", ""]
    if schema.get("description"):
        lines += [schema["description"], ""]
    lines += [
        "Keys marked **required** must be set; every other key has the default shown or is "
        "optional. Mappings not listed with keys accept any keys (`extensions`, `reward.kwargs`).",
        "",
    ]
    for path, node in _objects(schema, ()):
        title = ".".join(str(p) for p in path).replace(".[]", "[]")
        lines.append(f"## `{title}`" if path else "## Top-level keys")
        lines.append("")
        if path and node.get("description"):
            lines += [node["description"], ""]
        required = set(node.get("required", []))
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for key, sub in node["properties"].items():
            default = _code(sub["default"]) if "default" in sub else ("**required**" if key in required else "")
            lines.append(f"| `{key}` | {_cell(_type(sub))} | {_cell(default)} | {_cell(sub.get('description', ''))} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"
