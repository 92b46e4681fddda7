"""Every shipped recipe's launch.sbatch passes ``sbatch --test-only`` on a local cluster shaped like
the recipe (nodes x GPUs per node, GPU type, CPUs, memory, partition), compiled with
``--set cluster.container.runtime=none`` (the harness has no Pyxis). Recipes that are negative
fixtures (rule errors by design, under tests/recipes/nemo-rl-2471/), and shipped recipes whose model facts only
their checkpoint's config.json has (RLC216 offline), get their launch.sbatch rendered directly.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
RECIPES = [*(REPO / "rlc" / "recipes").glob("*.yaml"), *(REPO / "tests" / "recipes" / "nemo-rl-2471").glob("*.yaml")]


def _mem_mb(text: str | None) -> int:
    if not text or text == "0":
        return 64000
    m = re.fullmatch(r"([0-9]+)([KMGT]?)", text)
    scale = {"": 1, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[m.group(2)]
    return max(64000, int(int(m.group(1)) * scale))


def _shape(recipe) -> dict:
    """The local cluster a typed recipe asks for (the harness's own choices where the recipe says nothing)."""
    c = recipe.cluster
    return {"nodes": c.nodes, "gpus": c.gpus_per_node, "gpu_type": c.gpu_type_gres or "",
            "cpus": max(4, c.cpus_per_node or 4), "mem_mb": _mem_mb(c.mem_per_node),
            "partitions": c.slurm.partition or "debug"}


def _launch_script(recipe_path: Path, out: Path, tmp_path: Path) -> tuple[Path, Any]:
    from rlc import __version__
    from rlc.compiler.api import check
    from rlc.compiler.bundle import build_bundle
    from rlc.compiler.bundle.context import build_context
    from rlc.compiler.bundle.render import render_script
    from rlc.compiler.shell import Quoted

    overrides = ["cluster.container.runtime=none", f"cluster.log_dir={tmp_path}/logs"]
    result = check(recipe_path, overrides)
    assert result.recipe is not None, result.diagnostics
    if result.ok:
        build_bundle(result, out)
    else:  # a negative fixture: the same renderer, without the parts its errors block
        # negative fixtures, and shipped recipes whose model facts only their checkpoint's config.json has
        assert recipe_path.parent.name == "nemo-rl-2471" or {d.rule for d in result.errors} == {"RLC216"}, \
            result.errors
        ctx = build_context(result.recipe.cluster, result.recipe.name, out, str(tmp_path / "logs"), __version__)
        out.mkdir()
        # (sbatch --test-only never runs the script: its file-hash check needs no real manifest)
        values = {**ctx.values, "manifest_sha256": Quoted("0" * 64), "tree_sha256": Quoted("0" * 64)}
        (out / "launch.sbatch").write_text(render_script("launch.sbatch.j2", values))
        (tmp_path / "logs").mkdir()
    return out / "launch.sbatch", result.recipe


def _order(path: Path):  # group by cluster shape: fewer restarts
    from rlc.compiler.api import check

    r = check(path, ["cluster.container.runtime=none"]).recipe
    return (sorted(_shape(r).items()), path.name) if r else ((), path.name)


@pytest.mark.parametrize("recipe_path", sorted(RECIPES, key=_order),
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_launch_sbatch_passes_test_only(slurm, tmp_path, recipe_path):
    script, recipe = _launch_script(recipe_path, tmp_path / "bundle", tmp_path)
    shape = _shape(recipe)
    slurm.shape(**shape)
    proc = slurm.run("sbatch", "--test-only", str(script), check=False)
    assert proc.returncode == 0, proc.stderr
    nodes = shape["nodes"]
    expected = "node1" if nodes == 1 else f"node[1-{nodes}]"
    assert f"on nodes {expected}" in proc.stderr, proc.stderr


def test_a_too_small_cluster_is_refused(slurm, tmp_path):
    """The check above is not vacuous: one node fewer than the recipe asks for fails at submit."""
    multi = [p for p in sorted(RECIPES) if _order(p)[0] and dict(_order(p)[0])["nodes"] >= 2]
    recipe_path = multi[0]
    script, recipe = _launch_script(recipe_path, tmp_path / "bundle", tmp_path)
    shape = _shape(recipe)
    slurm.shape(**{**shape, "nodes": shape["nodes"] - 1})
    proc = slurm.run("sbatch", "--test-only", str(script), check=False)
    assert proc.returncode != 0 and "Node count specification invalid" in proc.stderr, proc.stderr
    slurm.shape(**{**shape, "gpus": shape["gpus"] - 1})
    proc = slurm.run("sbatch", "--test-only", str(script), check=False)
    assert proc.returncode != 0 and "Requested node configuration is not available" in proc.stderr, proc.stderr
