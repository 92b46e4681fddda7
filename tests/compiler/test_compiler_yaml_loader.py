"""The hardened YAML loader: YAML 1.2 scalars, positions, and every rejection it promises."""
from __future__ import annotations

import pytest

from rlc.compiler import yaml_loader
from rlc.compiler.yaml_loader import YamlLoadError, load_yaml, parse_text


def load(text: str):
    return parse_text(text, "t.yaml")


def errors(text: str) -> list:
    with pytest.raises(YamlLoadError) as info:
        load(text)
    return info.value.diagnostics


@pytest.mark.parametrize(
    "text, expected",
    [
        ("on", "on"), ("off", "off"), ("yes", "yes"), ("no", "no"), ("y", "y"),  # 1.1 booleans are strings
        ("true", True), ("False", False), ("TRUE", True),
        ("04:00:00", "04:00:00"),  # 1.1 reads 14400 (base 60)
        ("1e-6", 1e-6), ("3.0e-4", 3.0e-4), ("-2.5", -2.5), (".5", 0.5),  # 1.1 reads '1e-6' as a string
        ("017", 17), ("0o17", 15), ("0x1F", 31), ("-3", -3), ("+4", 4),  # 1.1 reads 017 as octal
        ("1_000", "1_000"), ("~", None), ("null", None), ("", None),
        ("'on'", "on"), ('"2"', "2"), ("!!str 12", "12"), ("!!int '12'", 12), ("!!float 1", 1.0),
        ("2026-01-01", "2026-01-01"),  # no implicit timestamps
    ],
)
def test_yaml_12_core_scalars(text, expected):
    value = load(f"k: {text}\n").data["k"]
    assert value == expected and type(value) is type(expected)


def test_positions_are_one_based_for_keys_and_list_items():
    doc = load("a: 1\nb:\n  c: [x, y]\n  d:\n    - e: 1\n")
    assert doc.positions[("a",)] == (1, 1)
    assert doc.positions[("b", "c")] == (3, 3)
    assert doc.positions[("b", "c", 1)] == (3, 10)
    assert doc.positions[("b", "d", 0)] == (5, 7)
    assert doc.positions[("b", "d", 0, "e")] == (5, 7)


def test_duplicate_keys_name_both_positions_and_all_are_reported():
    diags = errors("a: 1\nb: {c: 1, c: 2}\na: 3\n")
    assert [(d.line, d.col, d.path) for d in diags] == [(2, 11, "b.c"), (3, 1, "a")]
    assert "first defined at line 2, column 5" in diags[0].message
    assert "first defined at line 1, column 1" in diags[1].message


def test_alias_bomb_is_stopped_quickly():
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    diags = errors("\n".join(lines) + "\n")
    assert len(diags) == 1 and "alias bomb" in diags[0].message


def test_small_aliases_are_fine():
    doc = load("a: &x {p: 1}\nb: *x\n")
    assert doc.data == {"a": {"p": 1}, "b": {"p": 1}}
    assert doc.data["a"] is not doc.data["b"]  # expanded into independent copies


def test_recursive_alias_is_an_error():
    assert "recursive alias" in errors("a: &x [*x]\n")[0].message


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("a: !!python/object/apply:os.system [ls]\n", "unsupported tag !!python/object/apply:os.system"),
        ("a: !!binary aGVsbG8=\n", "unsupported tag !!binary"),
        ("a: !!timestamp 2026-01-01\n", "unsupported tag !!timestamp"),
        ("a: !mine {b: 1}\n", "unsupported tag !mine"),
        ("a: !!set {b: null}\n", "unsupported tag !!set"),
        ("a: !!int abc\n", "invalid !!int value"),
        ("? [a, b]\n: 1\n", "complex (mapping or list) keys"),
        ("1: x\n", "key 1 is not a string"),
        ("null: x\n", "key null is not a string"),
        ("base: &b {x: 1}\nc:\n  <<: *b\n", "merge keys"),
        ("a: .nan\n", "not a finite number"),
        ("a: -.inf\n", "not a finite number"),
        ("a: 1e999\n", "not a finite number"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("just text\n", "top level must be a mapping"),
        ("# only a comment\n", "empty recipe"),
        ("a: 1\n---\nb: 2\n", "expected a single document"),
        ("a: [1\n", "YAML syntax error"),
        ("a: \x07\n", "control characters are not allowed"),
    ],
)
def test_rejections(text, fragment):
    diags = errors(text)
    assert any(fragment in d.message for d in diags), [d.message for d in diags]
    assert all(d.file == "t.yaml" and d.severity == "error" for d in diags)


def test_quoted_merge_key_is_just_a_string():
    assert load("'<<': 1\n").data == {"<<": 1}


def test_deep_nesting_is_an_error_not_a_crash():
    diags = errors("a: " + "[" * 200 + "]" * 200 + "\n")
    assert "nesting deeper than" in diags[0].message


def test_syntax_error_has_a_position():
    diag = errors("a: 1\nb: [1, 2\nc: 3\n")[0]
    assert diag.line == 3 and "flow sequence that starts at line 2" in diag.message


def test_size_limit(tmp_path, monkeypatch):
    path = tmp_path / "big.yaml"
    path.write_text("a: 1\n" + "# pad\n" * 100)
    monkeypatch.setattr(yaml_loader, "MAX_BYTES", 200)
    with pytest.raises(YamlLoadError) as info:
        load_yaml(path)
    assert "limited to" in info.value.diagnostics[0].message


def test_binary_file_is_rejected_with_position(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"version: 1\nx: \x00\x01\x02")
    with pytest.raises(YamlLoadError) as info:
        load_yaml(path)
    diag = info.value.diagnostics[0]
    assert "binary" in diag.message and (diag.line, diag.col) == (2, 4)


def test_non_utf8_is_rejected_with_position(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("version: 1\nname: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(YamlLoadError) as info:
        load_yaml(path)
    diag = info.value.diagnostics[0]
    assert "not UTF-8" in diag.message and "0xe9" in diag.message and (diag.line, diag.col) == (2, 10)


def test_utf8_bom_and_unicode_are_fine(tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes("\ufeffname: caf\u00e9 \u2713\n".encode("utf-8"))
    assert load_yaml(path).data == {"name": "caf\u00e9 \u2713"}


def test_schema_modeline_comment_is_accepted():
    doc = load("# yaml-language-server: $schema=../schemas/recipe.schema.json\nversion: 1\n")
    assert doc.data == {"version": 1} and doc.positions[("version",)] == (2, 1)


def test_parse_value_mode_returns_plain_values():
    assert parse_text("[1, on]", "--set", require_mapping=False) == [1, "on"]
    assert parse_text("", "--set", require_mapping=False) is None
