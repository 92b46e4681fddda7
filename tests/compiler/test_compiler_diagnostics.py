"""Diagnostic formats, exit codes, key paths and suggestions."""
from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from rlc.compiler.diagnostics import (
    Diagnostic,
    exit_code,
    format_github,
    format_json,
    format_path,
    format_text,
    parse_path,
    summary,
)
from rlc.compiler.suggest import close_matches, closest, did_you_mean

ERR = Diagnostic("error", "unknown key 'tpp'; did you mean 'tp'?", "parallelism.train.tpp", "r.yaml", 3, 5)
WARN = Diagnostic("warning", "buffer is small", "refit.buffer_gb", "r.yaml", 9, 3, rule="RLC301",
                  hint="raise it to 4")
SET = Diagnostic("error", "0 is out of range", "cluster.nodes", "--set")


def test_text_format():
    assert format_text([ERR, WARN, SET]) == (
        "r.yaml:3:5: parallelism.train.tpp: unknown key 'tpp'; did you mean 'tp'?\n"
        "r.yaml:9:3: refit.buffer_gb: warning: buffer is small [RLC301]\n"
        "    hint: raise it to 4\n"
        "--set: cluster.nodes: 0 is out of range\n"
    )
    assert format_text([]) == ""


def test_text_format_without_location_or_path():
    assert format_text([Diagnostic("error", "boom")]) == "boom\n"
    assert format_text([Diagnostic("error", "boom", file="f.yaml")]) == "f.yaml: boom\n"


def test_github_format_escapes_and_skips_pseudo_files():
    tricky = Diagnostic("error", "50% bad\nsecond line", "a.b", "dir,x/r:1.yaml", 2, 4)
    out = format_github([tricky, WARN, SET]).splitlines()
    assert out[0] == ("::error file=dir%2Cx/r%3A1.yaml,line=2,col=4,title=rlc a.b::"
                      "a.b: 50%25 bad%0Asecond line")
    assert out[1].startswith("::warning file=r.yaml,line=9,col=3,title=rlc RLC301 refit.buffer_gb::")
    assert out[1].endswith("%0Ahint: raise it to 4")
    assert out[2] == "::error title=rlc cluster.nodes::--set: cluster.nodes: 0 is out of range"


def test_json_format_round_trips():
    data = json.loads(format_json([ERR, WARN]))
    assert data[1] == {"severity": "warning", "message": "buffer is small", "path": "refit.buffer_gb",
                       "file": "r.yaml", "line": 9, "col": 3, "rule": "RLC301", "hint": "raise it to 4"}
    assert [Diagnostic(**d) for d in data] == [ERR, WARN]


def test_exit_codes():
    assert exit_code([]) == 0
    assert exit_code([WARN]) == 0
    assert exit_code([WARN, ERR]) == 1
    assert exit_code([ERR, Diagnostic("error", "cannot read", rule="io")]) == 2
    assert exit_code([Diagnostic("warning", "x", rule="io")]) == 0


def test_summary():
    assert summary([]) == "no problems"
    assert summary([ERR, ERR, WARN]) == "2 errors, 1 warning"


def test_paths():
    assert format_path(("a", "b", 0, "c")) == "a.b[0].c"
    assert format_path(("env", "with.dot", "x y")) == 'env["with.dot"]["x y"]'
    assert format_path(()) == ""
    assert parse_path('a.b[0].c["d.e"]') == ("a", "b", 0, "c", "d.e")


key = st.one_of(st.text(min_size=1, max_size=12), st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True))


@given(st.lists(st.one_of(key, st.integers(0, 99)), min_size=1, max_size=6).filter(lambda p: isinstance(p[0], str)))
def test_path_round_trip(parts):
    assert parse_path(format_path(parts)) == tuple(parts)


def test_parse_path_rejects_malformed():
    import pytest

    for bad in ("a..b", ".a", "a.", "[0]", "a[x]", 'a["unterminated]'):
        with pytest.raises(ValueError):
            parse_path(bad)


def test_suggestions():
    assert closest("tpp", ["tp", "pp", "ep"]) == "tp"
    assert closest("Bfloat16", ["bfloat16", "float16"]) == "bfloat16"
    assert closest("sleep-level", ["sleep_level"]) == "sleep_level"
    # "-" is read as "_" before difflib: many dashes (difflib alone scores 0.57, under the cutoff) and
    # an exact normalised match beating a candidate difflib would rank higher
    assert closest("a-b-c-d", ["a_b_c_d"]) == "a_b_c_d"
    assert closest("sleep-level", ["sleep-levels", "sleep_level"]) == "sleep_level"
    assert closest("h100", ["h100-80gb", "h100-94gb"]) == "h100-80gb"  # ties: the first candidate
    assert closest("zzz", ["tp", "pp"]) is None
    assert closest("tp", ["tp"]) is None  # an exact match is not a suggestion
    assert closest("2", [1, 2]) == 2
    assert did_you_mean("dtpye", ["dtype", "id"]) == "; did you mean 'dtype'?"
    assert did_you_mean("qqq", ["dtype"]) == ""
    # several suggestions, best first, on the same normalised spelling; the candidates' own spelling comes back
    assert close_matches("h100-80GB", ["h100-94gb", "h100-80gb", "b200"], n=2, cutoff=0.4) == ["h100-80gb",
                                                                                              "h100-94gb"]
    assert close_matches("zzz", ["tp", "pp"]) == []
