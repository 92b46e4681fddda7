"""How a setting is declared, once, and the one strict loader that builds the typed trees.

Every recipe key is one field of a section class in :mod:`rlc.compiler.recipe_types`, declared with
:func:`key`: its type (the annotation), its description, its default and its limits, and what the
runtime does with it. From those declarations ``python -m rlc.compiler.declarations`` writes the recipe
JSON Schema (``rlc/schemas/recipe.schema.json``), the ``runtime.yaml`` types
(:mod:`rlc.contract.runtime_types`) and ``docs/reference.md``; a test keeps the three equal to what the
declarations give.

What the runtime does with a key is its *policy* (``runtime=`` of :func:`key`); every key of a section
that reaches ``runtime.yaml`` states one (sections that never do, such as ``cluster.slurm``, need none):

* :data:`COMPILER`: the key shapes the launch or the plan and never reaches ``runtime.yaml``;
* :data:`EXPERIMENT`: it defines what is being trained; a checkpoint records it, and resuming under
  another value is refused (``rlc.runtime.checkpoint``);
* :func:`restart` ``("why")``: it may change between restarts of one experiment, for the reason given.

:func:`load` is the one loader of both trees: the typed recipe from a recipe the schema accepted (with
its defaults filled), and the runtime config from a ``runtime.yaml``. It refuses unknown and missing
keys, wrong types and values outside a ``Literal``, naming the key path.

Pure Python (no torch, ray, vllm, megatron or jsonschema): the compiler and the runtime both import it.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union

from rlc.contract.typed_fields import field_types

T = TypeVar("T")


# --------------------------------------------------------------------------- policy


class Policy:
    """What the runtime makes of a key: ``experiment`` (it defines what is being trained), ``restart``
    (it may change between restarts of one experiment; ``why`` says what it changes instead) or
    ``compiler`` (the runtime never reads it). Compared by value."""

    __slots__ = ("kind", "why")
    kind: Literal["experiment", "restart", "compiler"]
    why: str

    def __init__(self, kind: Literal["experiment", "restart", "compiler"], why: str) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "why", why)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Policy is read-only ({name})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and (self.kind, self.why) == (other.kind, other.why)

    def __hash__(self) -> int:
        return hash((self.kind, self.why))

    def __repr__(self) -> str:
        return f"Policy({self.kind!r}, {self.why!r})"

    @property
    def experiment(self) -> bool:
        return self.kind == "experiment"

    @property
    def reaches_runtime(self) -> bool:
        return self.kind != "compiler"


#: The key defines what is being trained (a checkpoint written under another value is another experiment's).
EXPERIMENT = Policy("experiment", "defines what is being trained")
#: The compiler alone reads the key (the launch, the plan, the checks); it never reaches ``runtime.yaml``.
COMPILER = Policy("compiler", "read by the compiler only")


def restart(why: str) -> Policy:
    """The key may change between restarts of one experiment: ``why`` says what it changes instead."""
    if not why:
        raise ValueError("restart() needs the reason the key may change between restarts")
    return Policy("restart", why)


# --------------------------------------------------------------------------- declaring


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


#: ``key(default=...)`` when the schema gives no default (the key is required, or optional and absent).
NO_DEFAULT: Any = _NoDefault()

#: JSON Schema keywords :func:`key` takes, by their Python names.
_SCHEMA_WORDS = {
    "minimum": "minimum", "maximum": "maximum", "exclusive_minimum": "exclusiveMinimum",
    "exclusive_maximum": "exclusiveMaximum", "min_length": "minLength", "max_length": "maxLength",
    "pattern": "pattern", "unique_items": "uniqueItems",
}


def key(description: str | None = None, *, default: Any = NO_DEFAULT, runtime: Policy | None = None,
        runtime_name: str | None = None, runtime_type: str | None = None, resolved: bool = False,
        runtime_default: Callable[[], Any] | None = None,
        items: Mapping[str, Any] | None = None, values: Mapping[str, Any] | None = None,
        property_names: str | None = None, nullable: bool = False, **limits: Any) -> Any:
    """Declare one recipe key (a field of a section class in :mod:`rlc.compiler.recipe_types`).

    ``description`` is the one description of the key (schema, reference docs, the ``runtime.yaml``
    types); a field that holds a section may leave it out and take the section's docstring.
    ``default`` is its schema default, the only one anywhere (the classes state none). Limits are
    JSON Schema keywords by their Python names: ``minimum``, ``maximum``, ``exclusive_minimum``,
    ``exclusive_maximum``, ``min_length``, ``max_length``, ``pattern``, ``unique_items``; ``items``
    adds keywords to a list's items, ``values`` is the schema of a free-form mapping's values and
    ``property_names`` the pattern of its keys; ``nullable`` lets ``null`` be written for an
    ``Optional`` key without a ``null`` default.

    ``runtime`` is the key's policy (:data:`COMPILER`, :data:`EXPERIMENT` or :func:`restart`). A key that
    reaches ``runtime.yaml`` goes to the same place unless ``runtime_name`` names another (a dotted path
    from the top); its type there is the recipe type with lists as lists and mappings as dicts,
    ``resolved`` drops ``None`` and ``"auto"`` (the compiler settles them), and ``runtime_type`` states
    it where it differs otherwise; ``runtime_default`` (a factory) lets a ``runtime.yaml`` leave the key
    out.
    """
    unknown = sorted(set(limits) - set(_SCHEMA_WORDS))
    if unknown:
        raise TypeError(f"key(): unknown limit(s) {', '.join(unknown)}; known: {', '.join(_SCHEMA_WORDS)}")
    schema = {_SCHEMA_WORDS[k]: v for k, v in limits.items()}
    meta = {"description": description, "default": default, "schema": schema, "runtime": runtime,
            "runtime_name": runtime_name, "runtime_type": runtime_type, "resolved": resolved,
            "runtime_default": runtime_default,
            "items": dict(items) if items else None, "values": dict(values) if values is not None else None,
            "property_names": property_names, "nullable": nullable}
    return dataclasses.field(metadata=meta)


def runtime_key(policy: Policy | None, *, recipe: str | None = None, minimum: float | None = None,
                maximum: float | None = None, default_factory: Callable[[], Any] | None = None) -> Any:
    """A field of the ``runtime.yaml`` types (:mod:`rlc.contract.runtime_types`, generated): its
    ``policy`` (``None`` for a field that holds a section), the recipe key it is resolved from (``None``:
    the compiler derives it) and, for a derived number, its range. ``default_factory`` lets an older
    ``runtime.yaml`` leave it out."""
    meta = {"runtime": policy, "recipe": recipe, "range": (minimum, maximum)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(metadata=meta)


class Declared:
    """``__init__``, frozenness, ``repr``, ``==`` and ``hash`` of the declared classes, by their fields.

    Written once here instead of generated per class: ``dataclass`` compiles each generated method
    separately, and with ~60 classes that was most of the import time every ``rlc`` command pays.
    The classes stay dataclasses (``dataclasses.fields``, ``replace`` and ``asdict`` work) and are
    frozen: assigning a field raises ``dataclasses.FrozenInstanceError``."""

    __slots__ = ()
    # (not annotated: typing.get_type_hints of a section lists its fields only)
    __field_names__ = frozenset[str]()
    __factories__ = dict[str, Callable[[], Any]]()

    def __init__(self, **values: Any) -> None:
        cls = type(self)
        if values.keys() != cls.__field_names__:
            for name, make in cls.__factories__.items():
                if name not in values:
                    values[name] = make()
            missing = sorted(cls.__field_names__ - values.keys())
            unknown = sorted(values.keys() - cls.__field_names__)
            if missing or unknown:
                raise TypeError(f"{cls.__name__}(): " + "; ".join(
                    part for part in (missing and f"missing {', '.join(missing)}",
                                      unknown and f"unexpected {', '.join(unknown)}") if part))
        self.__dict__.update(values)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))  # type: ignore[arg-type]

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))  # type: ignore[arg-type]
        return f"{type(self).__name__}({inner})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Declared)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self), self._values()))


@typing.dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(key, runtime_key))
def section(cls: type[T] | None = None, *, runtime: str | None = None) -> Any:
    """A frozen dataclass of declared settings; ``runtime`` names its class in the ``runtime.yaml``
    types (sections without one stay in the compiler). Type checkers see keyword-only fields: a
    declared default is the schema's, never the constructor's. The class must derive from
    :class:`Declared`, which gives it its ``__init__`` and keeps it frozen."""

    def wrap(c: type[T]) -> type[T]:
        if not issubclass(c, Declared):
            raise TypeError(f"{c.__name__}: a declared section derives from Declared")
        c.__runtime_class__ = runtime  # type: ignore[attr-defined]
        made = dataclasses.dataclass(init=False, repr=False, eq=False)(c)
        fields = dataclasses.fields(made)  # type: ignore[arg-type]
        made.__field_names__ = frozenset(f.name for f in fields)
        made.__factories__ = {f.name: f.default_factory for f in fields
                              if f.default_factory is not dataclasses.MISSING}
        return made

    return wrap if cls is None else wrap(cls)


def runtime_class(cls: type) -> str | None:
    """The ``runtime.yaml`` class a recipe section becomes (``None``: it stays in the compiler)."""
    return getattr(cls, "__runtime_class__", None)


def settings(cls: type) -> tuple[tuple[str, Any, Mapping[str, Any]], ...]:
    """``(name, resolved type, metadata)`` of each field of a declared class, in order."""
    found = _SETTINGS.get(cls)
    if found is None:
        hints = field_types(cls)
        found = _SETTINGS[cls] = tuple((f.name, hints[f.name], f.metadata) for f in dataclasses.fields(cls))
    return found


_SETTINGS: dict[type, tuple[tuple[str, Any, Mapping[str, Any]], ...]] = {}


# --------------------------------------------------------------------------- loading


class Reading:
    """How :func:`load` reads one kind of tree: the error it raises and its messages.

    The typed recipe is built from a mapping the schema accepted, with its defaults filled; an
    unknown or missing key there is a bug, and ``Optional`` keys without a default may be absent. A
    ``runtime.yaml`` is read as written, by hand or by another rlc (``as_written``): every key must be
    there, a mapping is a ``dict``, an integer is read as a float where the type says float, and a
    ``Literal`` value must have the option's own type (``1.0`` is no ``1``); the typed recipe keeps the
    schema's values as they are (``2`` stays ``2``)."""

    __slots__ = ("error", "unknown", "missing", "not_a_mapping", "as_written", "top_level_ignored")

    def __init__(self, *, error: type[Exception], unknown: Callable[[str, list[str]], str],
                 missing: Callable[[str], str], not_a_mapping: Callable[[str, Any], str], as_written: bool,
                 top_level_ignored: frozenset[str] = frozenset()) -> None:
        self.error = error  # raised with each message
        self.unknown = unknown  # (path, sorted unknown keys) -> message
        self.missing = missing  # key path -> message
        self.not_a_mapping = not_a_mapping  # (path, value) -> message
        self.as_written = as_written
        self.top_level_ignored = top_level_ignored


def load(cls: type[T], data: Any, path: str, how: Reading) -> T:
    """``cls`` (a declared class) built from ``data`` at key ``path``, checked key by key."""
    return _plan(cls, how)(data, path)


def convert(tp: Any, value: Any, path: str, how: Reading) -> Any:
    """``value`` as a field of type ``tp`` at key ``path`` holds it (checked as :func:`load` checks it)."""
    return _converter(tp, how)(value, path)


Converter = Callable[[Any, str], Any]
_PLANS: dict[tuple[type, Reading], Converter] = {}
_CONVERTERS: dict[tuple[Any, Reading], Converter] = {}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    origin = typing.get_origin(tp)
    return typing.get_args(tp) if origin is Union or origin is types.UnionType else None


def _shown(value: Any) -> str:
    return repr(value)


def _plan(cls: type, how: Reading) -> Converter:
    """The converter of section ``cls``: built once per class and reading."""
    plan = _PLANS.get((cls, how))
    if plan is not None:
        return plan
    fields = [(name, _converter(tp, how), _optional(tp), f) for (name, tp, _), f in
              zip(settings(cls), dataclasses.fields(cls))]
    names = frozenset(name for name, *_ in fields)
    ignored = how.top_level_ignored

    def build(data: Any, path: str) -> Any:
        if not isinstance(data, dict if how.as_written else Mapping):
            raise how.error(how.not_a_mapping(path, data))
        values: dict[str, Any] = {}
        for name, convert, optional, f in fields:
            where = f"{path}.{name}" if path else name
            if name in data:
                values[name] = convert(data[name], where)
            elif optional and not how.as_written:
                values[name] = None
            elif f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            else:
                raise how.error(how.missing(where))
        foreign = data.keys() - names
        if foreign:
            extra = sorted(str(k) for k in foreign if path or k not in ignored)
            if extra:
                raise how.error(how.unknown(path, extra))
        return cls(**values)

    _PLANS[(cls, how)] = build
    return build


def _optional(tp: Any) -> bool:
    args = _union_args(tp)
    return args is not None and type(None) in args


def _converter(tp: Any, how: Reading) -> Converter:
    found = _CONVERTERS.get((tp, how))
    if found is None:
        found = _CONVERTERS[(tp, how)] = _make_converter(tp, how)
    return found


_SCALARS: dict[Any, str] = {int: "int", float: "float", str: "str", bool: "bool"}


def _make_converter(tp: Any, how: Reading) -> Converter:
    error = how.error
    if tp is Any:
        return lambda value, path: value
    if _is_section(tp):
        plan = _plan(tp, how)
        return plan
    args = _union_args(tp)
    if args is not None:
        options = [a for a in args if a is not type(None)]
        nullable = len(options) < len(args)
        if len(options) == 1:
            inner = _converter(options[0], how)

            def optional(value: Any, path: str) -> Any:
                if value is None:
                    return None
                return inner(value, path)
            return optional if nullable else inner
        alternatives = [(a, _converter(a, how)) for a in options]

        def either(value: Any, path: str) -> Any:
            if value is None:
                if nullable:
                    return None
                raise error(f"{path}: must not be null")
            problems = []
            for _, convert in alternatives:
                try:
                    return convert(value, path)
                except error as exc:
                    problems.append(str(exc).partition(": ")[2])
            raise error(f"{path}: {'; or '.join(problems)}")
        return either
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        choices = ", ".join(_shown(v) for v in allowed)
        same_type = how.as_written

        def literal(value: Any, path: str) -> Any:
            if value is None:
                raise error(f"{path}: must not be null")
            for option in allowed:  # as JSON compares: 1 is 1.0, never True
                if value == option and isinstance(value, bool) == isinstance(option, bool) and \
                        (type(value) is type(option) or not same_type):
                    return value
            raise error(f"{path}: {_shown(value)} is not allowed; choose one of: {choices}")
        return literal
    if origin in (list, tuple):
        item = _converter(typing.get_args(tp)[0] if typing.get_args(tp) else Any, how)
        make: Callable[[Any], Any] = tuple if origin is tuple else list
        accepted = (list, tuple) if origin is tuple else list

        def sequence(value: Any, path: str) -> Any:
            if value is None:
                raise error(f"{path}: must not be null")
            if not isinstance(value, accepted):
                raise error(f"{path}: expected a list, got {type(value).__name__}")
            return make(item(v, f"{path}[{i}]") for i, v in enumerate(value))
        return sequence
    if origin is dict or origin is Mapping or tp is dict:
        copy = origin is dict or tp is dict

        def mapping(value: Any, path: str) -> Any:
            if value is None:
                raise error(f"{path}: must not be null")
            if not isinstance(value, dict if copy else Mapping):
                raise error(f"{path}: expected a mapping, got {type(value).__name__}")
            return dict(value) if copy else value
        return mapping
    if tp in _SCALARS:
        name = _SCALARS[tp]
        if tp is float:
            to_float = how.as_written

            def number(value: Any, path: str) -> Any:
                if isinstance(value, float):
                    return value
                if isinstance(value, int) and not isinstance(value, bool):
                    return float(value) if to_float else value
                if value is None:
                    raise error(f"{path}: must not be null")
                raise error(f"{path}: expected float, got {value!r}")
            return number

        def scalar(value: Any, path: str) -> Any:
            if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
                return value
            if value is None:
                raise error(f"{path}: must not be null")
            raise error(f"{path}: expected {name}, got {value!r}")
        return scalar
    raise TypeError(f"no loader for the declared type {tp!r}")


def leaves(cls: type, path: str = "") -> list[tuple[str, Any, Mapping[str, Any]]]:
    """``(dotted path, type, metadata)`` of every setting under ``cls``, nested sections opened."""
    out: list[tuple[str, Any, Mapping[str, Any]]] = []
    for name, tp, meta in settings(cls):
        where = f"{path}.{name}" if path else name
        inner = [a for a in (tp, *(typing.get_args(tp))) if _is_section(a)]
        if inner:
            out += leaves(inner[0], where)
        else:
            out.append((where, tp, meta))
    return out


__all__ = ["COMPILER", "EXPERIMENT", "NO_DEFAULT", "Declared", "Policy", "Reading", "convert", "key", "leaves", "load",
           "restart", "runtime_class", "runtime_key", "section", "settings"]
