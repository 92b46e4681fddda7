"""Atomic bundle writing: everything goes into a temporary folder beside the target, which is
renamed into place at the end. A folder that is not an rlc bundle is never replaced; an existing
bundle only with ``force``.

An existing bundle is swapped with the new one in one step (Linux ``renameat2(RENAME_EXCHANGE)``),
so a compile killed at any moment leaves the old or the new bundle in place. Where the filesystem
cannot swap, the old bundle is moved aside first; the temporary folders carry the compiling
process's id, and the next compile to the same place removes those of processes that are gone and
puts back an old bundle that a killed compile had moved aside (:func:`recover`).
"""
from __future__ import annotations

import errno
import os
import re
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


def _owner_alive(folder: Path) -> bool:
    """Whether the process whose id is in a temporary folder's name (``.b.tmp-<pid>-x``) still runs."""
    m = re.search(r"\.(?:tmp|old)-(\d+)-", folder.name)
    if m is None:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(out_dir: Path) -> list[str]:
    """Clean up after compiles to ``out_dir`` that were killed: remove their temporary folders and
    put back an old bundle one had moved aside (when ``out_dir`` is missing). Folders of compiles
    still running are left alone. Returns what was done, for the user."""
    done: list[str] = []
    parent = out_dir.parent
    if not parent.is_dir():
        return done
    for folder in sorted(parent.glob(f".{out_dir.name}.old-*")) + sorted(parent.glob(f".{out_dir.name}.tmp-*")):
        if _owner_alive(folder) or not folder.is_dir():
            continue
        aside = folder / "b"
        if ".old-" in folder.name and not out_dir.exists() and read_lock(aside) is not None:
            os.rename(aside, out_dir)
            done.append(f"restored the bundle {out_dir} that an interrupted compile had moved aside")
        shutil.rmtree(folder, ignore_errors=True)
        done.append(f"removed {folder.name}, left behind by an interrupted compile")
    return done


def staging_dir(out_dir: Path) -> Path:
    """A fresh temporary folder beside ``out_dir`` (same filesystem, so the rename is atomic)."""
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=parent))
        umask = os.umask(0)
        os.umask(umask)
        staged.chmod(0o777 & ~umask)  # mkdtemp makes 0700; a bundle is a normal folder
        return staged
    except OSError as exc:
        raise BundleError(f"cannot write beside {out_dir}: {exc.strerror or exc}", kind="io") from None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where the
    system or filesystem cannot."""
    import ctypes  # noqa: PLC0415 - only to replace an existing bundle (a first compile never swaps)

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err))


def commit(staged: Path, out_dir: Path, force: bool) -> None:
    """Move ``staged`` to ``out_dir``, replacing an old bundle (``force``) or an empty folder."""
    old: Path | None = None
    try:
        check_target(out_dir, force)  # again: something may have appeared meanwhile
        if out_dir.exists() and _exchange(staged, out_dir):
            shutil.rmtree(staged, ignore_errors=True)  # now the old bundle
            return
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-{os.getpid()}-", dir=out_dir.parent))
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
