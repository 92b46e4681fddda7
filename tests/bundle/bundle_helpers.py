"""Helpers for the bundle tests: compile a recipe into a bundle folder, run real bash."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[2]
E2E_RECIPE = REPO / "tests" / "slurm" / "recipes" / "e2e-2node.yaml"


def compile_recipe(recipe: Path, out: Path, overrides: Sequence[str] = (), force: bool = False):
    """``rlc compile`` as a function: check, then build; fails the test on recipe errors."""
    from rlc.compiler.api import check
    from rlc.compiler.bundle import build_bundle

    result = check(recipe, list(overrides))
    assert result.ok, [(d.path, d.message) for d in result.errors]
    return build_bundle(result, out, force=force)


def bash(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``bash -c script`` (real bash, no shell=True of our own); output decoded without newline
    translation (a ``\\r`` stays a ``\\r``)."""
    proc = subprocess.run(["bash", "-c", script, "bash", *args], capture_output=True, env=env, timeout=30,
                          check=False)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8", "surrogateescape"),
                                       proc.stderr.decode("utf-8", "surrogateescape"))
