"""``rlc lint``: check many recipes at once (files and folders), for CI and pre-commit.

Folders are searched recursively for ``*.yaml``/``*.yml`` files (hidden folders skipped). Only
files that look like recipes are checked, so pre-commit can hand every YAML file of a repository
(workflows, compose files, ...) to ``rlc lint``: a recipe has a top-level ``version:`` or
``extends:`` key, or the ``yaml-language-server`` schema comment pointing at the recipe schema.
Each recipe goes through the same check as ``rlc validate`` (:func:`rlc.compiler.cli.run_check`).

A recipe's ``lint.ignore`` silences warnings by rule id (each with a reason); errors cannot be
silenced.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.recipe import shared_parents

RECIPE_SUFFIXES = (".yaml", ".yml")
_MARKER = re.compile(
    rb"^(?:version|extends)[ \t]*:|^#[ \t]*yaml-language-server:[^\n]*recipe\.schema\.json", re.M
)
#: Bytes read to decide whether a file looks like a recipe.
SNIFF_BYTES = 64 * 1024


def looks_like_recipe(path: Path) -> bool:
    """True when the file has a top-level ``version:``/``extends:`` or the recipe schema comment."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError:
        return True  # let the check report why it cannot be read
    return _MARKER.search(head.lstrip(b"\xef\xbb\xbf")) is not None


def _walk(folder: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(RECIPE_SUFFIXES):
                yield Path(dirpath) / name


@dataclass
class LintTarget:
    """What ``rlc lint PATH...`` found: recipe files, skipped YAML files, and missing paths."""

    recipes: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def discover(paths: Iterable[str | os.PathLike[str]]) -> LintTarget:
    """Expand files and folders into the recipes to lint (each once, in the order found)."""
    found = LintTarget()
    seen: set[str] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            candidates: Iterable[Path] = _walk(path)
        elif path.exists():
            candidates = [path]
        else:
            found.missing.append(str(raw))
            continue
        for candidate in candidates:
            key = os.path.realpath(candidate)
            if key in seen:
                continue
            seen.add(key)
            (found.recipes if looks_like_recipe(candidate) else found.skipped).append(candidate)
    return found


def lint(paths: Sequence[str], check: Callable[[str], Sequence[Diagnostic]]) -> tuple[list[Diagnostic], LintTarget]:
    """Run ``check`` on every recipe under ``paths``; missing paths become usage errors."""
    target = discover(paths)
    diags = [Diagnostic("error", "no such file or folder", "", p, rule="io") for p in target.missing]
    with shared_parents():  # a base recipe extended by many is parsed once
        for recipe in target.recipes:
            diags.extend(check(str(recipe)))
    return diags, target
