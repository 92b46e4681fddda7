"""RLC20x: the refit switches (each a fix from a field report) and refit configuration errors.

Each ``auto`` switch is decided here (``ctx.decide``) with the reason written into runtime.yaml;
an explicit ``off`` where the fix is needed is an error.
"""
from __future__ import annotations

import fnmatch

from rlc.compiler.mcore_generation import uses_megatron
from rlc.compiler.planner.fused_transfer import fused_transfer
from rlc.compiler.planner.layout import train_layout
from rlc.compiler.recipe_types import Switch
from rlc.compiler.schema import default_at
from rlc.compiler.rules.engine import Context, rule
from rlc.contract.refit_buffer import BF16_REFIT_SWITCHES, bf16_switch_applies

R = "refit"


def decide_switch(ctx: Context, name: str, *, needed: bool, why: str, off_error: str, hint: str,
                  on_by_default: bool = False) -> None:
    """Settle the ``auto|on|off`` refit switch ``refit.<name>``.

    ``auto`` turns it on when ``needed`` (with an info naming why) or when ``on_by_default``;
    ``off`` where it is needed is an error (``off_error``, fixed by ``hint``); ``on`` is always allowed.
    """
    key = f"{R}.{name}"
    value: Switch = getattr(ctx.recipe.refit, name)
    if value == "auto":
        on = needed or on_by_default
        ctx.decide(key, on, ("on: " if on else "off: ") + why)
        if needed:
            ctx.info(f"{name}: auto → on: {why}", key)
    elif value == "off" and needed:
        ctx.error(off_error, key, hint=hint)


@rule("RLC201", "MTP with a shared embedding and PP > 1 needs the MTP-embedding dedupe",
      severities=("error", "info"),
      rationale="With multi-token prediction that reuses the word embedding (HF mtp_use_dedicated_embeddings: "
                "false) and pipeline parallelism, Megatron places the MTP block on the last stage and replicates "
                "embedding.word_embeddings.weight there. The exporter then finds the same logical parameter on "
                "PP rank 0 and on the last rank and refit setup fails. The dedupe drops the replica on the last "
                "stage; PP rank 0 stays its only owner.",
      seed="NeMo-RL #2471 failure 1: 'ValueError: Object present on multiple PP ranks: [0, 7]' "
           "(Qwen3.5-397B-A17B, PP 8); Megatron-Bridge build_conversion_tasks does not call "
           "_should_skip_mtp_duplicate_embedding_export.",
      fixes="Leave refit.dedupe_mtp_embedding at auto (or on).")
def mtp_dedupe(ctx: Context) -> None:
    if uses_megatron(ctx.recipe):
        return  # vLLM's IPC stream only (RLC403 records it as n/a)
    pp = train_layout(ctx.recipe).pp
    f = ctx.facts
    if f is None:
        needed, why = pp > 1, f"model facts unknown and PP{pp} > 1 (on is harmless without MTP)"
    elif f.mtp_num_layers == 0:
        needed, why = False, "the model has no MTP layers"
    elif f.mtp_shared_embedding is False:
        needed, why = False, "the MTP block has its own embedding"
    elif pp == 1:
        needed, why = False, "PP is 1 (one owner of the embedding)"
    else:
        mtp = "an unknown number of" if f.mtp_num_layers is None else str(f.mtp_num_layers)
        shared = "shares the word embedding" if f.mtp_shared_embedding else \
            "may share the word embedding (not stated for this model)"
        needed = True
        why = (f"MTP ({mtp} layer(s)) {shared} and PP{pp} > 1: the last stage holds a replica of "
               "embedding.word_embeddings.weight (NeMo-RL #2471 failure 1)")
    decide_switch(ctx, "dedupe_mtp_embedding", needed=needed, why=why,
                  off_error=f"dedupe_mtp_embedding is off, but {why}; refit setup fails with "
                            f"'Object present on multiple PP ranks: [0, {pp - 1}]'",
                  hint="set refit.dedupe_mtp_embedding: auto")


@rule("RLC202", "distributed optimizer + overlap_param_gather needs a param sync before refit",
      severities=("error", "info"),
      rationale="With overlap_param_gather the updated parameter shards are only all-gathered at the next "
                "forward. Refit runs between the optimizer step and that forward, so every rank would export its "
                "own fresh shard next to stale copies of the others (wrong weights, no crash). The fix forces a "
                "synchronous parameter all-gather before the export.",
      seed="NeMo-RL #4086 (NeMo-RL fix 'synchronize parameters before inference refit': stale shards with "
           "overlap_param_gather=True; native-planner destinations differ before the gather, equal after).",
      fixes="Leave refit.sync_params_before_refit at auto (or on), or turn overlap_param_gather off.")
def sync_params(ctx: Context) -> None:
    dist = ctx.recipe.training.use_distributed_optimizer
    overlap = ctx.recipe.training.overlap_param_gather
    needed = bool(dist and overlap)
    why = (
        (
            "distributed optimizer with overlap_param_gather: updated shards are gathered only at the next "
            "forward (NeMo-RL #4086)"
        )
        if needed
        else "overlap_param_gather is off (parameters are current after the step)"
    )
    decide_switch(ctx, "sync_params_before_refit", needed=needed, why=why,
                  off_error="sync_params_before_refit is off with the distributed optimizer and "
                            "overlap_param_gather: refit would export stale parameter shards (wrong weights, no error)",
                  hint="set refit.sync_params_before_refit: auto, or training.overlap_param_gather: false")


@rule("RLC203", "EP > 1 or PP > 1 needs per-rank IPC metadata", severities=("error", "info"),
      rationale="Each trainer rank packs its own buffer (different tensors and order per rank once EP or PP "
                "split the model). If only rank 0's slicing metadata is sent, every vLLM worker slices its own "
                "buffer with rank 0's names and sizes: correct bytes load under wrong names, generation turns to "
                "coherent-looking garbage and rewards drop to zero, with no crash.",
      seed="SkyRL #1816 (SkyRL, Nemotron-3-Ultra, TP8/PP4/EP16): post-sync logprob diff 2.0 → 0.15 after sending "
           "per-GPU metadata; worked by luck at PP 2, broke at PP > 2 / EP > 16.",
      fixes="Leave refit.per_rank_ipc_metadata at auto (or on).")
def per_rank_metadata(ctx: Context) -> None:
    if uses_megatron(ctx.recipe):
        return  # vLLM's IPC stream only (RLC403 records it as n/a)
    tl = train_layout(ctx.recipe)
    needed = tl.ep > 1 or tl.pp > 1
    why = (f"EP{tl.ep} / PP{tl.pp}: trainer ranks pack different tensors (SkyRL #1816)" if needed
           else "on by default (needed once EP or PP > 1)")
    decide_switch(ctx, "per_rank_ipc_metadata", needed=needed, why=why, on_by_default=True,
                  off_error=f"per_rank_ipc_metadata is off with EP{tl.ep} / PP{tl.pp}: vLLM workers would slice "
                            "their buffers with rank 0's metadata and load correct bytes under wrong names",
                  hint="set refit.per_rank_ipc_metadata: auto")


@rule("RLC204", "fp32 router / expert bias must stay fp32 on the wire", severities=("error", "info"),
      rationale="Aux-loss-free MoE routers add a per-expert bias (e_score_correction_bias; Megatron expert_bias) "
                "of magnitude ~25-57 whose per-expert differences are ~7e-4. Sending it in bf16 rounds those "
                "differences away and corrupts routing. fp32_params: auto keeps the model's known fp32 "
                "parameters fp32; an explicit list must cover them.",
      seed="SkyRL #1816: 'fp32 MoE router bias (gate.e_score_correction_bias) preserved through sync — bf16 ULP at "
           "its ~25–57 magnitude collapses the tiny per-expert offsets (std ~7e-4) and corrupts routing'.",
      fixes="Use refit.fp32_params: auto, or add the missing pattern (e.g. '*e_score_correction_bias*').")
def fp32_params(ctx: Context) -> None:
    if uses_megatron(ctx.recipe):
        return  # vLLM's IPC stream only (RLC403 records it as n/a)
    key, path = "refit.fp32_params", f"{R}.fp32_params"
    value = ctx.recipe.refit.fp32_params
    f = ctx.facts
    known = list(f.fp32_params) if f is not None else []
    if value == "auto":
        if f is None:
            ctx.decide(key, [], "auto: model facts unknown; no fp32 parameters known")
            return
        patterns = [p.pattern for p in known]
        if patterns:
            ctx.decide(key, patterns, f"auto: {f.model_id} has {', '.join(patterns)} (router bias, SkyRL #1816)")
            ctx.info(f"fp32_params: auto → {patterns}: router bias kept fp32 (SkyRL #1816)", path)
        else:
            ctx.decide(key, [], f"auto: {f.model_id} has no known fp32 parameters")
        return
    missed = [p for p in known if not any(fnmatch.fnmatchcase(p.example, pat) for pat in value)]
    hf_missed = [p for p in missed if not p.example.startswith("decoder.")]
    if hf_missed:
        names = ", ".join(f"{p.example} ({p.pattern})" for p in hf_missed)
        ctx.error(f"fp32_params {list(value)} misses the model's fp32 parameter(s) {names}: {hf_missed[0].why}", path,
                  hint=f"use fp32_params: auto, or add {', '.join(repr(p.pattern) for p in hf_missed)}")


@rule("RLC205", "optimizer_cpu_offload with colocated vLLM raised GPU residency", severities=("warning", "info"),
      rationale="Megatron's hybrid CPU optimizer keeps extra GPU staging buffers (fp32 master / grad scaling), "
                "which the explicit offload before refit would otherwise drop: residency after the offload went "
                "up, not down, leaving less for the refit buffer.",
      seed="NeMo-RL #2471 attempt 3: 'Step 2 after-offload GPU residency went 12.72 GB (off) → 15.86 GB (on)'.",
      fixes="Set training.optimizer_cpu_offload: false and keep refit.offload_optimizer_for_refit: true, where the "
            "train step fits without the CPU optimizer; where it does not (verl's, slime's and SkyRL's large MoE "
            "layouts), the layout needs it and the extra residency is only reported (info).")
def cpu_offload(ctx: Context) -> None:
    if ctx.recipe.training.optimizer_cpu_offload and ctx.recipe.colocated:
        extra = ""
        if ctx.plan is not None and "refit" in ctx.plan.phases:
            try:
                extra = f" (planned: +{ctx.plan.item_gib('refit', 'CPU-offload staging'):.2f} GiB at refit)"
            except KeyError:
                extra = ""
        observed = f"optimizer_cpu_offload with colocated vLLM raised post-step GPU residency 12.72 → 15.86 GB in " \
                   f"NeMo-RL #2471{extra}"
        without = ctx.plan.train_gib_without_cpu_offload if ctx.plan is not None else None
        limit = ctx.plan.gpu_memory_gib if ctx.plan is not None else None
        if without is not None and limit is not None and without > limit:
            ctx.info(f"{observed}; this layout needs it: with the whole optimizer state on the GPU the train step "
                     f"would need {without:.2f} of {limit:.2f} GiB", "training.optimizer_cpu_offload")
            return
        ctx.warning(observed, "training.optimizer_cpu_offload",
                    hint="optimizer_cpu_offload: false; refit.offload_optimizer_for_refit: true does the offload")


@rule("RLC206", "buffer_gb and buffer_memory_ratio are mutually exclusive", severities=("error",),
      rationale="The IPC buffer is sized either from free memory (ratio) or as a fixed size; with both set it is "
                "unclear which one the author meant, and the runtime refuses it.",
      seed="rlc refit contract (rlc/runtime/refit/bucket_planner.py: exactly one of the two).",
      fixes="Remove one of refit.buffer_gb / refit.buffer_memory_ratio.")
def buffer_exclusive(ctx: Context) -> None:
    refit = ctx.recipe.refit
    if refit.buffer_gb is None:
        return
    set_ratio = ctx.user_set("refit.buffer_memory_ratio")
    if set_ratio is None:  # no raw recipe: a non-default ratio can only have come from the recipe
        set_ratio = refit.buffer_memory_ratio != default_at("refit.buffer_memory_ratio")
    if set_ratio:
        ctx.error(f"both refit.buffer_gb ({refit.buffer_gb}) and refit.buffer_memory_ratio "
                  f"({refit.buffer_memory_ratio}) are set", "refit.buffer_gb",
                  hint="keep one of them")


@rule("RLC207", "generation colocated with the trainer; refit transport", severities=("error", "warning"),
      rationale="rlc plans and runs generation colocated with the trainer: vLLM shares the trainer's GPUs, sleeps "
                "while it trains, and receives the weights through CUDA IPC on each GPU, which only works between "
                "processes on the same GPU. Generation on GPUs of its own (NeMo-RL's non-colocated mode, weights "
                "broadcast over NCCL) has neither a transport in the bundled runtime nor a memory plan. The "
                "shared-memory transport copies every tensor through host memory and is meant for tests.",
      seed="rlc runtime design (rlc/runtime/refit: CUDA IPC or shm buffers per GPU).",
      fixes="Keep colocated: true with transport cuda_ipc.")
def transport(ctx: Context) -> None:
    t = ctx.recipe.refit.transport
    if not ctx.recipe.colocated:
        ctx.error("colocated: false puts generation on GPUs of its own; rlc plans and runs generation colocated "
                  "with the trainer only (non-colocated generation, with the weights broadcast over NCCL, is not "
                  "supported)", "colocated",
                  hint="set colocated: true: the generation engine then shares the trainer's GPUs and sleeps while "
                       "it trains")
    elif t == "shm" and train_layout(ctx.recipe).world > 1:
        ctx.warning("refit.transport shm copies every weight through host memory (meant for tests)",
                    "refit.transport", hint="use transport: cuda_ipc")


@rule("RLC208", "overlap_param_gather needs the distributed optimizer", severities=("error",),
      rationale="Overlapping the parameter all-gather only exists for the distributed optimizer, which shards "
                "parameters over data-parallel ranks; Megatron rejects it otherwise.",
      seed="Megatron-core DistributedDataParallelConfig (overlap_param_gather requires use_distributed_optimizer).",
      fixes="Set training.use_distributed_optimizer: true or overlap_param_gather: false.")
def overlap_needs_dist(ctx: Context) -> None:
    if ctx.recipe.training.overlap_param_gather and not ctx.recipe.training.use_distributed_optimizer:
        ctx.error("overlap_param_gather needs use_distributed_optimizer: true", "training.overlap_param_gather",
                  hint="set training.overlap_param_gather: false")


@rule("RLC209", "fused expert transfer: on where every expert is whole on one GPU", severities=("info",),
      rationale="Per expert, a MoE refit moves one tensor per expert and projection (18,432 for Qwen3-30B-A3B) and "
                "vLLM's load_weights copies each into its slot of the layer's fused expert parameters; the cost is "
                "per tensor, not per byte. Fused, each layer's experts move as two stacked tensors copied straight "
                "into vLLM's w13_weight / w2_weight through a table checked every refit. auto turns it on for bf16 "
                "rollouts of a MoE model with gated, bias-free experts where every expert is whole on one GPU on "
                "both sides (the layouts whose copies have been checked bit for bit on a GPU); tensor- or "
                "expert-parallel layouts keep the per-expert path unless the recipe says on.",
      seed="Qwen3-30B-A3B on one H200 (benchmarks/refit_at_scale.py, docs/refit.md): 1.38 s median refit per "
           "expert, 0.33 s fused.",
      fixes="Nothing to fix; refit.fused_transfer: on opts a split layout in (check it with refit.verify_every).")
def fused_expert_transfer(ctx: Context) -> None:
    on, why = fused_transfer(ctx.recipe, ctx.facts)
    ctx.decide(f"{R}.fused_transfer", on, why)
    if on and ctx.recipe.refit.fused_transfer == "auto":
        ctx.info(f"fused_transfer: auto → {why}", f"{R}.fused_transfer")


@rule("RLC221", "offloading the trainer's parameters for generation needs the distributed optimizer",
      severities=("error",),
      rationale="refit.offload_params_for_generation moves Megatron's parameter buffers to host memory after the "
                "refit and back before the next logprob pass. Megatron gathers the parameters into one contiguous "
                "buffer per data-parallel bucket only with the distributed optimizer; without it the parameters "
                "are separate tensors the runtime does not move, so the switch would free nothing while the plan "
                "counts them in host memory.",
      seed="megatron-core 0.19 _ParamAndGradBuffer: param_data is allocated only with use_distributed_optimizer; "
           "offload_to_cpu(move_params=True) moves param_data.",
      fixes="Set training.use_distributed_optimizer: true, or turn refit.offload_params_for_generation off.")
def params_offload_needs_distributed_optimizer(ctx: Context) -> None:
    if ctx.recipe.refit.offload_params_for_generation and not ctx.recipe.training.use_distributed_optimizer:
        ctx.error("offload_params_for_generation needs the distributed optimizer (Megatron keeps the parameters in "
                  "its contiguous buffers only then)", f"{R}.offload_params_for_generation",
                  hint="set training.use_distributed_optimizer: true, or refit.offload_params_for_generation: false")


@rule("RLC223", "vLLM's weights kept awake cannot also sleep at level 2", severities=("error",),
      rationale="refit.keep_weights_awake puts only vLLM's KV cache to sleep: the weight shard stays on the GPU "
                "through the train step and the refit writes into it. refit.sleep_level says what vLLM's own sleep "
                "does with the weights (1 backs them up to host memory, 2 discards them); level 2 asks for the "
                "opposite of keeping them, so the two settings contradict each other and the plan could count "
                "only one of them.",
      seed="vLLM Worker.sleep (level 1 offloads the 'weights' tag, level 2 discards every tag); rlc's KV-only sleep "
           "(rlc/runtime/generation/extension.py).",
      fixes="Keep refit.keep_weights_awake: true and leave refit.sleep_level at 1, or turn keep_weights_awake off.")
def weights_awake_vs_sleep_level(ctx: Context) -> None:
    refit = ctx.recipe.refit
    if refit.keep_weights_awake and refit.sleep_level == 2:
        ctx.error("refit.keep_weights_awake keeps vLLM's weights on the GPU, and refit.sleep_level 2 discards them "
                  "at every sleep", f"{R}.keep_weights_awake",
                  hint="drop refit.sleep_level (or set it to 1), or set refit.keep_weights_awake: false")


@rule("RLC224", "Direct export, zero-copy views and replayed load move bf16 tensors only", severities=("error",),
      rationale="refit.direct_export hands vLLM views of the trainer's bf16 parameters (refit.zero_copy_views lets "
                "vLLM read them where the trainer holds them, refit.zero_copy_experts the experts too) and "
                "refit.replay_load replays "
                "the plain copies vLLM's loader made of them. FP8 rollouts load every refit inside vLLM's layerwise "
                "reload, which quantizes what it loads (and, with block scales, the trainer quantizes the stream "
                "first): neither a view of a bf16 parameter nor a recorded copy is what lands in the engine. The "
                "runtime would leave both off; the compiler says so instead of accepting a switch that does nothing.",
      seed="vLLM initialize_layerwise_reload / finalize_layerwise_reload (the FP8 refit path); rlc's replayed load "
           "(rlc/runtime/refit/replay.py).",
      fixes="Turn refit.direct_export, refit.zero_copy_views, refit.zero_copy_experts and refit.replay_load off for "
            "generation.precision: fp8.")
def direct_paths_need_bf16_rollouts(ctx: Context) -> None:
    for key in BF16_REFIT_SWITCHES:
        requested = bool(getattr(ctx.recipe.refit, key))
        on, why = bf16_switch_applies(key, requested, ctx.recipe.generation.precision)
        if requested and not on:
            ctx.error(f"refit.{key} moves bf16 tensors; {why.removeprefix('off: ')}", f"{R}.{key}",
                      hint=f"set refit.{key}: false with generation.precision: fp8")


@rule("RLC225", "Zero-copy views are the direct export's views", severities=("error",),
      rationale="refit.zero_copy_views lets vLLM read in place the tensors refit.direct_export found to be views of "
                "the trainer's parameters. Without the direct export every tensor comes out of Megatron-Bridge's "
                "conversion, a new tensor per refit, and none is read in place: the switch would do nothing.",
      seed="rlc's direct export (rlc/runtime/policy/direct_export.py) and zero-copy refit buckets "
           "(rlc/runtime/refit/producer_run.py).",
      fixes="Turn refit.direct_export on with refit.zero_copy_views, or turn refit.zero_copy_views off.")
def zero_copy_views_need_direct_export(ctx: Context) -> None:
    refit = ctx.recipe.refit
    if refit.zero_copy_views and not refit.direct_export:
        ctx.error("refit.zero_copy_views reads the direct export's views in place, and refit.direct_export is off",
                  f"{R}.zero_copy_views", hint="set refit.direct_export: true, or refit.zero_copy_views: false")


@rule("RLC226", "The KV cache wakes during the transfer only when the weights stay awake", severities=("error",),
      rationale="refit.wake_kv_during_transfer maps vLLM's KV cache back from inside the refit, while the weights "
                "arrive. It does so for rlc's KV-only sleep (refit.keep_weights_awake), which rlc tracks itself. "
                "vLLM's own sleep (levels 1 and 2) tracks what sleeps in the engine, which wakes it through its "
                "own call after the weights: waking the KV cache behind its back would leave the engine asleep in "
                "its own books, and the weights must be back on the GPU before they are written anyway.",
      seed="vLLM's executor sleep bookkeeping (sleeping_tags); rlc's KV-only sleep (rlc/runtime/generation/"
           "extension.py).",
      fixes="Turn refit.keep_weights_awake on with refit.wake_kv_during_transfer, or turn the latter off.")
def kv_wake_needs_weights_awake(ctx: Context) -> None:
    refit = ctx.recipe.refit
    if refit.wake_kv_during_transfer and not refit.keep_weights_awake:
        ctx.error("refit.wake_kv_during_transfer wakes the KV cache of rlc's KV-only sleep, and "
                  "refit.keep_weights_awake is off", f"{R}.wake_kv_during_transfer",
                  hint="set refit.keep_weights_awake: true, or refit.wake_kv_during_transfer: false")


@rule("RLC227", "The KV cache stays awake only with the weights, and then nothing wakes it", severities=("error",),
      rationale="refit.keep_kv_cache_awake keeps vLLM's KV cache on the GPU between rollouts, so that the engine does "
                "not sleep at all. The weights are the smaller part of that memory and the part every refit writes; "
                "keeping the KV pool while the weights sleep (vLLM's own levels release every tag) is not a state "
                "vLLM has, so the switch needs refit.keep_weights_awake. With the KV cache never asleep, "
                "refit.wake_kv_during_transfer would have nothing to map back.",
      seed="vLLM Worker.sleep (levels 1 and 2 release the kv_cache tag); verl's rollout.free_cache_engine "
           "(false keeps the KV cache between rollouts).",
      fixes="Set refit.keep_weights_awake: true with refit.keep_kv_cache_awake, and refit.wake_kv_during_transfer: "
            "false; or turn refit.keep_kv_cache_awake off.")
def kv_awake_needs_weights_awake(ctx: Context) -> None:
    refit = ctx.recipe.refit
    if not refit.keep_kv_cache_awake:
        return
    if not refit.keep_weights_awake:
        ctx.error("refit.keep_kv_cache_awake keeps vLLM's KV cache on the GPU, and refit.keep_weights_awake is off "
                  "(vLLM's sleep would release the KV cache with the weights)", f"{R}.keep_kv_cache_awake",
                  hint="set refit.keep_weights_awake: true, or refit.keep_kv_cache_awake: false")
    if refit.wake_kv_during_transfer:
        ctx.error("refit.wake_kv_during_transfer maps back a KV cache that refit.keep_kv_cache_awake never puts to "
                  "sleep", f"{R}.wake_kv_during_transfer",
                  hint="set refit.wake_kv_during_transfer: false (nothing to wake), or refit.keep_kv_cache_awake: "
                       "false")


@rule("RLC228", "Experts read in place are fused-transfer stacks read like zero-copy views", severities=("error",),
      rationale="refit.zero_copy_experts reads the stacked experts of refit.fused_transfer where the trainer holds "
                "them, through the storage sharing of refit.zero_copy_views. Without fused transfer the experts "
                "travel one tensor per expert out of Bridge's conversion, and without zero-copy views nothing is "
                "shared: the switch would do nothing.",
      seed="rlc's fused expert transfer (rlc/runtime/policy/fused_export.py) and zero-copy buckets "
           "(rlc/runtime/refit/producer_run.py).",
      fixes="Turn refit.zero_copy_views on and refit.fused_transfer to auto or on with refit.zero_copy_experts, or "
            "turn refit.zero_copy_experts off.")
def zero_copy_experts_need_views_and_fused_transfer(ctx: Context) -> None:
    refit = ctx.recipe.refit
    if not refit.zero_copy_experts:
        return
    missing = [k for k, on in (("refit.zero_copy_views", refit.zero_copy_views),
                               ("refit.fused_transfer", refit.fused_transfer != "off")) if not on]
    if missing:
        ctx.error(f"refit.zero_copy_experts reads fused-transfer stacks through zero-copy views, and "
                  f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} off", f"{R}.zero_copy_experts",
                  hint="set " + " and ".join(f"{k}: {'true' if k.endswith('views') else 'auto'}" for k in missing)
                  + ", or refit.zero_copy_experts: false")
