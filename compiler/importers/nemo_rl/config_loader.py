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

Bounded like every resolver in rlc (:mod:`rlc.contract.bounds`): each file is read by the bounded
reader and must be a mapping of at most ``MAX_NODES`` nodes (aliases counted at every use) with at
least one NeMo-RL section (:data:`NEMO_RL_SECTIONS`): any other YAML file (a secrets or password file
named by mistake) is refused without showing any of it. Override keys and values, each resolver's
result (``${mul:'A',300000000}``) and the resolved config stay within the shared size limits, the
resolution within a time limit, and a chain or cycle of references ends in a message, not a
``RecursionError``. ``${oc.env:VAR}`` would copy the caller's environment into the recipe: it is
refused unless ``allow_env`` (``rlc import nemo-rl --allow-env``).

Besides the values, the loader records where each leaf came from (``file:line`` or
``command line``), so the written recipe can say it.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, cast

import yaml

from rlc.compiler.files import read_text_capped
from rlc.compiler.suggest import closest
from rlc.compiler.yaml_loader import _redact
from rlc.contract.bounds import (
    MAX_DEPTH,
    MAX_NODES,
    MAX_TEXT,
    BoundsError,
    TimeLimit,
    key_path_problem,
    text_problem,
    value_problem,
)

OVERRIDE_ORIGIN = "command line"
_RESOLVERS: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}
#: OmegaConf's own resolvers that read only the config itself (``oc.env`` reads the environment).
_CONFIG_ONLY = ("oc.create", "oc.decode", "oc.deprecated", "oc.select", "oc.dict.keys", "oc.dict.values")
#: Top-level sections of NeMo-RL configs (its MasterConfig for GRPO, and the other algorithms').
NEMO_RL_SECTIONS = frozenset({"policy", "loss_fn", "env", "data", "grpo", "logger", "cluster", "checkpointing",
                              "sft", "dpo", "rm", "distillation", "teacher", "eval", "generation", "defaults"})
#: Largest integer a resolver may return (bits): enough for any size, small enough to print.
_MAX_INT_BITS = 256


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


def _register(name: str, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as resolver ``name`` (replacing one of that name) with OmegaConf 2.4 or 2.3."""
    import omegaconf  # noqa: PLC0415
    from omegaconf import OmegaConf  # noqa: PLC0415

    if tuple(int(p) for p in omegaconf.__version__.split(".")[:2] if p.isdigit()) >= (2, 4):
        OmegaConf.register_resolver(name, fn, replace=True)
    else:  # 2.3: register_resolver is the legacy (string-argument) API there
        OmegaConf.register_new_resolver(name, fn, replace=True)


def _bounded(name: str, fn: Callable[[Any, Any], Any], raised: list[BoundsError]) -> Callable[[Any, Any], Any]:
    """NeMo-RL's arithmetic resolver ``name``, refusing results beyond the shared limits before
    computing them (``${mul:'A',300000000}`` would build 300 million characters); what it refuses is
    also kept in ``raised`` (OmegaConf rewraps a resolver's exception in its own)."""
    def run(a: Any, b: Any) -> Any:
        try:
            return checked(a, b)
        except BoundsError as exc:
            raised.append(exc)
            raise

    def checked(a: Any, b: Any) -> Any:
        for seq, times in ((a, b), (b, a)):
            if (name == "mul" and isinstance(seq, (str, list)) and isinstance(times, int)
                    and len(seq) * times > MAX_TEXT):
                raise BoundsError(f"${{{name}:...}} would make {len(seq) * times} items, more than the {MAX_TEXT} "
                                  "rlc resolves")
        if name == "add" and isinstance(a, (str, list)) and isinstance(b, (str, list)) and len(a) + len(b) > MAX_TEXT:
            raise BoundsError(
                f"${{{name}:...}} would make {len(a) + len(b)} items, more than the {MAX_TEXT} rlc resolves"
            )
        if (name == "mul" and isinstance(a, int) and isinstance(b, int)
                and a.bit_length() + b.bit_length() > _MAX_INT_BITS):
            raise BoundsError(f"${{{name}:...}} would make a number of more than {_MAX_INT_BITS} bits")
        result = fn(a, b)
        if isinstance(result, int) and result.bit_length() > _MAX_INT_BITS:
            raise BoundsError(f"${{{name}:...}} made a number of more than {_MAX_INT_BITS} bits")
        return result
    return run


@contextmanager
def _resolvers(allow_env: bool) -> Iterator[list[BoundsError]]:
    """Within the block, OmegaConf resolves with NeMo-RL's arithmetic (bounded), its own resolvers that
    read only the config, and ``oc.env`` only when ``allow_env``; the registry is restored after.
    Yields the list of what the resolvers refused."""
    from omegaconf import OmegaConf  # noqa: PLC0415
    from omegaconf.basecontainer import BaseContainer  # noqa: PLC0415

    raised: list[BoundsError] = []

    def refuse_env(*args: Any) -> Any:
        raised.append(BoundsError(f"${{oc.env:{args[0] if args else ''}}} reads an environment variable; rlc import "
                                  "resolves it only with --allow-env (its value is written into the recipe)"))
        raise raised[-1]

    saved = BaseContainer._resolvers
    BaseContainer._resolvers = {k: v for k, v in saved.items()
                                if k in _CONFIG_ONLY or (allow_env and k == "oc.env")}
    try:
        for name, fn in _RESOLVERS.items():
            _register(name, _bounded(name, fn, raised))
        if not allow_env or not OmegaConf.has_resolver("oc.env"):
            _register("oc.env", refuse_env)
        yield raised
    finally:
        BaseContainer._resolvers = saved


def _compose(text: str, shown: str) -> Any:
    """The composed YAML of one file of the chain, checked before OmegaConf builds anything from it:
    YAML errors by position (the file's text is not quoted: it may be a secret named by mistake),
    at most ``MAX_NODES`` nodes with aliases counted at every use, and a mapping with a NeMo-RL section."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise NemoRlConfigError(f"{shown}: not valid YAML{at}: {_redact(exc.problem or exc.context or '')}") from None
    except yaml.YAMLError:
        raise NemoRlConfigError(f"{shown}: not valid YAML") from None
    except RecursionError:
        raise NemoRlConfigError(f"{shown}: nested more deeply than rlc reads") from None
    if root is None:
        return None
    if not isinstance(root, yaml.MappingNode):
        raise NemoRlConfigError(f"{shown}: a NeMo-RL config must be a mapping (its content is not shown)")
    sizes: dict[int, int] = {}

    def size(node: Any, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise NemoRlConfigError(f"{shown}: nested more than {MAX_DEPTH} levels deep")
        if id(node) in sizes:
            if sizes[id(node)] < 0:
                raise NemoRlConfigError(f"{shown}: an alias that contains itself")
            return sizes[id(node)]
        sizes[id(node)] = -1
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        total = 1 + sum(size(c, depth + 1) for c in children)
        if total > MAX_NODES:
            raise NemoRlConfigError(f"{shown}: expands to more than {MAX_NODES} values (aliases count at every use)")
        sizes[id(node)] = total
        return total

    size(root, 1)
    keys = {k.value for k, _ in root.value if isinstance(k, yaml.ScalarNode)}
    if root.value and not keys & NEMO_RL_SECTIONS:
        raise NemoRlConfigError(f"{shown}: not a NeMo-RL config: none of its top-level keys is a NeMo-RL section "
                                f"({', '.join(sorted(NEMO_RL_SECTIONS - {'defaults'}))}); nothing of it is shown")
    return root


def _key_lines(root: Any) -> dict[str, int]:
    """Dotted key -> 1-based line of every mapping key in one composed YAML file."""
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
    from omegaconf import DictConfig, OmegaConf  # noqa: PLC0415

    for key in list(override.keys()):
        child = override[key]
        if isinstance(child, DictConfig) and child.get("_override_", False):
            child.pop("_override_")
            if key in base:
                base.pop(key)
    return OmegaConf.merge(base, override)


def _load(path: Path, shown: str, stack: tuple[Path, ...], sources: list[_Source]) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf  # noqa: PLC0415

    resolved = path.resolve()
    if resolved in stack:
        chain = " -> ".join(str(p) for p in (*stack, resolved))
        raise NemoRlConfigError(f"defaults cycle: {chain}")
    if len(stack) > MAX_DEPTH:
        raise NemoRlConfigError(f"{shown}: defaults chain longer than {MAX_DEPTH} files")
    try:
        text = read_text_capped(path)
    except FileNotFoundError:
        via = f" (named in defaults of {stack[-1]})" if stack else ""
        raise NemoRlConfigError(f"{shown}: no such file{via}") from None
    except UnicodeDecodeError:
        raise NemoRlConfigError(f"{shown}: cannot read: not UTF-8 text") from None
    except OSError as exc:
        raise NemoRlConfigError(f"{shown}: cannot read: {exc.strerror or exc}") from None
    root = _compose(text, shown)
    try:
        config = OmegaConf.create(text) if root is not None else OmegaConf.create({})
    except Exception as exc:  # OmegaConf wraps yaml errors in several types  # noqa: BLE001
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise NemoRlConfigError(f"{shown}: not a config OmegaConf reads: {_redact(first)}") from None
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
    sources.append(_Source(shown, _key_lines(root)))
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
    shown = text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"
    if not sep or not key.strip():
        raise NemoRlConfigError(f"override {shown!r}: expected KEY=VALUE, e.g. "
                                "policy.megatron_cfg.tensor_model_parallel_size=4")
    too_big = key_path_problem(key.strip()) or text_problem(value_text)
    if too_big is not None:
        raise NemoRlConfigError(f"override {shown!r}: {too_big}")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else ""
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at column {mark.column + 1}" if mark is not None else ""
        raise NemoRlConfigError(f"override {shown!r}: the value is not valid YAML{at}") from None
    except RecursionError:
        raise NemoRlConfigError(f"override {shown!r}: the value is nested more deeply than rlc reads") from None
    too_big = value_problem(value)
    if too_big is not None:
        raise NemoRlConfigError(f"override {shown!r}: {too_big}")
    return mode, key.strip(), value


def _has_key(config: Any, key: str) -> bool:
    from omegaconf import DictConfig  # noqa: PLC0415

    node = config
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


def _apply_overrides(config: Any, overrides: Sequence[str]) -> list[str]:
    from omegaconf import OmegaConf  # noqa: PLC0415

    keys = []
    for text in overrides:
        mode, key, value = _parse_override(text)
        exists = _has_key(config, key)
        if mode == "set" and not exists:
            known = list(flatten(OmegaConf.to_container(config, resolve=False)))
            close = closest(key, known)
            hint = f"; did you mean {close}?" if close else f"; to add it, write +{key}=..."
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


class _Budget:
    """Values resolved so far: at most ``MAX_NODES`` (an interpolation of a section stands for a copy
    of it, so references to references can multiply a small config), and each resolved once."""

    def __init__(self) -> None:
        self.used = 0
        self.done: dict[int, tuple[Any, int]] = {}  # id(interpolation node) -> (plain value, its values)

    def take(self, n: int = 1) -> None:
        self.used += n
        if self.used > MAX_NODES:
            raise BoundsError(f"the resolved config has more than {MAX_NODES} values (an interpolation of a "
                              "section counts as a copy of it)")


def _plain(container: Any, budget: _Budget) -> tuple[Any, int]:
    """``OmegaConf.to_container(container, resolve=True)`` within ``budget``, and its number of values.
    Each interpolation is resolved once (as OmegaConf 2.4 does); reusing it still counts its values."""
    from omegaconf import DictConfig, ListConfig  # noqa: PLC0415

    if container._is_none():
        return None, 1
    keys = list(container.keys()) if isinstance(container, DictConfig) else range(len(container))
    out: dict[Any, Any] | list[Any] = {} if isinstance(container, DictConfig) else []
    total = 1
    for key in keys:
        node = container._get_node(key)
        reused = budget.done.get(id(node)) if node is not None and node._is_interpolation() else None
        if reused is not None:
            value, n = reused
        elif node is not None and not node._is_interpolation() and node._is_missing():
            value, n = "???", 1
        else:
            value, n = container[key], 1
            if isinstance(value, (DictConfig, ListConfig)):
                value, n = _plain(value, budget)
            elif isinstance(value, str) and len(value) > MAX_TEXT:
                raise BoundsError(f"{key!s} resolves to {len(value)} characters, more than the {MAX_TEXT} rlc resolves")
            if node is not None and node._is_interpolation():
                budget.done[id(node)] = (value, n)
        budget.take(n if reused is not None else 1)
        total += n
        if isinstance(out, dict):
            out[key] = value
        else:
            out.append(value)
    return out, total


def _resolve(config: Any, path: str | Path, allow_env: bool) -> dict[str, Any]:
    """Every interpolation of ``config`` resolved, within the limits (see the module docstring)."""
    from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415

    limit = TimeLimit(what="resolving the interpolations")
    raised: list[BoundsError] = []
    try:
        with _resolvers(allow_env) as raised, limit:
            values, _ = _plain(config, _Budget())
    except BoundsError as exc:  # (OmegaConf may have added its own lines: the first is the reason)
        raise NemoRlConfigError(f"{path}: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise NemoRlConfigError(f"{path}: interpolations refer to each other more deeply than rlc follows (a chain of "
                                "hundreds of references)") from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        said = str(getattr(exc, "msg", None) or exc).splitlines()[0]
        if limit.expired:
            reason = f"resolving the interpolations took longer than {limit.seconds:g} s"
        elif raised:
            reason = str(raised[-1])
        elif said.startswith("RecursionError"):
            reason = "interpolations refer to each other more deeply than rlc follows (a chain of hundreds)"
        else:
            reason = said
        raise NemoRlConfigError(f"{path}: cannot resolve the interpolation of {key}: {reason}") from None
    assert isinstance(values, dict)
    return values


def load_nemo_rl_config(path: str | Path, overrides: Sequence[str] = (), allow_env: bool = False) -> NemoRlConfig:
    """Load ``path`` with its defaults chain, apply Hydra-style ``overrides``, resolve interpolations
    (``${oc.env:...}`` only with ``allow_env``)."""
    from omegaconf import OmegaConf  # noqa: PLC0415
    from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415

    sources: list[_Source] = []
    config = _load(Path(path), os.path.normpath(str(path)), (), sources)
    try:
        override_keys = _apply_overrides(config, overrides)
    except RecursionError:
        raise NemoRlConfigError("an override nests more deeply than rlc reads") from None
    except OmegaConfBaseException as exc:
        raise NemoRlConfigError(f"an override cannot be applied: {str(exc).splitlines()[0]}") from None
    raw = OmegaConf.to_container(config, resolve=False)
    values = _resolve(config, path, allow_env)
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
    return NemoRlConfig(
        values=values, raw=cast("dict[str, Any]", raw), origins=origins, files=tuple(s.label for s in sources)
    )


def _line_for(lines: dict[str, int], leaf: str) -> int | None:
    """The line of ``leaf``'s key in one file (lists and ``{}`` are leaves, so their key is it)."""
    return lines.get(leaf)
