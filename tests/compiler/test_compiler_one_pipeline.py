"""One check pipeline: validate, lint, plan and compile report the same problems, all in one round
(schema, rule and bundle-stage errors together where the later stages can run)."""
from __future__ import annotations

import json

import pytest
from compiler_testing import run_rlc

# A recipe whose cluster section is schema-valid but cannot become a bundle, six ways.
CLUSTER = """\
cluster:
  nodes: 2
  gpus_per_node: 8
  gpu: h100-80gb
  env:
    RAY_AUTH_MODE: disabled
    PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True
  container:
    runtime: pyxis
    image: nvcr.io/nvidia/pytorch:25.01-py3
    mounts: ["/data:/proc/x", "relative/src:/data"]
  slurm:
    job_name: "ok\\n#SBATCH --uid=0"
    extra_flags: ["--nodes=4"]
  ray:
    port: 20005
"""
BUNDLE_ERRORS = [
    "cluster.env.RAY_AUTH_MODE: RAY_AUTH_MODE cannot be set in a recipe",
    "cluster.container.mounts[0]: mounting over /proc/x would break the container",
    "cluster.container.mounts[1]: source mount path 'relative/src' is not absolute",
    "cluster.slurm.job_name: contains a newline",
    "cluster.slurm.extra_flags[0]: --nodes is set by the bundle from cluster.nodes",
    "cluster.ray.port: port 20005 lies inside the worker port range 20000-29999",
]
RULE_ERROR = "cluster.env.PYTORCH_CUDA_ALLOC_CONF: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True enables"
SCHEMA_ERROR = "grpo.max_steps: 0 is out of range"


def _recipe(tmp_path, *, schema_error: bool) -> str:
    text = ("version: 1\nmodel: {id: Qwen/Qwen3-8B}\n" + CLUSTER + "data: {train: /d/train.jsonl}\n"
            + ("grpo: {max_steps: 0}\n" if schema_error else ""))
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("command", ["validate", "lint", "plan", "compile"])
def test_every_command_reports_rule_and_bundle_errors_in_one_round(tmp_path, command):
    recipe = _recipe(tmp_path, schema_error=False)
    argv = [command, recipe] + (["-o", str(tmp_path / "bundle")] if command == "compile" else [])
    run = run_rlc(*argv)
    assert run.code == 1, run.both
    for message in [*BUNDLE_ERRORS, RULE_ERROR]:
        assert message in run.both, f"{command} did not report {message!r}:\n{run.both}"
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("command", ["validate", "lint", "plan", "compile"])
def test_schema_errors_elsewhere_do_not_hide_the_bundle_errors(tmp_path, command):
    """The schema rejects grpo.max_steps; the cluster section is still checked (the rules, which
    need the whole recipe, are not run)."""
    recipe = _recipe(tmp_path, schema_error=True)
    argv = [command, recipe] + (["-o", str(tmp_path / "bundle")] if command == "compile" else [])
    run = run_rlc(*argv)
    assert run.code == 1, run.both
    for message in [SCHEMA_ERROR, *BUNDLE_ERRORS]:
        assert message in run.both, f"{command} did not report {message!r}:\n{run.both}"
    assert RULE_ERROR not in run.both


def test_plan_json_carries_the_bundle_errors(tmp_path):
    run = run_rlc("plan", "--json", _recipe(tmp_path, schema_error=False))
    paths = {d["path"] for d in json.loads(run.out)["diagnostics"] if d["severity"] == "error"}
    assert {m.split(": ")[0] for m in BUNDLE_ERRORS} <= paths


def test_a_schema_error_inside_the_cluster_section_skips_its_bundle_checks(tmp_path):
    """Bundle checks read the cluster section: with the schema rejecting part of it they would
    only echo that problem, so they wait until it is fixed."""
    recipe = _recipe(tmp_path, schema_error=False)
    run = run_rlc("validate", recipe, "--set", "cluster.nodes=0")
    assert run.code == 1
    assert "cluster.nodes: 0 is out of range" in run.err
    assert not any(m in run.err for m in BUNDLE_ERRORS)


# ------------------------------------------------------------------ experiments never share state

def _child(tmp_path, file_name: str, body: str) -> str:
    from compiler_testing import REPO

    config = REPO / "rlc" / "recipes" / "models" / "tiny-qwen3" / "config.json"
    parent = REPO / "tests" / "slurm" / "recipes" / "e2e-2node.yaml"  # named, default output folders
    path = tmp_path / file_name
    path.write_text(f"version: 1\nextends: {parent}\nmodel: {{config: {config}}}\n{body}")
    return str(path)


def test_a_child_recipe_without_its_own_name_is_named_after_its_file(tmp_path):
    from rlc.compiler.api import check
    from rlc.compiler.resolve import to_runtime_config

    low = check(_child(tmp_path, "lr-low.yaml", "training: {optimizer: {lr: 1.0e-6}}\n"))
    high = check(_child(tmp_path, "lr high!.yaml", "training: {optimizer: {lr: 3.0e-6}}\n"))
    assert low.ok and high.ok
    assert (low.recipe.name, high.recipe.name) == ("lr-low", "lr-high")
    dirs = [to_runtime_config(r)["checkpointing"]["dir"] for r in (low, high)]
    assert dirs[0] != dirs[1] and dirs[0].endswith("/checkpoints/lr-low")
    assert any(d.severity == "info" and d.path == "name" and "named 'lr-low' after its file" in d.message
               for d in low.diagnostics)
    named = check(_child(tmp_path, "named.yaml", "name: mine\n"))
    assert named.recipe.name == "mine" and not any(d.path == "name" for d in named.diagnostics)


def test_lint_warns_when_two_recipes_share_output_folders(tmp_path):
    for file_name in ("a.yaml", "b.yaml"):
        _child(tmp_path, file_name, "name: same-run\n")
    _child(tmp_path, "c.yaml", "name: other-run\n")
    run = run_rlc("lint", str(tmp_path))
    assert run.code == 0, run.both
    for me, other in (("a", "b"), ("b", "a")):
        for key, sub in (("checkpointing.dir", "checkpoints"), ("logging.dir", "metrics")):
            assert (f"{tmp_path}/{me}.yaml: {key}: warning: " in run.out
                    and f"/{sub}/same-run is also the {key} of {tmp_path}/{other}.yaml" in run.out), run.out
    assert "c.yaml: checkpointing.dir" not in run.out
