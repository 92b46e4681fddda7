"""Compiler speed: ``rlc validate`` on the largest shipped recipe and ``rlc lint`` over 200 recipes.

Both are measured as a user sees them: wall-clock time of a fresh ``rlc`` process (interpreter
start and imports included), median of several runs. Not a test (timings depend on the machine);
targets are for the 2-core CI machine:

* ``rlc validate <largest shipped recipe>``: <= 0.3 s
* ``rlc lint`` over 200 generated recipe variants (a tenth of them broken): <= 3 s

Usage: ``python benchmarks/bench_compiler.py [--runs N] [--variants N]``
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlc.compiler.cli import dump_yaml
from rlc.compiler.recipe import load_recipe, shipped_recipe_names, shipped_recipe_path

REPO = Path(__file__).resolve().parents[1]
FALLBACK = REPO / "tests" / "compiler" / "fixtures" / "valid" / "full.yaml"


def rlc_command() -> list[str]:
    """The installed ``rlc`` script next to this interpreter, else ``python -m rlc``."""
    script = Path(sys.executable).with_name("rlc")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rlc"]


def largest_recipe() -> Path:
    shipped = [shipped_recipe_path(n) for n in shipped_recipe_names()]
    return max(shipped, key=lambda p: p.stat().st_size) if shipped else FALLBACK


def wall(cmd: list[str], runs: int, cwd: Path, ok: set[int], env: dict[str, str] | None = None) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        times.append(time.perf_counter() - start)
        if proc.returncode not in ok:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}")
    return times


def make_variants(base: Path, folder: Path, count: int, seed: int = 0) -> int:
    """Write ``count`` recipes derived from ``base``: half full copies, half ``extends`` children
    with a few overrides; every tenth has an error. Returns the number of broken ones."""
    rng = random.Random(seed)
    data = load_recipe(base).data
    model = data.get("model", {})
    if isinstance(model.get("config"), str) and not os.path.isabs(model["config"]):
        model["config"] = str((base.parent / model["config"]).resolve())
    broken = 0
    for i in range(count):
        name = f"variant-{i:03d}"
        if i % 2 == 0:
            variant = dict(data, name=name)
            variant["grpo"] = dict(data.get("grpo", {}), max_steps=rng.randint(1, 1000), seed=i)
        else:
            variant = {"version": 1, "extends": str(base.resolve()), "name": name,
                       "training": {"optimizer": {"lr": rng.choice([1e-6, 3e-6, 1e-5])}}}
        if i % 10 == 9:
            variant["grpo"] = {"max_stpes": 10}  # a typo: one schema error
            broken += 1
        text = "# yaml-language-server: $schema=../schemas/recipe.schema.json\n" + dump_yaml(variant)
        (folder / f"{name}.yaml").write_text(text)
    return broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11, help="runs of validate (median reported)")
    parser.add_argument("--lint-runs", type=int, default=5, help="runs of lint (median reported)")
    parser.add_argument("--variants", type=int, default=200, help="recipes for the lint benchmark")
    args = parser.parse_args(argv)

    rlc = rlc_command()
    recipe = largest_recipe()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        # As a user runs it: Python caches bytecode (an installed wheel has it precompiled). This
        # environment may set PYTHONDONTWRITEBYTECODE, which makes every run recompile every rlc
        # module of an editable install; the cache goes to a temp folder, not the source tree.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "pycache")
        no_cache = dict(env, PYTHONDONTWRITEBYTECODE="1")
        no_cache.pop("PYTHONPYCACHEPREFIX")

        validate = rlc + ["validate", str(recipe)]
        wall(validate, 1, tmp_path, {0}, env)  # warm the OS file cache, write the bytecode
        t = wall(validate, args.runs, tmp_path, {0}, env)
        rows.append((f"rlc validate {recipe.name} ({recipe.stat().st_size} B)", t, 0.3))
        t = wall(validate, max(3, args.runs // 2), tmp_path, {0}, no_cache)
        rows.append(("  same, no bytecode cache (compiles every module)", t, None))
        t = wall([sys.executable, "-c", "pass"], args.runs, tmp_path, {0}, env)
        rows.append(("  python -c pass (interpreter start, for reference)", t, None))

        folder = tmp_path / "recipes"
        folder.mkdir()
        broken = make_variants(recipe, folder, args.variants)
        lint = rlc + ["lint", str(folder)]
        t = wall(lint, args.lint_runs, tmp_path, {1} if broken else {0}, env)
        rows.append((f"rlc lint {args.variants} recipes ({broken} broken)", t, 3.0))
        shutil.rmtree(folder)

    print(f"{'benchmark':58} {'median s':>9} {'min s':>7} {'max s':>7} {'target':>7}  status")
    for label, times, target in rows:
        med = statistics.median(times)
        status = "" if target is None else ("ok" if med <= target else "SLOW")
        tgt = "" if target is None else f"{target:.2f}"
        print(f"{label:58} {med:9.3f} {min(times):7.3f} {max(times):7.3f} {tgt:>7}  {status}")
    load = os.getloadavg()[0]
    print(f"({len(os.sched_getaffinity(0))} CPUs, load average {load:.1f}; rlc = {' '.join(rlc)}; "
          f"runs = {args.runs}/{args.lint_runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
