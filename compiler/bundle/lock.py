"""bundle.lock.json: what a bundle was made from and a hash of everything in it.

It also marks a folder as an rlc bundle: ``rlc compile --force`` only replaces folders whose
lock file carries ``"rlc_bundle": 1``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rlc.compiler.files import CONFIG_BYTES, read_capped
from rlc.compiler.recipe_types import ContainerSection

LOCK_NAME = "bundle.lock.json"
LOCK_FORMAT = 1
#: ``sha256sum`` lines of every file the job uses (all but launch.sbatch, this and the lock);
#: launch.sbatch carries this file's own hash and checks both before it starts anything.
MANIFEST_NAME = "files.sha256"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def make_lock(folder: Path, *, recipe_files: list[Path], overrides: list[str], container: ContainerSection,
              recipe_name: str, log_dir: str) -> dict[str, Any]:
    """The lock mapping for the files now in ``folder`` (the lock file itself excluded)."""
    from rlc import RECIPE_VERSION, RUNTIME_CONFIG_VERSION, __version__

    files = sorted(p for p in folder.rglob("*")
                   if p.is_file() and p.relative_to(folder).as_posix() != LOCK_NAME)
    return {
        "rlc_bundle": LOCK_FORMAT,
        "rlc_version": __version__,
        "recipe_schema_version": RECIPE_VERSION,
        "runtime_config_version": RUNTIME_CONFIG_VERSION,
        "recipe": {
            "name": recipe_name,
            "files": [{"path": str(Path(f).resolve()), "sha256": sha256_file(Path(f))} for f in recipe_files],
            "overrides": list(overrides),
        },
        "log_dir": log_dir,
        "container": {"runtime": container.runtime, "image": container.image},
        "files": {p.relative_to(folder).as_posix(): sha256_file(p) for p in files},
    }


def write_lock(folder: Path, lock: dict[str, Any]) -> Path:
    """Write ``lock`` as ``folder/bundle.lock.json`` (sorted keys, stable)."""
    path = folder / LOCK_NAME
    path.write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_lock(folder: Path) -> dict[str, Any] | None:
    """The lock of ``folder`` if it is an rlc bundle, else ``None``."""
    try:
        data = json.loads(read_capped(folder / LOCK_NAME, CONFIG_BYTES))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("rlc_bundle") == LOCK_FORMAT else None


def write_manifest(folder: Path, skip: tuple[str, ...]) -> str:
    """Write :data:`MANIFEST_NAME` (``sha256sum --check`` format) for the files in ``folder`` but
    ``skip``; returns the manifest's own sha256, which the job script carries."""
    lines = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel not in (*skip, MANIFEST_NAME, LOCK_NAME):
            lines.append(f"{sha256_file(path)}  {rel}\n")
    manifest = folder / MANIFEST_NAME
    manifest.write_text("".join(lines), encoding="utf-8")
    return sha256_file(manifest)


def lock_mismatches(folder: Path, lock: dict[str, Any]) -> list[str]:
    """How ``folder`` differs from what its lock recorded: changed, missing and added files."""
    recorded = lock.get("files") or {}
    present = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*")
               if p.is_file() and p.relative_to(folder).as_posix() != LOCK_NAME}
    problems = [f"{rel} is missing" for rel in sorted(set(recorded) - set(present))]
    problems += [f"{rel} was added" for rel in sorted(set(present) - set(recorded))]
    problems += [f"{rel} was changed" for rel in sorted(set(recorded) & set(present))
                 if sha256_file(present[rel]) != recorded[rel]]
    return problems
