"""Atomic bundle writing: everything goes into a temporary folder beside the target, which is
renamed into place at the end. A folder that is not an rlc bundle is never replaced; an existing
bundle only with ``force``.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from rlc.compiler.bundle.errors import BundleError
from rlc.compiler.bundle.lock import LOCK_NAME, read_lock


def check_target(out_dir: Path, force: bool) -> None:
    """Raise :class:`BundleError` (kind ``io``) if ``out_dir`` may not be (re)written."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise BundleError(f"{out_dir} exists and is not a folder; choose another -o/--output", kind="io")
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    if read_lock(out_dir) is None:
        raise BundleError(f"{out_dir} exists and is not an rlc bundle (no {LOCK_NAME}); it is never "
                          "overwritten: choose another -o/--output or remove it yourself", kind="io")
    if not force:
        raise BundleError(f"{out_dir} already holds a bundle; pass --force to replace it", kind="io")


def staging_dir(out_dir: Path) -> Path:
    """A fresh temporary folder beside ``out_dir`` (same filesystem, so the rename is atomic)."""
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
        umask = os.umask(0)
        os.umask(umask)
        staged.chmod(0o777 & ~umask)  # mkdtemp makes 0700; a bundle is a normal folder
        return staged
    except OSError as exc:
        raise BundleError(f"cannot write beside {out_dir}: {exc.strerror or exc}", kind="io") from None


def commit(staged: Path, out_dir: Path, force: bool) -> None:
    """Move ``staged`` to ``out_dir``, replacing an old bundle (``force``) or an empty folder."""
    old: Path | None = None
    try:
        check_target(out_dir, force)  # again: something may have appeared meanwhile
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "b")
        os.rename(staged, out_dir)
    except OSError as exc:
        if old is not None and not out_dir.exists() and (old / "b").exists():
            os.rename(old / "b", out_dir)  # put the old bundle back
        raise BundleError(f"cannot move the bundle into {out_dir}: {exc.strerror or exc}", kind="io") from None
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def discard(staged: Path) -> None:
    """Remove a staging folder after a failure."""
    shutil.rmtree(staged, ignore_errors=True)
