"""The ``rlc`` command line: exit codes, show, schema, lint, and what it imports."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from compiler_testing import FIXTURES, REPO, run_rlc

from rlc.compiler import cli
from rlc.compiler.lint import MIN_RECIPES_PER_JOB, discover, job_count, lint, looks_like_recipe
from rlc.compiler.recipe import load_recipe, shipped_recipe_names
from rlc.compiler.schema import load_schema, validate_data, with_defaults
from rlc.compiler.yaml_loader import parse_text


def test_version():
    from rlc import __version__

    r = run_rlc("--version")
    assert r.code == 0 and r.out.strip() == f"rlc {__version__}"


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["validate"], ["lint", "--format", "xml", "."],
                                  ["compile"]])
def test_usage_errors_exit_2_without_traceback(argv):
    r = run_rlc(*argv)
    assert r.code == 2 and "usage:" in r.err and "Traceback" not in r.both


def test_help_exits_0():
    r = run_rlc("--help")
    assert r.code == 0 and "validate" in r.out


def test_validate_ok(monkeypatch):
    r = run_rlc("validate", "valid/full.yaml", cwd=FIXTURES)
    assert r.code == 0, r.both
    assert r.out.startswith("valid/full.yaml: ok")


def test_validate_reports_all_errors_and_exits_1():
    r = run_rlc("validate", "errors/many.yaml", cwd=FIXTURES)
    assert r.code == 1
    lines = [line for line in r.err.splitlines() if re.match(r"errors/many\.yaml:\d+:\d+: ", line)]
    assert len(lines) == 7


@pytest.mark.parametrize("extends", [False, True])
def test_a_5000_character_recipe_name_is_a_usage_or_recipe_error_not_a_bug(tmp_path, extends):
    name = "a" * 5000  # longer than a file name may be: this used to exit 3 (OSError: File name too long)
    if extends:
        (tmp_path / "mine.yaml").write_text(f"version: 1\nextends: {name}\n")
        r = run_rlc("validate", "mine.yaml", cwd=tmp_path)
        assert r.code == 1 and "mine.yaml:2:1: extends: no shipped recipe named" in r.err, r.both
    else:
        r = run_rlc("validate", name, cwd=tmp_path)
        assert r.code == 2 and "cannot read recipe" in r.err, r.both
    assert "internal error" not in r.both and "Traceback" not in r.both


def test_import_writes_into_a_folder_that_does_not_exist_yet(tmp_path):
    config = REPO / "tests" / "importers" / "nemo_rl_configs" / "grpo_base.yaml"
    out = tmp_path / "new" / "deeper" / "recipe.yaml"  # used to fail: "cannot write ...: No such file or directory"
    r = run_rlc("import", "nemo-rl", str(config), "-o", str(out), "--set", "cluster.gpu=h100-80gb")
    assert r.code in (0, 1) and f"wrote {out}" in r.out, r.both
    assert load_recipe(out).data["version"] == 1
    r = run_rlc("import", "nemo-rl", str(config), "-o", str(out.parent), "--force")
    assert r.code == 2 and "is a folder; name the recipe file" in r.err, r.both


def test_validate_a_shipped_recipe_by_name():
    names = shipped_recipe_names()
    if not names:
        pytest.skip("no shipped recipes yet")
    assert "qwen35-397b-grpo-32xh100" in names
    r = run_rlc("validate", "qwen35-397b-grpo-32xh100")  # (nemotron3-ultra needs its checkpoint's config.json)
    assert r.code == 0, r.both


def test_debug_flag_is_accepted_before_or_after_the_command():
    assert run_rlc("--debug", "validate", "valid/minimal.yaml", cwd=FIXTURES).code == 0
    assert run_rlc("validate", "--debug", "valid/minimal.yaml", cwd=FIXTURES).code == 0


def test_internal_errors_are_reported_without_traceback_unless_debug(monkeypatch):
    def boom(args):
        raise RuntimeError("kaput")

    monkeypatch.setattr(cli, "cmd_validate", boom)
    r = run_rlc("validate", "x.yaml")
    assert r.code == 3 and "internal error: RuntimeError: kaput" in r.err and "Traceback" not in r.err
    r = run_rlc("--debug", "validate", "x.yaml")
    assert r.code == 3 and "Traceback" in r.err


# --------------------------------------------------------------------------- show

def test_show_origin_annotates_every_key():
    r = run_rlc("show", "extends/child.yaml", "--origin", "--set", "grpo.max_steps=7", cwd=FIXTURES)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert "  nodes: 2  # extends/child.yaml:6:3" in lines
    assert "    tp: 4  # extends/mid.yaml:10:11" in lines
    assert "    pp: 2  # extends/base.yaml:16:18" in lines
    assert "  max_steps: 7  # --set" in lines
    assert "    ep: 1  # <default>" in lines
    assert all("  # " in line for line in lines)  # every line says where it came from


def test_show_output_is_the_resolved_recipe_and_reads_back(tmp_path):
    r = run_rlc("show", "valid/full.yaml", "--set", "cluster.env.X=on", cwd=FIXTURES)
    assert r.code == 0, r.err
    expected = with_defaults(load_recipe(FIXTURES / "valid/full.yaml", ["cluster.env.X=on"]).data)
    assert parse_text(r.out, "show").data == expected
    annotated = run_rlc("show", "valid/full.yaml", "--origin", cwd=FIXTURES).out
    assert parse_text(annotated, "show").data == with_defaults(load_recipe(FIXTURES / "valid/full.yaml").data)
    assert validate_data(expected) == []


def test_dump_yaml_quotes_what_yaml_12_would_misread():
    data = {"a": "1e-6", "b": "0o17", "c": "true", "d": "null", "e": "", "f": "x\ny", "g": " pad",
            "h": [{"i": 1, "j": [1, {"k": "on"}]}, [], {}], "l": {"m.n": "a: b"}, "o": 1.5e-08}
    assert parse_text(cli.dump_yaml(data), "t").data == data


def test_show_list_and_show_by_name():
    r = run_rlc("show", "--list")
    assert r.code == 0 and r.out.split() == shipped_recipe_names()
    if shipped_recipe_names():
        assert run_rlc("show", shipped_recipe_names()[0]).code == 0


def test_show_without_file_is_a_usage_error():
    r = run_rlc("show")
    assert r.code == 2 and "needs a recipe FILE" in r.err


# --------------------------------------------------------------------------- schema & docs

def test_schema_prints_the_schema():
    r = run_rlc("schema")
    assert r.code == 0 and json.loads(r.out) == load_schema()


def test_reference_docs_are_up_to_date():
    r = run_rlc("schema", "--markdown")
    assert r.code == 0
    assert (REPO / "docs" / "reference.md").read_text(encoding="utf-8") == r.out, \
        "docs/reference.md is stale: run `rlc schema --markdown -o docs/reference.md`"


def test_markdown_mentions_every_key():
    text = run_rlc("schema", "--markdown").out

    def walk(node, prefix):
        for key, sub in node.get("properties", {}).items():
            assert f"| `{key}` |" in text, prefix + key
            walk(sub, f"{prefix}{key}.")

    walk(load_schema(), "")
    assert "## `cluster.slurm`" in text and "## `lint.ignore[]`" in text


def test_schema_output_file(tmp_path):
    out = tmp_path / "s.json"
    assert run_rlc("schema", "-o", str(out)).code == 0
    assert json.loads(out.read_text()) == load_schema()
    assert run_rlc("schema", "-o", str(tmp_path / "no" / "dir" / "s.json")).code == 2


# --------------------------------------------------------------------------- lint

def test_lint_discovery_skips_non_recipes_and_hidden_folders():
    target = discover([FIXTURES / "lintdir"])
    names = sorted(p.relative_to(FIXTURES / "lintdir").as_posix() for p in target.recipes)
    assert names == ["bad.yaml", "sub/also_bad.yml", "sub/broken.yaml"]
    assert sorted(p.name for p in target.skipped) == ["notes.yaml", "workflow.yml"]


def test_lint_explicit_non_recipe_files_are_skipped_with_skip_non_recipes():
    """pre-commit names every YAML file: with --skip-non-recipes the non-recipes are skipped; without
    it a named file is checked like `rlc validate` checks it."""
    r = run_rlc("lint", "--skip-non-recipes", "lintdir/workflow.yml", "lintdir/notes.yaml", cwd=FIXTURES)
    assert r.code == 0 and r.out == "" and "linted 0 recipe(s), skipped 2" in r.err
    r = run_rlc("lint", "lintdir/workflow.yml", "lintdir/notes.yaml", cwd=FIXTURES)
    assert r.code == 1 and "not an rlc recipe" in r.out and "linted 2 recipe(s)" in r.err


def test_looks_like_recipe(tmp_path):
    cases = {"a.yaml": "version: 1\n", "b.yaml": "# c\nextends: x\n", "c.yaml": "  version: 1\n",
             "d.yaml": "# yaml-language-server: $schema=../schemas/recipe.schema.json\nname: x\n",
             "e.yaml": "name: x\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    assert {n for n in cases if looks_like_recipe(tmp_path / n)} == {"a.yaml", "b.yaml", "c.yaml", "d.yaml"}


def test_lint_exit_codes():
    assert run_rlc("lint", "valid", cwd=FIXTURES).code == 0
    assert run_rlc("lint", "valid", "lintdir", cwd=FIXTURES).code == 1
    assert run_rlc("lint", "valid", "nope", cwd=FIXTURES).code == 2


def test_lint_json_is_parseable_and_complete():
    r = run_rlc("lint", "--format", "json", "lintdir", cwd=FIXTURES)
    data = json.loads(r.out)
    assert {d["file"] for d in data} == {"lintdir/bad.yaml", "lintdir/sub/also_bad.yml", "lintdir/sub/broken.yaml"}
    assert all(d["line"] and d["col"] for d in data)


def test_lint_github_lines_are_workflow_commands():
    r = run_rlc("lint", "--format", "github", "lintdir", cwd=FIXTURES)
    lines = r.out.splitlines()
    assert lines and all(re.match(r"^::error file=[^,]+,line=\d+,col=\d+,title=[^:]*::", line) for line in lines)


def test_lint_over_worker_processes_reports_the_same_in_the_same_order():
    """Split across forked workers, lint reports exactly what one process reports, in order."""
    paths = [FIXTURES / "valid", FIXTURES / "lintdir", FIXTURES / "extends",
             REPO / "tests" / "recipes" / "nemo-rl-2471", REPO / "rlc" / "recipes" / "qwen35-397b-grpo-32xh100.yaml"]

    def check(path):
        result = cli.run_check(path, ())
        return cli._ordered(result.diagnostics, result)

    one, target = lint(paths, check, jobs=1)
    assert len(target.recipes) >= 8 and any(d.severity == "error" for d in one)
    for jobs in (2, 3):
        many, _ = lint(paths, check, jobs=jobs)
        assert many == one


def test_lint_job_count():
    assert job_count(1, 5000) == 1 and job_count(3, 2) == 2
    assert job_count(None, MIN_RECIPES_PER_JOB - 1) == 1  # small runs stay in one process
    assert 1 <= job_count(None, 100 * MIN_RECIPES_PER_JOB) <= max(1, len(os.sched_getaffinity(0)))
    bad = run_rlc("lint", "-j", "0", "valid", cwd=FIXTURES)
    assert bad.code == 2 and "--jobs" in bad.err and "Traceback" not in bad.both


def test_lint_ignore_drops_listed_warnings_but_never_errors():
    """lint.ignore is applied once, by the rules engine; validate and lint show its result."""
    ep128 = str(REPO / "tests" / "recipes" / "nemo-rl-2471" / "qwen35-397b-nemo-rl-2471-3-ep128.yaml")
    plain = run_rlc("validate", ep128)
    assert plain.code == 0 and "[RLC212]" in plain.err
    quiet = run_rlc("validate", ep128, "--set", "lint.ignore=[{rule: RLC212, reason: measured margin here}]")
    assert quiet.code == 0 and "[RLC212]" not in quiet.err and "[RLC203]" in quiet.err
    defaults = str(REPO / "tests" / "recipes" / "nemo-rl-2471" / "qwen35-397b-nemo-rl-2471-1-defaults.yaml")
    loud = run_rlc("validate", defaults, "--set", "lint.ignore=[{rule: RLC210, reason: trust me please}]")
    assert loud.code == 1 and "[RLC210]" in loud.err


# --------------------------------------------------------------------------- packaging metadata

def test_pre_commit_hook_definition():
    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    (hook,) = [h for h in hooks if h["id"] == "rlc-lint"]
    assert hook["entry"] == "rlc lint --skip-non-recipes" and hook["language"] == "python"
    pattern = re.compile(hook["files"])
    assert pattern.search("a/b.yaml") and pattern.search("c.yml") and not pattern.search("d.json")


def test_ci_docs_workflow_is_valid_yaml_and_uses_github_format():
    text = (REPO / "docs" / "ci-lint.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    workflows = [yaml.safe_load(b) for b in blocks if "jobs:" in b]
    assert workflows
    steps = workflows[0]["jobs"]["lint"]["steps"]
    assert any("rlc lint --format github" in s.get("run", "") for s in steps)


# --------------------------------------------------------------------------- imports

HEAVY = ("torch", "ray", "vllm", "megatron")


def test_cli_never_imports_heavy_frameworks(tmp_path):
    """validate/lint/show/schema (and ``import rlc.compiler``) in a fresh interpreter."""
    script = f"""
import sys
import rlc.compiler
from rlc.compiler.cli import main
codes = [
    main(["validate", "valid/full.yaml"]),
    main(["validate", "errors/many.yaml"]),
    main(["lint", "valid", "lintdir"]),
    main(["show", "extends/child.yaml", "--origin"]),
    main(["schema"]),
    main(["schema", "--markdown"]),
]
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
print("CODES", codes)
print("HEAVY", heavy)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=FIXTURES, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "CODES [0, 1, 1, 0, 0, 0]" in proc.stdout, proc.stdout + proc.stderr
    assert "HEAVY []" in proc.stdout


def test_compile_path_does_not_import_network_modules(tmp_path):
    """Writing a bundle (plan.svg included) needs no http/ssl: escaping SVG text once pulled them in
    through xml.sax.saxutils -> urllib.request."""
    script = f"""
import sys
before = set(sys.modules)
from rlc.compiler.cli import main
code = main(["compile", "valid/full.yaml", "-o", {str(tmp_path / "bundle")!r}, "--set", "cluster.log_dir={tmp_path}"])
print("CODE", code)
print("NET", sorted(m for m in sys.modules if m.split(".")[0] in ("ssl", "http", "email", "xml")
                   or m == "urllib.request"))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=FIXTURES, capture_output=True, text=True, timeout=120)
    assert "CODE 0" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "bundle" / "plan.svg").exists()
    assert "NET []" in proc.stdout, proc.stdout


def test_plain_import_is_light():
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, rlc.compiler.cli, rlc.compiler.recipe, rlc.compiler.diagnostics;"
         "print(sorted(m for m in ('jsonschema', 'jinja2', 'torch', 'ray') if m in sys.modules))"],
        capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


# --------------------------------------------------------------------------- later stages (lazy)

def test_explain_list_and_unknown_rule():
    listed = run_rlc("explain", "--list")
    assert listed.code == 0 and re.match(r"RLC\d{3} ", listed.out)
    first = listed.out.split()[0]
    shown = run_rlc("explain", first)
    assert shown.code == 0 and shown.out.startswith(first)
    unknown = run_rlc("explain", "RLC9999")
    assert unknown.code == 2 and "unknown rule" in unknown.err and "Traceback" not in unknown.both


def test_plan_json_is_machine_readable():
    r = run_rlc("plan", "valid/minimal.yaml", "--json", cwd=FIXTURES)
    assert r.code == 0, r.both
    data = json.loads(r.out)
    assert set(data) == {"diagnostics", "decisions", "plan"}


def test_plan_of_a_broken_recipe_prints_errors_only():
    r = run_rlc("plan", "errors/enum.yaml", cwd=FIXTURES)
    assert r.code == 1 and r.out == "" and "model.dtype" in r.err


def test_missing_stage_is_a_usage_error(monkeypatch):
    def missing(name, *a, **k):
        raise ImportError("gone", name="rlc.compiler.submit")

    monkeypatch.setattr("importlib.import_module", missing)
    r = run_rlc("submit", "somewhere")
    assert r.code == 2 and "not available in this build" in r.err


def test_lint_of_the_shipped_recipes_folder_passes():
    """rlc/recipes/ holds only recipes that compile (the must-fail fixtures live under tests/), except where the
    model's facts are only in its checkpoint's config.json, which a test run has not: there RLC216 alone."""
    r = run_rlc("lint", str(REPO / "rlc" / "recipes"))
    errors = [line for line in r.out.splitlines() if ": error:" in line or "[RLC" in line and ": info:" not in line
              and ": warning:" not in line]
    assert all("nemotron3-ultra-grpo-64xh200.yaml" in e and "[RLC216]" in e for e in errors), r.both
    assert r.code == 1 and len(errors) == 1, r.both


def test_lint_reports_a_parents_finding_once_not_once_per_child(tmp_path):
    base = REPO / "tests" / "slurm" / "recipes" / "e2e-2node.yaml"
    config = REPO / "rlc" / "recipes" / "models" / "tiny-qwen3" / "config.json"
    (tmp_path / "parent.yaml").write_text(
        f"version: 1\nextends: {base}\nmodel: {{config: {config}}}\n"
        "generation: {sampling: {temperature: 0.2}}\n")  # a warning (RLC304) placed in the parent
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.yaml").write_text(f"version: 1\nextends: parent.yaml\nname: run-{name}\n")
    r = run_rlc("lint", str(tmp_path))
    assert r.code == 0, r.both
    assert r.out.count("generation.sampling.temperature: warning: temperature 0.2") == 1, r.out
    # ... and that one line names every recipe that met it (it is in the parent's file)
    line = next(x for x in r.out.splitlines() if "temperature 0.2" in x)
    assert line.startswith(f"{tmp_path / 'parent.yaml'}:4:") and all(
        str(tmp_path / f"{n}.yaml") in line for n in "abc"), line


def test_lint_names_the_child_whose_finding_sits_in_its_parent(tmp_path):
    # a child's own setting (gpus_per_node: 3) breaks a key its parent sets (global_batch_size): the
    # finding is placed at the parent's line, and used to name no child at all
    base = REPO / "tests" / "slurm" / "recipes" / "e2e-2node.yaml"
    config = REPO / "rlc" / "recipes" / "models" / "tiny-qwen3" / "config.json"
    (tmp_path / "parent.yaml").write_text(f"version: 1\nextends: {base}\nmodel: {{config: {config}}}\n"
                                          "training: {global_batch_size: 32}\n")
    (tmp_path / "child.yaml").write_text("version: 1\nextends: parent.yaml\nname: child\n"
                                         "cluster: {gpus_per_node: 3}\n")
    r = run_rlc("lint", "parent.yaml", "child.yaml", cwd=tmp_path)
    assert r.code == 1, r.both
    errors = [x for x in r.out.splitlines() if x.startswith("parent.yaml:4:") and "global_batch_size" in x]
    assert len(errors) == 1 and errors[0].endswith("(checking child.yaml) [RLC107]"), r.out
    r = run_rlc("lint", "--format", "json", "child.yaml", cwd=tmp_path)
    found = [d for d in json.loads(r.out) if d["path"] == "training.global_batch_size"]
    assert found and found[0]["file"] == "parent.yaml" and "(checking child.yaml)" in found[0]["message"]


def test_validate_and_lint_do_not_load_the_bundle_renderer():
    """Every command runs the bundle-stage checks, but only ``compile`` renders: jinja2 stays unloaded."""
    script = """
import sys
from rlc.compiler.cli import main
print("CODES", main(["validate", "valid/full.yaml"]), main(["lint", "valid/full.yaml"]))
print("JINJA", "jinja2" in sys.modules, "rlc.compiler.bundle.build" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=FIXTURES, capture_output=True, text=True, timeout=120)
    assert "CODES 0 0" in proc.stdout, proc.stdout + proc.stderr
    assert "JINJA False False" in proc.stdout, proc.stdout


def test_validate_loads_only_what_it_uses():
    """``rlc validate`` of the production recipe as a process: no module that only another command, an error
    message or a bundle needs (each costs start-up time on every run); the pipeline it does run is loaded."""
    recipe = REPO / "rlc" / "recipes" / "qwen35-397b-grpo-32xh100.yaml"
    unused = ("shutil", "difflib", "ctypes", "tempfile", "importlib.resources", "jinja2", "jsonschema",
              "rlc.compiler.bundle.build", "rlc.compiler.bundle.render", "rlc.compiler.bundle.pkgcopy")
    script = f"""
import sys
before = set(sys.modules)  # (what the interpreter's start loaded, an install's .pth hooks included, is not rlc's)
from rlc.compiler.cli import main
code = main(["validate", {str(recipe)!r}])
print("CODE", code)
print("LOADED", sorted(m for m in {unused!r} if m in sys.modules and m not in before))
print("PIPELINE", all(m in sys.modules for m in ("rlc.compiler.planner.memory", "rlc.compiler.rules", "yaml")))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "CODE 0" in proc.stdout, proc.stdout + proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout
    assert "PIPELINE True" in proc.stdout, proc.stdout


@pytest.mark.parametrize("columns", [None, "100", "37", "0", "-3", "wide"])
def test_help_width_is_the_terminal_width_shutil_reports(monkeypatch, columns):
    """The parser reads the terminal width itself (``shutil`` stays unloaded): the same as
    ``shutil.get_terminal_size`` for every ``COLUMNS`` setting, so the help text wraps as before."""
    import shutil  # noqa: PLC0415 - the reference, only here

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert cli._terminal_columns() == shutil.get_terminal_size().columns
    parser = cli.build_parser(only="validate")
    assert parser._get_formatter()._width == shutil.get_terminal_size().columns - 2


def test_a_first_compile_loads_neither_ctypes_nor_importlib_resources(tmp_path):
    """The templates are read as package files; ctypes is only for swapping an existing bundle."""
    script = f"""
import sys
before = set(sys.modules)
from rlc.compiler.cli import main
code = main(["compile", "valid/full.yaml", "-o", {str(tmp_path / "bundle")!r}, "--set", "cluster.log_dir={tmp_path}"])
print("CODE", code)
print("LOADED", sorted(m for m in ("ctypes", "importlib.resources") if m in sys.modules and m not in before))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=FIXTURES, capture_output=True, text=True, timeout=120)
    assert "CODE 0" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "bundle" / "launch.sbatch").exists()
    assert "LOADED []" in proc.stdout, proc.stdout
