"""Typed recipe + rule decisions → the resolved ``runtime.yaml`` contents.

The runtime reads only this (``rlc.contract.runtime_config``), so every default is explicit,
derived sizes are computed here, and each ``auto`` refit switch is replaced by the rule decision
that settled it, with the reason kept in ``refit.decisions``.
"""
from __future__ import annotations

import dataclasses
import os
import posixpath
import typing
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from rlc import RUNTIME_CONFIG_VERSION
from rlc.contract.runtime_config import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    GenerationConfig,
    GenerationParallelConfig,
    GrpoConfig,
    LoggingConfig,
    LossConfig,
    MegatronGenerationConfig,
    ModelConfig,
    RefitConfig,
    RewardConfig,
    RuntimeConfig,
    RuntimeConfigError,
    SequencePackingConfig,
    TrainingConfig,
    TrainParallelConfig,
    runtime_config_to_dict,
    section_from_dict,
)
from rlc.contract.typed_fields import field_types

from rlc.compiler.planner.layout import generation_layout, train_layout
from rlc.compiler.recipe_types import Recipe, RefitSection

if TYPE_CHECKING:
    from rlc.compiler.api import CheckResult

T = TypeVar("T")

# Refit switches the rules decide when the recipe says ``auto`` (recipe key -> runtime key).
AUTO_SWITCHES = ("sync_params_before_refit", "dedupe_mtp_embedding", "per_rank_ipc_metadata")


class ResolveError(ValueError):
    """The recipe cannot be turned into a runtime config (should have been a rule error)."""


def _switch(refit: RefitSection, key: str, decisions: dict[str, tuple[Any, str]]) -> tuple[bool, str]:
    value = getattr(refit, key)
    decided = decisions.get(f"refit.{key}")
    if value == "on":
        return True, "set in recipe"
    if value == "off":
        return False, "set in recipe"
    if decided is None:
        raise ResolveError(f"refit.{key}: 'auto' was not decided by any rule")
    flag, reason = decided
    return bool(flag), reason


def _fp32_params(refit: RefitSection, decisions: dict[str, tuple[Any, str]]) -> tuple[list[str], str]:
    if refit.fp32_params != "auto":
        return list(refit.fp32_params), "set in recipe"
    decided = decisions.get("refit.fp32_params")
    if decided is None:
        return [], "auto: model has no known fp32 parameters"
    patterns, reason = decided
    return list(patterns), reason


def _fp8_scales(recipe: Recipe, decisions: dict[str, tuple[Any, str]]) -> tuple[str, str]:
    """``generation.fp8.scales`` for the runtime: the recipe's, or the one RLC330 decided for ``auto``
    (``block`` for bf16 rollouts, where nothing reads it)."""
    scales = recipe.generation.fp8.scales
    if scales != "auto":
        return scales, "set in recipe"
    decided = decisions.get("generation.fp8.scales")
    if decided is None:
        if recipe.generation.precision == "fp8":
            raise ResolveError("generation.fp8.scales: 'auto' was not decided by any rule")
        return "block", "not used: bf16 rollouts"
    value, reason = decided
    return str(value), reason


def _plain(value: Any) -> Any:
    """A typed-recipe value as runtime-config data: tuples as lists, mappings copied."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _section_type(tp: Any) -> Any:
    """The runtime config section a field holds (``X`` or ``X | None``), or ``None`` for a plain value."""
    for candidate in (tp, *typing.get_args(tp)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _section(cls: type[T], source: Any, path: str, **given: Any) -> T:
    """``cls`` (a runtime config section) from the typed recipe section ``source`` at ``path``.

    A field takes the recipe setting of the same name; a nested section is built the same way from
    the typed sub-section of that name; ``given`` supplies the fields the compiler derives or
    renames. A field with no setting and no given value is a resolver bug, named.
    """
    values: dict[str, Any] = {}
    hints = field_types(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # cls is a dataclass type
        if f.name in given:
            values[f.name] = given[f.name]
        elif hasattr(source, f.name):
            value = getattr(source, f.name)
            nested = _section_type(hints[f.name])
            if nested is not None and dataclasses.is_dataclass(value):
                values[f.name] = dataclasses.asdict(_section(nested, value, f"{path}.{f.name}"))
            else:
                values[f.name] = _plain(value)
        else:
            raise ResolveError(f"{path}.{f.name}: the runtime needs it and the recipe has no such setting "
                               "(recipe types and runtime config disagree)")
    try:
        return section_from_dict(cls, values, path)
    except RuntimeConfigError as exc:
        raise ResolveError(str(exc)) from None


def output_dirs(recipe: Recipe) -> tuple[str, str]:
    """The absolute checkpoint and metrics folders of a recipe's run: ``checkpointing.dir`` and
    ``logging.dir``, by default ``checkpoints/<name>`` and ``metrics/<name>`` under ``cluster.log_dir``.

    A relative ``cluster.log_dir`` means "beside where rlc compile ran" (shipped recipes live inside
    the installed package, so the recipe's own folder would be the wrong anchor).
    """
    return output_dirs_of(recipe.cluster.log_dir, recipe.name, recipe.checkpointing.dir, recipe.logging.dir)


def output_dirs_of(log_dir: str, name: str, checkpoint_dir: str | None, logging_dir: str | None) -> tuple[str, str]:
    """:func:`output_dirs` from the four settings it reads (for checks that run without a whole recipe)."""
    log_dir = os.path.abspath(log_dir)
    return (os.path.abspath(checkpoint_dir if checkpoint_dir is not None
                            else posixpath.join(log_dir, "checkpoints", name)),
            os.path.abspath(logging_dir if logging_dir is not None else posixpath.join(log_dir, "metrics", name)))


def resolve_runtime_config(result: CheckResult) -> RuntimeConfig:
    """The typed runtime config of a successful check: recipe + rule decisions + derived sizes."""
    if not result.ok or result.recipe is None or result.facts is None or result.gpu is None:
        raise ResolveError("cannot resolve a recipe with errors")
    r, facts, decisions = result.recipe, result.facts, result.decisions
    cluster, tl, gl = r.cluster, train_layout(r), generation_layout(r)
    name = r.name
    log_dir = os.path.abspath(cluster.log_dir)  # relative: beside where rlc ran (see output_dirs)
    checkpoint_dir, metrics_dir = output_dirs(r)

    refit = r.refit
    switches = {k: _switch(refit, k, decisions) for k in AUTO_SWITCHES}
    fp32, fp32_reason = _fp32_params(refit, decisions)
    refit_decisions = {k: reason for k, (_, reason) in switches.items()}
    refit_decisions["fp32_params"] = fp32_reason
    scales, scales_reason = _fp8_scales(r, decisions)
    if r.generation.precision == "fp8":
        refit_decisions["fp8_scales"] = scales_reason
    megatron = _megatron(r, decisions, refit_decisions)

    model, data = r.model, r.data
    return RuntimeConfig(
        version=RUNTIME_CONFIG_VERSION,
        name=name,
        model=_section(ModelConfig, model, "model", name=model.id, checkpoint=model.checkpoint_path,
                       tokenizer=model.tokenizer_path, num_layers=facts.num_layers,
                       num_experts=facts.num_experts or 0, mtp_num_layers=facts.mtp_num_layers or 0,
                       mtp_shared_embedding=bool(facts.mtp_shared_embedding)),
        cluster=_section(ClusterConfig, cluster, "cluster", world_size=cluster.world_size, gpu_type=cluster.gpu,
                         gpu_memory_gib=float(result.gpu.memory_gib), log_dir=log_dir,
                         ray={"address": "auto", "namespace": f"rlc-{name}",
                              "join_timeout_s": cluster.ray.join_timeout_s}),
        train_parallel=_section(TrainParallelConfig, r.parallelism.train, "parallelism.train",
                                dp=tl.dp, expert_dp=tl.expert_dp),
        generation_parallel=_section(GenerationParallelConfig, r.parallelism.generation, "parallelism.generation",
                                     dp=gl.dp),
        colocated=r.colocated,
        refit=_section(RefitConfig, refit, "refit",
                       buffer_memory_ratio=None if refit.buffer_gb is not None else refit.buffer_memory_ratio,
                       fp32_params=fp32, decisions=refit_decisions,
                       **{k: flag for k, (flag, _) in switches.items()}),
        generation=_section(GenerationConfig, r.generation, "generation", vllm_version=_vllm_version(result, r),
                            fp8={"scales": scales, "pow2_scales": r.generation.fp8.pow2_scales},
                            megatron=megatron),
        training=_section(TrainingConfig, r.training, "training", global_batch_size=r.global_batch_size,
                          logprob_batch_size=r.logprob_batch_size, max_sequence_length=r.max_sequence_length,
                          sequence_packing=dataclasses.asdict(_section(
                              SequencePackingConfig, r.training.sequence_packing, "training.sequence_packing",
                              train_mb_tokens=r.train_mb_tokens, logprob_mb_tokens=r.logprob_mb_tokens))),
        grpo=_section(GrpoConfig, r.grpo, "grpo"),
        loss=_section(LossConfig, r.loss, "loss"),
        data=_section(DataConfig, data, "data", train_path=data.train, val_path=data.val),
        reward=_section(RewardConfig, r.reward, "reward"),
        checkpointing=_section(CheckpointConfig, r.checkpointing, "checkpointing", dir=checkpoint_dir),
        logging=_section(LoggingConfig, r.logging, "logging", dir=metrics_dir),
        env={k: _env_str(v) for k, v in cluster.env.items()},
        extensions=_plain(r.extensions),
    )


#: Megatron-backend decisions the rules record (``generation.megatron.*`` and the refit kind), into ``refit.decisions``.
MEGATRON_DECISIONS = ("weight_sync", "generation.megatron.mode", "generation.megatron.transformer_impl",
                      "generation.megatron.reset_router_num_groups")


def _megatron(recipe: Recipe, decisions: dict[str, tuple[Any, str]],
              refit_decisions: dict[str, str]) -> dict[str, Any] | None:
    """``generation.megatron`` of runtime.yaml (None with the vLLM backend); its decisions go to ``refit.decisions``."""
    if recipe.generation.backend != "megatron":
        return None
    for key in MEGATRON_DECISIONS:
        if key in decisions:
            refit_decisions[key] = decisions[key][1]
    for key in MEGATRON_DECISIONS[:3]:
        if key not in decisions:
            raise ResolveError(f"{key}: not decided by any rule (generation.backend megatron)")
    m = recipe.generation.megatron
    reset = decisions.get("generation.megatron.reset_router_num_groups")
    return dataclasses.asdict(_section(
        MegatronGenerationConfig, m, "generation.megatron", mode=decisions["generation.megatron.mode"][0],
        transformer_impl=decisions["generation.megatron.transformer_impl"][0],
        reset_router_num_groups=bool(reset[0]) if reset else False))


def to_runtime_config(result: CheckResult) -> dict[str, Any]:
    """The ``runtime.yaml`` mapping of a successful check (:func:`resolve_runtime_config` as data)."""
    return runtime_config_to_dict(resolve_runtime_config(result))


def _vllm_version(result: CheckResult, recipe: Recipe) -> str:
    """The vLLM version the plan assumed: the recipe's, else the calibration entry's for the GPU."""
    plan = result.plan
    if plan is not None and plan.vllm_version:
        return str(plan.vllm_version)
    from rlc.compiler.planner.calibration import calibration_for
    from rlc.compiler.planner.vllm_sleep import planned_vllm_version

    entry = calibration_for(recipe.cluster.gpu, table=result.calibration or None)
    return planned_vllm_version(recipe, entry.versions)


def _env_str(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
