"""Dotted overrides at runtime start: ``python -m rlc.runtime runtime.yaml grpo.max_steps=10``.

The compiled ``runtime.yaml`` stays the record of what the compiler decided; an override changes this
one start only (say, fewer steps, or a refit switch turned off on purpose to reproduce a failure the
compiler's rules would refuse). Values are parsed by OmegaConf's dotlist grammar (``false``, ``10``,
``[]``, ``[a, b]``); the result goes through the same strict loader as the file, so an unknown key or a
wrong type fails with its key path. Every override is logged with its old and new value.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from rlc.contract.runtime_config import RuntimeConfig, RuntimeConfigError, runtime_config_from_dict


def _lookup(data: Any, dotted: str) -> Any:
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return "<unset>"
        node = node[part]
    return node


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with each ``key=value`` applied; returns the new mapping and one line per change."""
    from omegaconf import OmegaConf  # noqa: PLC0415
    from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415

    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key or key != key.strip():
            raise RuntimeConfigError(f"override {item!r}: expected KEY=VALUE with a dotted key, e.g. grpo.max_steps=10")
    try:
        patch = OmegaConf.from_dotlist(list(overrides))
        merged = OmegaConf.merge(OmegaConf.create(data), patch)
        result = OmegaConf.to_container(merged, resolve=False)
    except OmegaConfBaseException as exc:
        raise RuntimeConfigError(f"overrides {overrides}: {exc}") from None
    assert isinstance(result, dict)
    changes = []
    for item in overrides:
        key = item.partition("=")[0]
        changes.append(f"{key}: {_lookup(data, key)!r} -> {_lookup(result, key)!r}")
    return cast("dict[str, Any]", result), changes  # runtime.yaml keys are strings


def load_with_overrides(path: str | Path, overrides: list[str]) -> tuple[RuntimeConfig, list[str]]:
    """Read ``runtime.yaml``, apply ``overrides``, build the typed config (strict keys and types)."""
    import yaml  # noqa: PLC0415

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise RuntimeConfigError(f"{path}: not a mapping")
    changes: list[str] = []
    if overrides:
        data, changes = apply_overrides(data, overrides)
    return runtime_config_from_dict(data), changes
