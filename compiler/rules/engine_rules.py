"""RLC31x: engine options — pass-through blocks, what the runtime cannot run yet, option combinations."""
from __future__ import annotations

from rlc.compiler.planner.layout import train_layout
from rlc.compiler.rules.engine import Context, rule
from rlc.compiler.runtime_support import runtime_gaps
from rlc.contract.sequence_packing import pad_multiples, round_up
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
      rationale="The schema can state configurations that ran on other stacks (FP8 rollouts) so "
                "they validate and plan. The bundled runtime cannot execute some of them yet; rlc compile refuses "
                "to write a bundle that would silently run something else.",
      seed="rlc/compiler/runtime_support.py.",
      fixes="Do what the hint says (most often: the key back to its default, e.g. `generation.precision: auto`) "
            "to compile for the bundled runtime, or run the plan with the stack that supports it.")
def runtime_cannot(ctx: Context) -> None:
    for gap in runtime_gaps(ctx.recipe):
        ctx.warning(f"the bundled runtime cannot run this yet ({gap.message}); rlc compile will refuse it",
                    gap.key, hint=gap.hint or f"set `{gap.fix}` to compile for the bundled runtime")


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


SPECULATIVE = "generation.speculative_decoding"
NGRAM_ONLY = ("prompt_lookup_min", "prompt_lookup_max")


@rule("RLC314", "speculative decoding needs what its method drafts from", severities=("error", "warning"),
      rationale="With method mtp, vLLM's drafter is the checkpoint's own multi-token-prediction layers: a checkpoint "
                "without them leaves the drafter nothing to load and vLLM fails at start. model.overrides that switch "
                "the trainer's MTP off (num_nextn_predict_layers / mtp_num_hidden_layers: 0, NeMo-RL mtp_num_layers: "
                "0) do not remove them from the checkpoint, so the count that matters is the checkpoint's. "
                "The drafter's "
                "weights live in vLLM's weight pool: sleep level 2 discards them, vLLM's wake-up restores only the "
                "target model's buffers and the refit writes only the target model, so after the first sleep the "
                "drafter would run on undefined memory; level 1 backs them up with the rest. The n-gram window "
                "(prompt_lookup_min ≤ prompt_lookup_max) is vLLM's own check, moved to compile time.",
      seed="vLLM SpeculativeConfig (method 'mtp': the draft model is the target checkpoint; ngram: "
           "'prompt_lookup_min must be <= prompt_lookup_max'); vLLM Worker.sleep / wake_up (level 2 saves and "
           "restores model_runner.model's buffers only); NeMo-RL's DeepSeek-V3 performance recipe with "
           "speculative_config method deepseek_mtp (NeMo-RL PR #3356).",
      fixes="Use method: ngram (or no speculative decoding) for a checkpoint without MTP layers; sleep level 1 "
            "with mtp; keep "
            "prompt_lookup_min ≤ prompt_lookup_max and set the n-gram window only with method: ngram.")
def speculative_decoding(ctx: Context) -> None:
    spec = ctx.recipe.generation.speculative_decoding
    if spec is None:
        return
    if spec.method == "ngram":
        if spec.prompt_lookup_min > spec.prompt_lookup_max:
            ctx.error(f"prompt_lookup_min {spec.prompt_lookup_min} > prompt_lookup_max {spec.prompt_lookup_max}: "
                      "vLLM refuses the n-gram window", f"{SPECULATIVE}.prompt_lookup_min",
                      hint=f"{SPECULATIVE}.prompt_lookup_min ≤ prompt_lookup_max")
        return
    written = ((ctx.raw or {}).get("generation") or {}).get("speculative_decoding") or {}
    for key in NGRAM_ONLY:
        if isinstance(written, dict) and key in written:
            ctx.error(f"{SPECULATIVE}.{key} is an n-gram setting; method mtp drafts with the checkpoint's MTP layers "
                      "and has no n-gram window", f"{SPECULATIVE}.{key}", hint=f"drop {key} (or use method: ngram)")
    facts = ctx.facts
    layers = None if facts is None else facts.checkpoint_mtp_num_layers
    if facts is not None and layers == 0:
        ctx.error(f"method mtp drafts with the checkpoint's MTP layers, and {facts.model_id}'s checkpoint has none "
                  "(its config gives 0 MTP layers)", f"{SPECULATIVE}.method",
                  hint=f"use {SPECULATIVE}.method: ngram, or drop {SPECULATIVE}")
        return
    if facts is not None and layers is None:
        ctx.warning(f"method mtp: how many MTP layers {facts.model_id}'s checkpoint has is not known, so the plan "
                    "leaves the drafter's weights out", f"{SPECULATIVE}.method",
                    hint="state num_nextn_predict_layers (or mtp_num_hidden_layers) in model.config")
    if ctx.recipe.generation.drafts_with_mtp and ctx.recipe.colocated and ctx.recipe.refit.sleep_level == 2:
        ctx.error("method mtp with refit.sleep_level 2: vLLM discards every weight at level 2 and restores only the "
                  "target model's buffers, and the refit writes only the target model, so the MTP drafter would "
                  "draft from whatever the freed memory holds after the first sleep", "refit.sleep_level",
                  hint="refit.sleep_level: 1 (the drafter's weights are backed up to host memory with the model's)")


PACKING = "training.sequence_packing"


@rule("RLC315", "a packed micro batch must hold the longest sequence", severities=("error",),
      rationale="With training.sequence_packing the trainer bin-packs sequences into micro batches of at most "
                "train_mb_tokens (train pass) and logprob_mb_tokens (logprob passes) tokens, each sequence padded to "
                "the multiple context and sequence parallelism cut it by (2 × CP, times TP with sequence parallelism). "
                "The longest sequence a rollout can give (data.max_prompt_length + generation.sampling.max_tokens, "
                "at most training.max_sequence_length) that does not fit one micro batch cannot be trained: the run "
                "would stop at its first such rollout.",
      seed="NeMo-RL nemo_rl/data/packing/algorithms.py ('Sequence length ... exceeds bin capacity'); "
           "nemo_rl/models/megatron/data.py (per-sequence padding to 2 × CP × TP).",
      fixes="Raise the budget the message names to at least the padded longest sequence, or lower "
            "generation.sampling.max_tokens (or data.max_prompt_length).")
def packing_budget_holds_a_sequence(ctx: Context) -> None:
    r = ctx.recipe
    if not r.training.sequence_packing.enabled:
        return
    tl = train_layout(r)
    fp8 = r.training.fp8
    pad = pad_multiples(tp=tl.tp, sequence_parallel=tl.sequence_parallel, cp=tl.cp,
                        fp8_recipe=fp8.recipe if fp8.enabled else None)
    sequence = r.longest_sequence
    longest = round_up(sequence, pad.sequence)
    source = ("training.max_sequence_length" if sequence == r.max_sequence_length else
              f"a prompt of data.max_prompt_length {r.data.max_prompt_length} + generation.sampling.max_tokens "
              f"{r.generation.sampling.max_tokens}")
    for key, budget in (("train_mb_tokens", r.train_mb_tokens), ("logprob_mb_tokens", r.logprob_mb_tokens)):
        if budget < longest:
            padded = f", padded to a multiple of {pad.sequence}: {longest} tokens" if longest != sequence else " tokens"
            ctx.error(f"{PACKING}.{key} = {budget} tokens cannot hold the longest sequence a rollout can give "
                      f"({sequence}{padded}; {source})", f"{PACKING}.{key}",
                      hint=f"set {PACKING}.{key}: {longest} or more")
