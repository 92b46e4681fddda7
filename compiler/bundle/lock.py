"""bundle.lock.json and the manifests: what a bundle was made from, and the whole tree it holds.

Three records, one listing format:

* ``files.tree``: every entry the job uses (everything but :data:`UNCHECKED`), one line each,
  ``d MODE - PATH`` for a folder and ``TYPE MODE LINKS PATH`` for anything else (``f`` a regular
  file; ``l``, ``p``, ``c``, ... what ``find -printf %y`` prints), sorted as ``LC_ALL=C sort`` sorts.
  It is exactly what ``find . -mindepth 1 ... -printf`` prints for the bundle as compiled, so the job
  compares the two: a file added (``rlc_pkg/sitecustomize.py``), removed, replaced by a link or a
  FIFO, hard-linked, or with other permissions fails the check before anything is opened.
* ``files.sha256``: ``sha256sum`` lines of every regular file in ``files.tree``.
  ``launch.sbatch`` carries the hashes of both (SLURM runs its own copy of the script, captured at
  submit), so the job trusts only what it hashed (:func:`job_check_values`).
* ``bundle.lock.json``, written last: the versions, the recipe files and overrides (values under
  ``cluster.env`` not recorded: they may be secrets), the container, the log folder, and the tree
  line and hash of every other entry, ``launch.sbatch`` and the manifests included. ``rlc submit``
  checks the bundle against it (:func:`lock_mismatches`) and takes the log folder from the script it
  hashes. It also marks a folder as an rlc bundle: ``rlc compile --force`` only replaces folders
  whose lock file carries ``"rlc_bundle": 1``.

Every read here opens regular files only (never a link, FIFO or device), so no check can block.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlc.compiler.files import CONFIG_BYTES, read_capped, sha256_regular
from rlc.compiler.recipe_types import ContainerSection
from rlc.contract.files import kind_of
from rlc import RECIPE_VERSION, RUNTIME_CONFIG_VERSION, __version__

LOCK_NAME = "bundle.lock.json"
LOCK_FORMAT = 1
#: ``sha256sum`` lines of every regular file the job uses.
MANIFEST_NAME = "files.sha256"
#: The type, permissions and link count of every entry the job uses.
TREE_NAME = "files.tree"
#: What the job's own check leaves out: the script (SLURM runs its own copy, which carries the
#: manifests' hashes), the two manifests (checked by those hashes) and the lock (written last).
UNCHECKED = ("launch.sbatch", MANIFEST_NAME, TREE_NAME, LOCK_NAME)
#: The permissions the compiler gives what it writes: folders, files, scripts, and the files that
#: may hold secrets (``cluster.env`` values: ``env.sh``, ``runtime.yaml``), readable by the owner only.
DIR_MODE, FILE_MODE, SCRIPT_MODE, SECRET_MODE = 0o755, 0o644, 0o755, 0o600

_TYPES = ((stat.S_ISREG, "f"), (stat.S_ISDIR, "d"), (stat.S_ISLNK, "l"), (stat.S_ISFIFO, "p"),
          (stat.S_ISSOCK, "s"), (stat.S_ISCHR, "c"), (stat.S_ISBLK, "b"))


def sha256_file(path: Path) -> str:
    """Hex sha256 of a regular file's bytes (a link is followed; a FIFO or device is refused)."""
    return sha256_regular(path, follow_links=True)


Entries = Sequence[tuple[str, os.stat_result]]


def _entries(folder: Path, skip: tuple[str, ...]) -> list[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every entry under ``folder`` but ``skip``; links are not followed."""
    out: list[tuple[str, os.stat_result]] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        with os.scandir(folder / rel_dir if rel_dir else folder) as it:
            for entry in it:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                if rel in skip:
                    continue
                st = entry.stat(follow_symlinks=False)
                out.append((rel, st))
                if stat.S_ISDIR(st.st_mode):
                    pending.append(rel)
    return out


def tree_fields(st: os.stat_result) -> str:
    """An entry's type, permissions and link count as the listing writes them (``f 644 1``, ``d 755 -``)."""
    kind = next((t for test, t in _TYPES if test(st.st_mode)), "?")
    mode = format(stat.S_IMODE(st.st_mode), "o")
    return f"d {mode} -" if kind == "d" else f"{kind} {mode} {st.st_nlink}"


def tree_line(rel: str, st: os.stat_result) -> str:
    """One entry as the job's ``find -printf`` prints it (see the module docstring); a name with a
    line break is ``?`` (it can never match the listing)."""
    return "?" if "\n" in rel else f"{tree_fields(st)} {rel}"


def _c_sorted(lines: list[str]) -> list[str]:
    return sorted(lines, key=lambda s: s.encode("utf-8", "surrogateescape"))


def tree_lines(folder: Path, skip: tuple[str, ...] = UNCHECKED) -> list[str]:
    """The listing of ``folder`` (every entry but ``skip``), sorted like ``LC_ALL=C sort``."""
    return _c_sorted([tree_line(rel, st) for rel, st in _entries(folder, skip)])


def set_modes(folder: Path, secrets: tuple[str, ...], scripts: tuple[str, ...]) -> list[tuple[str, os.stat_result]]:
    """Give every entry the compiler's permissions (see :data:`DIR_MODE`): the same on every machine
    whatever the umask or the source checkout's modes, none writable by others. Returns every entry
    with its ``lstat`` after the change, for :func:`write_manifests` and :func:`make_lock` (``entries``), so
    the folder is walked once."""
    entries = _entries(folder, ())
    for i, (rel, st) in enumerate(entries):
        if stat.S_ISDIR(st.st_mode):
            mode = DIR_MODE
        elif stat.S_ISREG(st.st_mode):
            mode = SECRET_MODE if rel in secrets else SCRIPT_MODE if rel in scripts else FILE_MODE
        else:
            continue
        if stat.S_IMODE(st.st_mode) != mode:  # (what was created with its mode is left alone)
            (folder / rel).chmod(mode)
            entries[i] = (rel, os.lstat(folder / rel))
    return entries


def _sha256(folder: Path, rel: str, known: Mapping[str, str] | None) -> str:
    found = known.get(rel) if known else None
    return found if found is not None else sha256_regular(folder / rel)


def write_manifests(folder: Path, known: Mapping[str, str] | None = None,
                    entries: Entries | None = None) -> dict[str, str]:
    """Write :data:`TREE_NAME` and :data:`MANIFEST_NAME` for ``folder`` (all but :data:`UNCHECKED`);
    returns their sha256 as the job script's values ``tree_sha256`` and ``manifest_sha256``.
    ``known``: the sha256 of files (by relative path) hashed as they were written, not read again;
    ``entries``: the folder's entries as :func:`set_modes` returned them (else it is walked)."""
    entries = _entries(folder, UNCHECKED) if entries is None else [(r, st) for r, st in entries if r not in UNCHECKED]
    tree = "".join(line + "\n" for line in _c_sorted([tree_line(rel, st) for rel, st in entries]))
    files = sorted(rel for rel, st in entries if stat.S_ISREG(st.st_mode))
    manifest = "".join(f"{_sha256(folder, rel, known)}  {rel}\n" for rel in files)
    (folder / TREE_NAME).write_text(tree, encoding="utf-8")
    (folder / MANIFEST_NAME).write_text(manifest, encoding="utf-8")
    for name in (TREE_NAME, MANIFEST_NAME):
        (folder / name).chmod(FILE_MODE)
    return {
        "tree_sha256": sha256_regular(folder / TREE_NAME),
        "manifest_sha256": sha256_regular(folder / MANIFEST_NAME),
    }


#: Overrides whose values are not recorded in the lock: ``cluster.env`` may hold tokens.
_SECRET_KEYS = ("cluster.env", "cluster")


def recorded_override(text: str) -> str:
    """``text`` (a ``--set KEY=VALUE``) as the lock records it: a value that may hold a secret
    (``cluster.env`` and what contains it) is left out."""
    key, sep, _ = text.partition("=")
    path = key.strip()
    if sep and (path in _SECRET_KEYS or path.startswith("cluster.env.") or path.startswith("cluster.env[")):
        return f"{key}=(value not recorded: cluster.env may hold secrets)"
    return text


def make_lock(folder: Path, *, recipe_files: list[Path], overrides: list[str], container: ContainerSection,
              recipe_name: str, log_dir: str, known: Mapping[str, str] | None = None,
              entries: Entries | None = None) -> dict[str, Any]:
    """The lock mapping for the entries now in ``folder`` (the lock file itself excluded); ``known``
    as for :func:`write_manifests`; ``entries``: every entry now in ``folder`` with its ``lstat`` (else it
    is walked)."""
    entries = _entries(folder, (LOCK_NAME,)) if entries is None else [(r, st) for r, st in entries
                                                                        if r != LOCK_NAME]
    return {
        "rlc_bundle": LOCK_FORMAT,
        "rlc_version": __version__,
        "recipe_schema_version": RECIPE_VERSION,
        "runtime_config_version": RUNTIME_CONFIG_VERSION,
        "recipe": {
            "name": recipe_name,
            "files": [{"path": str(Path(f).resolve()), "sha256": sha256_file(Path(f))} for f in recipe_files],
            "overrides": [recorded_override(o) for o in overrides],
        },
        "log_dir": log_dir,
        "container": {"runtime": container.runtime, "image": container.image},
        "files": {rel: _sha256(folder, rel, known) for rel, st in sorted(entries) if stat.S_ISREG(st.st_mode)},
        "tree": {rel: tree_fields(st) for rel, st in sorted(entries)},
    }


def write_lock(folder: Path, lock: dict[str, Any]) -> Path:
    """Write ``lock`` as ``folder/bundle.lock.json`` (sorted keys, stable)."""
    path = folder / LOCK_NAME
    path.write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    path.chmod(FILE_MODE)
    return path


def read_lock(folder: Path) -> dict[str, Any] | None:
    """The lock of ``folder`` if it is an rlc bundle, else ``None``."""
    try:
        data = json.loads(read_capped(folder / LOCK_NAME, CONFIG_BYTES, follow_links=False))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and data.get("rlc_bundle") == LOCK_FORMAT else None


_KIND_NAMES = {"f": "a file", "d": "a folder", "l": "a symbolic link", "p": "a FIFO", "s": "a socket",
               "c": "a character device", "b": "a block device"}


def lock_mismatches(folder: Path, lock: dict[str, Any]) -> list[str]:
    """How ``folder`` differs from what its lock recorded: entries missing, added, of another kind
    or other permissions (a file replaced by a link, a FIFO, a device), and files changed."""
    recorded_tree = lock.get("tree")
    recorded_files = lock.get("files") or {}
    if not isinstance(recorded_tree, dict):  # a lock written before the tree was recorded
        recorded_tree = {rel: f"f {format(FILE_MODE, 'o')}" for rel in recorded_files}
    present = {rel: st for rel, st in _entries(folder, (LOCK_NAME,))}
    problems = [f"{rel} is missing" for rel in sorted(set(recorded_tree) - set(present))]
    problems += [f"{rel} was added" for rel in sorted(set(present) - set(recorded_tree))]
    for rel in sorted(set(recorded_tree) & set(present)):
        now, was = tree_fields(present[rel]).split(" "), str(recorded_tree[rel]).split(" ")
        if isinstance(lock.get("tree"), dict) and now != was and len(was) == 3:
            if now[0] != was[0]:
                problems.append(f"{rel} is now {_KIND_NAMES.get(now[0], now[0])} (compiled: "
                                f"{_KIND_NAMES.get(was[0], was[0])})")
                continue
            if now[1] != was[1]:
                problems.append(f"{rel} has mode {now[1]} (compiled: {was[1]})")
            if now[2] != was[2]:
                problems.append(f"{rel} has {now[2]} hard links (compiled: {was[2]}): another path shares its bytes")
        if rel in recorded_files:
            if not stat.S_ISREG(present[rel].st_mode):
                problems.append(f"{rel} is now {kind_of(present[rel].st_mode)} (compiled: a file)")
            elif sha256_regular(folder / rel) != recorded_files[rel]:
                problems.append(f"{rel} was changed")
    return problems


def script_value(script: Path, name: str) -> str | None:
    """The value of ``readonly NAME=...`` in a bundle's ``launch.sbatch`` (one shell word), or ``None``."""
    import shlex  # noqa: PLC0415

    try:
        text = read_capped(script, CONFIG_BYTES, follow_links=False).decode("utf-8", "replace")
    except OSError:
        return None
    prefix = f"readonly {name}="
    for line in text.splitlines():
        if line.startswith(prefix):
            try:
                words = shlex.split(line[len(prefix):])
            except ValueError:
                return None
            return words[0] if len(words) == 1 else None
    return None
