"""Test files cited by the product (code, calibration, docs) exist in this checkout."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"\btests/[A-Za-z0-9_/.-]+\.(?:py|sh|yaml)")


def _ours(cited: str) -> bool:
    """A citation of this repository's tests (not of another project's, e.g. Megatron-Bridge's tests/unit_tests)."""
    parts = cited.split("/")
    return len(parts) == 2 or (ROOT / "tests" / parts[1]).is_dir()


def test_cited_test_files_exist():
    files = [*ROOT.joinpath("rlc").rglob("*.py"), *ROOT.joinpath("rlc").rglob("*.yaml"),
             *ROOT.joinpath("docs").glob("*.md"), ROOT / "README.md", *ROOT.joinpath("benchmarks").glob("*.py")]
    missing = sorted({f"{path.relative_to(ROOT)}: {cited}" for path in files
                      for cited in CITATION.findall(path.read_text(encoding="utf-8"))
                      if _ours(cited) and not (ROOT / cited).exists()})
    assert not missing, missing
