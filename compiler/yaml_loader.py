"""Strict, safe YAML loading that remembers where every key came from.

A recipe is JSON-shaped data (mappings with string keys, lists, strings, numbers, booleans, null),
so this loader accepts exactly that and says clearly what it rejects. It is built on PyYAML's
*composer* (the C one when libyaml is present): composing gives nodes with ``start_mark``
(line/column), which a plain ``yaml.safe_load`` — or OmegaConf — throws away. The nodes are
turned into Python values here, which is where the hardening lives:

* **YAML 1.2 core scalars.** PyYAML implements YAML 1.1, where ``on``/``off``/``yes``/``no`` are
  booleans, ``04:00:00`` is the integer 14400 (base 60), ``1e-6`` is a string and ``017`` is
  octal. Recipes have keys whose values are literally ``on``/``off`` (``refit.*``) and SLURM
  times, so the implicit types follow the YAML 1.2 core schema instead: ``true``/``false``,
  ``null``/``~``, decimal/``0o``/``0x`` integers, floats with an optional exponent. Everything
  else is a string.
* **Only JSON types.** Explicit tags other than ``!!str !!int !!float !!bool !!null !!seq !!map``
  (``!!python/…``, ``!!binary``, ``!!timestamp``, ``!custom``), non-string keys, complex keys,
  ``NaN``/``inf`` and merge keys (``<<``; use ``extends:``) are errors.
* **Duplicate keys** are errors that name both positions (PyYAML silently keeps the last one).
* **Alias bombs** ("billion laughs"): every node visited while expanding aliases is counted and
  the load stops at :data:`MAX_NODES`; recursive aliases are detected.
* **Size and encoding:** files over :data:`MAX_BYTES`, binary files (NUL bytes) and files that are
  not UTF-8 are rejected before parsing, with the offending position.
* **Shape:** one document whose top level is a mapping.

All problems become :class:`~rlc.compiler.diagnostics.Diagnostic` objects (1-based positions);
:func:`load_yaml` raises :class:`YamlLoadError` carrying all of them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.resolver import BaseResolver

from rlc.compiler.diagnostics import Diagnostic, PathPart, format_path
from rlc.contract.bounds import MAX_DEPTH, MAX_NODES  # noqa: F401 - the limits every resolver shares
from rlc.compiler.files import FileTooLarge, read_capped

#: Largest recipe file accepted, in bytes.
MAX_BYTES = 1 << 20

_STR = "tag:yaml.org,2002:str"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_BOOL = "tag:yaml.org,2002:bool"
_NULL = "tag:yaml.org,2002:null"
_SEQ = "tag:yaml.org,2002:seq"
_MAP = "tag:yaml.org,2002:map"


class Resolver12(BaseResolver):
    """Implicit scalar types of the YAML 1.2 core schema (see the module docstring)."""


Resolver12.add_implicit_resolver(_NULL, re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""])
Resolver12.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
Resolver12.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
Resolver12.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)

try:  # libyaml's composer is several times faster; the pure-Python one is the fallback
    from yaml._yaml import CParser as _Parser

    class _Composer(_Parser, Resolver12):
        def __init__(self, text: str) -> None:
            _Parser.__init__(self, text)
            Resolver12.__init__(self)

except ImportError:  # pragma: no cover - depends on how PyYAML was built
    from yaml.composer import Composer
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Composer(Reader, Scanner, Parser, Composer, Resolver12):  # type: ignore[no-redef]
        def __init__(self, text: str) -> None:
            Reader.__init__(self, text)
            Scanner.__init__(self)
            Parser.__init__(self)
            Composer.__init__(self)
            Resolver12.__init__(self)


Position = tuple[int, int]  # 1-based (line, col)


@dataclass
class YamlDocument:
    """A loaded document: plain data plus the position of every key path (tuples of parts)."""

    data: dict[str, Any]
    positions: dict[tuple[PathPart, ...], Position]


class YamlLoadError(Exception):
    """The file could not be turned into recipe data; ``diagnostics`` says why (all problems)."""

    def __init__(self, diagnostics: list[Diagnostic]) -> None:
        super().__init__("; ".join(d.message for d in diagnostics))
        self.diagnostics = diagnostics


class _TooBig(Exception):
    """Raised to abort construction (alias bomb, nesting); carries the diagnostic."""

    def __init__(self, diag: Diagnostic) -> None:
        super().__init__(diag.message)
        self.diag = diag


def _pos(mark: Any) -> Position:
    return (mark.line + 1, mark.column + 1)


def _line_col(text: str, index: int) -> Position:
    line = text.count("\n", 0, index) + 1
    col = index - (text.rfind("\n", 0, index) + 1) + 1
    return line, col


def _tag_name(tag: str) -> str:
    return "!!" + tag[len("tag:yaml.org,2002:"):] if tag.startswith("tag:yaml.org,2002:") else tag


class _Builder:
    """Turns composed nodes into plain data, recording positions and collecting problems."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.positions: dict[tuple[PathPart, ...], Position] = {}
        self.diags: list[Diagnostic] = []
        self.visited = 0
        self.active: set[int] = set()  # ids of nodes being built (recursive alias detection)

    def error(self, message: str, path: tuple[PathPart, ...], pos: Position, hint: str | None = None) -> None:
        self.diags.append(
            Diagnostic("error", message, format_path(path), self.file, pos[0], pos[1], hint=hint)
        )

    def build(self, node: yaml.Node, path: tuple[PathPart, ...]) -> Any:
        self.visited += 1
        pos = _pos(node.start_mark)
        if self.visited > MAX_NODES:  # report at the top-level key whose value exploded
            line, col = self.positions.get(path[:1], pos)
            raise _TooBig(Diagnostic(
                "error", f"document expands to more than {MAX_NODES} nodes (alias bomb?)",
                format_path(path[:1]), self.file, line, col,
                hint="aliases (*name) are expanded at every use; recipes have a few hundred keys",
            ))
        if len(path) > MAX_DEPTH:
            raise _TooBig(Diagnostic(
                "error", f"nesting deeper than {MAX_DEPTH} levels", format_path(path),
                self.file, pos[0], pos[1],
            ))
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node, path, pos)
        if id(node) in self.active:
            self.error("recursive alias (a node that contains itself)", path, pos)
            return None
        self.active.add(id(node))
        try:
            if isinstance(node, yaml.SequenceNode):
                if node.tag != _SEQ:
                    self.error(f"unsupported tag {_tag_name(node.tag)}", path, pos)
                items = []
                for i, item in enumerate(node.value):
                    self.positions[path + (i,)] = _pos(item.start_mark)
                    items.append(self.build(item, path + (i,)))
                return items
            assert isinstance(node, yaml.MappingNode)  # the composer makes scalars, sequences and mappings
            return self.mapping(node, path, pos)
        finally:
            self.active.discard(id(node))

    def mapping(self, node: yaml.MappingNode, path: tuple[PathPart, ...], pos: Position) -> dict[str, Any]:
        if node.tag != _MAP:
            self.error(f"unsupported tag {_tag_name(node.tag)}", path, pos)
        out: dict[str, Any] = {}
        first_seen: dict[str, Position] = {}
        for key_node, value_node in node.value:
            kpos = _pos(key_node.start_mark)
            self.visited += 1
            if not isinstance(key_node, yaml.ScalarNode):
                self.error("complex (mapping or list) keys are not allowed", path, kpos)
                continue
            if key_node.tag == _STR and key_node.value == "<<" and not key_node.style:
                self.error("YAML merge keys ('<<') are not supported", path, kpos,
                           hint="use `extends:` to inherit from another recipe")
                continue
            key = self.scalar(key_node, path, kpos)
            if not isinstance(key, str):
                shown = "null" if key is None else str(key).lower() if isinstance(key, bool) else str(key)
                self.error(f"key {shown} is not a string", path, kpos,
                           hint=f"quote it: '{key_node.value}':")
                continue
            if key in first_seen:
                line, col = first_seen[key]
                self.error(f"duplicate key {key!r} (first defined at line {line}, column {col})",
                           path + (key,), kpos)
                continue
            first_seen[key] = kpos
            self.positions[path + (key,)] = kpos
            out[key] = self.build(value_node, path + (key,))
        return out

    def scalar(self, node: yaml.ScalarNode, path: tuple[PathPart, ...], pos: Position) -> Any:
        tag, text = node.tag, node.value
        if tag == _STR:
            return text
        if tag == _NULL:
            if text not in ("", "~", "null", "Null", "NULL"):
                self.error(f"invalid !!null value {text!r}", path, pos)
            return None
        if tag == _BOOL:
            if text.lower() not in ("true", "false"):
                self.error(f"invalid !!bool value {text!r} (YAML 1.2: true or false)", path, pos)
                return None
            return text.lower() == "true"
        if tag == _INT:
            try:
                if text[:2] in ("0o", "0x"):
                    return int(text[2:], 8 if text[1] == "o" else 16)
                return int(text, 10)
            except ValueError:
                self.error(f"invalid !!int value {text!r}", path, pos)
                return None
        if tag == _FLOAT:
            if text.lower().lstrip("+-") in (".nan", ".inf"):
                self.error(f"{text!r} is not a finite number; recipes hold JSON values only", path, pos)
                return None
            try:
                value = float(text)
            except ValueError:
                self.error(f"invalid !!float value {text!r}", path, pos)
                return None
            if not math.isfinite(value):
                self.error(f"{text!r} is not a finite number; recipes hold JSON values only", path, pos)
                return None
            return value
        self.error(f"unsupported tag {_tag_name(tag)}", path, pos,
                   hint="recipes hold plain strings, numbers, booleans, null, lists and mappings")
        return None


def _read_text(file: str, raw: bytes) -> str:
    """Decode ``raw`` as UTF-8 (BOM allowed) after the size and binary checks."""
    def fail(message: str, pos: Position | None = None, hint: str | None = None) -> YamlLoadError:
        line, col = pos if pos else (None, None)
        return YamlLoadError([Diagnostic("error", message, "", file, line, col, hint=hint)])

    if len(raw) > MAX_BYTES:
        raise fail(f"more than {MAX_BYTES} bytes; recipes are limited to 1 MiB")
    for bom, codec in ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
                       (b"\xfe\xff", "UTF-16")):
        if raw.startswith(bom):
            raise fail(f"not UTF-8: the file is {codec} text (it starts with a {codec} byte-order mark)", (1, 1),
                       hint="save the file as UTF-8")
    nul = raw.find(b"\x00")
    if nul >= 0:
        pos = _line_col(raw[:nul].decode("utf-8", "replace"), nul) if nul < 65536 else None
        raise fail("binary file (contains NUL bytes); a recipe is UTF-8 YAML text", pos)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        start = exc.start
        prefix = raw[:start].decode("utf-8", "replace")
        raise fail(f"not UTF-8: invalid byte 0x{raw[start]:02x}", _line_col(prefix, len(prefix)),
                   hint="save the file as UTF-8") from None


#: compiled on first use (``re`` caches it): only a file that fails to parse needs it
_QUOTED = r"'(?![<\s\\])[^']{2,}(?<!\s)'|\"(?![<\s\\])[^\"]{2,}(?<!\s)\""


def _redact(message: str) -> str:
    """A YAML parser message without the file's text: PyYAML quotes what it found (an alias name,
    an escape, a directive), and a file that did not parse may be a secret named by mistake.
    Single characters (``','``, ``'\\t'``) and token names (``'<block end>'``) stay."""
    return re.sub(_QUOTED, "(text not shown)", message)


def parse_text(text: str, file: str, require_mapping: bool = True,
               marker: tuple[str, ...] = ()) -> YamlDocument | Any:
    """Parse YAML ``text``. With ``require_mapping`` the top level must be a mapping and a
    :class:`YamlDocument` is returned; otherwise the plain value (used for ``--set`` values).
    With ``marker`` the mapping must have one of those top-level keys (``version`` or ``extends`` for a
    recipe); a mapping
    without it is refused before any of its values is read, so nothing of it is echoed."""
    def fail(message: str, pos: Position | None, hint: str | None = None) -> YamlLoadError:
        line, col = pos if pos else (None, None)
        return YamlLoadError([Diagnostic("error", message, "", file, line, col, hint=hint)])

    if len(text) > MAX_BYTES:
        raise fail(f"{len(text)} characters; rlc reads at most {MAX_BYTES}", None)
    try:
        node = _Composer(text).get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = exc.problem or exc.context or "invalid YAML"
        if exc.context and exc.problem:
            if exc.context.startswith("while") and exc.context_mark is not None:
                cl, cc = _pos(exc.context_mark)
                message = f"{exc.problem} ({exc.context} that starts at line {cl}, column {cc})"
            else:
                message = f"{exc.context}, {exc.problem}"
        raise fail(f"YAML syntax error: {_redact(message)}", _pos(mark) if mark else None) from None
    except yaml.reader.ReaderError as exc:
        raise fail(f"YAML error: {exc.reason}", _line_col(text, exc.position)) from None
    except yaml.YAMLError as exc:
        raise fail(f"YAML error: {_redact(str(exc))}", None) from None
    except RecursionError:
        raise fail(f"nesting too deep to parse (limit {MAX_DEPTH} levels)", None) from None

    if node is None:
        if require_mapping:
            raise fail("empty recipe: expected a mapping with at least `version:`", (1, 1))
        return None
    if require_mapping and not isinstance(node, yaml.MappingNode):
        # Nothing of a file that is not a recipe mapping is echoed: it may be a token or key file
        # named by mistake (say, in `extends:`), and messages reach terminals and CI annotations.
        kind = "a list" if isinstance(node, yaml.SequenceNode) else "a single value (not shown)"
        raise fail(f"top level must be a mapping of recipe keys, found {kind}", _pos(node.start_mark))
    if require_mapping and marker and not any(
            isinstance(k, yaml.ScalarNode) and k.tag == _STR and k.value in marker for k, _ in node.value):
        # A mapping without the marker is some other YAML file (a secrets or password file named by
        # mistake reads as one: every `name:hash` line is a key): none of its keys or values is shown.
        keys = " or ".join(f"`{m}:`" for m in marker)
        raise fail(f"not an rlc recipe: it has no top-level {keys} key (nothing of this file is shown)",
                   _pos(node.start_mark), hint=f"a recipe starts with `{marker[0]}: 1`")
    builder = _Builder(file)
    try:
        data = builder.build(node, ())
    except _TooBig as exc:
        raise YamlLoadError([exc.diag]) from None
    if builder.diags:
        raise YamlLoadError(builder.diags)
    if not require_mapping:
        return data
    return YamlDocument(data, builder.positions)


def load_yaml(path: str | Path, display: str | None = None, marker: tuple[str, ...] = ()) -> YamlDocument:
    """Read and parse the recipe file at ``path``; ``display`` is the file name in diagnostics;
    ``marker``: the top-level keys the file must have one of (see :func:`parse_text`).

    Raises :class:`YamlLoadError` (problems in the file) or ``OSError`` (cannot read it).
    """
    file = display if display is not None else str(path)
    try:
        raw = read_capped(path, MAX_BYTES)  # regular files only: a FIFO or device is an OSError
    except FileTooLarge as exc:
        raise YamlLoadError([Diagnostic(
            "error", f"file is {exc.size} bytes; recipes are limited to {MAX_BYTES} bytes (1 MiB)",
            "", file, None, None)]) from None
    return parse_text(_read_text(file, raw), file, marker=marker)
