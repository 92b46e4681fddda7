"""RLC31x: engine options — pass-through blocks, what the runtime cannot run yet, option combinations."""
from __future__ import annotations

from rlc.compiler.rules.engine import Context, rule
from rlc.compiler.runtime_support import runtime_gaps
from rlc.contract.engine_options import MEGATRON_OWNED, VLLM_OWNED
from rlc.compiler.suggest import closest


@rule("RLC310", "pass-through engine options must not set what rlc sets from typed keys", severities=("error",),
      rationale="generation.vllm_kwargs and training.megatron_kwargs hand options rlc does not reason about to vLLM "
                "and Megatron unchanged. An option the runtime already sets from a typed key (parallelism, memory, "
                "dtype, sleep mode, FP8, MoE dispatcher) would give one setting two sources that can disagree, and "
                "the planner and rules would check the other one.",
      seed="Design: one source of truth per setting; typed keys where rlc reasons about a value.",
      fixes="Move the option to the typed key the message names, or drop it.")
def owned_options(ctx: Context) -> None:
    blocks = (("generation.vllm_kwargs", ctx.recipe.generation.vllm_kwargs, VLLM_OWNED),
              ("training.megatron_kwargs", ctx.recipe.training.megatron_kwargs, MEGATRON_OWNED))
    for block, options, owned in blocks:
        for key in options:
            if key in owned:
                source, hint = _owner(owned[key])
                ctx.error(f"{block}.{key} is set by rlc {source}", f"{block}.{key}", hint=hint)
            else:
                near = closest(key, list(owned), cutoff=0.85)
                if near:
                    source, hint = _owner(owned[near])
                    ctx.error(f"{block}.{key} looks like {near!r}, which rlc sets {source}", f"{block}.{key}",
                              hint=hint)


def _owner(owner: str) -> tuple[str, str]:
    """How rlc sets an owned option, and the hint: a typed key to use, or a fixed value (``(always ...: why)``)
    that no recipe key changes."""
    if owner.startswith("("):
        return owner, "drop it: rlc sets this option itself"
    return f"from {owner}", f"use {owner} instead"


@rule("RLC311", "setting the bundled runtime cannot run yet", severities=("warning",),
      rationale="The schema can state configurations that ran on other stacks (FP8 rollouts, sequence packing) so "
                "they validate and plan. The bundled runtime cannot execute some of them yet; rlc compile refuses "
                "to write a bundle that would silently run something else.",
      seed="rlc/compiler/runtime_support.py.",
      fixes="Turn the setting off to compile for the bundled runtime, or run the plan with the stack that "
            "supports it.")
def runtime_cannot(ctx: Context) -> None:
    for gap in runtime_gaps(ctx.recipe):
        ctx.warning(f"the bundled runtime cannot run this yet ({gap.message}); rlc compile will refuse it",
                    gap.key, hint=f"turn {gap.key} off to compile for the bundled runtime")


@rule("RLC312", "the precision-aware optimizer needs the distributed optimizer", severities=("error",),
      rationale="Megatron's precision-aware optimizer keeps fp32 master weights inside the distributed optimizer's "
                "state (Transformer Engine FusedAdam); Megatron rejects it without use_distributed_optimizer.",
      seed="Megatron-core OptimizerConfig: 'use_precision_aware_optimizer requires use_distributed_optimizer'.",
      fixes="Set training.use_distributed_optimizer: true, or use_precision_aware_optimizer: false.")
def precision_aware_needs_distributed(ctx: Context) -> None:
    training = ctx.recipe.training
    if training.use_precision_aware_optimizer and not training.use_distributed_optimizer:
        ctx.error("use_precision_aware_optimizer needs use_distributed_optimizer: true",
                  "training.use_precision_aware_optimizer", hint="training.use_distributed_optimizer: true")


@rule("RLC313", "DeepEP needs the flex dispatcher and expert parallelism", severities=("error", "info"),
      needs=("facts",),
      rationale="Megatron runs DeepEP only through the flex token dispatcher; it only does something for MoE layers "
                "under expert parallelism.",
      seed="Megatron-core TransformerConfig (moe_enable_deepep requires moe_token_dispatcher_type 'flex').",
      fixes="Set training.moe.token_dispatcher: flex with deepep: true; EP > 1 for a MoE model.")
def deepep(ctx: Context) -> None:
    moe = ctx.recipe.training.moe
    if not moe.deepep:
        return
    if moe.token_dispatcher != "flex":
        ctx.error(f"training.moe.deepep needs token_dispatcher: flex (not {moe.token_dispatcher!r})",
                  "training.moe.token_dispatcher", hint="training.moe.token_dispatcher: flex")
    if ctx.facts is not None and (not ctx.facts.is_moe or ctx.recipe.parallelism.train.ep == 1):
        ctx.info("training.moe.deepep has no effect: " + ("the model is dense" if not ctx.facts.is_moe else "EP is 1"),
                 "training.moe.deepep")
