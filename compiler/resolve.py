"""Typed recipe + rule decisions → the resolved ``runtime.yaml`` contents.

The runtime reads only this (``rlc.contract.runtime_config``), so every default is explicit,
derived sizes are computed here, and each ``auto`` refit switch is replaced by the rule decision
that settled it, with the reason kept in ``refit.decisions``.

Each field of the ``runtime.yaml`` types names the recipe key it is resolved from
(:func:`rlc.contract.declare.runtime_key`), so the tree is built from those declarations: a key's
value is copied from the typed recipe, and only the values the compiler settles (derived sizes,
model facts, ``auto`` decisions, default folders) are given here, each by its ``runtime.yaml`` path.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from rlc import RUNTIME_CONFIG_VERSION
from rlc.contract.declare import load, settings
from rlc.contract.runtime_config import (
    READING,
    MegatronGenerationConfig,
    RuntimeConfig,
    RuntimeConfigError,
    runtime_config_to_dict,
)

from rlc.compiler.planner.layout import generation_layout, train_layout
from rlc.compiler.run_dirs import output_dirs
from rlc.compiler.recipe_types import Recipe, RefitSection, Switch

if TYPE_CHECKING:
    from rlc.compiler.api import CheckResult

T = TypeVar("T")

#: Refit switches the rules decide when the recipe says ``auto``: the refit keys declared as a :data:`Switch`.
AUTO_SWITCHES = tuple(name for name, tp, _ in settings(RefitSection) if tp == Switch)


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


def _recipe_value(recipe: Recipe, key: str) -> Any:
    node: Any = recipe
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _tree(cls: type, recipe: Recipe, given: dict[str, Any], path: str, used: set[str]) -> dict[str, Any]:
    """The ``runtime.yaml`` mapping of section ``cls`` at ``path``: each field the compiler settles from
    ``given`` (by its dotted path), every other one from the recipe key it declares."""
    out: dict[str, Any] = {}
    for name, tp, meta in settings(cls):
        where = f"{path}.{name}" if path else name
        if where in given:
            out[name] = given[where]
            used.add(where)
            continue
        source = meta.get("recipe")
        if source is None:
            raise ResolveError(f"{where}: the compiler derives it, and the resolver gives no value for it")
        value = _recipe_value(recipe, source)
        nested = _section_type(tp)
        out[name] = (_tree(nested, recipe, given, where, used) if nested is not None and value is not None
                     else _plain(value))
    return out


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

    model = r.model
    given: dict[str, Any] = {  # what the compiler settles, by runtime.yaml path; the rest is the recipe's
        "version": RUNTIME_CONFIG_VERSION,
        "model.checkpoint": model.checkpoint_path, "model.tokenizer": model.tokenizer_path,
        "model.num_layers": facts.num_layers, "model.num_experts": facts.num_experts or 0,
        "model.mtp_num_layers": facts.mtp_num_layers or 0,
        "model.mtp_shared_embedding": bool(facts.mtp_shared_embedding),
        "cluster.world_size": cluster.world_size, "cluster.gpu_memory_gib": float(result.gpu.memory_gib),
        "cluster.log_dir": log_dir, "cluster.ray.address": "auto", "cluster.ray.namespace": f"rlc-{name}",
        "train_parallel.dp": tl.dp, "train_parallel.expert_dp": tl.expert_dp, "generation_parallel.dp": gl.dp,
        "refit.buffer_memory_ratio": None if refit.buffer_gb is not None else refit.buffer_memory_ratio,
        "refit.fp32_params": fp32, "refit.decisions": refit_decisions,
        **{f"refit.{k}": flag for k, (flag, _) in switches.items()},
        "generation.vllm_version": _vllm_version(result, r), "generation.fp8.scales": scales,
        "generation.megatron": megatron,
        "training.global_batch_size": r.global_batch_size, "training.logprob_batch_size": r.logprob_batch_size,
        "training.max_sequence_length": r.max_sequence_length,
        "training.sequence_packing.train_mb_tokens": r.train_mb_tokens,
        "training.sequence_packing.logprob_mb_tokens": r.logprob_mb_tokens,
        "checkpointing.dir": checkpoint_dir, "logging.dir": metrics_dir,
        "env": {k: _env_str(v) for k, v in cluster.env.items()},
    }
    return _build(RuntimeConfig, r, given, "")


def _build(cls: type[T], recipe: Recipe, given: dict[str, Any], path: str) -> T:
    """Section ``cls`` at ``path``, built from the recipe and ``given`` and checked as the runtime reads it."""
    used: set[str] = set()
    data = _tree(cls, recipe, given, path, used)
    unused = sorted(k for k in given if k not in used and (not path or k.startswith(path + ".")))
    if unused:
        raise ResolveError(f"{', '.join(unused)}: no such runtime.yaml key "
                           "(the resolver and the runtime types disagree)")
    try:
        return load(cls, data, path, READING)
    except RuntimeConfigError as exc:
        raise ResolveError(str(exc)) from None


#: Megatron-backend decisions the rules record (``generation.megatron.*`` and the refit kind), into ``refit.decisions``.
MEGATRON_DECISIONS = ("weight_sync", "generation.megatron.mode", "generation.megatron.transformer_impl",
                      "generation.megatron.reset_router_num_groups", "generation.megatron.router_dtype")
#: Those runtime.yaml takes its values from (every megatron-backend check decides them).
_REQUIRED_MEGATRON_DECISIONS = MEGATRON_DECISIONS[:3]


def _megatron(recipe: Recipe, decisions: dict[str, tuple[Any, str]],
              refit_decisions: dict[str, str]) -> dict[str, Any] | None:
    """``generation.megatron`` of runtime.yaml (None with the vLLM backend); its decisions go to ``refit.decisions``."""
    if recipe.generation.backend != "megatron":
        return None
    for key in MEGATRON_DECISIONS:
        if key in decisions:
            refit_decisions[key] = decisions[key][1]
    for key in _REQUIRED_MEGATRON_DECISIONS:
        if key not in decisions:
            raise ResolveError(f"{key}: not decided by any rule (generation.backend megatron)")
    reset = decisions.get("generation.megatron.reset_router_num_groups")
    return dataclasses.asdict(_build(MegatronGenerationConfig, recipe, {
        "generation.megatron.mode": decisions["generation.megatron.mode"][0],
        "generation.megatron.transformer_impl": decisions["generation.megatron.transformer_impl"][0],
        "generation.megatron.reset_router_num_groups": bool(reset[0]) if reset else False}, "generation.megatron"))


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
