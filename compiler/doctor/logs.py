"""Which files ``rlc doctor`` reads: one log, stdin, or every log file under a job's log folder
(rlc bundles write ``<log_dir>/<jobid>/``: the SLURM output, the driver's and workers' logs).

Every read is bounded (the shared reader, :mod:`rlc.contract.files`): regular files only (a FIFO or a
device named as the log is refused at once), at most :data:`LOG_BYTES` of each file (its first
:data:`LOG_HEAD_BYTES`, where runs print their settings, and its end, where they fail), at most
:data:`TOTAL_BYTES` in all, and from stdin at most :data:`STDIN_BYTES` read (its start and end kept).
Lines longer than :data:`MAX_LINE` characters are cut. A 500 MB log used to take 2.6 GB and 100 s, and
``/dev/zero`` (as the log or as stdin) ended in a ``MemoryError``.
"""
from __future__ import annotations

import sys
from pathlib import Path

from rlc.compiler.files import read_head_tail

#: File endings read from a folder (SLURM output, Ray and driver logs, metrics text).
LOG_SUFFIXES = (".log", ".out", ".err", ".txt")
MAX_FILES = 2000
#: Most bytes read from one log, and of those the ones from its start.
LOG_BYTES = 32 << 20
LOG_HEAD_BYTES = 4 << 20
#: Most bytes read from all the logs of a folder together.
TOTAL_BYTES = 128 << 20
#: Most bytes read from stdin (its first LOG_HEAD_BYTES and last LOG_BYTES - LOG_HEAD_BYTES are kept).
STDIN_BYTES = 1 << 30
#: Longest line scanned, in characters.
MAX_LINE = 16 << 10


class LogReadError(OSError):
    """The log cannot be read; the message names the path."""


def _decode(raw: bytes) -> str:
    lines = raw.decode("utf-8", errors="replace").split("\n")
    return "\n".join(line[:MAX_LINE] for line in lines)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n} bytes"


def _read_stdin(notes: list[str]) -> str:
    if sys.stdin is None:
        return ""
    stream = getattr(sys.stdin, "buffer", None)
    text_stream = sys.stdin if stream is None else None

    def read(n: int) -> bytes:
        if text_stream is not None:  # a text stream without bytes underneath (an embedding program's)
            return text_stream.read(n).encode("utf-8", "replace")
        return stream.read(n) if stream is not None else b""

    head = bytearray()
    tail = bytearray()
    total = 0
    keep_tail = LOG_BYTES - LOG_HEAD_BYTES
    while total < STDIN_BYTES:
        chunk = read(min(1 << 20, STDIN_BYTES - total))
        if not chunk:
            break
        total += len(chunk)
        room = LOG_HEAD_BYTES - len(head)
        if room > 0:
            head += chunk[:room]
            chunk = chunk[room:]
        tail += chunk
        if len(tail) > 2 * keep_tail:
            del tail[:len(tail) - keep_tail]
    skipped = max(0, len(tail) - keep_tail)
    if skipped:
        del tail[:skipped]
    if total >= STDIN_BYTES and read(1):
        notes.append(f"stdin: stopped after {_mib(STDIN_BYTES)} (give the log file instead: its end is read)")
    elif skipped:
        notes.append(f"stdin: {_mib(skipped)} in the middle not read (the first {_mib(LOG_HEAD_BYTES)} and the "
                     f"last {_mib(keep_tail)} are; line numbers past the gap are counted without it)")
    return _decode(bytes(head + tail))


def _read_file(path: Path, name: str, limit: int, notes: list[str]) -> tuple[str, int]:
    """The text of one log (within ``limit`` bytes) and the bytes read."""
    data, skipped = read_head_tail(path, limit, min(LOG_HEAD_BYTES, limit))
    if skipped:
        notes.append(f"{name}: {_mib(skipped)} in the middle not read (the first {_mib(min(LOG_HEAD_BYTES, limit))} "
                     f"and the last {_mib(limit - min(LOG_HEAD_BYTES, limit))} are; line numbers past the gap "
                     "are counted without it)")
    return _decode(data), len(data)


def read_logs(path: str, notes: list[str] | None = None) -> list[tuple[str, str]]:
    """``[(name, text)]``: ``-`` is stdin, a file is itself, a folder is its log files (recursively).
    What was left out (the middle of a long log, files past the total) is added to ``notes``."""
    notes = notes if notes is not None else []
    if path == "-":
        return [("", _read_stdin(notes))]
    p = Path(path)
    try:
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in LOG_SUFFIXES)
            if not files:
                raise LogReadError(f"{path}: no log files ({', '.join(LOG_SUFFIXES)}) in this folder")
            out, left = [], TOTAL_BYTES
            for f in files[:MAX_FILES]:
                name = str(f.relative_to(p))
                if left <= 0:
                    notes.append(f"{name} and later files not read ({_mib(TOTAL_BYTES)} read in all)")
                    break
                try:
                    text, read = _read_file(f, name, min(LOG_BYTES, left), notes)
                except OSError as exc:  # a file that changed kind after the listing: say so, read the rest
                    notes.append(f"{name}: not read ({exc.strerror or exc})")
                    continue
                left -= read
                out.append((name, text))
            if len(files) > MAX_FILES:
                notes.append(f"{len(files) - MAX_FILES} log file(s) past the first {MAX_FILES} not read")
            return out
        return [("", _read_file(p, path, LOG_BYTES, notes)[0])]
    except LogReadError:
        raise
    except OSError as exc:
        raise LogReadError(f"cannot read {path}: {exc.strerror or exc}") from None
