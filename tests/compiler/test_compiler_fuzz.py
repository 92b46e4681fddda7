"""Fuzzing the CLI with broken recipes: never a traceback, always exit code 0, 1 or 2.

Valid recipes are mutated (keys dropped, renamed or given random values), spliced with random
text, or replaced by random YAML-ish text or random bytes, and run through ``rlc validate``,
``rlc show --origin`` or ``rlc lint`` in-process (subprocesses would be 50x slower), sometimes with
random ``--set`` overrides.

``RLC_FUZZ_EXAMPLES`` sets the number of cases (default 2000, ~30 s on 2 cores).
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
from pathlib import Path

import pytest
import yaml
from compiler_testing import FIXTURES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlc.compiler.cli import dump_yaml, main
from rlc.compiler.recipe import load_recipe
from rlc.compiler.yaml_loader import parse_text

EXAMPLES = int(os.environ.get("RLC_FUZZ_EXAMPLES", "2000"))
SEEDS = [FIXTURES / "valid" / "full.yaml", FIXTURES / "valid" / "minimal.yaml", FIXTURES / "extends" / "child.yaml"]
BASES = [load_recipe(p).data for p in SEEDS]
TEXTS = [p.read_text() for p in SEEDS]


def _paths(node, prefix=()):
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        out.append(prefix + (key,))
        out.extend(_paths(child, prefix + (key,)))
    return out


PATHS = sorted({p for base in BASES for p in _paths(base)}, key=repr)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24), st.sampled_from(["on", "off", "yes", "auto", "04:00:00", "1e-6", "", "~", "bf16"]),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
mutation = st.one_of(
    st.tuples(st.just("drop"), st.sampled_from(PATHS)),
    st.tuples(st.just("rename"), st.sampled_from(PATHS), st.text(max_size=12)),
    st.tuples(st.just("retype"), st.sampled_from(PATHS), values),
)
YAML_CHARS = st.sampled_from(list(":-[]{},&*!|>'\"%@`#?\n\t ") + ["<<", "---", "...", "!!python/object", "&a", "*a"])
yaml_ish = st.lists(st.one_of(YAML_CHARS, st.text(max_size=6)), max_size=60).map("".join)
override = st.one_of(
    st.tuples(st.sampled_from(PATHS), yaml_ish).map(lambda kv: _fmt(kv[0]) + "=" + kv[1]),
    st.text(max_size=30),
)


def _fmt(path) -> str:
    from rlc.compiler.diagnostics import format_path

    return format_path(path)


def _apply(data, op) -> None:
    kind, path, *rest = op
    node = data
    for part in path[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return
    last = path[-1]
    if isinstance(node, dict) and last in node:
        if kind == "drop":
            del node[last]
        elif kind == "rename":
            node[rest[0]] = node.pop(last)
        else:
            node[last] = rest[0]
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        if kind == "drop":
            del node[last]
        elif kind == "retype":
            node[last] = rest[0]


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "splice", "text", "bytes"]))
    if kind == "mutate":
        data = copy.deepcopy(draw(st.sampled_from(BASES)))
        for op in draw(st.lists(mutation, min_size=1, max_size=5)):
            _apply(data, op)
        content = yaml.safe_dump(data, allow_unicode=True).encode("utf-8")
    elif kind == "splice":
        text = draw(st.sampled_from(TEXTS))
        start = draw(st.integers(0, len(text)))
        end = draw(st.integers(start, min(len(text), start + 40)))
        content = (text[:start] + draw(yaml_ish) + text[end:]).encode("utf-8")
    elif kind == "text":
        content = ("version: 1\n" + draw(yaml_ish)).encode("utf-8", "surrogatepass")
    else:
        content = draw(st.binary(max_size=200))
    command = draw(st.sampled_from(["validate", "validate", "show", "lint"]))
    overrides = draw(st.lists(override, max_size=2)) if command != "lint" else []
    return content, command, overrides


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "models" / "tiny").mkdir(parents=True)  # the seeds' model.config, relative to the recipe
    (root / "models" / "tiny" / "config.json").write_text(
        (FIXTURES / "valid" / "models" / "tiny" / "config.json").read_text())
    for name in ("base.yaml", "mid.yaml"):  # child.yaml's parents
        (root / name).write_text((FIXTURES / "extends" / name).read_text())
    return root


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_cli_never_crashes(case, workdir):
    content, command, overrides = case
    recipe = workdir / "recipe.yaml"
    recipe.write_bytes(content)
    argv = [command, str(recipe)]
    if command == "show":
        argv.append("--origin")
    for item in overrides:
        argv += ["--set", item]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = main(argv)
    output = buf.getvalue()
    assert code in (0, 1, 2), output
    assert "Traceback" not in output and "internal error" not in output, output
    if code == 1 and command != "show":
        assert f"{recipe}:" in output or "--set:" in output, output


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                         st.text())
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(), inner, max_size=4), max_leaves=12)


@settings(max_examples=max(50, EXAMPLES // 4), deadline=None)
@given(data=st.dictionaries(st.text(min_size=1), json_values, min_size=1, max_size=6))
def test_show_yaml_reads_back_exactly(data):
    """``rlc show`` output is YAML that rlc's own (YAML 1.2) loader reads back unchanged."""
    text = dump_yaml(data, comment=lambda path: "x.yaml:1:1")
    try:
        assert parse_text(text, "show").data == data
    except Exception as exc:  # pragma: no cover - shows the text on failure
        raise AssertionError(text) from exc
