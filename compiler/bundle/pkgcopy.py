"""Copy the running rlc into the bundle (``rlc_pkg/rlc/...``), so the job runs the exact code that
compiled it, inside any container that has torch/megatron/vllm/ray.

Each part is copied from its import location (``__path__``), which works for wheel installs
(one ``site-packages/rlc`` tree) and editable installs (each part mapped to its own folder).
"""
from __future__ import annotations

import importlib
import shutil
from pathlib import Path

#: (package, folder under rlc_pkg/rlc)
PARTS = (
    ("rlc", ""),
    ("rlc.compiler", "compiler"),
    ("rlc.runtime", "runtime"),
    ("rlc.templates", "templates"),
    ("rlc.schemas", "schemas"),
    ("rlc.recipes", "recipes"),
)
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", ".*")


def _source(package: str) -> Path:
    module = importlib.import_module(package)
    paths = list(getattr(module, "__path__", []))
    if not paths:
        raise RuntimeError(f"{package} is not a package")
    return Path(paths[0])


def copy_rlc(dest: Path) -> list[Path]:
    """Copy rlc into ``dest/rlc``; returns the copied files (relative to ``dest``)."""
    root = dest / "rlc"
    subfolders = {sub for _, sub in PARTS if sub}
    for package, sub in PARTS:
        src = _source(package)
        if sub:
            shutil.copytree(src, root / sub, ignore=_SKIP, dirs_exist_ok=True)
        else:  # the top level without the parts copied on their own (a wheel nests them)
            def skip(folder: str, names: list[str], _src: Path = src) -> set[str]:
                ignored = set(_SKIP(folder, names))
                if Path(folder) == _src:
                    ignored |= subfolders & set(names)
                return ignored

            shutil.copytree(src, root, ignore=skip, dirs_exist_ok=True)
    return sorted(p.relative_to(dest) for p in root.rglob("*") if p.is_file())
