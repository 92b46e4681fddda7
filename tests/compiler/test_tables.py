"""The shipped YAML tables read the same with libyaml as with PyYAML's pure-Python parser."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlc.compiler.tables import _LOADER, parse_table

REPO = Path(__file__).resolve().parents[2]
TABLES = sorted([*(REPO / "compiler" / "catalog").glob("*.yaml"), *(REPO / "compiler" / "planner").rglob("*.yaml")])


@pytest.mark.parametrize("path", TABLES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_shipped_table_reads_the_same_with_libyaml(path):
    text = path.read_text(encoding="utf-8")
    assert parse_table(text) == yaml.safe_load(text)


def test_libyaml_is_used_where_pyyaml_has_it_and_errors_stay_yaml_errors():
    assert len(TABLES) >= 4
    assert _LOADER is getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with pytest.raises(yaml.YAMLError):
        parse_table("a: [1, 2\n")
    with pytest.raises(yaml.YAMLError):
        parse_table("!!python/object:os.system x")
