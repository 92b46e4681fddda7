"""Recipe (schema defaults filled) + rule decisions → the resolved ``runtime.yaml`` contents.

The runtime reads only this mapping (see ``rlc.contract.runtime_config``), so every default is explicit,
derived sizes are computed here, and each ``auto`` refit switch is replaced by the rule decision
that settled it, with the reason kept in ``refit.decisions``.
"""
from __future__ import annotations

import os
import posixpath
from typing import Any

from rlc import RUNTIME_CONFIG_VERSION

# Refit switches the rules decide when the recipe says ``auto`` (recipe key -> runtime key).
AUTO_SWITCHES = ("sync_params_before_refit", "dedupe_mtp_embedding", "per_rank_ipc_metadata")


class ResolveError(ValueError):
    """The recipe cannot be turned into a runtime config (should have been a rule error)."""


def _switch(refit: dict[str, Any], key: str, decisions: dict[str, tuple[Any, str]]) -> tuple[bool, str]:
    value = refit[key]
    decided = decisions.get(f"refit.{key}")
    if value == "on":
        return True, "set in recipe"
    if value == "off":
        return False, "set in recipe"
    if decided is None:
        raise ResolveError(f"refit.{key}: 'auto' was not decided by any rule")
    flag, reason = decided
    return bool(flag), reason


def _fp32_params(refit: dict[str, Any], decisions: dict[str, tuple[Any, str]]) -> tuple[list[str], str]:
    if refit["fp32_params"] != "auto":
        return list(refit["fp32_params"]), "set in recipe"
    decided = decisions.get("refit.fp32_params")
    if decided is None:
        return [], "auto: model has no known fp32 parameters"
    patterns, reason = decided
    return list(patterns), reason


def to_runtime_config(result: Any) -> dict[str, Any]:
    """Build the ``runtime.yaml`` mapping from a successful :class:`rlc.compiler.api.CheckResult`."""
    if not result.ok:
        raise ResolveError("cannot resolve a recipe with errors")
    r = result.recipe
    facts = result.facts
    decisions = result.decisions
    cluster, par = r["cluster"], r.get("parallelism", {})
    train, gen = par.get("train", {}), par.get("generation", {})
    world = cluster["nodes"] * cluster["gpus_per_node"]
    name = r["name"]
    # A relative log_dir means "beside where rlc compile ran" (shipped recipes live inside the
    # installed package, so the recipe's own folder would be the wrong anchor).
    log_dir = os.path.abspath(cluster["log_dir"])

    refit = r["refit"]
    switches = {k: _switch(refit, k, decisions) for k in AUTO_SWITCHES}
    fp32, fp32_reason = _fp32_params(refit, decisions)
    refit_decisions = {k: reason for k, (_, reason) in switches.items()}
    refit_decisions["fp32_params"] = fp32_reason

    grpo, training = r["grpo"], r["training"]
    generation = r["generation"]
    model = r["model"]
    checkpoint = model.get("checkpoint", model["id"])
    data = r["data"]
    return {
        "version": RUNTIME_CONFIG_VERSION,
        "name": name,
        "model": {
            "name": model["id"],
            "checkpoint": checkpoint,
            "tokenizer": model.get("tokenizer", checkpoint),
            "dtype": model["dtype"],
            "trust_remote_code": model["trust_remote_code"],
            "num_layers": getattr(facts, "num_layers", None),
            "num_experts": getattr(facts, "num_experts", 0) or 0,
            "mtp_num_layers": getattr(facts, "mtp_num_layers", 0) or 0,
            "mtp_shared_embedding": bool(getattr(facts, "mtp_shared_embedding", False)),
        },
        "cluster": {
            "nodes": cluster["nodes"],
            "gpus_per_node": cluster["gpus_per_node"],
            "world_size": world,
            "gpu_type": cluster["gpu"],
            "gpu_memory_gib": float(result.gpu.memory_gib),
            "log_dir": log_dir,
            "ray": {
                "address": "auto",
                "namespace": f"rlc-{name}",
                "join_timeout_s": cluster["ray"]["join_timeout_s"],
            },
        },
        "train_parallel": {
            "tp": train["tp"],
            "pp": train["pp"],
            "ep": train["ep"],
            "etp": train["etp"],
            "cp": train["cp"],
            "vpp": train["vpp"],
            "sequence_parallel": train["sequence_parallel"],
            "num_layers_in_first_pipeline_stage": train.get("num_layers_in_first_pipeline_stage"),
            "num_layers_in_last_pipeline_stage": train.get("num_layers_in_last_pipeline_stage"),
            "dp": world // (train["tp"] * train["pp"] * train["cp"]),
            "expert_dp": world // (train["ep"] * train["etp"] * train["pp"]),
        },
        "generation_parallel": {
            "tp": gen["tp"],
            "pp": gen["pp"],
            "ep": gen["ep"],
            "dp": gen.get("dp", world // (gen["tp"] * gen["pp"])),
        },
        "colocated": r["colocated"],
        "refit": {
            "buffer_memory_ratio": None if "buffer_gb" in refit else refit["buffer_memory_ratio"],
            "buffer_gb": refit.get("buffer_gb"),
            "alignment_bytes": refit["alignment_bytes"],
            "sleep_level": refit["sleep_level"],
            "offload_optimizer_for_refit": refit["offload_optimizer_for_refit"],
            "sync_params_before_refit": switches["sync_params_before_refit"][0],
            "dedupe_mtp_embedding": switches["dedupe_mtp_embedding"][0],
            "per_rank_ipc_metadata": switches["per_rank_ipc_metadata"][0],
            "fp32_params": fp32,
            "verify_every": refit["verify_every"],
            "transport": refit["transport"],
            "decisions": refit_decisions,
        },
        "generation": {
            "backend": generation["backend"],
            "vllm_version": _vllm_version(result),
            "enforce_eager": generation["enforce_eager"],
            "gpu_memory_utilization": generation["gpu_memory_utilization"],
            "kv_cache_memory_bytes": generation.get("kv_cache_memory_bytes"),
            "precision": generation["precision"],
            "max_model_len": generation["max_model_len"],
            "sampling": dict(generation["sampling"]),
            "vllm_kwargs": dict(generation["vllm_kwargs"]),
        },
        "training": {
            "optimizer": dict(training["optimizer"]),
            "lr_schedule": dict(training["lr_schedule"]),
            "grad_clip": training["grad_clip"],
            "micro_batch_size": training["micro_batch_size"],
            "global_batch_size": training.get(
                "global_batch_size", grpo["prompts_per_step"] * grpo["generations_per_prompt"]
            ),
            "use_distributed_optimizer": training["use_distributed_optimizer"],
            "overlap_param_gather": training["overlap_param_gather"],
            "overlap_grad_reduce": training["overlap_grad_reduce"],
            "optimizer_cpu_offload": training["optimizer_cpu_offload"],
            "optimizer_offload_fraction": training["optimizer_offload_fraction"],
            "activation_checkpointing": training["activation_checkpointing"],
            "max_sequence_length": training.get("max_sequence_length", generation["max_model_len"]),
            "seed": training["seed"],
            "use_precision_aware_optimizer": training["use_precision_aware_optimizer"],
            "mtp_loss_scale": training["mtp_loss_scale"],
            "fp8": dict(training["fp8"]),
            "moe": dict(training["moe"]),
            "sequence_packing": dict(training["sequence_packing"]),
            "megatron_kwargs": dict(training["megatron_kwargs"]),
        },
        "grpo": {
            "prompts_per_step": grpo["prompts_per_step"],
            "generations_per_prompt": grpo["generations_per_prompt"],
            "max_steps": grpo["max_steps"],
            "normalize_advantages": grpo["normalize_advantages"],
            "leave_one_out": grpo["leave_one_out"],
            "dynamic_sampling": dict(grpo["dynamic_sampling"]),
            "max_gen_kl": grpo["max_gen_kl"],
            "seed": grpo["seed"],
        },
        "loss": dict(r["loss"]),
        "data": {
            "train_path": data["train"],
            "val_path": data.get("val"),
            "prompt_key": data["prompt_key"],
            "answer_key": data["answer_key"],
            "prompt_template": data["prompt_template"],
            "max_prompt_length": data["max_prompt_length"],
            "shuffle": data["shuffle"],
        },
        "reward": {
            "function": r["reward"]["function"],
            "kwargs": dict(r["reward"]["kwargs"]),
            "failure_reward": r["reward"]["failure_reward"],
        },
        "checkpointing": {
            "enabled": r["checkpointing"]["enabled"],
            "dir": os.path.abspath(r["checkpointing"].get("dir", posixpath.join(log_dir, "checkpoints", name))),
            "every_steps": r["checkpointing"]["every_steps"],
            "keep_last": r["checkpointing"]["keep_last"],
            "resume": r["checkpointing"]["resume"],
        },
        "logging": {
            "dir": os.path.abspath(r["logging"].get("dir", posixpath.join(log_dir, "metrics", name))),
            "jsonl": r["logging"]["jsonl"],
            "tensorboard": r["logging"]["tensorboard"],
            "progress_bar": r["logging"]["progress_bar"],
        },
        "env": {k: _env_str(v) for k, v in cluster["env"].items()},
        "extensions": dict(r["extensions"]),
    }


def _vllm_version(result: Any) -> str:
    """The vLLM version the plan assumed: the recipe's, else the calibration entry's for the GPU."""
    plan = getattr(result, "plan", None)
    if plan is not None and plan.vllm_version:
        return str(plan.vllm_version)
    from rlc.compiler.planner.calibration import calibration_for
    from rlc.compiler.planner.vllm_sleep import planned_vllm_version

    return planned_vllm_version(result.recipe, calibration_for(result.recipe["cluster"]["gpu"]).versions)


def _env_str(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
