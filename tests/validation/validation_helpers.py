"""Shared helpers of the validation suite (imported by name; tests/ has no packages)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rlc.compiler import api
from rlc.compiler.recipe import load_recipe

HERE = Path(__file__).resolve().parent
PRODUCTION = HERE / "recipes"
FAILURES = HERE / "failures"
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def recipes(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.yaml"))


def provenance(path: Path) -> dict[str, Any]:
    """The recipe's ``extensions.provenance`` mapping (where the configuration was published)."""
    return load_recipe(path).data.get("extensions", {}).get("provenance", {})


def rules(result: api.CheckResult, severity: str) -> set[str]:
    return {d.rule for d in result.diagnostics if d.severity == severity and d.rule}
