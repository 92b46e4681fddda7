"""`rlc lint` and `rlc compile` agree on every recipe: a file named on the command line is checked
whatever it looks like, and folder discovery finds recipes in any YAML style, encoding and header.

`rlc lint FILE` used to skip a named file unless `^version:` appeared in its first 64 KiB, and then
report "no problems" for JSON-style, flow-style and UTF-16 recipes and one after a long comment header,
all of which `rlc compile` refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from compiler_testing import FIXTURES, REPO, run_rlc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlc.compiler.cli import dump_yaml
from rlc.compiler.recipe import load_recipe

TINY = REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml"
BAD = {"version": 1, "extends": str(TINY), "grpo": {"max_steps": 0}}


def _styles(data: dict) -> dict[str, bytes]:
    """One recipe written in each way a user's editor or tool may write it."""
    block = dump_yaml(data)
    return {
        "block.yaml": block.encode(),
        "json.yaml": json.dumps(data).encode(),
        "json-indented.yml": json.dumps(data, indent=4).encode(),
        "flow.yaml": yaml.safe_dump(data, default_flow_style=True, width=60).encode(),
        "utf16.yaml": block.encode("utf-16"),
        "utf8-bom.yaml": b"\xef\xbb\xbf" + block.encode(),
        "long-header.yaml": ("# notes\n" * 20_000 + block).encode(),
        "indented.yaml": "".join("  " + line + "\n" for line in block.splitlines()).encode(),
    }


@pytest.mark.parametrize("name", sorted(_styles(BAD)))
def test_a_named_file_is_checked_as_validate_checks_it(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(_styles(BAD)[name])
    validate = run_rlc("validate", str(path))
    lint = run_rlc("lint", str(path))
    assert validate.code == 1, validate.both
    assert lint.code == validate.code, (lint.both, validate.both)
    assert "linted 1 recipe(s)" in lint.err and "no problems" not in lint.err
    reported = [line for line in validate.err.splitlines() if not line.startswith(str(path) + ": ")]  # no summary
    assert reported and set(reported) <= set(lint.out.splitlines()), (reported, lint.out)


@pytest.mark.parametrize("name", sorted(_styles(BAD)))
def test_folder_discovery_finds_recipes_in_every_style(tmp_path, name):
    (tmp_path / name).write_bytes(_styles(BAD)[name])
    (tmp_path / "workflow.yml").write_text("on: push\njobs: {}\n")
    run = run_rlc("lint", str(tmp_path))
    assert run.code == 1, run.both
    assert "linted 1 recipe(s), skipped 1 other YAML file(s)" in run.err, run.err


def test_a_named_file_that_is_not_a_recipe_is_an_error_in_lint_as_in_compile(tmp_path):
    path = tmp_path / "notes.yaml"
    path.write_text("title: meeting notes\nitems: [a, b]\n")
    for argv in (["lint", str(path)], ["validate", str(path)], ["compile", str(path), "-o", str(tmp_path / "b")]):
        run = run_rlc(*argv)
        assert run.code == 1 and "not an rlc recipe" in run.both, (argv, run.both)
    skipped = run_rlc("lint", "--skip-non-recipes", str(path))
    assert skipped.code == 0 and "skipped 1 other YAML file(s)" in skipped.err


# ------------------------------------------------------------------ any recipe a test can construct

@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("agree")
    shutil.copytree(FIXTURES / "valid" / "models", root / "models")
    for name in ("base.yaml", "mid.yaml"):
        shutil.copy(FIXTURES / "extends" / name, root / name)
    return root


SEEDS = [load_recipe(FIXTURES / "valid" / "full.yaml").data, load_recipe(FIXTURES / "valid" / "minimal.yaml").data,
         {"version": 1, "extends": "mid.yaml", "name": "child"}]
KEYS = [("grpo", "max_steps"), ("cluster", "nodes"), ("refit", "sleep_level"), ("model", "dtype"), ("name",),
        ("training", "micro_batch_size"), ("generation", "max_model_len"), ("cluster", "gpus_per_node")]
VALUES = st.one_of(st.integers(-3, 5000), st.sampled_from(["bf16", "bfloat16", "", "x y", None, True, 0.5, [1]]))


@st.composite
def recipes(draw) -> tuple[str, bytes]:
    data = json.loads(json.dumps(draw(st.sampled_from(SEEDS))))
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=3)):
        node = data
        for part in key[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[key[-1]] = draw(VALUES)
    if draw(st.booleans()):
        data.pop("version", None)
    styles = _styles(data)
    name = draw(st.sampled_from(sorted(styles)))
    return name, styles[name]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(case=recipes())
def test_lint_and_validate_agree_on_any_recipe(case, workdir):
    name, content = case
    path = workdir / name
    path.write_bytes(content)
    validate, lint = run_rlc("validate", str(path)), run_rlc("lint", str(path))
    assert lint.code == validate.code, (name, content[:300], lint.both, validate.both)
    assert "internal error" not in lint.both + validate.both


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(case=recipes())
def test_lint_and_compile_agree_on_any_recipe(case, workdir):
    """Compile refuses what lint flags; what lint passes compiles, or lint warned that the bundled
    runtime cannot run it yet (RLC311, which compile refuses)."""
    name, content = case
    path = workdir / name
    path.write_bytes(content)
    lint = run_rlc("lint", str(path))
    compiled = run_rlc("compile", str(path), "-o", str(workdir / "bundle"), "--force")
    assert "internal error" not in lint.both + compiled.both
    if lint.code == 0 and compiled.code != 0:
        assert "[RLC311]" in lint.both and "the bundled runtime cannot run this yet" in compiled.both, \
            (lint.both, compiled.both)
    else:
        assert lint.code == compiled.code, (name, lint.both, compiled.both)
