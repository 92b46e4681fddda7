"""Golden files: the rendered bundle of every shipped recipe, compared after normalising what varies
(the bundle and working folders, the rlc version, hashes, the bundled rlc's file list). Every rendered
script must pass ``bash -n`` and ``shellcheck``.

Regenerate after an intended change: ``RLC_UPDATE_GOLDEN=1 python -m pytest tests/bundle/test_bundle_golden.py``
and review the diff. The memory plan files are the planner's output and are not compared here.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bundle_helpers import REPO

GOLDEN = Path(__file__).parent / "golden"
COMPARED = ("launch.sbatch", "node.sh", "env.sh", "mounts.txt", "README.txt", "runtime.yaml", "bundle.lock.json")
SCRIPTS = ("launch.sbatch", "node.sh", "env.sh")
RECIPE_INDEPENDENT = ("node.sh",)
CHAIN = REPO / "tests" / "recipes" / "nemo-rl-2471"  # test fixtures: two fail by design
RECIPES = sorted([*(REPO / "rlc" / "recipes").glob("*.yaml"), *CHAIN.glob("*.yaml")])


def _id(path: Path) -> str:
    return f"tests__{path.stem}" if path.parent == CHAIN else path.stem


def normalise(name: str, text: str, bundle: Path, cwd: Path) -> str:
    from rlc import __version__

    if name == "bundle.lock.json":
        lock = json.loads(text)
        lock["files"] = {k: v for k, v in lock["files"].items() if not k.startswith("rlc_pkg/")}
        lock["tree"] = {k: v for k, v in lock["tree"].items() if not k.startswith("rlc_pkg/")}
        text = json.dumps(lock, indent=2, sort_keys=True) + "\n"
    text = text.replace(str(bundle), "<BUNDLE>").replace(str(cwd), "<CWD>").replace(str(REPO), "<REPO>")
    text = re.sub(r"\b[0-9a-f]{64}\b", "<SHA256>", text)
    text = re.sub(rf"(rlc[ _\"a-z:]*){re.escape(__version__)}\b", r"\1<VERSION>", text)
    return text


def _check(recipe: Path):
    from rlc.compiler.api import check

    return check(recipe, [])


@pytest.mark.parametrize("recipe", RECIPES, ids=_id)
def test_rendered_bundle_matches_golden(recipe, tmp_path, monkeypatch):
    from rlc.compiler.bundle import build_bundle

    result = _check(recipe)
    if not result.ok and {d.rule for d in result.errors} == {"RLC216"} and recipe.parent != CHAIN:
        pytest.skip(f"{_id(recipe)} takes its model facts from its checkpoint's config.json, which a test run "
                    "has not (RLC216); no bundle")
    if not result.ok:
        assert recipe.parent == CHAIN, f"shipped recipe {recipe.name} has errors: {result.errors}"
        pytest.skip(f"{_id(recipe)} is a negative fixture (errors by design: "
                    f"{', '.join(sorted({d.rule or '?' for d in result.errors}))}); no bundle")
    monkeypatch.chdir(tmp_path)
    bundle = tmp_path / "bundle"
    build_bundle(result, bundle)
    folder = GOLDEN / _id(recipe)
    update = os.environ.get("RLC_UPDATE_GOLDEN") == "1"
    mismatched = []
    for name in COMPARED:
        got = normalise(name, (bundle / name).read_text(), bundle, tmp_path)
        # node.sh does not depend on the recipe (it reads the bundle's env.sh at run time): one golden copy
        golden = GOLDEN / name if name in RECIPE_INDEPENDENT else folder / name
        if update:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(got)
        elif not golden.exists():
            pytest.fail(f"no golden file {golden.relative_to(REPO)}: run RLC_UPDATE_GOLDEN=1 python -m pytest "
                        f"tests/bundle/test_bundle_golden.py and review the new files")
        elif golden.read_text() != got:
            mismatched.append(name)
    assert not mismatched, (f"{_id(recipe)}: {mismatched} differ from {folder.relative_to(REPO)}; if the change "
                            "is intended, regenerate with RLC_UPDATE_GOLDEN=1 and review the diff")


@pytest.mark.parametrize("recipe", RECIPES, ids=_id)
def test_rendered_scripts_pass_bash_n_and_shellcheck(recipe, tmp_path, monkeypatch):
    from rlc.compiler.bundle import build_bundle

    result = _check(recipe)
    if not result.ok and {d.rule for d in result.errors} == {"RLC216"} and recipe.parent != CHAIN:
        pytest.skip(f"{_id(recipe)} takes its model facts from its checkpoint's config.json, which a test run "
                    "has not (RLC216); no bundle")
    if not result.ok:
        pytest.skip(f"{_id(recipe)} is a negative fixture (errors by design)")
    monkeypatch.chdir(tmp_path)
    build_bundle(result, tmp_path / "bundle")
    for name in SCRIPTS:
        path = tmp_path / "bundle" / name
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
        assert syntax.returncode == 0, f"{name}: {syntax.stderr}"
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is not installed (bash tests/harness/local_slurm.sh install)")
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    lint = subprocess.run(["shellcheck", "--severity=style", *(str(tmp_path / "bundle" / n) for n in SCRIPTS)],
                          capture_output=True, text=True, check=False)
    assert lint.returncode == 0, lint.stdout


def test_every_golden_folder_belongs_to_a_shipped_recipe():
    known = {_id(r) for r in RECIPES}
    stale = sorted(p.name for p in GOLDEN.iterdir() if p.is_dir() and p.name not in known) if GOLDEN.exists() else []
    assert not stale, f"golden folders without a recipe (delete them): {stale}"
