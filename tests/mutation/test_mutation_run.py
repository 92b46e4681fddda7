"""CI runs the mutation check: every planted bug (tests/mutation/check.py) must fail a test.

Each mutation changes one line of a product file in a temporary copy of the tree and runs the tests
that guard that behaviour against the copy; two run at a time (the CI machine has two cores)."""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _check_module():
    if "mutation_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("mutation_check", Path(__file__).with_name("check.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["mutation_check"] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules["mutation_check"]


def test_every_planted_bug_fails_a_test():
    check = _check_module()
    start = time.monotonic()
    results = check.run_many(list(check.MUTATIONS), jobs=2)
    verdicts = {m.name: v for m, v in results}
    assert [n for n, v in verdicts.items() if v != "caught"] == [], verdicts
    assert {m.behaviour for m in check.MUTATIONS} >= set(check.CI_BEHAVIOURS)
    print(f"{len(results)} mutations caught in {time.monotonic() - start:.0f} s")
