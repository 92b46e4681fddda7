"""The recipe JSON Schema: loading it, validating against it, filling its defaults.

``rlc/schemas/recipe.schema.json`` (package ``rlc.schemas``) is the single source of truth for
recipe keys. Validation uses :class:`jsonschema.Draft202012Validator` and its ``iter_errors``, so
every problem is reported at once; each ``jsonschema`` error is rewritten into a
:class:`~rlc.compiler.diagnostics.Diagnostic` that a person can act on:

* unknown key   -> ``unknown key 'tpp'; did you mean 'tp'?`` at the bad key's own position
* enum / const  -> the allowed values and the closest one
* type          -> ``expected an integer, got the string '2'`` (+ a YAML hint when it helps)
* ranges        -> ``0 is out of range: allowed 1 to 4096``
* required      -> ``missing required key 'gpu'`` at the parent mapping's position
* oneOf/anyOf   -> ``must be 'auto' or a list of strings``, or the inner error when only one
  alternative has the right shape

One deliberate tightening: ``integer`` means a YAML integer. JSON Schema counts ``2.0`` as an
integer, but the runtime would then receive a float.

``jsonschema`` takes ~0.05 s to import, so it is imported only for a recipe with a problem to
describe: whether there is one is answered first without it (:mod:`rlc.compiler.schema_check`).
"""
from __future__ import annotations

import copy
import json
import math
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from rlc.compiler.diagnostics import Diagnostic, PathPart, format_path, sort_diagnostics
from rlc.compiler.schema_check import is_valid
from rlc.compiler.suggest import closest, did_you_mean
from rlc.schemas import RECIPE_SCHEMA

if TYPE_CHECKING:  # pragma: no cover
    from jsonschema.exceptions import ValidationError

    from rlc.compiler.recipe import LoadedRecipe

SCHEMA_FILE = "recipe.schema.json"


@lru_cache(maxsize=1)
def _schema_text() -> str:
    return RECIPE_SCHEMA.read_text(encoding="utf-8")


def load_schema() -> dict[str, Any]:
    """The recipe schema as a dict (parsed once; callers get a fresh deep copy)."""
    return copy.deepcopy(_schema())


@lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    return json.loads(_schema_text())


def schema_text() -> str:
    """The schema file's text, exactly as shipped (``rlc schema`` prints it)."""
    return _schema_text()


@lru_cache(maxsize=1)
def _validator() -> Any:
    from jsonschema import Draft202012Validator, validators  # noqa: PLC0415

    def is_integer(_checker: Any, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def is_number(_checker: Any, value: Any) -> bool:  # NaN and infinities are no recipe value
        if isinstance(value, float):
            return math.isfinite(value)
        return isinstance(value, int) and not isinstance(value, bool)

    checker = Draft202012Validator.TYPE_CHECKER.redefine_many({"integer": is_integer, "number": is_number})
    strict = validators.extend(Draft202012Validator, type_checker=checker)
    return strict(_schema())


# --------------------------------------------------------------------------- schema navigation

def _resolve(node: Any) -> dict[str, Any]:
    """Follow a local ``$ref`` (``#/...``) if present."""
    if not isinstance(node, dict):
        return {} if node is True else {"not": {}}
    seen = 0
    while "$ref" in node and seen < 16:
        ref = node["$ref"]
        if not ref.startswith("#/"):
            break
        target: Any = _schema()
        for token in ref[2:].split("/"):
            target = target[token.replace("~1", "/").replace("~0", "~")]
        node, seen = target, seen + 1
    return node


def _branches(node: dict[str, Any]) -> list[dict[str, Any]]:
    """``node`` and its ``oneOf``/``anyOf``/``allOf`` alternatives (resolved)."""
    out = [node]
    for key in ("oneOf", "anyOf", "allOf"):
        out.extend(_resolve(sub) for sub in node.get(key, []))
    return out


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t or ())


def check_key_path(parts: Iterable[PathPart]) -> str | None:
    """``None`` when the schema allows a value at key path ``parts``, else the reason (with a
    did-you-mean for misspelt keys). Used for ``--set``."""
    nodes = [_resolve(_schema())]
    done: list[PathPart] = []
    for part in parts:
        where = format_path(done) or "the top level"
        nxt: list[dict[str, Any]] = []
        for node in (b for n in nodes for b in _branches(n)):
            if isinstance(part, int):
                if "items" in node or "array" in _types(node):
                    nxt.append(_resolve(node.get("items", True)))
                elif not _types(node) and not node.get("properties"):
                    nxt.append({})  # inside a free-form value: anything goes
                continue
            props = node.get("properties", {})
            if part in props:
                nxt.append(_resolve(props[part]))
            elif any(re.search(p, part) for p in node.get("patternProperties", {})):
                nxt.extend(_resolve(s) for p, s in node["patternProperties"].items() if re.search(p, part))
            elif "additionalProperties" in node and node["additionalProperties"] is not False:
                nxt.append(_resolve(node["additionalProperties"]))
            elif "additionalProperties" not in node and not props and (
                    not _types(node) or "object" in _types(node)):
                nxt.append({})  # free-form mapping (e.g. extensions, reward.kwargs)
        if not nxt:
            if isinstance(part, int):
                return f"{where} is not a list"
            keys = [k for n in nodes for b in _branches(n) for k in b.get("properties", {})]
            if not keys:
                return f"{where} has no keys"
            return f"unknown key {part!r} in {where}{did_you_mean(part, keys)}"
        nodes = nxt
        done.append(part)
    return None


@lru_cache(maxsize=1)
def _key_index() -> dict[str, list[str]]:
    """Every schema key name -> the dotted paths where it is allowed (for 'belongs elsewhere')."""
    index: dict[str, list[str]] = {}

    def walk(node: dict[str, Any], path: tuple[PathPart, ...], depth: int) -> None:
        if depth > 12:
            return
        for branch in _branches(node):
            for key, sub in branch.get("properties", {}).items():
                index.setdefault(key, []).append(format_path(path + (key,)))
                walk(_resolve(sub), path + (key,), depth + 1)
            if isinstance(branch.get("items"), dict):
                walk(_resolve(branch["items"]), path + (0,), depth + 1)

    walk(_resolve(_schema()), (), 0)
    return index


# --------------------------------------------------------------------------- defaults

def with_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``data`` with every schema default filled in, recursively.

    Absent mappings are created when something below them has a default. Keys come in schema
    order, then any extra keys (e.g. under ``extensions``) in their original order. Values of
    the wrong type are copied unchanged (validation reports them).
    """
    filled, _ = _fill(_resolve(_schema()), data, True)
    return filled


def default_at(path: str) -> Any:
    """The schema's default of the key at dotted ``path`` (``KeyError`` when it has none)."""
    node = _resolve(_schema())
    for part in path.split("."):
        node = _resolve(node.get("properties", {})[part])
    return copy.deepcopy(node["default"])


_ATOMS = (str, int, float, bool, type(None))


def _copy(value: Any) -> Any:
    """A copy of a recipe value that shares nothing mutable (scalars are returned as they are)."""
    return value if isinstance(value, _ATOMS) else copy.deepcopy(value)


#: What ``_fill`` makes of an absent key, per schema node: the node (so that its id is not reused), the filled
#: defaults and whether there are any.
_ABSENT: dict[int, tuple[dict[str, Any], Any, bool]] = {}


def _clone(value: Any) -> Any:
    """A copy of defaults built by ``_fill`` (mappings, lists and scalars) that shares nothing mutable."""
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return _copy(value)


def _fill(node: dict[str, Any], value: Any, present: bool) -> tuple[Any, bool]:
    if present:
        return _fill_uncached(node, value, present)
    entry = _ABSENT.get(id(node))
    if entry is None or entry[0] is not node:  # an absent key's defaults depend on its schema node alone
        entry = (node, *_fill_uncached(node, None, False))
        _ABSENT[id(node)] = entry
    return _clone(entry[1]), entry[2]


def _fill_uncached(node: dict[str, Any], value: Any, present: bool) -> tuple[Any, bool]:
    if not present:
        if "default" in node:
            value, present = _copy(node["default"]), True
        elif "properties" in node:
            value = {}
        else:
            return None, False
    if isinstance(value, dict) and "properties" in node:
        out: dict[str, Any] = {}
        for key, sub in node["properties"].items():
            child, ok = _fill(_resolve(sub), value.get(key), key in value)
            if ok:
                out[key] = child
        for key, child in value.items():
            if key not in out and key not in node["properties"]:
                out[key] = _copy(child)
        if not present and not out:
            return None, False
        return out, True
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        items = _resolve(node["items"])
        return [_fill(items, v, True)[0] for v in value], True
    return _copy(value), True


# --------------------------------------------------------------------------- error messages

_TYPE_WORDS = {
    "string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
    "array": "a list", "object": "a mapping", "null": "null",
}
_YAML_BOOL_WORDS = {"yes", "no", "on", "off", "y", "n"}


def render(value: Any, limit: int = 60) -> str:
    """A value as it would look in YAML, shortened: ``'text'``, ``2``, ``true``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        text = repr(value)
        return text if len(text) <= limit else text[: limit - 4] + "...'"
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _got(value: Any) -> str:
    if isinstance(value, bool):
        return f"the boolean {render(value)}"
    if value is None:
        return "null"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {render(value)}" if math.isfinite(value) else f"the non-finite number {render(value)}"
    if isinstance(value, str):
        return f"the string {render(value)}"
    if isinstance(value, list):
        return "a list"
    return "a mapping"


def _first_sentence(text: str | None, short: int = 100) -> str | None:
    """A description for a hint: whole when short, else its first sentence."""
    if not text:
        return None
    text = " ".join(text.split())
    if len(text) <= short:
        return text
    m = re.match(r"(.+?[.!?])(?=\s+[A-Z]|$)", text)
    return m.group(1) if m else text


def describe(node: dict[str, Any]) -> str:
    """A short English description of what a schema accepts: ``'auto' or a list of strings``."""
    node = _resolve(node)
    alternatives = node.get("oneOf") or node.get("anyOf")
    if alternatives:
        return " or ".join(describe(sub) for sub in alternatives)
    if "const" in node:
        return render(node["const"])
    if "enum" in node:
        return "one of " + ", ".join(render(v) for v in node["enum"])
    types = sorted(_types(node), key=list(_TYPE_WORDS).index) if _types(node) else []
    if types == ["array"] and isinstance(node.get("items"), dict):
        inner = describe(node["items"])
        plural = {"a string": "strings", "an integer": "integers", "a number": "numbers",
                  "a mapping": "mappings", "true or false": "booleans"}.get(inner, inner)
        return f"a list of {plural}"
    if not types:
        return "any value"
    if len(types) == 1:
        return _TYPE_WORDS.get(types[0], types[0])
    words = [_TYPE_WORDS.get(t, t) if t != "boolean" else "a boolean" for t in types]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _range_text(node: dict[str, Any]) -> str:
    none = (None, None)
    lo = (">=", node["minimum"]) if "minimum" in node else \
        (">", node["exclusiveMinimum"]) if "exclusiveMinimum" in node else none
    hi = ("<=", node["maximum"]) if "maximum" in node else \
        ("<", node["exclusiveMaximum"]) if "exclusiveMaximum" in node else none
    if lo[0] == ">=" and hi[0] == "<=":
        return f"{render(lo[1])} to {render(hi[1])}"
    return " and ".join(f"{op} {render(bound)}" for op, bound in (lo, hi) if op)


class _Converter:
    """Turns ``jsonschema`` errors into diagnostics placed with the recipe's origin map."""

    def __init__(self, loaded: "LoadedRecipe | None") -> None:
        self.loaded = loaded

    def diag(self, path: tuple[PathPart, ...], message: str, hint: str | None = None,
             at: tuple[PathPart, ...] | None = None) -> Diagnostic:
        """A schema error at key ``path``; placed at ``at`` (default: ``path``)."""
        text = format_path(path)
        origin = self.loaded.locate(format_path(at if at is not None else path)) if self.loaded else None
        d = Diagnostic("error", message, text, hint=hint)
        if origin is not None:
            d.file, d.line, d.col = origin.file, origin.line, origin.col
        if hint is None and origin is not None and origin.file == "--set" and message.startswith("expected a string"):
            d.hint = "--set values are YAML; quote text that YAML would read otherwise: --set 'k=\"a: b\"'"
        return d

    def convert(self, error: "ValidationError") -> Iterator[Diagnostic]:
        path: tuple[Any, ...] = tuple(error.absolute_path)
        value, node, kind = error.instance, error.schema, error.validator
        handler = getattr(self, f"on_{kind}", None)
        if "propertyNames" in error.absolute_schema_path:
            reason = (f"must match {error.validator_value}" if kind == "pattern"
                      else self._short(error))
            yield self.diag(path + (value,), f"invalid key name {render(value)}: {reason}")
        elif handler is not None:
            yield from handler(error, path, value, node)
        else:
            yield self.diag(path, self._short(error))

    @staticmethod
    def _short(error: "ValidationError") -> str:
        message = error.message
        return message if len(message) <= 200 else message[:197] + "..."

    # -- one method per JSON Schema keyword --------------------------------------------

    def on_additionalProperties(self, error, path, value, node):  # noqa: N802
        props = node.get("properties", {})
        patterns = node.get("patternProperties", {})
        extras = [k for k in value if k not in props and not any(re.search(p, k) for p in patterns)]
        for key in extras:
            suggestion = closest(key, props)
            message = f"unknown key {key!r}"
            if suggestion is not None:
                message += f"; did you mean {suggestion!r}?"
            hint = None
            elsewhere = [p for p in _key_index().get(key, []) if p != format_path(path + (key,))]
            if elsewhere:
                hint = f"{key!r} is a key of " + ", ".join(p.rsplit(".", 1)[0] if "." in p else "the top level"
                                                           for p in elsewhere[:4])
            elif suggestion is None and props:
                hint = "allowed keys here: " + ", ".join(props)
            yield self.diag(path + (key,), message, hint)

    def on_required(self, error, path, value, node):
        props = node.get("properties", {})
        for key in error.validator_value:
            if isinstance(value, dict) and key not in value:
                sub = _resolve(props.get(key, {}))
                hint = _first_sentence(sub.get("description"))
                near = closest(key, [k for k in value if k not in props])
                if near is not None:
                    hint = f"found {near!r}; is that a misspelling of {key!r}?"
                yield self.diag(path + (key,), f"missing required key {key!r}", hint, at=path)

    def on_type(self, error, path, value, node):
        expected = describe({"type": error.validator_value})
        hint = None
        types = _types(node)
        if isinstance(value, str):
            if "boolean" in types and value.lower() in _YAML_BOOL_WORDS:
                hint = f"write true or false; rlc reads YAML 1.2, where {value!r} is a string"
            elif types & {"integer", "number"} and re.fullmatch(r"[-+]?[0-9._eE+-]+", value.strip()):
                hint = "remove the quotes to make it a number"
        elif isinstance(value, float) and "integer" in types and value.is_integer():
            hint = f"write {int(value)} (no decimal point)"
        elif "string" in types and isinstance(value, (int, float, bool)):
            hint = f"quote it to make it a string: \"{render(value)}\""
        yield self.diag(path, f"expected {expected}, got {_got(value)}", hint)

    def on_enum(self, error, path, value, node):
        allowed = error.validator_value
        message = f"{render(value)} is not allowed; choose one of: {', '.join(render(v) for v in allowed)}"
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            message += did_you_mean(value, allowed, render)
        yield self.diag(path, message)

    def on_const(self, error, path, value, node):
        yield self.diag(path, f"must be {render(error.validator_value)}, got {render(value)}",
                        _first_sentence(node.get("description")))

    def _on_range(self, error, path, value, node):
        yield self.diag(path, f"{render(value)} is out of range: allowed {_range_text(node)}")

    on_minimum = on_maximum = on_exclusiveMinimum = on_exclusiveMaximum = _on_range

    def on_minLength(self, error, path, value, node):  # noqa: N802
        if value == "":
            yield self.diag(path, "must not be empty")
        else:
            yield self.diag(path, f"{render(value)} is too short: at least {error.validator_value} characters")

    def on_maxLength(self, error, path, value, node):  # noqa: N802
        yield self.diag(path, f"is too long ({len(value)} characters): at most {error.validator_value}")

    def on_pattern(self, error, path, value, node):
        yield self.diag(path, f"{render(value)} does not match the required pattern {error.validator_value}",
                        _first_sentence(node.get("description")))

    def on_minItems(self, error, path, value, node):  # noqa: N802
        yield self.diag(path, f"needs at least {error.validator_value} item(s), has {len(value)}")

    def on_maxItems(self, error, path, value, node):  # noqa: N802
        yield self.diag(path, f"allows at most {error.validator_value} item(s), has {len(value)}")

    def on_uniqueItems(self, error, path, value, node):  # noqa: N802
        yield self.diag(path, "items must be unique")

    def _on_alternatives(self, error, path, value, node):
        keyword = error.validator
        if not error.context:  # valid under several oneOf branches
            yield self.diag(path, f"{render(value)} is ambiguous: it matches more than one of "
                                  f"{describe({keyword: error.validator_value})}")
            return
        by_branch: dict[int, list[ValidationError]] = {}
        for sub in error.context:
            by_branch.setdefault(sub.relative_schema_path[0], []).append(sub)
        # A branch whose errors are all below the value has the right shape: report its errors.
        shaped = [errs for errs in by_branch.values()
                  if all(len(e.absolute_path) > len(path) for e in errs)]
        if len(shaped) == 1:
            for sub in shaped[0]:
                yield from self.convert(sub)
            return
        yield self.diag(path, f"must be {describe({keyword: error.validator_value})}, got {_got(value)}")

    on_oneOf = on_anyOf = _on_alternatives


def validate_data(data: Any, loaded: "LoadedRecipe | None" = None) -> list[Diagnostic]:
    """Every schema problem of ``data`` (positions from ``loaded`` when given), sorted.

    A recipe without a problem is known as one without importing ``jsonschema``
    (:func:`rlc.compiler.schema_check.is_valid`); ``jsonschema`` finds and describes the problems."""
    if is_valid(_schema(), data):
        return []
    converter = _Converter(loaded)
    diags: list[Diagnostic] = []
    seen: set[tuple] = set()
    for error in _validator().iter_errors(data):
        for d in converter.convert(error):
            ident = (d.path, d.message)
            if ident not in seen:
                seen.add(ident)
                diags.append(d)
    first = loaded.root.file if loaded is not None and loaded.root is not None else None
    return sort_diagnostics(diags, first)


def validate(loaded: "LoadedRecipe") -> list[Diagnostic]:
    """Every schema problem of a loaded recipe, each placed at the file:line:col that caused it."""
    return validate_data(loaded.data, loaded)
