"""Copy the running rlc into the bundle (``rlc_pkg/rlc/...``), so the job runs the exact code that
compiled it, inside any container that has torch/megatron/vllm/ray.

The package is one folder (``rlc/``) in a source checkout and in an install alike, so the copy is
that folder, wherever ``rlc`` was imported from.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import rlc

_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", ".*")


def copy_rlc(dest: Path) -> list[Path]:
    """Copy rlc into ``dest/rlc``; returns the copied files (relative to ``dest``)."""
    root = dest / "rlc"
    shutil.copytree(Path(rlc.__file__).resolve().parent, root, ignore=_SKIP, dirs_exist_ok=True)
    return sorted(p.relative_to(dest) for p in root.rglob("*") if p.is_file())
