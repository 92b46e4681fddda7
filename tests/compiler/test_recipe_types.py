"""The typed recipe and the schema describe the same keys, and defaults come only from the schema."""
from __future__ import annotations

import collections.abc
import dataclasses
import typing

import pytest

from rlc.compiler.recipe import load_recipe, shipped_recipe_names, shipped_recipe_path
from rlc.compiler.recipe_types import (NOT_SETTINGS, Recipe, RecipeTypeError, recipe_from_data, typed_fields,
                                       with_value)
from rlc.compiler.schema import load_schema, with_defaults

MINIMAL = {
    "version": 1,
    "model": {"id": "x"},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "h100-80gb"},
    "data": {"train": "/d.jsonl"},
}
_SCALARS = {"integer": int, "number": float, "boolean": bool, "string": str}


def _present_after_fill(node: dict) -> bool:
    """Whether ``with_defaults`` always puts this key into the recipe (a default, or a default below)."""
    return "default" in node or any(_present_after_fill(sub) for sub in node.get("properties", {}).values())


def _strip_optional(tp):
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else typing.Union[rest]), True
    return tp, False


def _check_value(node: dict, tp, path: str, problems: list[str]) -> None:
    """``tp`` (optional stripped) is the type the schema's ``node`` describes."""
    origin = typing.get_origin(tp)
    if "properties" in node:
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            problems.append(f"{path}: a section in the schema, {tp} in the typed recipe")
        else:
            _check_section(node, tp, path, problems)
        return
    alternatives = node.get("oneOf") or node.get("anyOf")
    if alternatives:
        if origin is not typing.Union:
            problems.append(f"{path}: alternatives in the schema, {tp} in the typed recipe")
            return
        for sub, arg in zip(alternatives, typing.get_args(tp)):
            _check_value(sub, arg, f"{path}|", problems)
        return
    if "enum" in node or "const" in node:
        allowed = set(node.get("enum", [node.get("const")]))
        if origin is typing.Literal and set(typing.get_args(tp)) != allowed:
            problems.append(f"{path}: schema allows {sorted(map(str, allowed))}, the type {tp}")
        elif origin is not typing.Literal and not all(isinstance(v, tp) for v in allowed):
            problems.append(f"{path}: schema allows {allowed}, the type {tp}")
        return
    types = node.get("type")
    types = [types] if isinstance(types, str) else [t for t in (types or []) if t != "null"]
    if types == ["object"]:
        if origin is not collections.abc.Mapping:
            problems.append(f"{path}: a free-form mapping in the schema, {tp} in the typed recipe")
    elif types == ["array"]:
        if origin is not tuple:
            problems.append(f"{path}: a list in the schema, {tp} in the typed recipe (lists are tuples)")
        else:
            _check_value(node.get("items", {}), typing.get_args(tp)[0], f"{path}[]", problems)
    elif len(types) == 1 and types[0] in _SCALARS:
        if tp is not _SCALARS[types[0]]:
            problems.append(f"{path}: {types[0]} in the schema, {tp} in the typed recipe")


def _check_section(node: dict, cls: type, path: str, problems: list[str]) -> None:
    fields = typed_fields(cls)
    keys = set(node["properties"]) - (NOT_SETTINGS if not path else set())
    for key in sorted(keys - set(fields)):
        problems.append(f"{path}.{key}: in the schema, no field of {cls.__name__}")
    for name in sorted(set(fields) - keys):
        problems.append(f"{path}.{name}: a field of {cls.__name__}, not in the schema")
    required = set(node.get("required", []))
    for key in sorted(keys & set(fields)):
        sub, where = node["properties"][key], f"{path}.{key}" if path else key
        tp, optional = _strip_optional(fields[key])
        absent_or_null = (key not in required and not _present_after_fill(sub)) or \
            "null" in (sub.get("type") or []) or sub.get("default", ...) is None
        if optional != absent_or_null:
            problems.append(f"{where}: the schema {'lets it be absent or null' if absent_or_null else 'always gives it'}"
                            f", the field is {'' if optional else 'not '}Optional")
        _check_value(sub, tp, where, problems)


def test_every_schema_key_has_its_typed_field_and_every_field_its_key():
    problems: list[str] = []
    _check_section(load_schema(), Recipe, "", problems)
    assert not problems, "\n".join(problems)


def test_the_parity_check_catches_each_kind_of_drift():
    """The check above is not vacuous: a schema that drifted from the classes in each way is reported."""
    schema = load_schema()
    props = schema["properties"]
    props["refit"]["properties"]["new_key"] = {"type": "integer", "default": 1}
    del props["grpo"]["properties"]["seed"]
    props["loss"]["properties"]["clip_ratio_c"] = {"type": "number", "default": 1.0}
    props["training"]["properties"]["moe"]["properties"]["deepep"] = {"type": "string"}
    props["generation"]["properties"]["precision"]["enum"] = ["auto", "fp8", "fp4"]
    props["cluster"]["properties"]["container"]["properties"]["mounts"] = {
        "type": "array", "items": {"type": "integer"}, "default": []}
    problems: list[str] = []
    _check_section(schema, Recipe, "", problems)
    assert sorted(p.split(":")[0] for p in problems) == [
        "cluster.container.mounts[]", "generation.precision", "grpo.seed", "loss.clip_ratio_c", "refit.new_key",
        "training.moe.deepep", "training.moe.deepep"]


def test_typed_classes_state_no_defaults():
    """Defaults come from the schema once: no field of the typed recipe has a default of its own."""
    seen, todo, stated = set(), [Recipe], []
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                stated.append(f"{cls.__name__}.{f.name}")
        for tp in typed_fields(cls).values():
            todo += [a for a in (tp, *typing.get_args(tp), *(x for arg in typing.get_args(tp)
                                                         for x in typing.get_args(arg)))
                     if isinstance(a, type) and dataclasses.is_dataclass(a)]
    assert len(seen) > 20 and not stated, stated


def test_a_filled_minimal_recipe_takes_the_schema_defaults():
    recipe = recipe_from_data(with_defaults(MINIMAL))
    schema = load_schema()["properties"]
    assert recipe.refit.buffer_memory_ratio == schema["refit"]["properties"]["buffer_memory_ratio"]["default"]
    assert recipe.grpo.dynamic_sampling.max_gen_batches == \
        schema["grpo"]["properties"]["dynamic_sampling"]["properties"]["max_gen_batches"]["default"]
    assert recipe.refit.fp32_params == "auto" and recipe.lint.ignore == ()
    assert recipe.model.checkpoint is None and recipe.model.checkpoint_path == "x" and recipe.model.tokenizer_path == "x"
    assert recipe.parallelism.generation.dp is None and recipe.training.global_batch_size is None
    assert recipe.global_batch_size == recipe.grpo.prompts_per_step * recipe.grpo.generations_per_prompt
    assert recipe.max_sequence_length == recipe.generation.max_model_len


def test_lists_become_tuples_and_items_typed():
    data = with_defaults({**MINIMAL, "refit": {"fp32_params": ["*bias*"]},
                          "lint": {"ignore": [{"rule": "RLC212", "reason": "measured"}]}})
    recipe = recipe_from_data(data)
    assert recipe.refit.fp32_params == ("*bias*",)
    assert recipe.lint.ignore[0].rule == "RLC212" and recipe.lint.ignore[0].reason == "measured"
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.refit.sleep_level = 2  # type: ignore[misc]


def test_an_unfilled_or_foreign_mapping_is_refused_with_the_key():
    with pytest.raises(RecipeTypeError, match=r"^refit\.sleep_level: missing"):
        data = with_defaults(MINIMAL)
        del data["refit"]["sleep_level"]
        recipe_from_data(data)
    with pytest.raises(RecipeTypeError, match=r"^refit: no typed field for sleep_levle"):
        recipe_from_data(with_defaults({**MINIMAL, "refit": {"sleep_levle": 2}}))


def test_with_value_replaces_one_setting_and_shares_the_rest():
    recipe = recipe_from_data(with_defaults(MINIMAL))
    changed = with_value(recipe, "refit.sleep_level", 2)
    assert changed.refit.sleep_level == 2 and recipe.refit.sleep_level == 1
    assert changed.cluster is recipe.cluster and changed.refit.transport == recipe.refit.transport
    assert with_value(recipe, "refit.fp32_params", ["a"]).refit.fp32_params == ("a",)
    with pytest.raises(RecipeTypeError, match="refit.sleep_levle: not a setting"):
        with_value(recipe, "refit.sleep_levle", 2)


@pytest.mark.parametrize("name", shipped_recipe_names())
def test_every_shipped_recipe_builds(name):
    loaded = load_recipe(shipped_recipe_path(name))
    recipe = recipe_from_data(with_defaults(loaded.data))
    assert recipe.name == loaded.data["name"] and recipe.cluster.world_size >= 1


def test_sections_compare_by_value_and_show_their_fields():
    a, b = recipe_from_data(with_defaults(MINIMAL)), recipe_from_data(with_defaults(MINIMAL))
    assert a == b and a is not b and a != with_value(a, "refit.sleep_level", 2) and a.refit != a.loss
    assert repr(a.refit).startswith("RefitSection(buffer_memory_ratio=0.3, buffer_gb=None, alignment_bytes=256,")
    with pytest.raises(TypeError):
        hash(a)
