"""The quick schema check agrees with jsonschema: on every shipped and test recipe, and on each key of the
schema set to values of every JSON kind (in and out of range, right and wrong type), unknown keys,
missing required keys and odd key names."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from rlc.compiler import schema as S
from rlc.compiler.recipe import RecipeLoadError, load_recipe
from rlc.compiler.schema_check import is_valid

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted({*(REPO / "rlc" / "recipes").rglob("*.yaml"), *(REPO / "tests" / "recipes").rglob("*.yaml"),
                  *(REPO / "tests" / "compiler" / "fixtures").rglob("*.yaml")})
PROBES = [None, True, False, 0, 1, -1, 2, 7, 64, 0.5, 1.0, 1e30, -1e30, float("nan"), float("inf"), "", "x", "auto",
          "on", "/abs", "--flag=v", "RLC123", "0.17.1", "{prompt}", "math", "a:b", "h100-80gb", [], ["x"], [1, 1],
          [1, 2], ["--a", "--a"], [{"rule": "RLC212", "reason": "why"}], {}, {"a": 1}, {"A_B": "x"}, {"1x": 1}, {3: 1}]


def _agree(data) -> list[str]:
    quick, full = is_valid(S._schema(), data), S._validator().is_valid(data)
    return [] if quick is full else [f"quick {quick}, jsonschema {full}"]


def _loadable():
    out = []
    for path in RECIPES:
        try:
            out.append(load_recipe(path).data)
        except RecipeLoadError:
            pass
    return out


def test_the_quick_check_agrees_on_every_recipe_in_the_repository():
    datas = _loadable()
    assert len(datas) > 20
    assert {is_valid(S._schema(), d) for d in datas} == {True, False}  # both kinds are among them
    assert [_agree(d) for d in datas] == [[] for _ in datas]


def _paths(node, path=()):
    """Every key path of the schema (a list's first item as index 0)."""
    for key, sub in node.get("properties", {}).items():
        yield path + (key,)
        yield from _paths(sub, path + (key,))
    if isinstance(node.get("items"), dict):
        yield path + (0,)
        yield from _paths(node["items"], path + (0,))
    for sub in node.get("oneOf", []):
        yield from _paths(sub, path)


def _set(data, path, value):
    node = data
    for part in path[:-1]:
        if isinstance(part, int):
            while len(node) <= part:
                node.append({} if not node else copy.deepcopy(node[0]))
            node = node[part]
        else:
            if not isinstance(node.get(part), (dict, list)):
                node[part] = [] if isinstance(path[path.index(part) + 1], int) else {}
            node = node[part]
    last = path[-1]
    if isinstance(last, int):
        while len(node) <= last:
            node.append(None)
    node[last] = value


@pytest.fixture(scope="module")
def base():
    data = load_recipe(REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml").data
    assert S._validator().is_valid(data)
    return data


def test_the_quick_check_agrees_on_every_key_set_to_every_kind_of_value(base):
    wrong, seen = [], {True: 0, False: 0}
    for path in sorted(set(_paths(S._schema())), key=str):
        for value in PROBES:
            data = copy.deepcopy(base)
            _set(data, path, copy.deepcopy(value))
            quick, full = is_valid(S._schema(), data), S._validator().is_valid(data)
            seen[full] += 1
            if quick is not full:
                wrong.append(f"{'.'.join(map(str, path))} = {value!r}: quick {quick}, jsonschema {full}")
    assert wrong == []
    assert seen[True] > 500 and seen[False] > 3000, seen  # both answers were exercised


def test_the_quick_check_agrees_on_unknown_missing_and_odd_keys(base):
    wrong = []
    for path in [()] + [p for p in set(_paths(S._schema())) if not isinstance(p[-1], int)]:
        for change in ("unknown", "missing", "odd"):
            data = copy.deepcopy(base)
            node = data
            try:
                for part in path:
                    node = node[part]
            except (KeyError, IndexError, TypeError):
                continue
            if not isinstance(node, dict):
                continue
            if change == "unknown":
                node["tpp"] = 1
            elif change == "odd":
                node[5] = "x"
                node["has space"] = "x"
            elif node:
                del node[next(iter(node))]
            wrong += [f"{path} {change}: {p}" for p in _agree(data)]
    assert wrong == []


def test_a_keyword_it_does_not_know_is_left_to_jsonschema():
    assert is_valid({"type": "object", "if": {}}, {}) is None
    assert is_valid({"type": "string", "format": "date"}, "x") is None
    assert is_valid({"enum": [1, 2]}, True) is False and is_valid({"enum": [1, 2]}, 1.0) is True


def test_a_valid_recipe_is_validated_without_importing_jsonschema(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from rlc.compiler import api; r = api.check(sys.argv[1]); "
            "print(r.ok, 'jsonschema' in sys.modules)")
    good = subprocess.run([sys.executable, "-c", code, str(REPO / "rlc/recipes/tiny-qwen3-1gpu.yaml")],
                          capture_output=True, text=True, check=True)
    assert good.stdout.split() == ["True", "False"]
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "rlc/recipes/tiny-qwen3-1gpu.yaml").read_text() + "\ntpyo: 1\n")
    broken = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, check=True)
    assert broken.stdout.split() == ["False", "True"]  # the errors are jsonschema's, as before
