"""Read a NeMo-RL config the way NeMo-RL reads it (``nemo_rl/utils/config.py``), with OmegaConf.

* ``defaults:`` names one parent or a list of parents, relative to the file that names them (or
  absolute). Parents are loaded depth-first and merged left to right, then the file itself is merged
  on top: the last one wins. Mappings merge key by key, lists and scalars replace (OmegaConf.merge).
* A section carrying ``_override_: true`` replaces the inherited section instead of merging into it.
* ``${a.b}`` interpolations and NeMo-RL's resolvers (``${mul:..}``, ``add``, ``sub``, ``div``,
  ``max``) resolve after the command-line overrides, so an override of ``a.b`` reaches every value
  that refers to it.
* Command-line overrides follow Hydra's forms: ``key=value`` (the key must exist), ``+key=value``
  (add a new key), ``++key=value`` (add or replace), ``~key`` (delete). Values are read as YAML.

Besides the values, the loader records where each leaf came from (``file:line`` or
``command line``), so the written recipe can say it.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, cast

import yaml

from rlc.compiler.files import read_text_capped

OVERRIDE_ORIGIN = "command line"
_RESOLVERS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}


class NemoRlConfigError(Exception):
    """The NeMo-RL config cannot be read (missing file, bad YAML, bad defaults, interpolation, override)."""


@dataclass(frozen=True)
class NemoRlConfig:
    """A NeMo-RL config after defaults, overrides and interpolation.

    ``values``: plain dicts/lists with every interpolation resolved; ``raw``: the same before
    resolution (interpolation strings kept); ``origins``: dotted leaf key -> ``file:line`` or
    ``command line``; ``files``: every file of the defaults chain, in merge order.
    """

    values: dict[str, Any]
    raw: dict[str, Any]
    origins: dict[str, str]
    files: tuple[str, ...]

    def leaves(self) -> dict[str, Any]:
        """Dotted key -> resolved value for every leaf (lists and empty mappings are leaves)."""
        return flatten(self.values)

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.values
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def raw_text(self, key: str) -> Any:
        """The value as written (``${...}`` kept), or ``None`` when the key is absent."""
        node: Any = self.raw
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of nested mappings; lists, scalars and empty mappings are leaves."""
    out: dict[str, Any] = {}
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    elif prefix:
        out[prefix] = tree
    return out


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver  # 2.4 / 2.3
    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            register(name, fn)


def _key_lines(text: str) -> dict[str, int]:
    """Dotted key -> 1-based line of every mapping key in one YAML file."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            lines[path] = key_node.start_mark.line + 1
            walk(value_node, path)

    walk(root, "")
    lines.pop("defaults", None)
    return lines


@dataclass
class _Source:
    label: str  # file path as shown, or OVERRIDE_ORIGIN
    lines: dict[str, int]  # dotted key -> line (0 when unknown)


def _merge_with_override(base: Any, override: Any) -> Any:
    """NeMo-RL's merge: a section marked ``_override_: true`` replaces the inherited one."""
    from omegaconf import DictConfig, OmegaConf

    for key in list(override.keys()):
        child = override[key]
        if isinstance(child, DictConfig) and child.get("_override_", False):
            child.pop("_override_")
            if key in base:
                base.pop(key)
    return OmegaConf.merge(base, override)


def _load(path: Path, shown: str, stack: tuple[Path, ...], sources: list[_Source]) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    resolved = path.resolve()
    if resolved in stack:
        chain = " -> ".join(str(p) for p in (*stack, resolved))
        raise NemoRlConfigError(f"defaults cycle: {chain}")
    try:
        text = read_text_capped(path)
    except FileNotFoundError:
        via = f" (named in defaults of {stack[-1]})" if stack else ""
        raise NemoRlConfigError(f"{shown}: no such file{via}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NemoRlConfigError(f"{shown}: cannot read: {exc}") from None
    try:
        config = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except Exception as exc:  # OmegaConf wraps yaml errors in several types
        raise NemoRlConfigError(f"{shown}: not valid YAML: {exc}") from None
    if not isinstance(config, DictConfig):
        raise NemoRlConfigError(f"{shown}: a NeMo-RL config must be a mapping, not a list")
    parents: list[str] = []
    if "defaults" in config:
        defaults = config.pop("defaults")
        if isinstance(defaults, ListConfig):
            parents = [str(d) for d in defaults]
        elif defaults is not None:
            parents = [str(defaults)]
    base = OmegaConf.create({})
    for ref in parents:
        parent = Path(ref) if ref.startswith("/") else path.parent / ref
        parent_cfg = _load(parent, os.path.normpath(str(parent)), (*stack, resolved), sources)
        base = _merge_with_override(base, parent_cfg)
    sources.append(_Source(shown, _key_lines(text)))
    return _merge_with_override(base, config) if parents else config


def _parse_override(text: str) -> tuple[str, str, Any]:
    """``(mode, key, value)``; mode is ``set`` / ``add`` / ``force`` / ``delete``."""
    if text.startswith("~"):
        key = text[1:].partition("=")[0].strip()
        return "delete", key, None
    mode = "set"
    if text.startswith("++"):
        mode, text = "force", text[2:]
    elif text.startswith("+"):
        mode, text = "add", text[1:]
    key, sep, value_text = text.partition("=")
    if not sep or not key.strip():
        raise NemoRlConfigError(f"override {text!r}: expected KEY=VALUE, e.g. "
                                "policy.megatron_cfg.tensor_model_parallel_size=4")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else ""
    except yaml.YAMLError as exc:
        raise NemoRlConfigError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    return mode, key.strip(), value


def _has_key(config: Any, key: str) -> bool:
    from omegaconf import DictConfig

    node = config
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


def _apply_overrides(config: Any, overrides: Sequence[str]) -> list[str]:
    from omegaconf import OmegaConf

    keys = []
    for text in overrides:
        mode, key, value = _parse_override(text)
        exists = _has_key(config, key)
        if mode == "set" and not exists:
            known = list(flatten(OmegaConf.to_container(config, resolve=False)))
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else f"; to add it, write +{key}=..."
            raise NemoRlConfigError(f"override {text!r}: {key} is not in the NeMo-RL config{hint}")
        if mode == "add" and exists:
            raise NemoRlConfigError(f"override {text!r}: {key} already exists; write {key}=... (or ++{key}=...)")
        if mode == "delete":
            if not exists:
                raise NemoRlConfigError(f"override {text!r}: {key} is not in the NeMo-RL config")
            *parents, leaf = key.split(".")
            node = OmegaConf.select(config, ".".join(parents)) if parents else config
            node.pop(leaf)
        else:
            OmegaConf.update(config, key, value, merge=False, force_add=True)
        keys.append(key)
    return keys


def load_nemo_rl_config(path: str | Path, overrides: Sequence[str] = ()) -> NemoRlConfig:
    """Load ``path`` with its defaults chain, apply Hydra-style ``overrides``, resolve interpolations."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register_resolvers()
    sources: list[_Source] = []
    config = _load(Path(path), os.path.normpath(str(path)), (), sources)
    override_keys = _apply_overrides(config, overrides)
    raw = OmegaConf.to_container(config, resolve=False)
    try:
        values = OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise NemoRlConfigError(f"{path}: cannot resolve the interpolation of {key}: {exc.msg if hasattr(exc, 'msg') else exc}") from None
    assert isinstance(values, dict) and isinstance(raw, dict)
    origins: dict[str, str] = {}
    for leaf in flatten(values):
        if any(leaf == k or leaf.startswith(k + ".") for k in override_keys):
            origins[leaf] = OVERRIDE_ORIGIN
            continue
        for source in reversed(sources):
            line = _line_for(source.lines, leaf)
            if line is not None:
                origins[leaf] = f"{source.label}:{line}"
                break
    return NemoRlConfig(values=cast("dict[str, Any]", values), raw=cast("dict[str, Any]", raw), origins=origins, files=tuple(s.label for s in sources))


def _line_for(lines: dict[str, int], leaf: str) -> int | None:
    """The line of ``leaf``'s key in one file (lists and ``{}`` are leaves, so their key is it)."""
    return lines.get(leaf)
