"""Loading a recipe: the ``extends:`` chain, ``--set`` overrides, and the origin of every key.

:func:`load_recipe` returns a :class:`LoadedRecipe`: the merged plain data (schema defaults are
*not* filled; see :func:`rlc.compiler.schema.with_defaults`) and, for every key path, the
:class:`Origin` (file, line, column) that set it, so later stages can point at the right line
even when the value came from a parent recipe or from ``--set``.

Merging rules: a child recipe is merged over its parent mapping by mapping, key by key; lists and
scalars replace whatever the parent had. ``extends:`` is either a path (relative to the file that
says it; anything ending in ``.yaml``/``.yml`` or containing ``/``) or the name of a recipe
shipped with rlc (``rlc show --list``). Chains may be several levels deep; a cycle is reported with
the whole chain. ``--set KEY=VALUE`` overrides are applied after all merging, in order; VALUE is
YAML (``2``, ``true``, ``[a, b]``, ``"quoted: text"``), and KEY is a key path such as
``parallelism.train.tp`` or ``cluster.slurm.extra_flags[0]`` that must exist in the schema.

Problems are collected as diagnostics and raised together as :class:`RecipeLoadError`.
"""
from __future__ import annotations

import copy
import functools
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from rlc.compiler.diagnostics import SET_ORIGIN, Diagnostic, PathPart, format_path, parse_path
from rlc.compiler.suggest import did_you_mean
from rlc.compiler.yaml_loader import YamlLoadError, load_yaml, parse_text
from rlc.contract.bounds import key_path_problem
from rlc.recipes import FOLDER
from rlc.compiler import schema

#: A recipe file has one of these top-level keys; any other YAML mapping is refused without being shown.
RECIPE_MARKERS = ("version", "extends")
#: Longest ``extends:`` chain followed before giving up.
MAX_EXTENDS_DEPTH = 32
_RECIPE_SUFFIXES = (".yaml", ".yml")

Key = tuple[PathPart, ...]


@dataclass(frozen=True)
class Origin:
    """Where a key was set: a file (or ``--set``/``<default>``) and a 1-based line and column."""

    file: str
    line: int | None = None
    col: int | None = None

    def __str__(self) -> str:
        return ":".join(str(p) for p in (self.file, self.line, self.col) if p is not None)


class RecipeLoadError(Exception):
    """The recipe could not be loaded (YAML, IO, ``extends`` or ``--set`` problems)."""

    def __init__(self, diagnostics: Sequence[Diagnostic]) -> None:
        self.diagnostics = list(diagnostics)
        super().__init__("\n".join(f"{d.location()}: {d.message}" for d in self.diagnostics))


@dataclass
class LoadedRecipe:
    """A merged recipe and where each of its keys came from."""

    data: dict[str, Any]
    origins: dict[str, Origin]
    files: list[Path]
    overrides: list[str] = field(default_factory=list)
    root: Origin | None = None
    named_after_file: str | None = None  # the name a child recipe without its own `name` got

    def locate(self, path: str) -> Origin | None:
        """The origin of ``path``, or of its nearest ancestor that has one (the file's start for
        the root). ``None`` only for an unparsable path in a recipe with no files."""
        if path in self.origins:
            return self.origins[path]
        try:
            parts = list(parse_path(path))
        except ValueError:
            return self.root
        while parts:
            parts.pop()
            found = self.origins.get(format_path(parts))
            if found is not None:
                return found
        return self.root


# --------------------------------------------------------------------------- shipped recipes

def _recipes_dir() -> Path:
    return FOLDER


def shipped_recipe_names() -> list[str]:
    """Names of the recipes shipped with rlc (file names without ``.yaml``), sorted."""
    return sorted(
        p.stem for p in _recipes_dir().iterdir() if p.suffix in _RECIPE_SUFFIXES and p.is_file()
    )


def shipped_recipe_path(name: str) -> Path:
    """The file of the shipped recipe ``name``; ``KeyError`` when there is none.

    ``name`` is looked up among the shipped files, never joined into a path and opened: any text
    (5,000 characters, ``..``, a NUL byte) is either one of those names or not found."""
    for candidate in sorted(_recipes_dir().iterdir()):
        if candidate.stem == name and candidate.suffix in _RECIPE_SUFFIXES and candidate.is_file():
            return candidate
    raise KeyError(name)


def looks_like_path(ref: str) -> bool:
    """``extends:`` values that are paths rather than shipped recipe names."""
    return ref.endswith(_RECIPE_SUFFIXES) or "/" in ref or os.sep in ref or ref.startswith(".")


# --------------------------------------------------------------------------- origins helpers

def _prune(origins: dict[Key, Origin], prefix: Key) -> None:
    """Forget the origins of ``prefix`` and everything below it."""
    n = len(prefix)
    for key in [k for k in origins if k[:n] == prefix]:
        del origins[key]


def _graft(dst: dict[Key, Origin], src: dict[Key, Origin], prefix: Key, value: Any) -> None:
    """Copy the origins of ``prefix`` and of every key path inside ``value`` (the value at
    ``prefix``) from ``src`` to ``dst``."""
    for key in (prefix, *_subpaths(value, prefix)):
        origin = src.get(key)
        if origin is not None:
            dst[key] = origin


def _merge(dst: dict, dst_origins: dict[Key, Origin], src: dict, src_origins: dict[Key, Origin],
           prefix: Key = ()) -> None:
    """Merge ``src`` (the child) over ``dst`` in place: mappings key by key, others replace.
    ``src`` and ``src_origins`` are only read (a parent may be shared by many recipes in a lint
    run); the top-level ``extends`` key is not merged."""
    for key, value in src.items():
        path = prefix + (key,)
        if not prefix and key == "extends":
            continue
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            if path in src_origins:
                dst_origins[path] = src_origins[path]
            _merge(dst[key], dst_origins, value, src_origins, path)
        else:
            if key in dst:
                _prune(dst_origins, path)
            dst[key] = copy.deepcopy(value)
            _graft(dst_origins, src_origins, path, value)


# --------------------------------------------------------------------------- the extends chain

@dataclass
class _Link:
    """One parsed recipe file of an ``extends`` chain: its data and where each key was set."""

    path: Path
    display: str
    data: dict[str, Any]
    origins: dict[Key, Origin]


#: Parents parsed once per ``rlc lint`` run (see :func:`shared_parents`); ``None`` outside one.
_PARENTS: dict[tuple[str, str], _Link] | None = None


@contextmanager
def shared_parents() -> Iterator[None]:
    """Within the block, a recipe named by ``extends:`` is read and parsed once and shared (read
    only) by every recipe that extends it: ``rlc lint`` over a folder of children of one base."""
    global _PARENTS
    outer, _PARENTS = _PARENTS, {} if _PARENTS is None else _PARENTS
    try:
        yield
    finally:
        _PARENTS = outer


def _read(path: Path, display: str, *, via: Diagnostic | None) -> _Link:
    """Load one file of the chain. ``via`` is a template diagnostic at the ``extends:`` that led
    here (``None`` for the recipe named on the command line)."""
    if via is None or _PARENTS is None:
        return _parse(path, display, via=via)
    key = (os.path.realpath(path), display)
    if key not in _PARENTS:
        _PARENTS[key] = _parse(path, display, via=via)
    return _PARENTS[key]


def _parse(path: Path, display: str, *, via: Diagnostic | None) -> _Link:
    try:
        doc = load_yaml(path, display, marker=RECIPE_MARKERS)
    except YamlLoadError as exc:
        raise RecipeLoadError(exc.diagnostics) from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if via is None:
            diag = Diagnostic("error", f"cannot read recipe: {reason}", "", display, rule="io")
            if isinstance(exc, FileNotFoundError) and not looks_like_path(display):
                suggestion = did_you_mean(display, shipped_recipe_names())
                diag.hint = f"not a file, nor a shipped recipe{suggestion}" if suggestion else None
            raise RecipeLoadError([diag]) from None
        via.message = f"cannot read {display}: {reason}"
        if isinstance(exc, FileNotFoundError) and path.parent.is_dir():
            siblings = [p.name for p in path.parent.iterdir() if p.suffix in _RECIPE_SUFFIXES]
            via.message += did_you_mean(path.name, sorted(siblings))
        raise RecipeLoadError([via]) from None
    origins = {key: Origin(display, line, col) for key, (line, col) in doc.positions.items()}
    return _Link(path, display, doc.data, origins)


def _extends_target(link: _Link, ref: str, at: Diagnostic) -> tuple[Path, str]:
    """Resolve an ``extends:`` value to (file, display name) or raise with a diagnostic at ``at``."""
    if looks_like_path(ref):
        target = Path(ref) if os.path.isabs(ref) else link.path.parent / ref
        display = ref if os.path.isabs(ref) else os.path.normpath(os.path.join(os.path.dirname(link.display), ref))
        return target, display
    try:
        target = shipped_recipe_path(ref)
    except KeyError:
        names = shipped_recipe_names()
        at.message = f"no shipped recipe named {ref!r}{did_you_mean(ref, names)}"
        at.hint = (f"shipped recipes: {', '.join(names)}; for a file, write a path "
                   "ending in .yaml (relative to this recipe)") if names else \
            "for a file, write a path ending in .yaml (relative to this recipe)"
        raise RecipeLoadError([at]) from None
    return target, str(target)


def _load_chain(path: Path, display: str) -> list[_Link]:
    """The recipe and its ancestors, child first."""
    chain = [_read(path, display, via=None)]
    seen = {os.path.realpath(path): display}
    while "extends" in chain[-1].data:
        link = chain[-1]
        ref = link.data["extends"]
        where = link.origins.get(("extends",)) or Origin(link.display)
        at = Diagnostic("error", "", "extends", link.display, where.line, where.col)
        if not isinstance(ref, str) or not ref.strip():
            at.message = "extends must be a recipe name or a path to a recipe file"
            raise RecipeLoadError([at])
        if len(chain) > MAX_EXTENDS_DEPTH:
            at.message = f"extends chain longer than {MAX_EXTENDS_DEPTH} recipes"
            raise RecipeLoadError([at])
        target, target_display = _extends_target(link, ref.strip(), at)
        real = os.path.realpath(target)
        if real in seen:
            names = [link.display for link in chain] + [seen[real]]
            at.message = "extends cycle: " + " -> ".join(names)
            raise RecipeLoadError([at])
        seen[real] = target_display
        chain.append(_read(target, target_display, via=at))
    return chain


# --------------------------------------------------------------------------- --set

#: Characters of a ``--set`` argument quoted back in a message.
_SHOWN_CHARS = 200


def _shown(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def _set_error(text: str, message: str, path: str = "", rule: str | None = None, hint: str | None = None) -> Diagnostic:
    return Diagnostic("error", f"{message} (in --set {_shown(text)})", _shown(path), SET_ORIGIN, rule=rule,
                      hint=hint)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"the value {value!r}"


def _apply_set(data: dict, origins: dict[Key, Origin], parts: Key, value: Any, text: str) -> Diagnostic | None:
    """Set ``parts`` to ``value`` in ``data``, creating mappings/lists on the way."""
    node: Any = data
    set_origin = Origin(SET_ORIGIN)
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = format_path(parts[:i]) or "the recipe"
        if isinstance(part, int):
            if not isinstance(node, list):
                return _set_error(text, f"{here} is {_describe(node)}, not a list", format_path(parts))
            if part < 0 or part > len(node):
                return _set_error(text, f"index {part} is out of range: {here} has {len(node)} "
                                        f"item(s); use [{len(node)}] to append", format_path(parts))
            if part == len(node):
                node.append(None)
        elif not isinstance(node, dict):
            return _set_error(text, f"{here} is {_describe(node)}, not a mapping", format_path(parts))
        key_path = parts[: i + 1]
        if last:
            _prune(origins, key_path)
            node[part] = copy.deepcopy(value)
            origins[key_path] = set_origin
            for sub in _subpaths(value, key_path):
                origins[sub] = set_origin
            return None
        nxt = parts[i + 1]
        child = node[part] if (isinstance(part, int) or part in node) else None  # an int part indexes a list
        if child is None:
            child = [] if isinstance(nxt, int) else {}
            node[part] = child
            origins[key_path] = set_origin
        node = child
    return None


def _subpaths(value: Any, prefix: Key) -> list[Key]:
    out: list[Key] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        out.extend(_subpaths(v, prefix + (k,)))
    return out


def _apply_overrides(data: dict, origins: dict[Key, Origin], overrides: Sequence[str]) -> list[Diagnostic]:
    diags: list[Diagnostic] = []
    for text in overrides:
        key_text, sep, value_text = text.partition("=")
        if not sep or not key_text.strip():
            diags.append(_set_error(text, "expected KEY=VALUE, e.g. parallelism.train.tp=2",
                                    rule="usage"))
            continue
        too_big = key_path_problem(key_text.strip())
        if too_big is not None:
            diags.append(_set_error(text, too_big, rule="usage"))
            continue
        try:
            parts = parse_path(key_text.strip())
        except ValueError as exc:
            diags.append(_set_error(text, f"bad key path {_shown(key_text.strip())!r}: {exc}", rule="usage"))
            continue
        path = format_path(parts)
        if parts[0] == "extends":
            diags.append(_set_error(text, "extends cannot be changed with --set", path,
                                    hint="pass the other recipe's file instead, or edit extends:"))
            continue
        problem = schema.check_key_path(parts)
        if problem is not None:
            diags.append(_set_error(text, problem, path))
            continue
        try:
            value = parse_text(value_text, SET_ORIGIN, require_mapping=False)
        except YamlLoadError as exc:
            reason = "; ".join(d.message for d in exc.diagnostics)
            diags.append(_set_error(text, f"value is not valid YAML: {reason}", path,
                                    hint="quote the value for the shell and for YAML: --set 'k=\"a: b\"'"))
            continue
        problem_diag = _apply_set(data, origins, parts, value, text)
        if problem_diag is not None:
            diags.append(problem_diag)
    return diags


def apply_set_overrides(data: dict, overrides: Sequence[str]) -> tuple[list[Diagnostic], list[str]]:
    """Apply ``--set KEY=VALUE`` strings to a recipe tree in place (as ``load_recipe`` does after
    ``extends``); returns the problems and the dotted keys that were set (for ``rlc import``)."""
    origins: dict[Key, Origin] = {}
    diags = _apply_overrides(data, origins, overrides)
    return diags, [format_path(k) for k in origins]


# --------------------------------------------------------------------------- entry point

def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> LoadedRecipe:
    """Load ``path`` with its ``extends`` chain and ``overrides`` (``KEY=VALUE`` strings).

    Raises :class:`RecipeLoadError` with every problem found (YAML, IO, extends, --set).
    Schema validation is separate (:func:`rlc.compiler.schema.validate`).
    """
    display = os.path.normpath(str(path))
    chain = _load_chain(Path(path), display)
    data: dict[str, Any] = {}
    origins: dict[Key, Origin] = {}
    for link in reversed(chain):  # root ancestor first, the named recipe last
        _merge(data, origins, link.data, link.origins)
    named_after_file = None
    if len(chain) > 1 and "name" not in chain[0].data:
        # A child recipe is its own experiment: inheriting the parent's name would share its
        # checkpoint and metrics folders (and resume from its checkpoint).
        named_after_file = name_from_file(chain[0].path)
        data["name"] = named_after_file
        origins[("name",)] = Origin(chain[0].display, 1, 1)
    diags = _apply_overrides(data, origins, overrides)
    if diags:
        raise RecipeLoadError(diags)
    return LoadedRecipe(
        data=data,
        origins={_key_text(k): v for k, v in origins.items()},
        files=[link.path for link in chain],
        overrides=list(overrides),
        root=Origin(chain[0].display, 1, 1),
        named_after_file=named_after_file,
    )


@functools.lru_cache(maxsize=16384)
def _key_text(key: Key) -> str:
    """``format_path`` of a key path (the same paths recur in every recipe a lint run loads)."""
    return format_path(key)


def name_from_file(path: Path) -> str:
    """A run name from a recipe's file name (what the schema allows in ``name``)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(path).stem).strip("-._")[:64]
    return stem if stem and stem[0].isalnum() else f"r{stem}"[:64]
