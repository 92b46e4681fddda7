"""Diagnostics: one finding about a recipe, and the three ways the CLI prints them.

Every stage of the compiler (loader, schema, rules) reports problems as :class:`Diagnostic`
objects instead of raising, so a user sees every problem at once. A diagnostic knows its key path
(``parallelism.train.tp``, list items as ``[0]``) and, once placed, the ``file:line:col`` that set
that key.

Formats:

* text (:func:`format_text`): ``file:line:col: key.path: message``, one per line, compiler style,
  so editors and terminals can jump to it. A hint follows on its own indented line.
* GitHub (:func:`format_github`): workflow commands, ``::error file=…,line=…,col=…::message``,
  which GitHub Actions turns into annotations on the pull request.
* JSON (:func:`format_json`): a list of objects with the dataclass fields.

Key paths are built and parsed here too (:func:`format_path`, :func:`parse_path`), because a
diagnostic's ``path`` is the one place every stage shares them.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Iterable, Literal, Sequence, Union

Severity = Literal["error", "warning", "info"]
PathPart = Union[str, int]

#: Pseudo file names used for keys that no recipe file set.
SET_ORIGIN = "--set"
DEFAULT_ORIGIN = "<default>"

#: The rule of an error that is a bug in rlc rather than a problem of the input (exit code 3).
INTERNAL_RULE = "internal"
#: Rules whose errors are usage/IO problems (exit code 2) rather than recipe problems (exit code 1);
#: they, and :data:`INTERNAL_RULE`, are not printed as rule ids.
USAGE_RULES = frozenset({"io", "usage", INTERNAL_RULE})

_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}


@dataclass
class Diagnostic:
    """One finding. ``file``/``line``/``col`` are 1-based and may be unknown (``None``)."""

    severity: Severity
    message: str
    path: str = ""
    file: str | None = None
    line: int | None = None
    col: int | None = None
    rule: str | None = None
    hint: str | None = None

    def location(self) -> str:
        """``file:line:col`` with unknown parts left out (``''`` when nothing is known)."""
        parts = [str(p) for p in (self.file, self.line, self.col) if p is not None]
        if self.file is None:
            return ""
        return ":".join(parts)


# --------------------------------------------------------------------------- key paths

_PLAIN_KEY = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$-]*$")
_PATH_TOKEN = re.compile(
    r"""
      \[(?P<index>-?[0-9]+)\]          # [3]
    | \[(?P<quoted>"(?:[^"\\]|\\.)*")\] # ["key with . or spaces"]
    | (?P<plain>[^.\[\]"]+)             # key
    | (?P<dot>\.)
    """,
    re.VERBOSE,
)


def format_path(parts: Iterable[PathPart]) -> str:
    """``('parallelism', 'train', 'tp')`` -> ``parallelism.train.tp``; ints become ``[i]``.

    Keys that are not plain identifiers are written as ``["a.b"]`` (JSON string syntax).
    """
    out: list[str] = []
    for part in parts:
        if isinstance(part, int) and not isinstance(part, bool):
            out.append(f"[{part}]")
        elif _PLAIN_KEY.fullmatch(str(part)):  # fullmatch: "$" alone would accept a trailing newline
            out.append(("." if out else "") + str(part))
        else:
            out.append(f"[{json.dumps(str(part), ensure_ascii=False)}]")
    return "".join(out)


def parse_path(text: str) -> tuple[PathPart, ...]:
    """Inverse of :func:`format_path`. Raises ``ValueError`` with a reason for malformed paths."""
    parts: list[PathPart] = []
    pos = 0
    expect_key = True  # at start or after '.'
    if not text:
        return ()
    while pos < len(text):
        m = _PATH_TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"unexpected {text[pos]!r} at position {pos + 1}")
        if m.group("dot") is not None:
            if expect_key:
                raise ValueError(f"empty key at position {pos + 1}")
            expect_key = True
        elif m.group("plain") is not None:
            if not expect_key:
                raise ValueError(f"missing '.' before {m.group('plain')!r}")
            parts.append(m.group("plain").strip())
            expect_key = False
        elif m.group("index") is not None:
            if not parts:
                raise ValueError("a path cannot start with an index")
            parts.append(int(m.group("index")))
            expect_key = False
        else:
            parts.append(json.loads(m.group("quoted")))
            expect_key = False
        pos = m.end()
    if expect_key:
        raise ValueError("path ends with '.'")
    return tuple(parts)


# --------------------------------------------------------------------------- ordering & exit code

def sort_diagnostics(diags: Iterable[Diagnostic], first_file: str | None = None) -> list[Diagnostic]:
    """Diagnostics in reading order: ``first_file`` (the recipe named on the command line) first,
    then other files (parents) by name, then ``--set``, then those with no file; by line and
    column within a file. The sort is stable: ties keep the order they were reported in."""
    def key(d: Diagnostic) -> tuple:
        return (
            d.file is None,
            d.file == SET_ORIGIN,
            d.file != first_file,
            d.file or "",
            d.line if d.line is not None else 0,
            d.col if d.col is not None else 0,
        )

    return sorted(diags, key=key)


def exit_code(diags: Iterable[Diagnostic]) -> int:
    """0 when there is no error, 3 when one is a bug in rlc, 2 when one is a usage/IO problem,
    else 1."""
    errors = [d for d in diags if d.severity == "error"]
    if not errors:
        return 0
    if any(d.rule == INTERNAL_RULE for d in errors):
        return 3
    if any(d.rule in USAGE_RULES for d in errors):
        return 2
    return 1


def summary(diags: Sequence[Diagnostic]) -> str:
    """``2 errors, 1 warning`` (zero counts left out; ``no problems`` when empty)."""
    counts = {s: sum(1 for d in diags if d.severity == s) for s in ("error", "warning", "info")}
    words = [f"{n} {s}{'' if n == 1 else 's'}" for s, n in counts.items() if n]
    return ", ".join(words) if words else "no problems"


# --------------------------------------------------------------------------- formats

def format_text(diags: Iterable[Diagnostic]) -> str:
    """One ``file:line:col: key.path: message`` line per diagnostic (plus an indented hint line).

    Errors carry no severity word (the format the issue asks for); warnings and infos say
    ``warning:`` / ``info:`` before the message. The rule id, if any, ends the line in brackets.
    """
    lines = []
    for d in diags:
        head = [p for p in (d.location(), d.path) if p]
        message = d.message if d.severity == "error" else f"{d.severity}: {d.message}"
        if d.rule and d.rule not in USAGE_RULES:
            message += f" [{d.rule}]"
        lines.append(": ".join(head + [message]))
        if d.hint:
            lines.append(f"    hint: {d.hint}")
    return "\n".join(lines) + ("\n" if lines else "")


def _gh_escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_escape_property(text: str) -> str:
    return _gh_escape_data(text).replace(":", "%3A").replace(",", "%2C")


def format_github(diags: Iterable[Diagnostic]) -> str:
    """GitHub Actions workflow commands (``::error``/``::warning``/``::notice``), one per line.

    ``file``/``line``/``col`` are given only for real files (not ``--set``/``<default>``).
    """
    command = {"error": "error", "warning": "warning", "info": "notice"}
    lines = []
    for d in diags:
        props = []
        if d.file and d.file not in (SET_ORIGIN, DEFAULT_ORIGIN):
            props.append(f"file={_gh_escape_property(d.file)}")
            if d.line is not None:
                props.append(f"line={d.line}")
            if d.col is not None:
                props.append(f"col={d.col}")
        title = "rlc" + (f" {d.rule}" if d.rule and d.rule not in USAGE_RULES else "")
        if d.path:
            title += f" {d.path}"
        props.append(f"title={_gh_escape_property(title)}")
        message = f"{d.path}: {d.message}" if d.path else d.message
        if d.file in (SET_ORIGIN,):
            message = f"{SET_ORIGIN}: {message}"
        if d.hint:
            message += f"\nhint: {d.hint}"
        lines.append(f"::{command.get(d.severity, 'error')} {','.join(props)}::{_gh_escape_data(message)}")
    return "\n".join(lines) + ("\n" if lines else "")


def format_json(diags: Iterable[Diagnostic]) -> str:
    """A JSON list of diagnostics (the dataclass fields), indented, newline-terminated."""
    return json.dumps([asdict(d) for d in diags], indent=2, ensure_ascii=False) + "\n"


FORMATTERS = {"text": format_text, "github": format_github, "json": format_json}
