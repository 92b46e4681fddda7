"""The resolved runtime config (``bundle/runtime.yaml``): the only contract between compiler and runtime.

The compiler (``rlc.compiler.resolve``) writes every value explicitly: defaults filled, derived
values (world size, data-parallel sizes) computed, and each ``auto`` refit switch decided, with the
rule that decided it recorded in ``refit.decisions``. The runtime reads nothing else.

The types are :mod:`rlc.contract.runtime_types`, generated from the recipe's key declarations
(:mod:`rlc.compiler.recipe_types`), and re-exported here. This module is pure Python (no torch, ray,
vllm or megatron) so that the compiler, CI and the runtime share one definition.
``load_runtime_config`` reads them with the one strict loader (:func:`rlc.contract.declare.load`): it
rejects unknown and missing keys, wrong types and values outside a key's choices, naming the key
path, and every number outside its range (:mod:`rlc.contract.ranges`), so a stale or hand-edited
``runtime.yaml`` fails loudly instead of running with a default.
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from rlc.contract.declare import Reading, load
from rlc.contract.errors import RuntimeConfigError
from rlc.contract.ranges import range_problems
from rlc.contract.runtime_file import read_runtime_yaml
from rlc.contract.runtime_types import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    DynamicSamplingConfig,
    Fp8RolloutConfig,
    Fp8TrainingConfig,
    GenerationConfig,
    GenerationParallelConfig,
    GrpoConfig,
    LoggingConfig,
    LossConfig,
    LRScheduleConfig,
    MegatronGenerationConfig,
    ModelConfig,
    MoeConfig,
    OptimizerConfig,
    RayConfig,
    RefitConfig,
    RewardConfig,
    RewardScalingConfig,
    RewardShapingConfig,
    RouterReplayConfig,
    RuntimeConfig,
    SamplingConfig,
    SequencePackingConfig,
    SpeculativeDecodingConfig,
    TrainingConfig,
    TrainParallelConfig,
)
from rlc.contract.version import RUNTIME_CONFIG_VERSION


def vllm_speculative_config(spec: SpeculativeDecodingConfig) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for ``spec``: vLLM's generic ``mtp`` method (vLLM >= 0.10 finds the
    checkpoint's MTP module for DeepSeek-V3, Qwen3.5 / Qwen3-Next, GLM-4.5 and Nemotron-H), or ``ngram`` with
    its n-gram window."""
    out: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "ngram":
        out.update(prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
    return out


#: How ``runtime.yaml`` is read: every key as written, none left out, none unknown.
READING = Reading(
    error=RuntimeConfigError,
    unknown=lambda path, extra: (f"unknown key(s) {', '.join((path + '.' if path else '') + k for k in extra)}: "
                                 "this runtime does not know them; recompile the bundle with the rlc that runs it"),
    missing=lambda where: f"{where}: missing; recompile the bundle (runtime.yaml must be fully resolved)",
    not_a_mapping=lambda path, value: f"{path or '<root>'}: expected a mapping, got {type(value).__name__}",
    as_written=True)


T = typing.TypeVar("T")


def section_from_dict(cls: type[T], data: Any, path: str) -> T:
    """One section (any class of :mod:`rlc.contract.runtime_types`) from a mapping, with the same strict checks."""
    return load(cls, data, path, READING)


def runtime_config_from_dict(data: dict[str, Any]) -> RuntimeConfig:
    """Build a ``RuntimeConfig`` from a mapping; unknown or missing keys raise ``RuntimeConfigError``."""
    cfg = load(RuntimeConfig, data, "", READING)
    if cfg.version != RUNTIME_CONFIG_VERSION:
        raise RuntimeConfigError(
            f"version: runtime.yaml is version {cfg.version}, this runtime reads {RUNTIME_CONFIG_VERSION}; "
            "recompile the bundle"
        )
    out_of_range = range_problems(data)
    if out_of_range:
        raise RuntimeConfigError("; ".join(out_of_range))
    return cfg


def runtime_config_to_dict(cfg: RuntimeConfig) -> dict[str, Any]:
    """The plain-data form written to ``runtime.yaml``."""
    return dataclasses.asdict(cfg)


def load_runtime_config(path: str | Path) -> RuntimeConfig:
    """Read ``runtime.yaml`` (:func:`rlc.contract.runtime_file.read_runtime_yaml`) into a ``RuntimeConfig``."""
    return runtime_config_from_dict(read_runtime_yaml(path))


__all__ = ["READING", "CheckpointConfig", "ClusterConfig", "DataConfig", "DynamicSamplingConfig", "Fp8RolloutConfig",
           "Fp8TrainingConfig", "GenerationConfig", "GenerationParallelConfig", "GrpoConfig", "LRScheduleConfig",
           "LoggingConfig", "LossConfig", "MegatronGenerationConfig", "ModelConfig", "MoeConfig", "OptimizerConfig",
           "RayConfig", "RefitConfig", "RewardConfig", "RewardScalingConfig", "RewardShapingConfig",
           "RouterReplayConfig", "RuntimeConfig", "RuntimeConfigError",
           "SamplingConfig", "SequencePackingConfig", "SpeculativeDecodingConfig", "TrainParallelConfig",
           "TrainingConfig", "load_runtime_config", "runtime_config_from_dict", "runtime_config_to_dict",
           "section_from_dict", "vllm_speculative_config"]
