"""Dotted overrides at runtime start: ``python -m rlc.runtime runtime.yaml grpo.max_steps=10``.

The compiled ``runtime.yaml`` stays the record of what the compiler decided; an override changes this
one start only (say, fewer steps, or a refit switch turned off on purpose to reproduce a failure the
compiler's rules would refuse). Values are parsed by OmegaConf's dotlist grammar (``false``, ``10``,
``[]``, ``[a, b]``); the result goes through the same strict loader as the file, so an unknown key, a
wrong type or a number out of range fails with its key path. Every override is logged with its old and
new value. Keys and values stay within the limits every resolver in rlc shares (:mod:`rlc.contract.bounds`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from rlc.contract.bounds import key_path_problem, text_problem, value_problem
from rlc.contract.runtime_config import RuntimeConfig, RuntimeConfigError, runtime_config_from_dict
from rlc.contract.runtime_file import read_runtime_yaml


def _lookup(data: Any, dotted: str) -> Any:
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return "<unset>"
        node = node[part]
    return node


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with each ``key=value`` applied; returns the new mapping and one line per change."""
    import yaml  # noqa: PLC0415
    from omegaconf import OmegaConf  # noqa: PLC0415
    from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415

    for item in overrides:
        key, sep, value = item.partition("=")
        shown = item if len(item) <= 200 else f"{item[:200]}... ({len(item)} characters)"
        if not sep or not key or key != key.strip():
            raise RuntimeConfigError(
                f"override {shown!r}: expected KEY=VALUE with a dotted key, e.g. grpo.max_steps=10"
            )
        too_big = key_path_problem(key) or text_problem(value)
        if too_big is not None:
            raise RuntimeConfigError(f"override {shown!r}: {too_big}")
    try:
        patch = OmegaConf.from_dotlist(list(overrides))
        merged = OmegaConf.merge(OmegaConf.create(data), patch)
        result = OmegaConf.to_container(merged, resolve=False)
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as exc:  # (the values are read as YAML)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RuntimeConfigError(f"overrides: {reason}") from None
    except RecursionError:
        raise RuntimeConfigError("overrides: a value nested more deeply than rlc reads") from None
    assert isinstance(result, dict)
    too_big = value_problem(result)
    if too_big is not None:
        raise RuntimeConfigError(f"overrides: {too_big}")
    changes = []
    for item in overrides:
        key = item.partition("=")[0]
        changes.append(f"{key}: {_lookup(data, key)!r} -> {_lookup(result, key)!r}")
    return cast("dict[str, Any]", result), changes  # runtime.yaml keys are strings


def load_with_overrides(path: str | Path, overrides: list[str]) -> tuple[RuntimeConfig, list[str]]:
    """Read ``runtime.yaml``, apply ``overrides``, build the typed config (strict keys, types and ranges).

    Raises ``OSError`` when the file cannot be read and ``RuntimeConfigError`` when its content (or an
    override) is not a config this runtime runs."""
    data = read_runtime_yaml(path)
    changes: list[str] = []
    if overrides:
        data, changes = apply_overrides(data, overrides)
    return runtime_config_from_dict(data), changes
