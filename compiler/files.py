"""Reading a file a user named (recipe, ``extends:`` parent, ``model.config``, calibration table,
run records, an imported config): regular files only, size-capped, never blocking.

A FIFO given as a recipe used to block ``rlc`` forever, and ``model.config: /dev/zero`` grew to
gigabytes before a ``MemoryError``. :func:`read_capped` opens without blocking (``O_NONBLOCK``: a
FIFO with no writer opens at once), refuses anything that is not a regular file before reading a
byte, and reads at most ``limit`` bytes. Its errors are ``OSError`` s whose ``strerror`` says what
to do, so callers' existing ``except OSError`` handlers report them.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

#: Default cap for small configuration files (HF ``config.json``, calibration tables).
CONFIG_BYTES = 16 << 20

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class FileTooLarge(OSError):
    """The file is larger than the cap; ``size`` and ``limit`` in bytes."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"file is {size} bytes, more than the {limit} bytes rlc reads")
        self.size, self.limit = size, limit


def read_capped(path: str | os.PathLike[str], limit: int = CONFIG_BYTES) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``, else :class:`FileTooLarge`)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise OSError(errno.EINVAL, f"{kind}, not a regular file; name a file")
        size = os.fstat(fd).st_size
        if size > limit:
            raise FileTooLarge(size, limit)
        chunks, total = [], 0
        while total <= limit:  # the file may grow while it is read
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise FileTooLarge(total, limit)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text_capped(path: str | os.PathLike[str], limit: int = CONFIG_BYTES) -> str:
    """:func:`read_capped` decoded as UTF-8 (``UnicodeDecodeError`` for other encodings)."""
    return read_capped(path, limit).decode("utf-8")


def is_regular_file(path: str | os.PathLike[str]) -> bool:
    """True for a regular file (following links); never opens it."""
    try:
        return stat.S_ISREG(Path(path).stat().st_mode)
    except OSError:
        return False
