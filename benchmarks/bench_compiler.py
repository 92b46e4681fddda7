"""Compiler speed: ``rlc validate`` and ``rlc compile`` of one production recipe, ``rlc lint`` over
2000 recipes, and peers doing the same kind of work.

Each is measured as a user sees it: wall-clock time of a fresh process (interpreter start, imports
and exit included); the minimum of several runs (the least disturbed by other work on the machine)
and the median. ``rlc compile`` writes a new bundle folder each run. Not a test (timings depend on
the machine). Goals:

* ``rlc validate`` of the base recipe: <= 0.10 s; ``rlc compile``: <= 0.20 s (minimum of the runs);
* ``rlc lint`` over 2000 recipe variants (a tenth of them broken) takes at most the time of 15
  single ``rlc validate`` runs of the base recipe, both measured in this run (medians).

Peers, measured in the same run where installed: a hand-rolled recipe tool (OmegaConf to load, jsonschema
to validate against rlc's schema, jinja2 to render a launch script), and the imports of NeMo-Run and
SkyPilot (a lower bound of their commands).

``--baseline DIR`` measures another rlc checkout (e.g. ``git worktree add /tmp/old <commit>``) with
the same recipes in the same run, for before/after numbers. ``--json FILE`` writes the table with
the command and the machine; ``--check`` exits 1 when a goal is missed.

Usage: ``python benchmarks/bench_compiler.py [--runs 21] [--variants 2000] [--baseline DIR] [--json FILE] [--check]``
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlc.compiler.cli import dump_yaml
from rlc.compiler.recipe import load_recipe

if __package__:
    from benchmarks._provenance import git_commit, machine
else:  # run as a script (python benchmarks/bench_compiler.py): this folder is first on the path
    from _provenance import git_commit, machine  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "rlc" / "recipes" / "qwen35-397b-grpo-32xh100.yaml"
LINT_GOAL_VALIDATE_RUNS = 15
VALIDATE_GOAL_S = 0.10
COMPILE_GOAL_S = 0.20

#: A hand-rolled recipe tool, for comparison: load with OmegaConf, validate with jsonschema, render with jinja2.
HAND_ROLLED = """
import json, sys
from omegaconf import OmegaConf
import jsonschema, jinja2
data = OmegaConf.to_container(OmegaConf.load(sys.argv[1]), resolve=True)
schema = json.load(open(sys.argv[2]))
errors = list(jsonschema.Draft202012Validator(schema).iter_errors(data))
script = jinja2.Template("#SBATCH --nodes={{ c.nodes }}\\nsrun python -m run {{ name }}\\n").render(
    c=data["cluster"], name=data.get("name", "run"))
sys.exit(1 if errors or not script else 0)
"""
#: Peers: name -> (module that must be importable, ``python -c`` code, its arguments).
PEERS: dict[str, tuple[str, str, list[str]]] = {
    "hand-rolled: OmegaConf + jsonschema + jinja2": ("omegaconf", HAND_ROLLED,
                                                     [str(BASE), str(REPO / "schemas" / "recipe.schema.json")]),
    "import nemo_run (NeMo-Run)": ("nemo_run", "import nemo_run", []),
    "import sky (SkyPilot)": ("sky", "import sky", []),
}


def wall(cmd: list[str], runs: int, cwd: Path, ok: set[int], env: dict[str, str]) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        times.append(time.perf_counter() - start)
        if proc.returncode not in ok:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}")
    return times


def make_variants(base: Path, folder: Path, count: int, seed: int = 0) -> int:
    """Write ``count`` recipes derived from ``base`` as a recipe repository would hold them: half
    full copies with other refit/generation settings (so the planner's fixes and warnings run),
    half ``extends`` children with a few overrides; every tenth has a schema error. Returns the
    number of broken ones."""
    rng = random.Random(seed)
    data = load_recipe(base).data
    broken = 0
    for i in range(count):
        name = f"variant-{i:04d}"
        if i % 2 == 0:
            variant = dict(data, name=name)
            variant["grpo"] = dict(data.get("grpo", {}), max_steps=rng.randint(1, 1000), seed=i)
            variant["refit"] = dict(data["refit"], buffer_memory_ratio=rng.choice([0.3, 0.39, 0.4, 0.45, 0.5]),
                                    sleep_level=rng.choice([1, 2]))
            variant["generation"] = dict(data["generation"], enforce_eager=rng.choice([True, False]))
            variant["parallelism"] = dict(data["parallelism"],
                                          generation=dict(data["parallelism"]["generation"],
                                                          ep=rng.choice([64, 128, 256])))
        else:
            variant = {"version": 1, "extends": str(base.resolve()), "name": name,
                       "training": {"optimizer": {"lr": rng.choice([1e-6, 3e-6, 1e-5])}}}
        if i % 10 == 9:
            variant["grpo"] = {"max_stpes": 10}  # a typo: one schema error
            broken += 1
        text = "# yaml-language-server: $schema=../schemas/recipe.schema.json\n" + dump_yaml(variant)
        (folder / f"{name}.yaml").write_text(text)
    return broken


def _times(values: list[float]) -> dict[str, Any]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "runs": len(values)}


def _env(source: Path, tmp: Path) -> dict[str, str]:
    """``source``'s rlc first on the path, bytecode cached in a temp folder of its own.

    As a user runs it: Python caches bytecode (an installed wheel has it precompiled). This environment
    may set PYTHONDONTWRITEBYTECODE, which makes every run recompile every rlc module; the cache goes to
    a temp folder, not the source tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(source)
    env["PYTHONPYCACHEPREFIX"] = str(tmp / f"pycache-{abs(hash(str(source)))}")
    return env


def measure(sources: list[Path], folder: Path, broken: int, args: argparse.Namespace,
            tmp: Path) -> list[dict[str, Any]]:
    """Wall times of ``validate`` and ``compile`` (base recipe) and ``lint`` (all variants) with each source's rlc.

    The checkouts take turns run by run (the order rotating each run), so a change of the machine's load
    during the measurement weighs on all of them alike instead of on whichever ran last."""
    rlc = [sys.executable, "-m", "rlc"]
    validate = rlc + ["validate", str(BASE)]
    envs = {s: _env(s, tmp) for s in sources}
    bundles = {s: tmp / f"bundles-{abs(hash(str(s)))}" for s in sources}

    def compile_once(s: Path, i: int) -> float:
        return wall(rlc + ["compile", str(BASE), "-o", str(bundles[s] / f"b{i}")], 1, tmp, {0}, envs[s])[0]

    for s in sources:  # warm the OS file cache, write the bytecode
        wall(validate, 1, tmp, {0}, envs[s])
        compile_once(s, args.runs)
    v: dict[Path, list[float]] = {s: [] for s in sources}
    c: dict[Path, list[float]] = {s: [] for s in sources}
    start: dict[Path, list[float]] = {s: [] for s in sources}
    for i in range(args.runs):
        turn = sources[i % len(sources):] + sources[:i % len(sources)]
        for s in turn:
            v[s] += wall(validate, 1, tmp, {0}, envs[s])
            c[s].append(compile_once(s, i))
            start[s] += wall([sys.executable, "-c", "pass"], 1, tmp, {0}, envs[s])
    out = []
    for s in sources:
        lt = wall(rlc + ["lint", str(folder)], args.lint_runs, tmp, {1} if broken else {0}, envs[s])
        out.append({"source": str(s), "commit": git_commit(s),
                    "validate_s": _times(v[s]), "compile_s": _times(c[s]), "lint_s": _times(lt),
                    "python_start_s": min(start[s]), "python_start_median_s": statistics.median(start[s]),
                    "lint_in_validate_runs": statistics.median(lt) / statistics.median(v[s]),
                    "lint_per_recipe_ms": 1e3 * statistics.median(lt) / args.variants})
    return out


def measure_peers(runs: int, tmp: Path) -> list[dict[str, Any]]:
    """Wall times of each installed peer (:data:`PEERS`); the others are listed as not installed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = []
    for name, (module, code, argv) in PEERS.items():
        if importlib.util.find_spec(module) is None:
            out.append({"peer": name, "installed": False})
            continue
        cmd = [sys.executable, "-c", code, *argv]
        wall(cmd, 1, tmp, {0}, env)
        out.append({"peer": name, "installed": True, "seconds": _times(wall(cmd, runs, tmp, {0}, env))})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="runs of validate, compile and each peer")
    parser.add_argument("--lint-runs", type=int, default=3, help="runs of lint (median reported)")
    parser.add_argument("--variants", type=int, default=2000, help="recipes for the lint benchmark")
    parser.add_argument("--baseline", type=Path, action="append", default=[],
                        help="another rlc checkout to measure in the same run (before/after)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--check", action="store_true", help="exit 1 when this checkout misses a goal")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        folder = tmp_path / "recipes"
        folder.mkdir()
        broken = make_variants(BASE, folder, args.variants)
        results = measure([REPO] + [b.resolve() for b in args.baseline], folder, broken, args, tmp_path)
        peers = measure_peers(args.runs, tmp_path)
    info = machine()  # (the load average after the runs)

    goal = LINT_GOAL_VALIDATE_RUNS
    print(f"rlc validate / compile {BASE.name}; rlc lint {args.variants} variants ({broken} broken); goals: "
          f"validate <= {VALIDATE_GOAL_S} s, compile <= {COMPILE_GOAL_S} s (min of {args.runs}), "
          f"lint <= {goal} x validate (medians)")
    print(f"{'rlc checkout':34} {'validate s':>15} {'compile s':>15} {'lint s':>7} {'lint/validate':>13}  status")
    print(f"{'':34} {'min / median':>15} {'min / median':>15}")
    for r in results:
        ok = (r["lint_in_validate_runs"] <= goal and r["validate_s"]["min"] <= VALIDATE_GOAL_S
              and r["compile_s"]["min"] <= COMPILE_GOAL_S)
        r["meets_goal"] = ok
        label = f"{Path(r['source']).name} @ {r['commit']}"
        print(f"{label:34} {r['validate_s']['min']:7.3f} {r['validate_s']['median']:7.3f} "
              f"{r['compile_s']['min']:7.3f} {r['compile_s']['median']:7.3f} {r['lint_s']['median']:7.3f} "
              f"{r['lint_in_validate_runs']:13.1f}  {'ok' if ok else 'SLOW'}")
    for p in peers:
        shown = (f"{p['seconds']['min']:7.3f} {p['seconds']['median']:7.3f}" if p["installed"]
                 else f"{'not installed':>15}")
        print(f"{p['peer'][:34]:34} {shown}   (peer)")
    print(f"({info['cpus']} CPUs {info['cpu']}, load average {info['load_average_1m']}; python {info['python']}; "
          f"runs = {args.runs}/{args.lint_runs}; interpreter start {results[0]['python_start_s']:.3f} s min)")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "compiler", "command": shlex.join([sys.executable, *sys.argv]), "machine": info,
            "goal": {"lint_max_validate_runs": goal, "validate_max_s": VALIDATE_GOAL_S,
                     "compile_max_s": COMPILE_GOAL_S, "startup_statistic": "min",
                     "variants": args.variants, "broken": broken, "base": str(BASE.relative_to(REPO))},
            "results": results, "peers": peers}, indent=2) + "\n")
    return 1 if args.check and not results[0]["meets_goal"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
