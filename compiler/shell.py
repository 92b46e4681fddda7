"""The one place where a recipe value becomes text in a generated script.

Every value that reaches ``launch.sbatch``, ``node.sh``, ``env.sh`` or ``mounts.txt`` goes through
:func:`quote`, which either returns a :class:`Quoted` string that is safe in the named context or
raises :class:`UnsafeValue` naming the recipe key and how to fix it. The bundle's jinja
environment refuses to print any string that is not :class:`Quoted` (see
``rlc.compiler.bundle.render``), so a template cannot forget to quote.

Contexts:

``shell``   one bash word (``shlex.quote``); anything but NUL.
``word``    one bash word that must also be a single plain token (no whitespace or control
            characters), e.g. an interpreter name.
``sbatch``  the value of an ``#SBATCH --flag=VALUE`` line. bash reads the line as a comment; sbatch
            reads it with its own tokenizer (quotes group, backslash escapes, unquoted ``#`` starts a
            comment), so the value is double-quoted with ``\\`` and ``"`` escaped. A newline would end
            the comment and turn the rest into script code: control characters are rejected.
``sbatch_path`` like ``sbatch`` for ``--output``/``--error``: additionally ``%`` is doubled (sbatch
            expands ``%j`` etc.) and ``\\`` is rejected (it switches that expansion off).
``mount``   one path inside a Pyxis ``--container-mounts`` / Apptainer ``--bind`` list
            (``src:dst[:ro|rw],...``): absolute, and only letters, digits and ``/._-+@=~``; ``,``
            and ``:`` separate entries and fields, and enroot's fstab splits on whitespace.
"""
from __future__ import annotations

import re
import shlex
from typing import Any

CONTEXTS = ("shell", "word", "sbatch", "sbatch_path", "mount")

_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_./:=,%+@-]+")
_MOUNT_PATH = re.compile(r"/[A-Za-z0-9/._+@=~-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class UnsafeValue(ValueError):
    """A recipe value that cannot be written safely where it is needed."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"{key}: {problem}; {fix}")


class Quoted(str):
    """A string already made safe for its place in a generated script (returned by :func:`quote`)."""


def _describe(ch: str) -> str:
    names = {"\n": "a newline", "\r": "a carriage return", "\x00": "a NUL byte", "\t": "a tab"}
    return names.get(ch, f"the character {ch!r}")


def _text(value: Any, key: str) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise UnsafeValue(key, f"expected a string, got {type(value).__name__}", "write a plain string")


def quote(value: Any, key: str, context: str = "shell") -> Quoted:
    """Return ``value`` made safe for ``context`` (see the module docstring) or raise
    :class:`UnsafeValue` naming ``key``. Numbers and booleans are written as text first
    (``True`` -> ``1``)."""
    if context not in CONTEXTS:
        raise ValueError(f"unknown quoting context {context!r}")
    text = _text(value, key)
    if "\x00" in text:
        raise UnsafeValue(key, "contains a NUL byte", "remove it")

    if context == "shell":
        return Quoted(shlex.quote(text))

    bad = _CONTROL.search(text)
    if context == "word":
        if not text or bad or any(c.isspace() for c in text):
            what = _describe(bad.group()) if bad else ("nothing" if not text else "whitespace")
            raise UnsafeValue(key, f"must be one word but contains {what}",
                              "give a single command or path without spaces or line breaks")
        return Quoted(shlex.quote(text))

    if context in ("sbatch", "sbatch_path"):
        if bad:
            raise UnsafeValue(key, f"contains {_describe(bad.group())}, which would end its #SBATCH line",
                              "remove line breaks and control characters")
        if context == "sbatch_path":
            if "\\" in text:
                raise UnsafeValue(key, "contains a backslash, which turns off sbatch's %-expansion",
                                  "use a path without backslashes")
            text = text.replace("%", "%%")
        if _SBATCH_PLAIN.fullmatch(text):
            return Quoted(text)
        return Quoted('"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"')

    # mount
    if not text.startswith("/"):
        raise UnsafeValue(key, f"mount path {text!r} is not absolute", "use an absolute path")
    if not _MOUNT_PATH.fullmatch(text):
        ch = next(c for c in text if not _MOUNT_PATH.fullmatch("/" + c))
        raise UnsafeValue(key, f"mount path {text!r} contains {_describe(ch)}",
                          "mount paths may only use letters, digits and / . _ - + @ = ~ "
                          "(',' and ':' separate mount entries and fields)")
    return Quoted(text)


def join_words(words: list[Quoted]) -> Quoted:
    """Join already-quoted words with spaces (the result stays :class:`Quoted`)."""
    for w in words:
        if not isinstance(w, Quoted):
            raise TypeError(f"join_words: {w!r} was not quoted")
    return Quoted(" ".join(words))
