"""What the bundled runtime can run, and which engine options it sets itself.

One source of truth for two things the compiler checks before writing a bundle:

* the options the runtime sets itself live in :mod:`rlc.contract.engine_options` (shared with the
  runtime's own guard);
* :func:`runtime_gaps`: recipe settings the schema can express (so a configuration that ran
  elsewhere validates and plans) but this runtime cannot execute yet. ``rlc validate`` warns about
  them (RLC311); ``rlc compile`` refuses to write a bundle that would run something else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlc.compiler.mcore_generation import layout_differences
from rlc.compiler.schema import default_at

if TYPE_CHECKING:
    from rlc.compiler.recipe_types import Recipe


@dataclass(frozen=True)
class Gap:
    """A recipe setting the bundled runtime cannot execute yet."""

    key: str
    message: str
    hint: str | None = None  # the fix, where setting ``key`` back to its default (:attr:`fix`) is not it

    @property
    def fix(self) -> str:
        """The setting that lifts the gap, as a recipe line: the key at its schema default, which the
        runtime always runs (``generation.precision: auto``, never an ``off`` the schema rejects)."""
        try:
            value = default_at(self.key)
        except KeyError:  # a key without a default: the message says what the runtime needs instead
            return f"{self.key}: (a value the bundled runtime runs, see above)"
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        return f"{self.key}: {text}"


def runtime_gaps(recipe: Recipe) -> list[Gap]:
    """Settings of ``recipe`` that this runtime cannot run yet."""
    gaps = []
    training = recipe.training
    if recipe.parallelism.train.cp > 1 and not training.sequence_packing.enabled:
        gaps.append(Gap("parallelism.train.cp",
                        "the bundled runtime splits sequences over context-parallel ranks only in packed micro "
                        "batches (NeMo-RL's Megatron trainer requires packing with context parallelism too)",
                        hint="set training.sequence_packing.enabled: true (or parallelism.train.cp: 1)"))
    gaps.extend(_router_replay_gaps(recipe))
    if recipe.generation.backend == "megatron":
        gaps.extend(megatron_gaps(recipe))
    return gaps


def megatron_gaps(recipe: Recipe) -> list[Gap]:
    """What of ``generation.backend: megatron`` the bundled runtime cannot run yet: it runs one eager engine per
    GPU (direct mode, no data-parallel coordinator) on the trainer's layout."""
    gaps = []
    t = recipe.parallelism.train
    if t.tp * t.pp * t.ep * t.cp > 1:
        gaps.append(Gap("parallelism.train",
                        f"Megatron inference with model parallelism (TP{t.tp} PP{t.pp} EP{t.ep} CP{t.cp}): the bundled "
                        "runtime runs one engine per GPU (data parallelism only); model-parallel engines need "
                        "megatron-core's data-parallel inference coordinator",
                        hint="parallelism.train tp, pp, ep and cp 1 (or generation.backend: vllm)"))
    elif layout_differences(recipe):
        gaps.append(Gap("parallelism.generation",
                        "resharding into an inference layout other than the trainer's ("
                        + "; ".join(layout_differences(recipe)) + ")",
                        hint="parallelism.generation equal to parallelism.train"))
    if not recipe.generation.enforce_eager:
        gaps.append(Gap("generation.enforce_eager", "CUDA graphs in the Megatron engine (the bundled runtime runs it "
                        "eager; the graphs would have to be chosen when the model is built)",
                        hint="generation.enforce_eager: true"))
    if recipe.generation.speculative_decoding is not None:
        gaps.append(Gap("generation.speculative_decoding", "MTP speculative decoding in the Megatron engine"))
    if recipe.generation.sampling.min_p > 0:
        gaps.append(Gap("generation.sampling.min_p", "min-p sampling in the Megatron engine (megatron-core's sampler "
                        "has temperature, top-k and top-p only)"))
    if recipe.training.fp8.enabled:
        gaps.append(Gap("training.fp8.enabled", "FP8 models in the Megatron engine (megatron-core converts them for "
                        "inference in place, which the shared training model cannot take)"))
    if recipe.training.router_replay.enabled:
        gaps.append(Gap("training.router_replay.enabled", "routing replay with the Megatron engine (the runtime "
                        "replays the routes vLLM records; it does not collect the Megatron engine's)"))
    return gaps


def _router_replay_gaps(recipe: Recipe) -> list[Gap]:
    """Layouts where the bundled runtime cannot lay vLLM's routes onto the trainer's tokens yet."""
    if not recipe.training.router_replay.enabled:
        return []
    key, train = "training.router_replay.enabled", recipe.parallelism.train
    gaps = []
    if train.vpp > 1:
        gaps.append(Gap(key, "routing replay with parallelism.train.vpp > 1: the interleaved schedule's recompute "
                             "order is not verified with the replay in the bundled runtime"))
    return gaps


__all__ = ["Gap", "runtime_gaps"]
