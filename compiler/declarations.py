"""What the recipe's key declarations (:mod:`rlc.compiler.recipe_types`) generate, and the command that
writes it.

``python -m rlc.compiler.declarations`` writes three files from the declarations; ``--check`` only says
which are stale (CI runs it, and ``tests/compiler/test_declarations.py`` does the same):

* ``rlc/schemas/recipe.schema.json``: the JSON Schema recipes are validated against;
* ``rlc/contract/runtime_types.py``: the ``runtime.yaml`` types, one class per section the runtime
  reads, each field with the policy (experiment or restart) and the recipe key it comes from;
* ``docs/reference.md``: the reference for every key (:mod:`rlc.compiler.docs`).

The ``runtime.yaml`` layout adds to the recipe's keys the values the compiler derives
(:data:`DERIVED`: sizes, model facts, rule decisions); each is declared there once, with its type,
range and policy.
"""
from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import json
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Union

from rlc.compiler import recipe_types as rt
from rlc.compiler.docs import render_markdown
from rlc.contract.declare import EXPERIMENT, NO_DEFAULT, Policy, restart, runtime_class, settings

REPO = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO / "schemas" / "recipe.schema.json"  # (rlc.schemas.RECIPE_SCHEMA in a checkout)
RUNTIME_TYPES_PATH = REPO / "contract" / "runtime_types.py"
REFERENCE_PATH = REPO / "docs" / "reference.md"

#: Keywords of a schema node in the order the file writes them.
_ORDER = ("description", "type", "enum", "const", "oneOf", "items", "uniqueItems", "propertyNames",
          "additionalProperties", "required", "properties", "minimum", "exclusiveMinimum", "maximum",
          "exclusiveMaximum", "minLength", "maxLength", "pattern", "default")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


class DeclarationError(ValueError):
    """A declaration the generator cannot turn into a schema or a ``runtime.yaml`` type."""


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _union(tp: Any) -> tuple[Any, ...] | None:
    return typing.get_args(tp) if typing.get_origin(tp) is Union else None


def _description(text: str | None) -> str | None:
    return " ".join(text.split()) if text else None


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    unknown = set(node) - set(_ORDER)
    if unknown:
        raise DeclarationError(f"schema keyword(s) {sorted(unknown)} have no place in the file's order")
    return {k: node[k] for k in _ORDER if k in node}


# --------------------------------------------------------------------------- the recipe schema


def _type_node(tp: Any, meta: Mapping[str, Any], where: str, *, alternative: bool = False) -> dict[str, Any]:
    """The schema node of a value of type ``tp`` (limits and description added by the caller)."""
    if _is_section(tp):
        return _section_node(tp, where)
    args = _union(tp)
    if args is not None:
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _type_node(options[0], meta, where)
        return {"oneOf": [_type_node(a, meta, where, alternative=True) for a in options]}
    origin = typing.get_origin(tp)
    if origin is Literal:
        values = list(typing.get_args(tp))
        if len(values) == 1:
            return {"const": values[0]} if alternative else {"type": _JSON_TYPES[type(values[0])], "const": values[0]}
        return {"enum": values}
    if origin is tuple:
        item_tp = typing.get_args(tp)[0]
        items = _type_node(item_tp, {}, f"{where}[]")
        items.update(meta.get("items") or {})
        return {"type": "array", "items": _ordered(items)}
    if origin is collections.abc.Mapping or origin is dict:
        node: dict[str, Any] = {"type": "object"}
        if meta.get("property_names"):
            node["propertyNames"] = {"pattern": meta["property_names"]}
        if meta.get("values") is not None:
            node["additionalProperties"] = meta["values"]
        return node
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    raise DeclarationError(f"{where}: no schema for the declared type {tp!r}")


def _required(cls: type) -> bool:
    """Whether a section must be written: some key below it has no default and may not be left out."""
    for _, tp, meta in settings(cls):
        if _union(tp) is not None and type(None) in typing.get_args(tp):
            continue
        if _is_section(tp):
            if _required(tp):
                return True
        elif meta.get("default", NO_DEFAULT) is NO_DEFAULT:
            return True
    return False


def _section_node(cls: type, where: str) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    required = []
    file_keys = rt.FILE_KEYS if cls is rt.Recipe else {}
    for name, node in ((k, n) for k, (after, n) in file_keys.items() if after is None):
        properties[name] = node
    for name, tp, meta in settings(cls):
        path = f"{where}.{name}" if where else name
        properties[name] = _field_node(tp, meta, path)
        optional = _union(tp) is not None and type(None) in typing.get_args(tp)
        if not optional and (_required(tp) if _is_section(tp) else meta.get("default", NO_DEFAULT) is NO_DEFAULT):
            required.append(name)
        for extra, (after, node) in file_keys.items():
            if after == name:
                properties[extra] = node
    out: dict[str, Any] = {"type": "object", "additionalProperties": False}
    if required:
        out["required"] = required
    out["properties"] = properties
    return out


def _field_node(tp: Any, meta: Mapping[str, Any], path: str) -> dict[str, Any]:
    node = _type_node(tp, meta, path)
    inner = [a for a in (tp, *typing.get_args(tp)) if _is_section(a)]
    described = _description(meta.get("description")) or (
        _description(inner[0].__doc__) if inner and typing.get_origin(tp) is not tuple else None)
    if described is None:
        raise DeclarationError(f"{path}: declare it with a description (key(\"...\"))")
    node["description"] = described
    node.update(meta.get("schema") or {})
    default = meta.get("default", NO_DEFAULT)
    optional = _union(tp) is not None and type(None) in typing.get_args(tp)
    nullable = optional and (default is None or meta.get("nullable"))
    if nullable:
        if "type" not in node:
            raise DeclarationError(f"{path}: a nullable value needs a JSON type")
        node["type"] = [node["type"], "null"]
    if default is not NO_DEFAULT:
        node["default"] = default
    return _ordered(node)


def recipe_schema() -> dict[str, Any]:
    """The recipe JSON Schema, from the declarations."""
    top = _section_node(rt.Recipe, "")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": rt.SCHEMA_ID,
            "title": rt.SCHEMA_TITLE, "description": _description(rt.Recipe.__doc__), **top}


def schema_text() -> str:
    """``rlc/schemas/recipe.schema.json`` as the generator writes it."""
    return json.dumps(recipe_schema(), indent=2, ensure_ascii=False) + "\n"


# --------------------------------------------------------------------------- the runtime.yaml types


@dataclasses.dataclass(frozen=True)
class Derived:
    """A ``runtime.yaml`` value the compiler derives (no recipe key of its own), declared once."""

    type: str  # its Python type, as written in the generated module
    description: str
    policy: Policy
    after: str | None = None  # the field it follows in its section ("": first; None: last)
    minimum: float | None = None  # the range of a derived number
    maximum: float | None = None


_WHERE, _TRAIN_LAYOUT = restart("where the run runs"), restart("how the trainer is laid out over the GPUs")

#: ``runtime.yaml`` values the compiler derives, by their dotted path.
DERIVED: dict[str, Derived] = {
    "version": Derived("int", "The `runtime.yaml` format; the runtime reads only its own (compared first).",
                       restart("the runtime.yaml format"), after=""),
    "model.num_layers": Derived("int | None", "Decoder layers (None where the architecture is not public; the plan "
                                "says so).", EXPERIMENT, minimum=1, maximum=10_000),
    "model.num_experts": Derived("int", "Routed experts per MoE layer (0: a dense model).", EXPERIMENT,
                                 minimum=0, maximum=1 << 40),
    "model.mtp_num_layers": Derived("int", "Multi-token-prediction layers of the checkpoint.", EXPERIMENT,
                                    minimum=0, maximum=10_000),
    "model.mtp_shared_embedding": Derived("bool", "The MTP block shares the word embedding (HF "
                                          "`mtp_use_dedicated_embeddings: false`).", EXPERIMENT),
    "cluster.world_size": Derived("int", "GPUs in the allocation: nodes × gpus_per_node.", _WHERE,
                                  after="gpus_per_node", minimum=1, maximum=1 << 24),
    "cluster.gpu_memory_gib": Derived("float", "The GPU's memory from the GPU catalog (what the plan assumed; the "
                                      "runtime measures its own).", _WHERE, after="gpu_type", minimum=0.001,
                                      maximum=1 << 20),
    "cluster.ray.address": Derived("str", "How the runtime reaches Ray: `auto` inside the sbatch job, `local` for "
                                   "a private cluster (hand runs, tests), or `host:port`.", _WHERE, after=""),
    "cluster.ray.namespace": Derived("str", "The Ray namespace of the run's actors.", _WHERE, after="address"),
    "train_parallel.dp": Derived("int", "Data-parallel size: world / (tp × pp × cp).", _TRAIN_LAYOUT,
                                 minimum=1, maximum=1 << 24),
    "train_parallel.expert_dp": Derived("int", "Expert data-parallel size: world / (ep × etp × pp).", _TRAIN_LAYOUT,
                                        minimum=1, maximum=1 << 24),
    "refit.decisions": Derived("dict[str, str]", "Why each `auto` was settled: the recipe, or the rule id and its "
                               "reason.", restart("how the weights reach vLLM, not their values")),
    "generation.megatron.reset_router_num_groups": Derived(
        "bool", "`moe_router_num_groups` 1 becomes None for the inference-optimized router.",
        restart("the generation engine's speed and memory, not what it samples")),
}

#: Docstrings of the generated classes where the recipe section's own would not fit.
_CLASS_DOCS = {
    "RuntimeConfig": "The resolved runtime config (``runtime.yaml``): every value explicit, every ``auto`` settled.",
    "RayConfig": "How the runtime reaches Ray. ``address: local`` starts a private cluster (hand runs, tests).",
}


@dataclasses.dataclass
class _Field:
    name: str
    type: str
    doc: str
    recipe: str | None
    policy: Policy | None
    minimum: float | None = None
    maximum: float | None = None
    default_factory: str | None = None


@dataclasses.dataclass
class _Class:
    name: str
    doc: str
    fields: list[_Field]


def _first_sentence(text: str, short: int = 200) -> str:
    """A description for a docstring: whole when short, else its first sentence."""
    text = " ".join(text.split())
    if len(text) <= short:
        return text
    m = re.match(r"(.+?[.!?])(?=\s+[A-Z]|$)", text)
    return m.group(1) if m else text


def _py(tp: Any, resolved: bool = False) -> str:
    """``tp`` as the ``runtime.yaml`` types write it (lists for tuples, dicts for mappings)."""
    if _is_section(tp):
        name = runtime_class(tp)
        if name is None:
            raise DeclarationError(f"{tp.__name__} reaches runtime.yaml but names no runtime class "
                                   "(@section(runtime=))")
        return name
    args = _union(tp)
    if args is not None:
        options = [a for a in args if a is not type(None)]
        text = " | ".join(_py(a, resolved) for a in options)
        return text if resolved or len(options) == len(args) else f"{text} | None"
    origin = typing.get_origin(tp)
    if origin is Literal:
        values = [v for v in typing.get_args(tp) if not (resolved and v == "auto")]
        return "Literal[" + ", ".join(json.dumps(v) if isinstance(v, str) else repr(v) for v in values) + "]"
    if origin is tuple:
        return f"list[{_py(typing.get_args(tp)[0])}]"
    if origin is collections.abc.Mapping or origin is dict:
        key_tp, value_tp = typing.get_args(tp) or (str, Any)
        return f"dict[{_py(key_tp)}, {_py(value_tp)}]"
    if tp is Any:
        return "Any"
    if tp in _JSON_TYPES:
        return tp.__name__
    raise DeclarationError(f"no runtime.yaml type for {tp!r}")


def runtime_layout() -> list[_Class]:
    """The ``runtime.yaml`` classes: the recipe's keys where the runtime reads them, and :data:`DERIVED`."""
    classes: dict[str, _Class] = {}
    path_class: dict[str, str] = {}

    def add(runtime_path: str, field: _Field) -> None:
        parent = runtime_path.rpartition(".")[0]
        if parent not in path_class:
            raise DeclarationError(f"{field.recipe}: goes to runtime.yaml's {runtime_path}, under no runtime section")
        classes[path_class[parent]].fields.append(field)

    def walk(cls: type, recipe_path: str, runtime_path: str) -> None:
        for name, tp, meta in settings(cls):
            key_path = f"{recipe_path}.{name}" if recipe_path else name
            where = meta.get("runtime_name") or (f"{runtime_path}.{name}" if runtime_path else name)
            inner = [a for a in (tp, *typing.get_args(tp)) if _is_section(a)]
            if inner and typing.get_origin(tp) is not tuple:
                sub = inner[0]
                if runtime_class(sub) is not None:
                    start(sub, where)
                    add(where, _Field(name=where.rpartition(".")[2], type=meta.get("runtime_type") or _py(tp),
                                      doc=_first_sentence(meta.get("description") or sub.__doc__ or ""),
                                      recipe=key_path, policy=None))
                walk(sub, key_path, where)
                continue
            policy = meta.get("runtime")
            if policy is None:
                if runtime_class(cls) is not None:
                    raise DeclarationError(f"{key_path}: say what the runtime does with it: runtime=EXPERIMENT, "
                                           "runtime=restart(\"why it may change between restarts\") or "
                                           "runtime=COMPILER")
                continue
            if not policy.reaches_runtime:
                continue
            add(where, _Field(name=where.rpartition(".")[2],
                              type=meta.get("runtime_type") or _py(tp, resolved=bool(meta.get("resolved"))),
                              doc=_first_sentence(meta["description"]), recipe=key_path, policy=policy,
                              default_factory=getattr(meta.get("runtime_default"), "__name__", None)))

    def start(cls: type, runtime_path: str) -> None:
        name = runtime_class(cls)
        assert name is not None
        if name in classes:
            raise DeclarationError(f"two sections become the runtime class {name}")
        doc = _CLASS_DOCS.get(name) or _first_sentence(cls.__doc__ or "")
        classes[name] = _Class(name, doc, [])
        path_class[runtime_path] = name

    start(rt.Recipe, "")
    walk(rt.Recipe, "", "")
    for path, d in DERIVED.items():
        parent, _, name = path.rpartition(".")
        if parent not in path_class:
            raise DeclarationError(f"DERIVED {path}: no runtime section {parent!r}")
        fields = classes[path_class[parent]].fields
        field = _Field(name, d.type, d.description, None, d.policy, d.minimum, d.maximum)
        if d.after is None:
            fields.append(field)
        else:
            at = 0 if d.after == "" else next((i + 1 for i, f in enumerate(fields) if f.name == d.after), None)
            if at is None:
                raise DeclarationError(f"DERIVED {path}: after {d.after!r}, which its section does not have")
            fields.insert(at, field)
    for c in classes.values():  # fields an older runtime.yaml may leave out go last
        c.fields.sort(key=lambda f: f.default_factory is not None)
    return list(classes.values())


def _named_policies() -> dict[Policy, str]:
    """The restart reasons :mod:`rlc.compiler.recipe_types` names (``_REFIT`` ...), by value."""
    return {v: k for k, v in vars(rt).items() if isinstance(v, Policy) and v.kind == "restart"}


def _policy_source(policy: Policy, named: dict[Policy, str]) -> str:
    if policy == EXPERIMENT:
        return "EXPERIMENT"
    return named.get(policy) or f"restart({json.dumps(policy.why, ensure_ascii=False)})"


def _field_source(f: _Field, named: dict[Policy, str]) -> list[str]:
    args = [_policy_source(f.policy, named)] if f.policy is not None else ["None"]
    if f.recipe is not None:
        args.append(f'recipe="{f.recipe}"')
    if f.minimum is not None:
        args.append(f"minimum={f.minimum!r}")
    if f.maximum is not None:
        args.append(f"maximum={f.maximum!r}")
    if f.default_factory:
        args.append(f"default_factory={f.default_factory}")
    call = f"runtime_key({', '.join(args)})"
    line = f"    {f.name}: {f.type} = {call}"
    if len(line) > 116:
        annotation = f.type
        if len(f"    {f.name}: {annotation} = runtime_key(") > 116:  # a long Literal: one option a line
            head, _, options = annotation.partition("[")
            annotation = f"{head}[\n        " + options.replace(", ", ",\n        ")
        joined = ", ".join(args)
        if len(joined) > 108:
            joined = ",\n        ".join(args)
        line = f"    {f.name}: {annotation} = runtime_key(\n        {joined})"
    doc = f.doc.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    wrapped = textwrap.fill(doc, 110, initial_indent='    """', subsequent_indent="    ",
                            break_long_words=False, break_on_hyphens=False)
    return [line, wrapped + '"""']


RUNTIME_TYPES_HEADER = '''"""The ``runtime.yaml`` types: one class per section the runtime reads.

Generated by ``python -m rlc.compiler.declarations`` from the recipe's key declarations
(:mod:`rlc.compiler.recipe_types`) and the values the compiler derives
(:data:`rlc.compiler.declarations.DERIVED`); do not edit by hand. Each field names the recipe key it is
resolved from (``recipe=``; none for a derived value) and its policy: part of the experiment a
checkpoint records, or free to change between restarts, and why. :mod:`rlc.contract.runtime_config`
loads them. (No ``from __future__ import annotations``: the annotations are built once, with the
classes, instead of compiled from strings when the loader first asks for them.)
"""
from typing import Any, Literal

from rlc.contract.declare import EXPERIMENT, Declared, restart, runtime_key, section
'''


def runtime_types_source() -> str:
    """``rlc/contract/runtime_types.py`` as the generator writes it."""
    classes = runtime_layout()
    by_name = {c.name: c for c in classes}
    order: list[str] = []

    def visit(name: str) -> None:  # sections before the classes that hold them
        if name in order:
            return
        for f in by_name[name].fields:
            for other in by_name:
                if other != name and other in f.type.replace("|", " ").split():
                    visit(other)
        order.append(name)

    for c in classes:
        visit(c.name)
    named = _named_policies()
    used = {f.policy for c in classes for f in c.fields if f.policy is not None}
    out = [RUNTIME_TYPES_HEADER.rstrip("\n"), ""]
    out += [f"{name} = {_policy_source(p, {})}" for p, name in sorted(named.items(), key=lambda kv: kv[1]) if p in used]
    for name in order:
        c = by_name[name]
        doc = textwrap.fill(c.doc, 110, initial_indent='    """', subsequent_indent="    ",
                            break_long_words=False, break_on_hyphens=False)
        out += ["", "", "@section", f"class {c.name}(Declared):", doc + '"""', ""]
        for f in c.fields:
            out += _field_source(f, named)
    names = textwrap.fill(", ".join(f'"{n}"' for n in sorted(order)), 110, initial_indent="__all__ = [",
                          subsequent_indent="           ", break_long_words=False, break_on_hyphens=False)
    out += ["", "", names + "]", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- writing


def generated() -> dict[Path, str]:
    """Every file the declarations generate, with the text it must have."""
    return {SCHEMA_PATH: schema_text(), RUNTIME_TYPES_PATH: runtime_types_source(),
            REFERENCE_PATH: render_markdown(recipe_schema())}


def stale() -> list[Path]:
    """The generated files whose text differs from what the declarations give."""
    out = []
    for path, text in generated().items():
        try:
            current = path.read_text(encoding="utf-8")
        except OSError:
            current = None
        if current != text:
            out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlc.compiler.declarations",
        description="Write the recipe schema, the runtime.yaml types and docs/reference.md from the key "
                    "declarations in rlc/compiler/recipe_types.py.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the stale files")
    args = parser.parse_args(argv)
    if args.check:
        behind = stale()
        for path in behind:
            print(f"{path.relative_to(REPO)}: stale; run `python -m rlc.compiler.declarations`", file=sys.stderr)
        return 1 if behind else 0
    for path, text in generated().items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
