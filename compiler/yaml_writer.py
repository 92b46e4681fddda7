"""Block-style YAML with a comment after each key: ``rlc show --origin`` and the recipes ``rlc import`` writes.

PyYAML cannot write comments, hence :func:`dump_yaml`, a small emitter whose scalars still go through PyYAML
(double-quoted where rlc's YAML 1.2 loader would read them as another type).
"""
from __future__ import annotations

from typing import Any, Callable

from rlc.compiler.diagnostics import PathPart


def _yaml_scalar(value: Any) -> str:
    """One scalar in YAML that rlc's YAML 1.2 loader reads back as the same value."""
    import yaml  # noqa: PLC0415 - PyYAML loads when a value is written: `import rlc.compiler.cli` stays light

    from rlc.compiler.yaml_loader import Resolver12  # noqa: PLC0415 - (PyYAML, as above)

    style = None
    if isinstance(value, str):
        tag = Resolver12().resolve(yaml.ScalarNode, value, (True, False))
        if tag != "tag:yaml.org,2002:str" or not value.isprintable() or value != value.strip():
            style = '"'  # PyYAML's double quotes escape control and line-break characters
    if isinstance(value, dict) and not value:
        return "{}"
    if isinstance(value, list) and not value:
        return "[]"
    text = yaml.safe_dump(value, default_flow_style=True, default_style=style, allow_unicode=True,
                          width=1 << 30)
    text = text.rstrip("\n")
    return text[:-4] if text.endswith("\n...") else text


def dump_yaml(data: Any, comment: Callable[[tuple[PathPart, ...]], str | None] | None = None) -> str:
    """Block-style YAML for ``data``; ``comment(path)`` adds ``  # text`` after each key/item.

    PyYAML cannot write comments, hence this small emitter; scalars still go through PyYAML
    (double-quoted for strings that YAML 1.2 would read as another type), so quoting and escaping
    are PyYAML's.
    """
    lines: list[str] = []

    def note(path: tuple[PathPart, ...]) -> str:
        text = comment(path) if comment else None
        return f"  # {text}" if text else ""

    def nested(value: Any) -> bool:
        return isinstance(value, (dict, list)) and bool(value)

    def emit(value: Any, path: tuple[PathPart, ...], indent: int) -> None:
        pad = " " * indent
        if isinstance(value, dict):
            for key, child in value.items():
                head = f"{pad}{_yaml_scalar(key)}:"
                if nested(child):
                    lines.append(head + note(path + (key,)))
                    emit(child, path + (key,), indent + 2)
                else:
                    lines.append(f"{head} {_yaml_scalar(child)}{note(path + (key,))}")
        else:
            for i, child in enumerate(value):
                if isinstance(child, dict) and child:
                    start = len(lines)
                    emit(child, path + (i,), indent + 2)
                    lines[start] = f"{pad}- {lines[start][indent + 2:]}"
                elif nested(child):
                    lines.append(f"{pad}-{note(path + (i,))}")
                    emit(child, path + (i,), indent + 2)
                else:
                    lines.append(f"{pad}- {_yaml_scalar(child)}{note(path + (i,))}")

    if nested(data):
        emit(data, (), 0)
    else:
        lines.append(_yaml_scalar(data))
    return "\n".join(lines) + "\n"
