"""``rlc calibrate RUN_DIR... --recipe RECIPE -o FILE``: runs' memory records -> a calibration file.

Reads each run folder (:mod:`rlc.compiler.planner.runs`), fits the per-GPU constants
(:mod:`rlc.compiler.planner.fit`; for runs of ``generation.backend: megatron`` the engine's constants,
:mod:`rlc.compiler.planner.mcore_fit`, on top of the recipe's calibration), writes the calibration file
atomically and returns the table of used GiB per phase, measured vs predicted before and after the fit.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import yaml

from rlc.compiler.planner.calibration import Calibration, CalibrationError, calibration_for, load_table
from rlc.compiler.planner import mcore_fit
from rlc.compiler.planner.fit import Fitted, check_runs, compare, comparison_text, fit, to_table
from rlc.compiler.planner.memory import plan_memory
from rlc.compiler.planner.runs import RunMeasurements, read_run

if TYPE_CHECKING:
    from rlc.compiler.api import CheckResult

HEADER = ("# Memory-planner calibration written by `rlc calibrate`; use it with `rlc plan --calibration FILE`\n"
          "# or `cluster.calibration: FILE` in a recipe. Constants marked `rlc calibrate` were fitted from the\n"
          "# runs named in `source`; the others come from the reference entry named in theirs.\n")


def default_id(gpu: str, versions: dict[str, str]) -> str:
    vllm = versions.get("vllm")
    return f"{gpu}-vllm-{vllm}" if vllm else gpu


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder (never half-written)."""
    folder = path.parent if str(path.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot write ({exc.strerror or exc})") from None


def _fit_megatron(runs: Sequence[RunMeasurements], result: CheckResult, base: Calibration,
                  entry_id: str) -> tuple[Calibration, list[Fitted]]:
    """The recipe's calibration (``base``) with the Megatron generation backend's constants fitted to ``runs``
    (runs of that backend); the trainer's constants stay the base's (fit them from a vLLM-backend run)."""
    recipe, facts, gpu = result.recipe, result.facts, result.gpu
    assert recipe is not None and facts is not None and gpu is not None
    check_runs(runs, recipe)
    cal, fitted = mcore_fit.fit_megatron_backend(mcore_fit.MegatronRunMemory.from_runs(runs), recipe, facts, gpu,
                                                 base)
    names = ", ".join(str(r.path) for r in runs)
    sources = dict(base.sources)
    if base.gpu != gpu.name:
        sources = {k: f"not measured on {gpu.name}: from {base.id} ({v})" for k, v in sources.items()}
    for f in fitted:
        sources[f.name] = f"rlc calibrate: {names}"
    return dataclasses.replace(cal, id=entry_id, gpu=gpu.name, versions=runs[0].versions,
                               source=f"{base.source}; the Megatron generation backend's constants: rlc calibrate "
                                      f"from {names} ({recipe.name})",
                               sources=sources, fallback_note=None), fitted


def calibrate(run_dirs: Sequence[str], result: CheckResult, output: Path, entry_id: Optional[str] = None) -> str:
    """Fit from ``run_dirs`` for the checked recipe ``result`` (with model facts and a GPU); write
    ``output``; return the report."""
    recipe, facts, gpu = result.recipe, result.facts, result.gpu
    if recipe is None or facts is None or gpu is None:
        raise CalibrationError("the recipe must pass the schema and name a known model and GPU to calibrate")
    runs = [read_run(d) for d in run_dirs]
    base = calibration_for(gpu.name, table=result.calibration or None)
    entry_id = entry_id or default_id(gpu.name, runs[0].versions)
    before = plan_memory(recipe, facts, gpu, calibration=result.calibration or None)
    if recipe.generation.backend == "megatron":
        fitted_cal, fitted = _fit_megatron(runs, result, base, entry_id)
        after = plan_memory(recipe, facts, gpu, calibration=[fitted_cal])
        comparison = mcore_fit.compare(before, after, mcore_fit.MegatronRunMemory.from_runs(runs))
        table = to_table(fitted_cal, fitted, comparison, {k: v for k, (_, v) in mcore_fit.COMPARED.items()})
    else:
        fitted_cal, fitted = fit(runs, recipe, facts, gpu, base, entry_id)
        after = plan_memory(recipe, facts, gpu, calibration=[fitted_cal])
        comparison = compare(before, after, runs)
        table = to_table(fitted_cal, fitted, comparison)
    write_atomically(output, HEADER + yaml.safe_dump(table, sort_keys=False, allow_unicode=True, width=110))
    load_table.cache_clear()
    load_table(str(output))  # what was written reads back
    lines = [f"runs: {', '.join(str(r.path) for r in runs)} ({gpu.name}; "
             + ", ".join(f"{k} {v}" for k, v in sorted(runs[0].versions.items())) + ")", "",
             "fitted constants (GiB):"]
    lines += [f"  {f.name:<29} {f.value:8.3f}   = {f.derived}" for f in fitted]
    lines += ["", "used GiB per phase (rank 0's GPU), measured vs predicted:"]
    text = "\n".join(lines) + "\n" + comparison_text(comparison, before.calibration_id, fitted_cal.id)
    return text + f"\nwrote {output}; use it with: rlc plan RECIPE --calibration {output}\n"
