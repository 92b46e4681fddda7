"""``rlc lint``: check many recipes at once (files and folders), for CI and pre-commit.

A file named on the command line is always checked, as ``rlc validate`` and ``rlc compile`` would
check it. In folders (searched recursively for ``*.yaml``/``*.yml`` files, hidden folders skipped),
and for named files with ``--skip-non-recipes`` (pre-commit hands every YAML file of a repository to
``rlc lint``: workflows, compose files, ...), only files that look like recipes are checked: a
top-level ``version:`` or ``extends:`` key in any YAML style (block, flow, JSON; UTF-8 or UTF-16/32
with a byte-order mark; after a comment header of any length), or the ``yaml-language-server`` schema
comment pointing at the recipe schema. Each recipe goes through the same check as ``rlc validate``
(:func:`rlc.compiler.cli.run_check`).

A recipe's ``lint.ignore`` silences warnings by rule id (each with a reason); errors cannot be
silenced.

Large runs (CI over a recipe repository) are split across worker processes, one per available
CPU and at most one per :data:`MIN_RECIPES_PER_JOB` recipes; each worker checks a contiguous slice
and the results are reported in discovery order, so the output does not depend on the job count.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.files import FileTooLarge, is_regular_file, read_capped
from rlc.compiler.recipe import shared_parents
from rlc.compiler.yaml_loader import MAX_BYTES
from rlc.compiler.run_dirs import output_dirs

RECIPE_SUFFIXES = (".yaml", ".yml")
_KEYS = ("version", "extends")
#: A recipe key at the start of a line, in block, flow or JSON style (quoted or not).
_KEY_LINE = re.compile(r"^[ \t]*[{,]?[ \t]*[\"']?(?:version|extends)[\"']?[ \t]*:", re.M)
_SCHEMA_COMMENT = re.compile(r"^#[ \t]*yaml-language-server:[^\n]*recipe\.schema\.json", re.M)
#: Bytes read to decide whether a file looks like a recipe: all a recipe may have.
SNIFF_BYTES = MAX_BYTES
_BOMS = ((b"\xef\xbb\xbf", "utf-8"), (b"\xff\xfe\x00\x00", "utf-32-le"), (b"\x00\x00\xfe\xff", "utf-32-be"),
         (b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be"))


def _sniff_text(raw: bytes) -> str:
    """``raw`` as text for the sniff: by its byte-order mark, as UTF-16 when every other byte of its
    start is NUL, else UTF-8 (undecodable bytes replaced: the check reports the encoding)."""
    for bom, codec in _BOMS:
        if raw.startswith(bom):
            return raw[len(bom):].decode(codec, "replace")
    start = raw[:256]
    if len(start) >= 4 and start[1::2].count(0) == len(start[1::2]):
        return raw.decode("utf-16-le", "replace")
    if len(start) >= 4 and start[0::2].count(0) == len(start[0::2]):
        return raw.decode("utf-16-be", "replace")
    return raw.decode("utf-8", "replace")


def looks_like_recipe(path: Path) -> bool:
    """True when the file has a top-level ``version:``/``extends:`` (in any YAML style and encoding,
    after any comment header) or the recipe schema comment."""
    if not is_regular_file(path):
        return True  # a FIFO or device is never opened here: the check reports it
    try:
        raw = read_capped(path, SNIFF_BYTES)
    except FileTooLarge:
        return True  # too large for a recipe: the check says so
    except OSError:
        return True  # let the check report why it cannot be read
    text = _sniff_text(raw)
    if _SCHEMA_COMMENT.search(text):
        return True
    try:
        import yaml  # noqa: PLC0415

        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except Exception:  # noqa: BLE001 - not YAML PyYAML reads (a broken recipe too): look at the lines
        return _KEY_LINE.search(text) is not None
    if isinstance(root, yaml.MappingNode):
        return any(isinstance(k, yaml.ScalarNode) and k.value in _KEYS for k, _ in root.value)
    return False


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


def discover(paths: Iterable[str | os.PathLike[str]], skip_non_recipes: bool = False) -> LintTarget:
    """Expand files and folders into the recipes to lint (each once, in the order found). A file named
    in ``paths`` is a recipe to lint, unless ``skip_non_recipes`` (pre-commit); in folders only the
    files that look like recipes are (:func:`looks_like_recipe`)."""
    found = LintTarget()
    seen: set[str] = set()
    for raw in paths:
        path = Path(raw)
        named = not path.is_dir()
        if path.is_dir():
            candidates: Iterable[Path] = _walk(path)
        elif path.exists() or path.is_symlink():
            candidates = [path]
        else:
            found.missing.append(str(raw))
            continue
        for candidate in candidates:
            key = os.path.realpath(candidate)
            if key in seen:
                continue
            seen.add(key)
            is_recipe = (named and not skip_non_recipes) or looks_like_recipe(candidate)
            (found.recipes if is_recipe else found.skipped).append(candidate)
    return found


#: Fewer recipes than this per worker process are checked in the calling process (a worker costs a
#: fork and a result transfer; small runs such as pre-commit stay in one process).
MIN_RECIPES_PER_JOB = 100

Check = Callable[[str], Sequence[Diagnostic]]
_WORKER_CHECK: Check | None = None  # the check a forked worker inherits from the parent


def job_count(requested: int | None, recipes: int) -> int:
    """Worker processes for ``recipes`` recipes: ``requested`` when given, else one per available
    CPU and at most one per :data:`MIN_RECIPES_PER_JOB` recipes; 1 where ``fork`` is unavailable."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if requested is not None:
        return max(1, min(requested, recipes))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, recipes // MIN_RECIPES_PER_JOB))


def _check_slice(paths: list[str]) -> list[list[Diagnostic]]:
    assert _WORKER_CHECK is not None
    with shared_parents():
        return [list(_WORKER_CHECK(p)) for p in paths]


def _check_all(recipes: list[str], check: Check, jobs: int) -> list[Sequence[Diagnostic]]:
    """``check`` of every recipe, in order, over ``jobs`` forked workers."""
    if jobs <= 1:
        with shared_parents():  # a base recipe extended by many is parsed once
            return [check(p) for p in recipes]
    global _WORKER_CHECK
    size = math.ceil(len(recipes) / (4 * jobs))  # a few slices per worker evens out slow recipes
    slices = [recipes[i:i + size] for i in range(0, len(recipes), size)]
    _WORKER_CHECK = check
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            parts = pool.map(_check_slice, slices)
    finally:
        _WORKER_CHECK = None
    return [diags for part in parts for diags in part]


def lint(paths: Sequence[str], check: Check, jobs: int | None = None,
         skip_non_recipes: bool = False) -> tuple[list[Diagnostic], LintTarget]:
    """Run ``check`` on every recipe under ``paths`` (over ``jobs`` worker processes; default: see
    :func:`job_count`); missing paths become usage errors. ``skip_non_recipes``: see :func:`discover`."""
    target = discover(paths, skip_non_recipes)
    diags = [Diagnostic("error", "no such file or folder", "", p, rule="io") for p in target.missing]
    recipes = [str(r) for r in target.recipes]
    seen: dict[tuple, Diagnostic] = {}
    found_by: dict[tuple, list[str]] = {}  # the checked recipes a finding placed elsewhere came from
    for recipe, found in zip(recipes, _check_all(recipes, check, job_count(jobs, len(recipes)))):
        own = os.path.normpath(recipe)
        for d in found:
            # the same finding at the same place of the same file (a parent's, met again through
            # each recipe that extends it) is reported once, naming every recipe that met it
            ident = (d.severity, d.file or own, d.line, d.col, d.path, d.message, d.rule)
            if ident not in seen:
                seen[ident] = d
                diags.append(d)
            if d.file is None or os.path.normpath(d.file) != own:
                found_by.setdefault(ident, []).append(recipe)
    for ident, by in found_by.items():
        seen[ident].message += f" (checking {', '.join(by)})"
    return diags, target


#: The rule of the (internal) record of a checked recipe's output folders, which the check hands
#: back with its diagnostics (checks may run in worker processes); never printed.
OUTPUTS_RULE = "outputs"


def output_folders(path: str, result: Any) -> Diagnostic:
    """Where a checked recipe's run writes state another run must not share (from its resolved
    ``runtime.yaml``): checkpoints and metrics, as an :data:`OUTPUTS_RULE` record."""
    import json  # noqa: PLC0415

    checkpoint_dir, metrics_dir = output_dirs(result.recipe)
    folders = {"checkpointing.dir": checkpoint_dir, "logging.dir": metrics_dir}
    return Diagnostic("info", json.dumps(folders), file=path, rule=OUTPUTS_RULE)


def shared_output_warnings(records: Sequence[Diagnostic]) -> list[Diagnostic]:
    """A warning on each recipe whose checkpoint or metrics folder another linted recipe also uses
    (say, two children of one parent that inherit its ``name``): they would resume from, and
    overwrite, each other's state. ``records``: :func:`output_folders` of each recipe."""
    import json  # noqa: PLC0415

    users: dict[tuple[str, str], list[str]] = {}
    for record in records:
        for key, folder in json.loads(record.message).items():
            users.setdefault((key, folder), []).append(str(record.file))
    diags = []
    for (key, folder), paths in users.items():
        for path in paths if len(paths) > 1 else ():
            others = ", ".join(p for p in paths if p != path)
            diags.append(Diagnostic("warning", f"{folder} is also the {key} of {others}: the runs would share "
                                    "(and resume from) each other's state", path=key, file=path,
                                    hint="give each recipe its own `name` (or set this folder)"))
    return diags
