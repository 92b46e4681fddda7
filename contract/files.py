"""Reading a file rlc or its runtime opens: regular files only, size-capped, never blocking.

Every file either half reads because a user or a bundle named it (a recipe and its ``extends:``
parents, ``model.config``, calibration tables, run records, an imported config, a job's log,
``runtime.yaml``, a bundle's files) goes through this module. A FIFO named as a recipe used to
block forever, ``model.config: /dev/zero`` grew to gigabytes before a ``MemoryError``, and a
bundle file swapped for a FIFO hung the job's own check. :func:`read_capped` opens without
blocking (``O_NONBLOCK``: a FIFO with no writer opens at once), refuses anything that is not a
regular file before reading a byte, and reads at most ``limit`` bytes. Its errors are
``OSError`` s whose ``strerror`` says what to do, so callers' ``except OSError`` handlers report
them.

Pure Python (no torch, ray, vllm, megatron): the compiler and the runtime both import it.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

#: Default cap for small configuration files (HF ``config.json``, calibration tables, runtime.yaml).
CONFIG_BYTES = 16 << 20

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"))


class FileTooLarge(OSError):
    """The file is larger than the cap; ``size`` and ``limit`` in bytes."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"file is {size} bytes, more than the {limit} bytes rlc reads")
        self.size, self.limit = size, limit


def kind_of(mode: int) -> str:
    """``a FIFO``, ``a character device``, ... for a ``st_mode`` that is not a regular file."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str], *, follow_links: bool = True) -> int:
    """A read-only descriptor of the regular file ``path`` (the caller closes it); never blocks.

    ``follow_links=False`` refuses a symbolic link at ``path`` itself (a bundle's files are never links)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise OSError(errno.ELOOP, "a symbolic link, not a regular file") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"{kind_of(mode)}, not a regular file; name a file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(path: str | os.PathLike[str], limit: int = CONFIG_BYTES, *, follow_links: bool = True) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``, else :class:`FileTooLarge`)."""
    fd = open_regular(path, follow_links=follow_links)
    try:
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


def read_head_tail(path: str | os.PathLike[str], limit: int, head: int) -> tuple[bytes, int]:
    """At most ``limit`` bytes of the regular file ``path``: all of it when it fits, else its first
    ``head`` bytes and its last ``limit - head``, joined; returns ``(bytes, bytes left out)``.
    (Logs: the settings are printed at the start, the failure at the end.)"""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size <= limit:
            data = _read_upto(fd, limit)
            return data, 0
        first = _read_upto(fd, head)
        os.lseek(fd, size - (limit - head), os.SEEK_SET)
        last = _read_upto(fd, limit - head)
        return first + last, size - len(first) - len(last)
    finally:
        os.close(fd)


def _read_upto(fd: int, n: int) -> bytes:
    chunks, total = [], 0
    while total < n:
        chunk = os.read(fd, min(1 << 20, n - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def sha256_regular(path: str | os.PathLike[str], *, follow_links: bool = False) -> str:
    """Hex sha256 of the regular file ``path`` (streamed, any size); links refused unless
    ``follow_links``. ``OSError`` for anything that is not a regular file."""
    fd = open_regular(path, follow_links=follow_links)
    import hashlib  # noqa: PLC0415  (OpenSSL's bindings: loaded by the commands that hash, not every one)

    digest = hashlib.sha256()
    try:
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            digest.update(chunk)
    finally:
        os.close(fd)
    return digest.hexdigest()


def is_regular_file(path: str | os.PathLike[str]) -> bool:
    """True for a regular file (following links); never opens it."""
    try:
        return stat.S_ISREG(Path(path).stat().st_mode)
    except OSError:
        return False


class JsonError(ValueError):
    """Text that is not JSON rlc reads: bad syntax, nesting deeper than Python follows, or a number
    too long to convert. The message (``detail``: the reason alone) names the line where known and
    never quotes the text."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def parse_json(text: str) -> Any:
    """``json.loads(text)`` with every failure a :class:`JsonError` (never a ``RecursionError`` or
    Python's integer-length ``ValueError``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        detail = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
        raise JsonError(f"not valid JSON ({detail})", detail) from None
    except RecursionError:
        detail = "nested more deeply than rlc reads"
        raise JsonError(f"JSON {detail}", detail) from None
    except ValueError as exc:  # Python's limit on the digits of an integer (int_max_str_digits)
        detail = f"a number too long to read: {str(exc).split(':')[0]}"
        raise JsonError(f"JSON with {detail}", detail) from None
