"""Every numeric key of the recipe schema, at any value (extremes, NaN, infinities, huge integers,
negatives), is either accepted or refused with a recipe error naming the key: never an internal
error, in the check every command runs nor in resolving and rendering what it accepts."""
from __future__ import annotations

import math
from functools import lru_cache

import pytest
from compiler_testing import REPO, run_rlc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlc.compiler import schema

BASE = str(REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml")
TINY_CONFIG = REPO / "rlc" / "recipes" / "models" / "tiny-qwen3" / "config.json"
#: Free-form values: env.sh text, and HF config facts (range-checked by the config reader).
FREE_FORM = ("cluster.env.", "model.overrides.")  # (architecture facts: test_architecture_facts_...)


@lru_cache(maxsize=1)
def numeric_keys() -> dict[str, dict]:
    """Every key path whose schema accepts a number -> its (numeric) schema node."""
    keys: dict[str, dict] = {}

    def walk(node: dict, path: str) -> None:
        node = schema._resolve(node)
        for branch in schema._branches(node):
            types = schema._types(branch)
            if types & {"integer", "number"} and path and not path.startswith(FREE_FORM):
                keys.setdefault(path, branch)
            for key, sub in branch.get("properties", {}).items():
                walk(sub, f"{path}.{key}" if path else key)
            if isinstance(branch.get("additionalProperties"), dict):
                walk(branch["additionalProperties"], f"{path}.X")

    walk(schema.load_schema(), "")
    return keys


def yaml_text(value: float | int) -> str:
    """``value`` as YAML 1.2 reads it back (``.nan``, ``.inf`` for the non-finite floats)."""
    if isinstance(value, float) and math.isnan(value):
        return ".nan"
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    return repr(value)


def extremes(node: dict) -> list[float | int]:
    """The edges of a key's range and the values that broke rlc before it had one."""
    values: list[float | int] = [0, -1, 1, 0.5, -0.5, 2**31, 2**63, 10**30, -10**30, 10**400,
                                 1.0e308, -1.0e308, 5e-324, float("nan"), float("inf"), float("-inf")]
    for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if bound in node:
            edge = node[bound]
            values += [edge, edge - 1, edge + 1, edge * 2, edge - 1e-9, edge + 1e-9]
    return values


def assert_no_internal_error(key: str, value: float | int) -> None:
    text = yaml_text(value)
    run = run_rlc("plan", "--json", BASE, "--set", f"{key}={text}")
    assert run.code in (0, 1), f"{key}={text}: exit {run.code}\n{run.both}"
    assert "internal error" not in run.both, f"{key}={text}:\n{run.both}"
    if run.code == 1:
        return
    # Accepted: resolving it into runtime.yaml and rendering the plan files must work too.
    from rlc.compiler.api import check
    from rlc.compiler.bundle.build import runtime_yaml
    from rlc.compiler.bundle.planfiles import plan_files
    from rlc.compiler.resolve import resolve_runtime_config
    from rlc.contract.runtime_config import runtime_config_to_dict

    result = check(BASE, [f"{key}={text}"])
    config = resolve_runtime_config(result)
    assert runtime_yaml(runtime_config_to_dict(config))
    assert plan_files(result.plan, result.recipe, config)["plan.txt"]


def test_the_schema_has_many_numeric_keys_each_with_a_range():
    keys = numeric_keys()
    assert len(keys) > 50
    unbounded = [k for k, node in keys.items()
                 if not ({"maximum", "exclusiveMaximum"} & set(node) or "const" in node or "enum" in node)]
    assert unbounded == [], f"numeric keys without an upper bound: {unbounded}"
    unfloored = [k for k, node in keys.items()
                 if not ({"minimum", "exclusiveMinimum"} & set(node) or "const" in node or "enum" in node)]
    assert unfloored == [], f"numeric keys without a lower bound: {unfloored}"


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(numeric_keys()))
def test_every_numeric_key_at_its_extremes(key):
    for value in extremes(numeric_keys()[key]):
        assert_no_internal_error(key, value)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(numeric_keys())),
       value=st.one_of(st.integers(), st.integers(min_value=-(2**80), max_value=2**80),
                       st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=-10, max_value=10)))
def test_any_value_of_any_numeric_key(key, value):
    assert_no_internal_error(key, value)


def test_the_value_from_the_field_report_is_a_recipe_error_in_every_command(tmp_path):
    for command in ("validate", "plan", "lint"):
        argv = [command, BASE] + ([] if command == "lint" else ["--set", "refit.buffer_gb=1.0e+308"])
        if command == "lint":
            recipe = tmp_path / "r.yaml"
            recipe.write_text(f"version: 1\nextends: {BASE}\nmodel: {{config: {TINY_CONFIG}}}\n"
                              "refit: {buffer_gb: 1.0e+308}\n")
            argv = ["lint", str(recipe)]
        run = run_rlc(*argv)
        assert run.code == 1, run.both
        assert "refit.buffer_gb: 1e+308 is out of range: allowed > 0 and <= 1024" in run.both


def test_lint_reports_a_bug_on_one_file_and_lints_the_others(tmp_path, monkeypatch):
    """A bug in rlc on one recipe (simulated: the planner raises for it) is reported for that file
    (exit 3, a bug), and the recipes after it are still linted."""
    from rlc.compiler import api

    real = api.plan_memory  # the pipeline's planner

    def plan_memory(recipe, *args, **kwargs):
        if recipe.grpo.max_steps == 77:
            raise ZeroDivisionError("simulated bug")
        return real(recipe, *args, **kwargs)

    monkeypatch.setattr(api, "plan_memory", plan_memory)
    files = []
    for name, extra in (("a", "grpo: {max_steps: 5}"), ("b", "grpo: {max_steps: 77}"),
                        ("c", "grpo: {max_steps: 0}")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"version: 1\nextends: {BASE}\nmodel: {{config: {TINY_CONFIG}}}\n{extra}\n")
        files.append(str(path))
    run = run_rlc("lint", *files)
    assert run.code == 3, run.both
    assert f"{files[1]}: internal error: ZeroDivisionError: simulated bug" in run.out
    assert f"{files[2]}:4:8: grpo.max_steps: 0 is out of range" in run.out  # the file after it
    assert "linted 3 recipe(s)" in run.err


@pytest.mark.parametrize("fact", ["hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                                  "intermediate_size", "num_key_value_heads"])
@pytest.mark.parametrize("value", [-5, 2**41, 10**400, 1.0e308, 0])
def test_architecture_facts_from_overrides_are_range_checked(fact, value):
    """model.overrides feed the planner's architecture facts: sizes outside 0..2**40 are a recipe
    error naming the key, never an internal error."""
    run = run_rlc("validate", BASE, "--set", f"model.overrides={{{fact}: {yaml_text(value)}}}")
    assert run.code in (0, 1) and "internal error" not in run.both, run.both
    if isinstance(value, int) and not 0 <= value <= 2**40:
        assert run.code == 1 and f"{fact} is {value}, which is no architecture size" in run.err


@pytest.mark.parametrize("fact, recipe", [
    ("num_hidden_layers", BASE),
    ("num_nextn_predict_layers", str(REPO / "rlc" / "recipes" / "tiny-moe-mtp-4gpu.yaml")),
    ("first_k_dense_replace", str(REPO / "rlc" / "recipes" / "tiny-moe-mtp-4gpu.yaml"))])
@pytest.mark.parametrize("value", [10_001, 10**8, 2**40])
def test_layer_counts_past_any_real_model_are_a_recipe_error_not_an_out_of_memory(fact, value, recipe):
    """The planner lays out every layer: 2**40 layers (in range as a size) used to end in a MemoryError
    after minutes; 10,000 layers is the limit, the same as the per-stage layer keys'."""
    run = run_rlc("validate", recipe, "--set", f"model.overrides.{fact}={value}")
    assert run.code == 1, run.both
    assert f"{fact} is {value}, more layers than rlc plans (at most 10000)" in run.err, run.both


def test_first_or_last_stage_larger_than_the_model_is_a_recipe_error_in_every_command(tmp_path):
    """num_layers_in_first/last_pipeline_stage beyond the model's layers used to crash the planner's
    per-stage shards (IndexError, exit 3) in validate, plan, lint, compile and doctor --recipe."""
    moe = str(REPO / "rlc" / "recipes" / "tiny-moe-mtp-2gpu-pp2.yaml")
    log = tmp_path / "job.log"
    log.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        recipe = tmp_path / f"{key}.yaml"
        recipe.write_text(f"version: 1\nextends: {moe}\nparallelism:\n  train: {{{key}: 100}}\n")
        for argv in (["validate", str(recipe)], ["plan", str(recipe)], ["lint", str(recipe)],
                     ["compile", str(recipe), "-o", str(tmp_path / "b")],
                     ["doctor", str(log), "--recipe", str(recipe)]):
            run = run_rlc(*argv)
            assert "internal error" not in run.both, (argv, run.both)
            if argv[0] != "doctor":
                assert run.code == 1, (argv, run.both)
                assert "4 layers with" in run.both and "=100 leave" in run.both, (argv, run.both)
