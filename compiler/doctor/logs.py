"""Which files ``rlc doctor`` reads: one log, stdin, or every log file under a job's log folder
(rlc bundles write ``<log_dir>/<jobid>/``: the SLURM output, the driver's and workers' logs)."""
from __future__ import annotations

import sys
from pathlib import Path

#: File endings read from a folder (SLURM output, Ray and driver logs, metrics text).
LOG_SUFFIXES = (".log", ".out", ".err", ".txt")
MAX_FILES = 2000


class LogReadError(OSError):
    """The log cannot be read; the message names the path."""


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def read_logs(path: str) -> list[tuple[str, str]]:
    """``[(name, text)]``: ``-`` is stdin, a file is itself, a folder is its log files (recursively)."""
    if path == "-":
        return [("", sys.stdin.read())]
    p = Path(path)
    try:
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in LOG_SUFFIXES)
            if not files:
                raise LogReadError(f"{path}: no log files ({', '.join(LOG_SUFFIXES)}) in this folder")
            return [(str(f.relative_to(p)), _decode(f.read_bytes())) for f in files[:MAX_FILES]]
        return [("", _decode(p.read_bytes()))]
    except LogReadError:
        raise
    except OSError as exc:
        raise LogReadError(f"cannot read {path}: {exc.strerror or exc}") from None
