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
    GPU (direct mode, no data-parallel coordinator), on the trainer's model or on a dedicated inference model
    resharded from a trainer with tensor and expert parallelism (see :func:`reshard_gaps`)."""
    gaps = reshard_gaps(recipe)
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


def reshard_gaps(recipe: Recipe) -> list[Gap]:
    """The inference layouts the bundled runtime's Megatron engine cannot run yet. It runs one engine per GPU, so
    the inference model has one GPU per replica (``parallelism.generation`` tp, pp and ep 1); a trainer with tensor
    or expert parallelism is resharded into it every step by a dedicated inference model (megatron-core's
    ``swap_model_weights``, NeMo-RL PR #3490). Pipeline and context parallelism in the trainer stay refused:
    pipeline-stage remapping (with the MTP layer's embedding replica on the last stage) and the swap out of a
    context-parallel trainer are not built here; so does expert tensor parallelism (megatron-core's expert
    tensors carry no stride for their gated halves)."""
    t, g = recipe.parallelism.train, recipe.parallelism.generation
    gaps = []
    if g.tp * g.pp * g.ep > 1:
        gaps.append(Gap("parallelism.generation",
                        f"Megatron inference with model parallelism (TP{g.tp} PP{g.pp} EP{g.ep}): the bundled "
                        "runtime runs one engine per GPU, without megatron-core's data-parallel inference "
                        "coordinator that model-parallel engines need",
                        hint="parallelism.generation: {tp: 1, pp: 1, ep: 1} (one inference replica per GPU; a "
                             "trainer with TP or EP is resharded into it every step), or generation.backend: vllm"))
    if t.pp > 1:
        gaps.append(Gap("parallelism.train.pp",
                        f"Megatron inference next to a pipeline-parallel trainer (PP{t.pp}): resharding pipeline "
                        "stages into the one-stage inference model (and the MTP layer's embedding replica on the "
                        "last stage) is not built in the bundled runtime",
                        hint="parallelism.train.pp: 1 (tensor or expert parallelism instead), or "
                             "generation.backend: vllm"))
    if t.etp > 1:
        gaps.append(Gap("parallelism.train.etp",
                        f"Megatron inference next to a trainer with expert tensor parallelism (ETP{t.etp}): on the "
                        "trainer's model the engine would split experts over GPUs, and a reshard into ETP 1 is "
                        "wrong in megatron-core 0.19, which marks a grouped-GEMM expert's gated linear_fc1 as a "
                        "plain split (partition_stride 1) and would lay the ranks' gate and up rows end to end",
                        hint="parallelism.train.etp: 1 (expert parallelism instead), or generation.backend: vllm"))
    if t.cp > 1:
        gaps.append(Gap("parallelism.train.cp",
                        f"Megatron inference next to a context-parallel trainer (CP{t.cp}): the swap into the "
                        "inference model's CP 1 is not built in the bundled runtime",
                        hint="parallelism.train.cp: 1, or generation.backend: vllm"))
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


__all__ = ["Gap", "megatron_gaps", "reshard_gaps", "runtime_gaps"]
