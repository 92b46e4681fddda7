"""Copy the running rlc into the bundle (``rlc_pkg/rlc/...``), so the job runs the exact code that
compiled it, inside any container that has torch/megatron/vllm/ray.

The package is one folder (``rlc/``) in a source checkout and in an install alike, so the copy is
that folder, wherever ``rlc`` was imported from (links followed, as ``shutil.copytree`` follows them;
``__pycache__``, ``*.pyc``, ``*.pyo`` and hidden entries left out).

Each file is read once: its bytes are written to the bundle and hashed in the same pass, and the
hashes are returned for the manifests and the lock (:mod:`rlc.compiler.bundle.lock`), which would
otherwise read every copied file twice more. The hash is of the bytes the bundle holds, read from
the installed file at this compile, so an installed file changed since the last compile changes
it. Files get the bundle's permissions as they are created (:data:`~rlc.compiler.bundle.lock.FILE_MODE`,
folders :data:`~rlc.compiler.bundle.lock.DIR_MODE`) and keep their access and modification times,
as ``shutil.copy2`` keeps them.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
from pathlib import Path

import rlc
from rlc.compiler.bundle.lock import DIR_MODE, FILE_MODE

#: Entries left out of the copy (``shutil.ignore_patterns`` of these, as before).
SKIP = ("__pycache__", "*.pyc", "*.pyo", ".*")
_CHUNK = 1 << 20
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _skipped(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in SKIP)


def copy_rlc(dest: Path) -> dict[str, str]:
    """Copy rlc into ``dest/rlc``; returns the sha256 of every copied file by its path relative
    to ``dest`` (``rlc/compiler/cli.py``), each hashed from the bytes written."""
    hashes: dict[str, str] = {}
    _copy_dir(Path(rlc.__file__).resolve().parent, dest / "rlc", "rlc", hashes)
    return hashes


def _copy_dir(src: Path, dst: Path, rel: str, hashes: dict[str, str]) -> None:
    os.makedirs(dst, mode=DIR_MODE, exist_ok=True)
    os.chmod(dst, DIR_MODE)  # exactly, whatever the umask
    with os.scandir(src) as it:
        entries = sorted((e for e in it if not _skipped(e.name)), key=lambda e: e.name)
    for entry in entries:
        source, target, name = Path(entry.path), dst / entry.name, f"{rel}/{entry.name}"
        if entry.is_dir():  # (a link to a folder is followed)
            _copy_dir(source, target, name, hashes)
        else:
            hashes[name] = _copy_file(source, target)
    st = os.stat(src)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_file(src: Path, dst: Path) -> str:
    """Copy one regular file (a link is followed); returns the sha256 of the bytes written."""
    digest = hashlib.sha256()
    fd_in = os.open(src, os.O_RDONLY | _CLOEXEC)
    try:
        st = os.fstat(fd_in)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"`{src}` is not a regular file")  # (as shutil.copyfile refuses a FIFO or device)
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _CLOEXEC, FILE_MODE)
        try:
            os.fchmod(fd_out, FILE_MODE)
            while chunk := os.read(fd_in, _CHUNK):
                digest.update(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd_out, view):]
            os.utime(fd_out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)
    return digest.hexdigest()
