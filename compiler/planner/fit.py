"""Fit the planner's per-GPU constants from the memory a real run measured (``rlc calibrate``).

Only constants that are facts of a GPU and a software stack are fitted; parameter bytes, the vLLM
pool (``gpu_memory_utilization × capacity``) and the refit buffer stay first-principles, so the
fitted entry predicts other recipes on the same stack. Each constant comes from one moment of the
run where it is the only unknown, using the planner's own accounting for everything else:

=============================  =================================================================
constant                       measured moment (device used GiB, rank 0's GPU)
=============================  =================================================================
``vllm_base_gib``              vLLM asleep: ``vllm_started`` − what ``sleep`` freed, minus the
                               planner's other asleep items (weights kept by the sleep level,
                               CUDA graphs with ``enforce_eager`` off)
``vllm_cuda_graph_gib``        the same moment, for runs with ``enforce_eager`` off (the base
                               then comes from the reference entry)
``vllm_awake_extra_gib``       ``vllm_started`` (only vLLM on the GPU) − pool − CUDA graphs
``megatron_context_gib``       ``policy_started`` − the trainer's torch reserve − vLLM asleep −
                               the trainer's NCCL NVLS buffers (first principles, ``nccl.py``)
``megatron_refit_residual_gib``  ``refit_free`` after step 1 − the planner's refit phase without it
=============================  =================================================================

The train and generate phases are not used to fit anything: they are what the fitted entry is
checked against (:func:`compare`).
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.calibration import Calibration, CalibrationError
from rlc.compiler.planner.memory import _core_plan, nvls_items, vllm_asleep_items, vllm_weights
from rlc.compiler.planner.plan import MemoryPlan
from rlc.compiler.planner.runs import RunMeasurements
from rlc.compiler.recipe_types import Recipe
from rlc.contract.refit_buffer import kv_cache_kept_awake

#: Phases compared before and after the fit, with the measurement each is compared to.
COMPARED = {
    "train": "memory/train/used_gib, median over steps",
    "generate": "memory/generate/used_gib, median over steps",
    "refit": "refit_free records after step 1, median",
}


@dataclass(frozen=True)
class Fitted:
    """One fitted constant: its value and the arithmetic that gave it."""

    name: str
    value: float
    derived: str


@dataclass(frozen=True)
class PhaseComparison:
    phase: str
    measured: Optional[float]
    before: Optional[float]
    after: Optional[float]

    @staticmethod
    def error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
        if predicted is None or not measured:
            return None
        return (predicted - measured) / measured


def _median(values: Sequence[float], what: str) -> float:
    if not values:
        raise CalibrationError(f"the runs have no {what}; cannot fit without it")
    return statistics.median(values)


def _per_run(runs: Sequence[RunMeasurements], get: Callable[[RunMeasurements], Optional[float]],
             what: str) -> float:
    return _median([v for v in (get(r) for r in runs) if v is not None], what)


def check_runs(runs: Sequence[RunMeasurements], recipe: Recipe) -> None:
    """The runs were made on the recipe's GPU, with its sleep level, weights-awake and eager settings, on one
    stack."""
    gpu = recipe.cluster.gpu
    level, eager, awake = recipe.refit.sleep_level, recipe.generation.enforce_eager, recipe.refit.keep_weights_awake
    versions = runs[0].versions
    for run in runs:
        if run.gpu_type != gpu:
            raise CalibrationError(f"{run.path}: measured on {run.gpu_type}, the recipe plans for {gpu} "
                                   "(calibrate each GPU type separately)")
        if run.versions != versions:
            diff = sorted(k for k in run.versions.keys() | versions.keys() if run.versions.get(k) != versions.get(k))
            raise CalibrationError(f"{run.path}: other library versions than {runs[0].path} ({', '.join(diff)}); "
                                   "a calibration is for one software stack")
        for rec in run.records:
            if rec.sleep_level and rec.sleep_level != level:
                raise CalibrationError(f"{run.path}: recorded with sleep_level {rec.sleep_level}, the recipe has "
                                       f"refit.sleep_level {level}; give the recipe the runs were compiled from")
            if rec.weights_awake != awake:
                raise CalibrationError(f"{run.path}: recorded with refit.keep_weights_awake {rec.weights_awake}, the "
                                       f"recipe has {awake} (vLLM's weights in the after-sleep memory or not); give "
                                       "the recipe the runs were compiled from")
            kv_awake = kv_cache_kept_awake(recipe.refit)
            if rec.kv_cache_awake != kv_awake:
                raise CalibrationError(f"{run.path}: recorded with refit.keep_kv_cache_awake {rec.kv_cache_awake}, "
                                       f"the recipe has {kv_awake} (vLLM's KV cache in the after-sleep memory or "
                                       "not); give the recipe the runs were compiled from")
            if rec.enforce_eager != eager:
                raise CalibrationError(f"{run.path}: recorded with enforce_eager {rec.enforce_eager}, the recipe has "
                                       f"generation.enforce_eager {eager}; give the recipe the runs were compiled from")


def _vllm_started(run: RunMeasurements) -> Optional[float]:
    started = run.first("vllm_started")
    return None if started is None else started.used_gib


def _vllm_asleep(run: RunMeasurements) -> Optional[float]:
    started = run.first("vllm_started")
    if started is None or not run.sleep_freed_gib:
        return None
    return started.used_gib - statistics.median(run.sleep_freed_gib)


def _context(run: RunMeasurements) -> Optional[float]:
    policy, asleep = run.first("policy_started"), _vllm_asleep(run)
    if policy is None or policy.torch_reserved_gib is None or asleep is None:
        return None
    return policy.used_gib - policy.torch_reserved_gib - asleep


def fit(runs: Sequence[RunMeasurements], recipe: Recipe, facts: ModelFacts, gpu: Any,
        base: Calibration, entry_id: str) -> tuple[Calibration, list[Fitted]]:
    """A calibration entry for ``gpu`` and the runs' versions: ``base`` with the fitted constants replaced."""
    if not runs:
        raise CalibrationError("no runs given")
    check_runs(runs, recipe)
    eager = recipe.generation.enforce_eager
    limit = float(gpu.memory_gib)
    pool = float(recipe.generation.gpu_memory_utilization) * limit
    fitted: list[Fitted] = []

    asleep = _per_run(runs, _vllm_asleep, "vllm_started record and memory/sleep_freed_gib metric")
    started = _per_run(runs, _vllm_started, "vllm_started record")
    freed = started - asleep
    weights, _ = vllm_weights(recipe, facts)
    others = sum(i.gib or 0.0 for i in vllm_asleep_items(recipe, facts, weights, base, gpu)
                 if i.source != "calibration:vllm_base_gib")
    cal = base
    if eager:
        value = asleep - others
        cal = dataclasses.replace(cal, vllm_base_gib=value)
        fitted.append(
            Fitted(
                "vllm_base_gib",
                value,
                f"vllm_started {started:.3f} - sleep freed {freed:.3f} - weights kept asleep {others:.3f}",
            )
        )
        graphs = 0.0
    else:
        value = asleep - others + base.vllm_cuda_graph_gib - base.vllm_base_gib
        cal = dataclasses.replace(cal, vllm_cuda_graph_gib=value)
        graphs = value
        fitted.append(Fitted("vllm_cuda_graph_gib", value,
                             f"vllm_started {started:.3f} - sleep freed {freed:.3f} - weights kept asleep "
                             f"{others - base.vllm_cuda_graph_gib:.3f} - vllm_base_gib {base.vllm_base_gib:.3f} "
                             f"(from {base.id})"))
    extra = started - pool - graphs
    cal = dataclasses.replace(cal, vllm_awake_extra_gib=extra)
    fitted.append(Fitted("vllm_awake_extra_gib", extra,
                         f"vllm_started {started:.3f} - pool {pool:.3f} (gpu_memory_utilization x {limit:g})"
                         + (f" - CUDA graphs {graphs:.3f}" if graphs else "")))

    trainer_nvls = sum(i.gib or 0.0 for i in nvls_items(recipe, facts, gpu)[0])
    context = _per_run(runs, _context, "policy_started record with torch_reserved_gib") - trainer_nvls
    cal = dataclasses.replace(cal, megatron_context_gib=context)
    policy = runs[0].first("policy_started")
    assert policy is not None and policy.torch_reserved_gib is not None
    fitted.append(Fitted("megatron_context_gib", context,
                         f"policy_started {policy.used_gib:.3f} - trainer torch reserved "
                         f"{policy.torch_reserved_gib:.3f} - vLLM asleep {asleep:.3f}"
                         + (f" - trainer NCCL NVLS buffers {trainer_nvls:.3f}" if trainer_nvls else "")))

    refit_used = _per_run(runs, lambda r: statistics.median(r.used("refit_free", min_step=1))
                          if r.used("refit_free", min_step=1) else None, "refit_free record after step 1")
    without = _refit_used(recipe, facts, gpu, dataclasses.replace(cal, megatron_refit_residual_gib=0.0))
    if without is None:
        raise CalibrationError("the planner cannot compute the refit phase for this recipe (unknown model facts)")
    residual = refit_used - without
    cal = dataclasses.replace(cal, megatron_refit_residual_gib=residual)
    fitted.append(Fitted("megatron_refit_residual_gib", residual,
                         f"refit_free {refit_used:.3f} - planner's refit phase without it {without:.3f}"))

    run_names = ", ".join(str(r.path) for r in runs)
    sources = dict(base.sources)
    meanings = dict(base.meanings)
    if base.gpu != gpu.name:
        for name in sources:
            sources[name] = f"not measured on {gpu.name}: from {base.id} ({base.sources.get(name, '')})"
    for f in fitted:
        sources[f.name] = f"rlc calibrate: {run_names}"
    cal = dataclasses.replace(cal, id=entry_id, gpu=gpu.name, versions=runs[0].versions,
                              source=f"rlc calibrate from {run_names} ({recipe.name})",
                              sources=sources, meanings=meanings, fallback_note=None,
                              reference={"recipe": recipe.name, "model": facts.model_id},
                              measured={})
    return cal, fitted


def _refit_used(recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration) -> Optional[float]:
    return _core_plan(recipe, facts, gpu, cal).phase_used_gib("refit")


def measured_phases(runs: Sequence[RunMeasurements]) -> dict[str, Optional[float]]:
    """What the runs measured for each :data:`COMPARED` phase (median over runs)."""
    def med(values: list[float]) -> Optional[float]:
        return statistics.median(values) if values else None

    return {
        "train": med([v for v in (r.step_median("train") for r in runs) if v is not None]),
        "generate": med([v for v in (r.step_median("generate") for r in runs) if v is not None]),
        "refit": med([statistics.median(r.used("refit_free", min_step=1)) for r in runs
                      if r.used("refit_free", min_step=1)]),
    }


def compare(before: MemoryPlan, after: MemoryPlan, runs: Sequence[RunMeasurements]) -> list[PhaseComparison]:
    """Predicted (before and after the fit) vs measured used GiB per compared phase."""
    measured = measured_phases(runs)
    return [PhaseComparison(p, measured[p], before.phase_used_gib(p), after.phase_used_gib(p)) for p in COMPARED]


def to_table(cal: Calibration, fitted: Sequence[Fitted], comparison: Sequence[PhaseComparison],
             measured_as: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The calibration file (``format: 1``, one entry) that :func:`load_table` reads. ``measured_as``: what each
    compared phase was measured as (:data:`COMPARED` by default). The arithmetic of constants measured on this
    GPU and kept from the base entry is kept too."""
    measured_as = COMPARED if measured_as is None else measured_as
    kept = {k: v for k, v in cal.derivations.items() if not cal.sources.get(k, "").startswith("not measured on")}
    derived = {**kept, **{f.name: f.derived for f in fitted}}
    constants: dict[str, Any] = {}
    for field in dataclasses.fields(Calibration):
        name = field.name
        if name not in cal.sources and name not in derived:
            continue
        value: Any = getattr(cal, name)
        if name == "fragmentation_points":
            value = [{"headroom": x, "gib": y} for x, y in value]
        elif isinstance(value, float):
            value = round(value, 4)
        constants[name] = {"value": value, "what": cal.meanings.get(name, ""), "source": cal.sources.get(name, "")}
        if name in derived:
            constants[name]["derived"] = derived[name]
    return {
        "format": 1,
        "entries": [{
            "id": cal.id,
            "gpu": cal.gpu,
            "versions": dict(cal.versions),
            "source": cal.source,
            "reference": dict(cal.reference),
            "constants": constants,
            "check": {c.phase: {"measured_used_gib": _round(c.measured), "predicted_before_gib": _round(c.before),
                                "predicted_after_gib": _round(c.after), "measured_as": measured_as[c.phase]}
                      for c in comparison},
        }],
    }


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 3)


def gib_text(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.2f}"


def comparison_text(comparison: Sequence[PhaseComparison], before_id: str, after_id: str) -> str:
    """The table ``rlc calibrate`` prints: used GiB per phase, measured vs predicted before/after."""
    def pct(x: Optional[float]) -> str:
        return "" if x is None else f" ({x:+.1%})"

    rows = [f"{'phase':<10} {'measured':>9}   {'before: ' + before_id:<34} after: {after_id}"]
    for c in comparison:
        before = gib_text(c.before) + pct(PhaseComparison.error(c.before, c.measured))
        after = gib_text(c.after) + pct(PhaseComparison.error(c.after, c.measured))
        rows.append(f"{c.phase:<10} {gib_text(c.measured):>9}   {before:<34} {after}")
    return "\n".join(rows) + "\n"


__all__ = ["COMPARED", "Fitted", "PhaseComparison", "check_runs", "compare", "comparison_text", "fit",
           "measured_phases", "to_table"]
