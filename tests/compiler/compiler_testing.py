"""Shared helpers for the compiler tests: fixture paths and an in-process ``rlc`` runner.

(A uniquely named module rather than ``conftest``: ``import conftest`` is ambiguous when several
test folders have one.)
"""
from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

from rlc.compiler.cli import main

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
REPO = HERE.parents[1]


@dataclass
class Run:
    """Result of one in-process ``rlc`` call."""

    code: int
    out: str
    err: str

    @property
    def both(self) -> str:
        return self.out + self.err


def run_rlc(*argv: str, cwd: str | os.PathLike[str] | None = None) -> Run:
    """Call ``rlc.compiler.cli.main`` in-process with stdout/stderr captured (no subprocess)."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        os.chdir(old)
    return Run(code, out.getvalue(), err.getvalue())

