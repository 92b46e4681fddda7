"""The mutation check stays runnable: every mutation still finds the exact text it changes."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("mutation_check", HERE / "check.py")
check = importlib.util.module_from_spec(_spec)
sys.modules["mutation_check"] = check  # dataclasses look their module up while the class is built
_spec.loader.exec_module(check)


@pytest.mark.parametrize("mutation", check.MUTATIONS, ids=[m.name for m in check.MUTATIONS])
def test_mutation_text_is_in_the_product_once(mutation):
    text = (check.REPO / mutation.path).read_text(encoding="utf-8")
    assert text.count(mutation.old) == 1, f"{mutation.name}: update its old text in tests/mutation/check.py"
    assert mutation.new != mutation.old
    for target in mutation.tests:
        assert (check.REPO / target.split("::")[0]).is_file(), target


def test_names_are_unique():
    names = [m.name for m in check.MUTATIONS]
    assert len(names) == len(set(names))
