"""Origin tracking through merged mappings: after `extends:` merging and `--set`, every key of the
merged recipe has exactly one origin, the file (or `--set`) whose value won, and no key that is gone
keeps one. Checked against a second implementation of the merge rules (mappings merge key by key,
everything else replaces; a mapping a child merges into is the child's), on random chains."""
from __future__ import annotations

import copy
import os

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlc.compiler.diagnostics import format_path
from rlc.compiler.recipe import SET_ORIGIN, RecipeLoadError, load_recipe

KEYS = st.sampled_from(["a", "b", "c"])
SCALARS = st.one_of(st.integers(0, 9), st.sampled_from(["x", "y"]), st.booleans(), st.none())
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                      max_leaves=8)
BODIES = st.dictionaries(st.sampled_from(["p", "q"]), VALUES, max_size=2).map(
    lambda top: {**top, "extensions": top.get("p", {}) if isinstance(top.get("p"), dict) else {}})
SET_PATHS = st.lists(KEYS, min_size=1, max_size=3).map(lambda parts: ("extensions", *parts))


def _paths(value, prefix):
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield prefix + (key,)
        yield from _paths(child, prefix + (key,))


def _own(owner, path, value, who):
    for key in [k for k in owner if k[:len(path)] == path]:
        del owner[key]
    owner[path] = who
    for sub in _paths(value, path):
        owner[sub] = who


def _merge(dst, src, owner, who, prefix=()):
    for key, value in src.items():
        path = prefix + (key,)
        if not prefix and key == "extends":
            continue
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            owner[path] = who
            _merge(dst[key], value, owner, who, path)
        else:
            dst[key] = copy.deepcopy(value)
            _own(owner, path, value, who)


def reference(files, sets):
    """(merged data, key path -> who) from the documented rules; ``None`` where a ``--set`` goes
    through a value that is not a mapping (an error)."""
    data, owner = {}, {}
    for who, body in files:
        _merge(data, body, owner, who)
    for path, value in sets:
        node = data
        for i, part in enumerate(path[:-1]):
            if node.get(part) is None:  # missing or null: --set makes the mapping
                node[part] = {}
                _own(owner, path[:i + 1], {}, SET_ORIGIN)
            elif not isinstance(node[part], dict):
                return None
            node = node[part]
        node[path[-1]] = copy.deepcopy(value)
        _own(owner, path, value, SET_ORIGIN)
    return data, owner


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(bodies=st.lists(BODIES, min_size=1, max_size=3),
       sets=st.lists(st.tuples(SET_PATHS, VALUES), max_size=2))
def test_every_key_has_the_origin_of_the_value_that_won(tmp_path_factory, bodies, sets):
    folder = tmp_path_factory.mktemp("chain")
    files = []
    for i, body in enumerate(bodies):  # root first; each child extends the one before
        text = {"version": 1, "name": f"r{i}", **body}
        if i:
            text["extends"] = f"f{i - 1}.yaml"
        path = folder / f"f{i}.yaml"
        path.write_text(yaml.safe_dump(text, sort_keys=False))
        files.append((os.path.normpath(str(path)), text))
    set_texts = [f"{format_path(p)}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                 for p, v in sets]
    expected = reference(files, sets)
    if expected is None:
        with pytest.raises(RecipeLoadError, match="not a mapping"):
            load_recipe(folder / f"f{len(bodies) - 1}.yaml", set_texts)
        return
    loaded = load_recipe(folder / f"f{len(bodies) - 1}.yaml", set_texts)
    data, owner = expected
    assert loaded.data == data
    got = {k: o.file for k, o in loaded.origins.items()}
    assert got == {format_path(k): who for k, who in owner.items()}


def test_a_child_mapping_merged_into_the_parents_is_the_childs_and_its_other_keys_stay_the_parents(tmp_path):
    (tmp_path / "base.yaml").write_text("version: 1\nname: base\nextensions:\n  keep: 1\n  deep: {x: 1, y: 2}\n")
    (tmp_path / "child.yaml").write_text("version: 1\nextends: base.yaml\nname: child\nextensions:\n"
                                         "  deep: 5\n  new: {z: 3}\n")
    loaded = load_recipe(tmp_path / "child.yaml")
    base, child = str(tmp_path / "base.yaml"), str(tmp_path / "child.yaml")
    where = {k: (o.file, o.line) for k, o in loaded.origins.items() if k.startswith("extensions")}
    assert where == {"extensions": (child, 4), "extensions.keep": (base, 4), "extensions.deep": (child, 5),
                     "extensions.new": (child, 6), "extensions.new.z": (child, 6)}
