"""The rule registry, explain(), and lint.ignore semantics."""
from __future__ import annotations

import re

import pytest

from rlc.compiler import api
from rlc.compiler.rules import UnknownRuleError, all_rules, explain, run_rules

from planner_helpers import SEED000, load, with_changes


def test_registry_ids_and_metadata():
    rules = all_rules()
    ids = [r.id for r in rules]
    assert len(ids) == len(set(ids)) >= 35
    for r in rules:
        assert re.fullmatch(r"RLC[0-4]\d\d", r.id)  # 0xx meta .. 4xx the Megatron generation backend
        assert set(r.severities) <= {"error", "warning", "info"} and r.severities
        assert r.rationale and r.seed and r.fixes and r.title
    required = {"RLC101", "RLC102", "RLC103", "RLC104", "RLC105", "RLC106", "RLC107", "RLC109", "RLC110",
                "RLC201", "RLC202", "RLC203", "RLC204", "RLC205", "RLC206", "RLC210", "RLC211", "RLC212",
                "RLC301", "RLC302"}
    assert required <= set(ids)


def test_explain_names_rationale_and_seed():
    text = explain("rlc210")
    assert text.startswith("RLC210:") and "8589934592 > 6263046144" in text and "errors cannot be silenced" in text
    assert "SkyRL #1816" in explain("RLC203") and "pytorch#147851" in explain("RLC301")
    assert "can be silenced" in explain("RLC212")
    with pytest.raises(UnknownRuleError, match="did you mean RLC21"):
        explain("RLC219x")


def test_ignoring_a_warning_with_a_reason_silences_it():
    override = "lint.ignore=[{rule: RLC212, reason: measured margin on our cluster}]"
    load(SEED000["ep128"], (override,))  # the override itself passes the schema
    result = api.check(str(SEED000["ep128"]), [override])
    assert not [d for d in result.diagnostics if d.rule == "RLC212"]
    assert result.ok


def test_ignoring_an_error_is_itself_an_error():
    result = api.check(str(SEED000["defaults"]), ["lint.ignore=[{rule: RLC210, reason: trust me please}]"])
    rules = [d.rule for d in result.diagnostics if d.severity == "error"]
    assert "RLC210" in rules and "RLC002" in rules
    bad = [d for d in result.diagnostics if d.rule == "RLC002"][0]
    assert bad.path == "lint.ignore[0].rule"


def test_ignoring_an_error_only_rule_that_did_not_fire_is_still_an_error(base_recipe, qwen397):
    recipe = with_changes(base_recipe, lint__ignore=[{"rule": "RLC301", "reason": "we know"}])
    result = run_rules(recipe, qwen397, None)
    assert [d.rule for d in result.diagnostics if d.severity == "error"] == ["RLC002"]


def test_ignoring_an_unknown_rule_warns(base_recipe, qwen397):
    recipe = with_changes(base_recipe, lint__ignore=[{"rule": "RLC299", "reason": "typo"}])
    hits = [d for d in run_rules(recipe, qwen397, None).diagnostics if d.rule == "RLC003"]
    assert hits and hits[0].severity == "warning"
    assert "did you mean RLC" in hits[0].message


def test_an_ignored_rule_in_lower_case_is_suggested_in_the_registry_spelling(base_recipe, qwen397):
    recipe = with_changes(base_recipe, lint__ignore=[{"rule": "rlc212", "reason": "lower case"}])
    hits = [d for d in run_rules(recipe, qwen397, None).diagnostics if d.rule == "RLC003"]
    assert hits and hits[0].message.endswith("did you mean RLC212?"), hits


def test_docs_rules_md_is_generated_from_the_registry():
    from rlc.compiler.rules.reference import rules_markdown

    from planner_helpers import ROOT

    assert (ROOT / "docs" / "rules.md").read_text(encoding="utf-8") == rules_markdown(), \
        "regenerate: python -m rlc.compiler.rules.reference > docs/rules.md"
