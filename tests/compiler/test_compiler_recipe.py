"""``load_recipe``: extends chains, merge rules, --set overrides and the origin map."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from compiler_testing import FIXTURES

from rlc.compiler.diagnostics import exit_code
from rlc.compiler.recipe import (
    Origin,
    RecipeLoadError,
    load_recipe,
    shipped_recipe_names,
    shipped_recipe_path,
)

EXT = FIXTURES / "extends"


@pytest.fixture(autouse=True)
def _in_fixtures(monkeypatch):
    monkeypatch.chdir(FIXTURES)


def load_errors(path, overrides=()):
    with pytest.raises(RecipeLoadError) as info:
        load_recipe(path, overrides)
    return info.value.diagnostics


def test_three_level_chain_merges_mappings_and_replaces_lists():
    r = load_recipe("extends/child.yaml")
    assert [p.name for p in r.files] == ["child.yaml", "mid.yaml", "base.yaml"]
    assert r.data["name"] == "child"
    assert r.data["cluster"]["nodes"] == 2  # child
    assert r.data["cluster"]["slurm"] == {"partition": "batch", "extra_flags": ["--constraint=h100"]}
    assert r.data["cluster"]["env"] == {"NCCL_DEBUG": "WARN", "NCCL_IB_HCA": "mlx5"}
    assert r.data["parallelism"]["train"] == {"tp": 4, "pp": 2}
    assert "extends" not in r.data


def test_origins_point_at_the_file_that_set_each_key():
    r = load_recipe("extends/child.yaml")
    base, mid, child = (os.path.join("extends", n) for n in ("base.yaml", "mid.yaml", "child.yaml"))
    assert r.origins["cluster.nodes"] == Origin(child, 6, 3)
    assert r.origins["parallelism.train.tp"] == Origin(mid, 10, 11)
    assert r.origins["parallelism.train.pp"] == Origin(base, 16, 18)
    assert r.origins["cluster.slurm.extra_flags[0]"] == Origin(mid, 6, 19)
    # the parent's second list item was replaced, so it has no origin any more
    assert "cluster.slurm.extra_flags[1]" not in r.origins
    assert "extends" not in r.origins


def test_locate_falls_back_to_the_nearest_ancestor_then_the_file_start():
    r = load_recipe("extends/child.yaml")
    assert r.locate("parallelism.train.ep") == r.origins["parallelism.train"]
    assert r.locate("grpo.max_steps") == Origin(os.path.join("extends", "child.yaml"), 1, 1)
    assert r.locate("") == Origin(os.path.join("extends", "child.yaml"), 1, 1)


def test_scalar_replaced_by_mapping_and_back(tmp_path):
    (tmp_path / "p.yaml").write_text("version: 1\na: {b: 1, c: [1, 2]}\nd: 5\n")
    (tmp_path / "c.yaml").write_text("version: 1\nextends: p.yaml\na: 7\nd: {e: 1}\n")
    r = load_recipe(tmp_path / "c.yaml")
    assert r.data == {"version": 1, "a": 7, "d": {"e": 1}, "name": "c"}  # a child is named after its file
    assert not any(k.startswith("a.") for k in r.origins)
    assert r.origins["d.e"].line == 4


def test_cycle_reports_the_whole_chain():
    diag = load_errors("extends/cycle_a.yaml")[0]
    chain = " -> ".join(os.path.join("extends", f"cycle_{x}.yaml") for x in "abca")
    assert diag.message == f"extends cycle: {chain}"
    assert (diag.file, diag.line, diag.path) == (os.path.join("extends", "cycle_c.yaml"), 2, "extends")


def test_self_extends_is_a_cycle(tmp_path):
    (tmp_path / "me.yaml").write_text("version: 1\nextends: me.yaml\n")
    assert "extends cycle" in load_errors(tmp_path / "me.yaml")[0].message


def test_missing_parent_is_a_recipe_error_with_suggestion():
    diags = load_errors("extends/missing_parent.yaml")
    assert exit_code(diags) == 1
    assert "did you mean 'base.yaml'?" in diags[0].message and diags[0].line == 2


def test_missing_top_level_file_is_an_io_error():
    diags = load_errors("no/such/recipe.yaml")
    assert exit_code(diags) == 2 and "cannot read recipe" in diags[0].message


def test_extends_must_be_a_string(tmp_path):
    (tmp_path / "r.yaml").write_text("version: 1\nextends: [a, b]\n")
    assert "extends must be" in load_errors(tmp_path / "r.yaml")[0].message


def test_shipped_recipes_are_found_by_name(tmp_path):
    names = shipped_recipe_names()
    if not names:
        pytest.skip("no shipped recipes yet")
    name = names[0]
    shipped = shipped_recipe_path(name)
    assert shipped.is_file() and shipped.suffix in (".yaml", ".yml")
    (tmp_path / "mine.yaml").write_text(f"version: 1\nextends: {name}\nname: mine\n")
    r = load_recipe(tmp_path / "mine.yaml")
    assert r.files[1] == shipped and r.data["name"] == "mine"
    assert r.origins["version"].file == str(tmp_path / "mine.yaml")
    # a key only the shipped recipe sets comes from the shipped file
    other = next(k for k, o in r.origins.items() if o.file == str(shipped))
    assert other


@pytest.mark.parametrize("ref", ["a" * 5000, "a" * 300, "x\x00y"])
def test_a_name_no_file_can_have_is_an_unknown_shipped_recipe_not_a_crash(tmp_path, ref):
    # 5,000 characters used to reach the filesystem as <recipes>/<name>.yaml: OSError "File name too
    # long", exit code 3 (a bug in rlc) instead of the recipe error it is
    (tmp_path / "mine.yaml").write_text(f"version: 1\nextends: {ref!r}\n".replace("'", '"'))
    diags = load_errors(tmp_path / "mine.yaml")
    assert len(diags) == 1 and diags[0].path == "extends", diags
    assert diags[0].message.startswith("no shipped recipe named") and exit_code(diags) == 1
    with pytest.raises(KeyError):
        shipped_recipe_path(ref)


def test_unknown_shipped_name_suggests_the_closest(tmp_path):
    names = shipped_recipe_names()
    if not names:
        pytest.skip("no shipped recipes yet")
    typo = names[0][:-1] + ("x" if names[0][-1] != "x" else "y")
    (tmp_path / "mine.yaml").write_text(f"version: 1\nextends: {typo}\n")
    diag = load_errors(tmp_path / "mine.yaml")[0]
    assert f"no shipped recipe named {typo!r}; did you mean {names[0]!r}?" == diag.message
    assert diag.hint and names[0] in diag.hint


def test_error_in_a_parent_is_placed_in_the_parent(tmp_path):
    (tmp_path / "p.yaml").write_text("version: 1\na: [1\n")
    (tmp_path / "c.yaml").write_text("version: 1\nextends: p.yaml\n")
    diag = load_errors(tmp_path / "c.yaml")[0]
    assert diag.file == os.path.normpath(str(tmp_path / "p.yaml"))


# --------------------------------------------------------------------------- --set

def test_set_values_are_yaml_typed_and_recorded():
    r = load_recipe("valid/minimal.yaml", [
        "parallelism.train.tp=2", "refit.sync_params_before_refit=on", "training.optimizer.lr=1e-5",
        "cluster.slurm.extra_flags=[--a, --b]", "cluster.env.X=a:b", "name=  spaced  ",
    ])
    assert r.data["parallelism"]["train"]["tp"] == 2
    assert r.data["refit"]["sync_params_before_refit"] == "on"
    assert r.data["training"]["optimizer"]["lr"] == 1e-5
    assert r.data["cluster"]["slurm"]["extra_flags"] == ["--a", "--b"]
    assert r.data["cluster"]["env"]["X"] == "a:b"
    assert r.data["name"] == "spaced"
    for key in ("parallelism.train.tp", "parallelism", "cluster.slurm.extra_flags[1]"):
        assert r.origins[key] == Origin("--set")
    assert r.overrides[0] == "parallelism.train.tp=2"


def test_set_list_index_replaces_and_appends():
    r = load_recipe("extends/base.yaml", ["cluster.slurm.extra_flags[0]=--foo",
                                          "cluster.slurm.extra_flags[2]=--bar"])
    assert r.data["cluster"]["slurm"]["extra_flags"] == ["--foo", "--exclusive", "--bar"]
    assert r.origins["cluster.slurm.extra_flags[0]"] == Origin("--set")
    assert r.origins["cluster.slurm.extra_flags[1]"].file.endswith("base.yaml")


def test_set_creates_a_missing_list():
    r = load_recipe("valid/minimal.yaml", ["cluster.slurm.extra_flags[0]=--foo"])
    assert r.data["cluster"]["slurm"]["extra_flags"] == ["--foo"]


def test_set_replacing_a_mapping_forgets_its_file_origins():
    r = load_recipe("extends/base.yaml", ["cluster.env={A: 1}"])
    assert r.data["cluster"]["env"] == {"A": 1}
    assert "cluster.env.NCCL_DEBUG" not in r.origins
    assert r.origins["cluster.env.A"] == Origin("--set")


def test_set_unknown_key_suggests():
    diag = load_errors("valid/minimal.yaml", ["parallelism.train.tpp=2"])[0]
    assert diag.file == "--set" and diag.path == "parallelism.train.tpp"
    assert "unknown key 'tpp' in parallelism.train; did you mean 'tp'?" in diag.message
    assert exit_code([diag]) == 1


def test_set_free_form_keys_are_allowed():
    r = load_recipe("valid/minimal.yaml", ["extensions.my.deep.key=1", "reward.kwargs.x=[1]",
                                           'extensions["a.b"]=2'])
    assert r.data["extensions"] == {"my": {"deep": {"key": 1}}, "a.b": 2}
    assert r.data["reward"]["kwargs"] == {"x": [1]}


@pytest.mark.parametrize(
    "override, fragment, code",
    [
        ("novalue", "expected KEY=VALUE", 2),
        ("=3", "expected KEY=VALUE", 2),
        ("a..b=1", "bad key path", 2),
        ("cluster.slurm.extra_flags[9]=--x", "index 9 is out of range", 1),
        ("cluster.nodes[0]=1", "is not a list", 1),
        ("cluster.nodes.x=1", "has no keys", 1),
        ("cluster.nodes=[1", "value is not valid YAML", 1),
        ("extends=other.yaml", "extends cannot be changed", 1),
        ("bogus=1", "unknown key 'bogus'", 1),
    ],
)
def test_set_errors(override, fragment, code):
    diags = load_errors("valid/minimal.yaml", [override])
    assert any(fragment in d.message for d in diags), [d.message for d in diags]
    assert exit_code(diags) == code


def test_all_set_errors_are_reported_at_once():
    diags = load_errors("valid/minimal.yaml", ["a=1", "b=2", "parallelism.train.tp=2"])
    assert [d.path for d in diags] == ["a", "b"]


def test_set_through_a_scalar_is_an_error(tmp_path):
    (tmp_path / "r.yaml").write_text("version: 1\nparallelism: 5\n")
    diag = load_errors(tmp_path / "r.yaml", ["parallelism.train.tp=2"])[0]
    assert "parallelism is the value 5, not a mapping" in diag.message


def test_files_are_paths_child_first():
    r = load_recipe(Path("extends/mid.yaml"))
    assert r.files == [Path("extends/mid.yaml"), Path("extends/base.yaml")]


def test_misspelt_shipped_name_on_the_command_line():
    names = shipped_recipe_names()
    if not names:
        pytest.skip("no shipped recipes yet")
    diags = load_errors(names[0][:-1])
    assert exit_code(diags) == 2 and diags[0].hint == f"not a file, nor a shipped recipe; did you mean {names[0]!r}?"


def test_overlong_extends_chain_is_an_error(tmp_path):
    from rlc.compiler.recipe import MAX_EXTENDS_DEPTH

    for i in range(MAX_EXTENDS_DEPTH + 3):
        (tmp_path / f"r{i}.yaml").write_text(f"version: 1\nextends: r{i + 1}.yaml\n")
    (tmp_path / f"r{MAX_EXTENDS_DEPTH + 3}.yaml").write_text("version: 1\n")
    assert "extends chain longer than" in load_errors(tmp_path / "r0.yaml")[0].message
    assert load_recipe(tmp_path / f"r{5}.yaml").files[-1].name == f"r{MAX_EXTENDS_DEPTH + 3}.yaml"
