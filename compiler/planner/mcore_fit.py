"""Fit the two constants of ``generation.backend: megatron``'s plan from the memory a run of that backend measured.

The trainer's own constants (``megatron_context_gib``, ``megatron_refit_residual_gib``) come from a vLLM-backend run
(``fit.py``); what megatron-core's engine adds is measured on a Megatron-backend run, with the planner's own
accounting for everything else (``mcore_memory.py``). Each constant comes from one moment of the run, the
largest value over its steps (a plan must not fall below any step):

==================================  ===========================================================================
constant                            measured moment (device used GiB, rank 0's GPU, max over steps)
==================================  ===========================================================================
``megatron_engine_context_gib``     ``memory/refit_offload``: the trainer offloaded, the engine suspended, the
                                    dedicated weights freed; minus the planner's suspended state without it
``megatron_train_workspace_gib``    ``memory/train`` (the allocator still holds the step's blocks) minus the
                                    planner's train phase without it, its activation and logits estimates taken
                                    at the run's micro batch: rows padded to the longest sequence the recipe
                                    allows (``data.max_prompt_length`` + ``generation.sampling.max_tokens``)
==================================  ===========================================================================

The fitted values are rounded up to 0.0001 GiB, so the plan of the fitted run is never below what it measured.
The other phases (``generate``, ``logprobs``, ``after_wake``) are not used: they are what the fit is checked
against. A run's measurements come from its log folder (``rlc calibrate``) or from the record of
``tests/gpu/test_mcore_generation.py`` (``MegatronRunMemory.from_record``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from rlc.compiler.files import JsonError, parse_json, read_text_capped
from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.calibration import Calibration, CalibrationError
from rlc.compiler.planner.fit import Fitted, PhaseComparison
from rlc.compiler.planner.layout import train_layout
from rlc.compiler.planner.mcore_memory import plan_megatron_generation, suspended_items
from rlc.compiler.planner.parts import DTYPE_BYTES, _stage_figures
from rlc.compiler.planner.passes import (LOSS_LOGITS_LABEL, loss_logits_bytes, train_activations,
                                         train_microbatch_tokens)
from rlc.compiler.planner.plan import GIB
from rlc.compiler.planner.residency import residency
from rlc.compiler.planner.runs import RunMeasurements
from rlc.compiler.planner.shards import megatron_stage_shards
from rlc.compiler.planner.vllm_sleep import planned_vllm_version, sleep_semantics
from rlc.compiler.recipe_types import Recipe
from rlc.contract.sequence_packing import padded_row_multiple, round_up

#: Constants fitted here, in the order they are fitted (the second needs the first).
FITTED = ("megatron_engine_context_gib", "megatron_train_workspace_gib")
SUSPENDED_PHASE = "refit_offload"
TRAIN_PHASE = "train"
#: A record of ``tests/gpu/test_mcore_generation.py`` (read with a cap like every record file).
RECORD_BYTES = 1 << 24


@dataclass(frozen=True)
class MegatronRunMemory:
    """What a Megatron-backend run measured: device used GiB per step phase, the largest over its steps."""

    source: str  # where the numbers were read
    max_used_gib: Mapping[str, float]
    steps: Optional[int] = None

    def at(self, phase: str) -> float:
        if phase not in self.max_used_gib:
            raise CalibrationError(f"{self.source}: no memory/{phase}/used_gib measured; the fit needs it (a run of "
                                   "generation.backend: megatron records it every step)")
        return float(self.max_used_gib[phase])

    @classmethod
    def from_runs(cls, runs: Sequence[RunMeasurements]) -> MegatronRunMemory:
        """The largest value of each step phase over the steps of ``runs`` (their log folders)."""
        phases: dict[str, float] = {}
        for run in runs:
            for phase, values in run.step_used_gib.items():
                phases[phase] = max([phases.get(phase, 0.0), *values])
        steps = max((len(v) for r in runs for v in r.step_used_gib.values()), default=0)
        return cls(", ".join(str(r.path) for r in runs), phases, steps)

    @classmethod
    def from_record(cls, path: str | Path) -> MegatronRunMemory:
        """The maxima in a record of ``tests/gpu/test_mcore_generation.py`` (``memory.measured.<phase>.max``)."""
        try:
            record = parse_json(read_text_capped(path, RECORD_BYTES))
        except (OSError, UnicodeDecodeError, JsonError) as exc:
            raise CalibrationError(f"{path}: cannot read the GPU check's record ({exc})") from None
        measured = record.get("memory", {}).get("measured") if isinstance(record, dict) else None
        if not isinstance(measured, dict) or not measured:
            raise CalibrationError(f"{path}: no memory.measured in the record (a tests/gpu/test_mcore_generation.py "
                                   "record of a finished run has it)")
        return cls(str(path), {phase: float(v["max"]) for phase, v in measured.items()}, record.get("steps"))


def _ceil4(x: float) -> float:
    """Rounded up to 0.0001 GiB (the table keeps four decimals): the plan never falls below the fitting point."""
    return math.ceil(round(x * 1e4, 6)) / 1e4


def suspended_gib(recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration) -> Optional[float]:
    """The planner's GPU with the engine suspended and the trainer as the refit leaves it, on its fullest
    pipeline stage (``mcore_memory.suspended_items``); None when the model facts do not give the shards."""
    tl = train_layout(recipe)
    shards = megatron_stage_shards(facts, tl)
    if shards is None:
        return None
    bpp = DTYPE_BYTES[recipe.model.dtype]
    table = residency(recipe, sleep_semantics(planned_vllm_version(recipe, cal.versions)), cal)
    totals = [sum(i.gib or 0.0 for i in suspended_items(recipe, facts, gpu, cal, _stage_figures(s, tl, recipe, bpp),
                                                        table))
              for s in shards]
    return max(totals)


def run_microbatch_tokens(recipe: Recipe) -> tuple[int, str]:
    """Tokens of one train micro batch as the run had them: packed, the recipe's budget; padded,
    ``micro_batch_size`` rows of the longest sequence the recipe allows (a prompt of at most
    ``data.max_prompt_length`` tokens and ``generation.sampling.max_tokens`` sampled, at most
    ``max_sequence_length``) rounded up to the padding multiple."""
    tl = train_layout(recipe)
    if recipe.training.sequence_packing.enabled:
        return train_microbatch_tokens(recipe, tl)
    row = round_up(recipe.longest_sequence, padded_row_multiple(tl.tp, tl.cp))
    rows = recipe.training.micro_batch_size
    return rows * row, f"{rows} × {row} tokens"


def train_at_run_tokens(recipe: Recipe, facts: ModelFacts, gpu: Any, cal: Calibration) -> tuple[float, str]:
    """The planner's train phase (GiB) with its activation and logits estimates taken at the run's micro batch
    (:func:`run_microbatch_tokens`) instead of the planned one, and how the micro batch was counted."""
    plan = plan_megatron_generation(recipe, facts, gpu, cal)
    phase = plan.phases.get("train")
    if phase is None or phase.used_gib is None:
        raise CalibrationError("the planner cannot compute the train phase for this recipe (unknown model facts)")
    tl = train_layout(recipe)
    planned, _ = train_microbatch_tokens(recipe, tl)
    run, how = run_microbatch_tokens(recipe)
    fig = next(f for f in plan.stages if f["stage"] == phase.stage)
    at_plan = train_activations(recipe, facts, tl, fig["stage"], fig["mtp_blocks"])
    at_run = train_activations(recipe, facts, tl, fig["stage"], fig["mtp_blocks"], (run, how))
    delta = (at_run.bytes - at_plan.bytes) if at_plan is not None and at_run is not None else 0
    if any(i.label == LOSS_LOGITS_LABEL for i in phase.items):
        at_plan_logits = loss_logits_bytes(recipe, facts, tl, fig["mtp_blocks"], planned) or 0
        delta += (loss_logits_bytes(recipe, facts, tl, fig["mtp_blocks"], run) or 0) - at_plan_logits
    return phase.used_gib + delta / GIB, how


def fit_megatron_backend(run: MegatronRunMemory, recipe: Recipe, facts: ModelFacts, gpu: Any,
                         base: Calibration) -> tuple[Calibration, list[Fitted]]:
    """``base`` with :data:`FITTED` replaced by their fit to ``run`` (a run of ``recipe`` on ``gpu``)."""
    if recipe.generation.backend != "megatron":
        raise CalibrationError("the Megatron-backend constants are fitted on a run with generation.backend: megatron "
                               "(give the recipe the run was compiled from)")
    zero = dataclasses.replace(base, megatron_engine_context_gib=0.0, megatron_train_workspace_gib=0.0)
    without = suspended_gib(recipe, facts, gpu, zero)
    if without is None:
        raise CalibrationError("the planner cannot compute the suspended state for this recipe (unknown model facts)")
    suspended = run.at(SUSPENDED_PHASE)
    engine = _ceil4(suspended - without)
    if engine < 0:
        raise CalibrationError(f"{run.source}: {SUSPENDED_PHASE} {suspended:.3f} GiB is below the planner's trainer "
                               f"alone ({without:.3f} GiB): refit the trainer's constants on this stack first")
    cal = dataclasses.replace(zero, megatron_engine_context_gib=engine)
    fitted = [Fitted(FITTED[0], engine, f"{SUSPENDED_PHASE} {suspended:.4f} (max over steps) - planner's suspended "
                                        f"state without it {without:.4f}")]
    train = run.at(TRAIN_PHASE)
    planned, how = train_at_run_tokens(recipe, facts, gpu, cal)
    workspace = _ceil4(max(0.0, train - planned))
    cal = dataclasses.replace(cal, megatron_train_workspace_gib=workspace)
    fitted.append(Fitted(FITTED[1], workspace, f"{TRAIN_PHASE} {train:.4f} (max over steps) - planner's train phase "
                                               f"without it at the run's micro batch ({how}) {planned:.4f}"))
    return cal, fitted


#: Plan phase -> the step phase it is compared with (the largest value over the steps), and how it was measured.
COMPARED = {
    "train": ("train", "memory/train/used_gib, max over steps"),
    "logprob": ("logprobs", "memory/logprobs/used_gib, max over steps"),
    "generate": ("generate", "memory/generate/used_gib, max over steps"),
    "refit": ("refit_offload", "memory/refit_offload/used_gib, max over steps (before the swap allocates the "
                               "inference weights)"),
}


def compare(before: Any, after: Any, run: MegatronRunMemory) -> list[PhaseComparison]:
    """Planned (before and after the fit) vs measured GiB per :data:`COMPARED` phase the plan has."""
    return [PhaseComparison(plan_phase, run.max_used_gib.get(step_phase), before.phase_used_gib(plan_phase),
                            after.phase_used_gib(plan_phase))
            for plan_phase, (step_phase, _) in COMPARED.items() if plan_phase in after.phases]


__all__ = ["COMPARED", "FITTED", "MegatronRunMemory", "compare", "fit_megatron_backend", "run_microbatch_tokens",
           "suspended_gib", "train_at_run_tokens"]
