"""Schema validation messages, defaults, and key-path checks."""
from __future__ import annotations

import copy

import pytest
from compiler_testing import FIXTURES

from rlc.compiler import schema
from rlc.compiler.recipe import load_recipe, shipped_recipe_names, shipped_recipe_path
from rlc.compiler.schema import check_key_path, describe, load_schema, validate, validate_data, with_defaults

MINIMAL = {
    "version": 1,
    "model": {"id": "x"},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "h100-80gb"},
    "data": {"train": "/d.jsonl"},
}


def messages(data) -> dict[str, str]:
    return {d.path: d.message for d in validate_data(data)}


def with_change(path: str, value):
    """A deep copy of MINIMAL with the dotted ``path`` set (missing mappings created): raw recipe data."""
    out = copy.deepcopy(MINIMAL)
    node = out
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def test_the_schema_is_a_valid_2020_12_schema():
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(load_schema())


def test_every_key_is_documented():
    missing = []

    def walk(node, path):
        for key, sub in node.get("properties", {}).items():
            if not sub.get("description"):
                missing.append(f"{path}{key}")
            walk(sub, f"{path}{key}.")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[].")

    walk(load_schema(), "")
    assert missing == []


def test_minimal_recipe_is_valid():
    assert validate_data(MINIMAL) == []


@pytest.mark.parametrize("name", shipped_recipe_names() or ["<none>"])
def test_shipped_recipes_pass_the_schema(name):
    if name == "<none>":
        pytest.skip("no shipped recipes yet")
    assert validate(load_recipe(shipped_recipe_path(name))) == []


@pytest.mark.parametrize("path", sorted(str(p.relative_to(FIXTURES)) for p in (FIXTURES / "valid").glob("*.yaml")))
def test_valid_fixtures_pass_the_schema(path, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    assert validate(load_recipe(path)) == []


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("model.dtype", "bf16", "'bf16' is not allowed; choose one of: 'bfloat16', 'float16', 'float32'; "
                                "did you mean 'bfloat16'?"),
        ("cluster.gpu", "h100", "did you mean 'h100-80gb'?"),
        ("refit.sleep_level", "2", "choose one of: 1, 2; did you mean 2?"),
        ("cluster.nodes", 0, "0 is out of range: allowed 1 to 4096"),
        ("refit.buffer_memory_ratio", 0.95, "0.95 is out of range: allowed > 0 and <= 0.9"),
        ("parallelism.train.tp", 0, "0 is out of range: allowed 1 to 65536"),
        ("cluster.nodes", "2", "expected an integer, got the string '2'"),
        ("cluster.nodes", 2.0, "expected an integer, got the number 2.0"),
        ("cluster.nodes", True, "expected an integer, got the boolean true"),
        ("colocated", "yes", "expected true or false, got the string 'yes'"),
        ("cluster.env", {"A": [1]}, None),
        ("version", 2, "must be 1, got 2"),
        ("model.id", "", "must not be empty"),
        ("name", "has space", "'has space' does not match the required pattern"),
        ("refit.fp32_params", 5, "must be 'auto' or a list of strings, got the integer 5"),
        ("refit.fp32_params", "manual", "must be 'auto' or a list of strings, got the string 'manual'"),
    ],
)
def test_error_messages(path, value, expected):
    got = messages(with_change(path, value))
    if expected is None:
        assert got  # some error
        return
    assert any(expected in m for m in got.values()), got


def test_env_value_type_message_lists_all_types():
    got = messages(with_change("cluster.env", {"A": [1]}))
    assert got == {"cluster.env.A": "expected a string, a number or a boolean, got a list"}


def test_oneof_with_the_right_shape_reports_the_inner_error():
    got = messages(with_change("refit.fp32_params", ["a", 3]))
    assert got == {"refit.fp32_params[1]": "expected a string, got the integer 3"}


def test_unknown_keys_each_get_their_own_diagnostic_and_hint():
    data = with_change("parallelism.train", {"tpp": 2, "zzzz": 1})
    data["parallelism"]["tp"] = 2
    diags = {d.path: d for d in validate_data(data)}
    assert diags["parallelism.train.tpp"].message == "unknown key 'tpp'; did you mean 'tp'?"
    assert diags["parallelism.train.zzzz"].message == "unknown key 'zzzz'"
    assert "allowed keys here: tp, pp" in diags["parallelism.train.zzzz"].hint
    assert diags["parallelism.tp"].hint == "'tp' is a key of parallelism.train, parallelism.generation"


def test_required_lists_each_missing_key_with_the_parents_position(tmp_path):
    (tmp_path / "r.yaml").write_text("version: 1\nmodel: {id: x}\ndata: {train: t}\ncluster:\n  nodes: 1\n")
    diags = validate(load_recipe(tmp_path / "r.yaml"))
    assert [(d.path, d.message, d.line, d.col) for d in diags] == [
        ("cluster.gpus_per_node", "missing required key 'gpus_per_node'", 4, 1),
        ("cluster.gpu", "missing required key 'gpu'", 4, 1),
    ]


def test_required_hint_points_at_a_misspelling():
    data = copy.deepcopy(MINIMAL)
    data["data"] = {"trian": "/d.jsonl"}
    diags = {d.path: d for d in validate_data(data)}
    assert diags["data.train"].hint == "found 'trian'; is that a misspelling of 'train'?"


def test_unknown_key_position_is_the_key_itself(tmp_path):
    (tmp_path / "r.yaml").write_text(
        "version: 1\nmodel: {id: x}\ndata: {train: t}\ncluster:\n  nodes: 1\n  gpus_per_node: 1\n"
        "  gpu: h100-80gb\n  slurm:\n    partiton: b\n")
    (d,) = validate(load_recipe(tmp_path / "r.yaml"))
    assert (d.line, d.col, d.path) == (9, 5, "cluster.slurm.partiton")


def test_errors_are_sorted_by_position_with_set_last(tmp_path):
    (tmp_path / "r.yaml").write_text(
        "version: 1\nmodel: {id: x, dtype: bf}\ndata: {train: t}\n"
        "cluster: {nodes: 0, gpus_per_node: 1, gpu: h100-80gb}\n")
    diags = validate(load_recipe(tmp_path / "r.yaml", ["parallelism.train.tp=0"]))
    assert [d.path for d in diags] == ["model.dtype", "cluster.nodes", "parallelism.train.tp"]
    assert diags[-1].file == "--set" and diags[-1].line is None


def test_strict_integers_but_numbers_accept_ints():
    assert messages(with_change("training.optimizer.lr", 1)) == {}
    assert "cluster.nodes" in messages(with_change("cluster.nodes", 1.0))


# --------------------------------------------------------------------------- defaults

def test_with_defaults_fills_absent_sections_and_keeps_values():
    filled = with_defaults(MINIMAL)
    assert filled["parallelism"]["train"]["tp"] == 1
    assert filled["cluster"]["ray"]["port"] == 6379
    assert filled["cluster"]["slurm"]["time"] == "04:00:00"
    assert filled["model"]["id"] == "x" and filled["model"]["dtype"] == "bfloat16"
    assert "checkpoint" not in filled["model"]  # no default: stays absent
    assert filled["extensions"] == {}


def test_with_defaults_does_not_mutate_and_keeps_extra_keys():
    data = copy.deepcopy(MINIMAL)
    data["extensions"] = {"z": {"deep": [1]}}
    data["cluster"]["env"] = {"B": "1"}
    before = copy.deepcopy(data)
    filled = with_defaults(data)
    assert data == before
    assert filled["extensions"] == {"z": {"deep": [1]}} and filled["cluster"]["env"] == {"B": "1"}
    filled["cluster"]["env"]["C"] = "2"
    assert "C" not in data["cluster"]["env"]


def test_with_defaults_defaults_are_independent_copies():
    a, b = with_defaults(MINIMAL), with_defaults(MINIMAL)
    a["cluster"]["slurm"]["extra_flags"].append("--x")
    assert b["cluster"]["slurm"]["extra_flags"] == []
    assert load_schema()["properties"]["cluster"]["properties"]["slurm"]["properties"]["extra_flags"]["default"] == []


def test_with_defaults_result_is_valid_and_idempotent():
    filled = with_defaults(MINIMAL)
    assert validate_data(filled) == []
    assert with_defaults(filled) == filled


def test_every_default_is_valid_for_its_key():
    from jsonschema import Draft202012Validator

    bad = []

    def walk(node, path):
        if "default" in node and not Draft202012Validator(node).is_valid(node["default"]):
            bad.append(path)
        for key, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{key}")

    walk(load_schema(), "")
    assert bad == []


def test_with_defaults_leaves_wrong_types_alone():
    data = with_change("parallelism", 5)
    assert with_defaults(data)["parallelism"] == 5


# --------------------------------------------------------------------------- key paths & describe

@pytest.mark.parametrize(
    "parts, problem",
    [
        (("parallelism", "train", "tp"), None),
        (("cluster", "slurm", "extra_flags", 0), None),
        (("cluster", "env", "ANY_NAME"), None),
        (("extensions", "x", "y", 3), None),
        (("refit", "fp32_params", 0), None),
        (("lint", "ignore", 0, "rule"), None),
        (("parallelism", "train", "tpp"), "unknown key 'tpp' in parallelism.train; did you mean 'tp'?"),
        (("clsuter",), "unknown key 'clsuter' in the top level; did you mean 'cluster'?"),
        (("cluster", "nodes", 0), "cluster.nodes is not a list"),
        (("lint", "ignore", 0, "rul"), "unknown key 'rul' in lint.ignore[0]; did you mean 'rule'?"),
    ],
)
def test_check_key_path(parts, problem):
    assert check_key_path(parts) == problem


def test_describe():
    assert describe({"type": "array", "items": {"type": "string"}}) == "a list of strings"
    assert describe({"oneOf": [{"const": "auto"}, {"type": "integer"}]}) == "'auto' or an integer"
    assert describe({"enum": [1, 2]}) == "one of 1, 2"
    assert describe({}) == "any value"


def test_load_schema_returns_a_copy():
    s = load_schema()
    s["properties"].clear()
    assert load_schema()["properties"]
    assert schema.schema_text().lstrip().startswith("{")
