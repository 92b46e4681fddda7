"""RLC21x: memory rules, judged on the memory plan (rlc.compiler.planner).

The numbers in the messages are the planner's; ``rlc plan`` shows the full arithmetic.
"""
from __future__ import annotations

from typing import Any, Optional

from rlc.compiler.planner.memory import DRAFTER_LABEL, VLLM_SHARD_LABEL
from rlc.compiler.planner.refit_math import KEPT_BUFFERS_LABEL
from rlc.compiler.planner.residency import KV_KEPT_AWAKE, KV_WOKEN_DURING_TRANSFER
from rlc.compiler.planner.plan import GIB
from rlc.compiler.planner.verify_host import LABEL as VERIFY_CHECK_LABEL
from rlc.compiler.rules.engine import Context, rule


def _buffer_path(ctx: Context) -> str:
    return "refit.buffer_gb" if ctx.recipe.refit.buffer_gb is not None else "refit.buffer_memory_ratio"


def _fix_hint(plan: Any, limit: int = 3) -> Optional[str]:
    sufficient = [f.text for f in plan.fixes if f.sufficient]
    if not sufficient:
        return plan.fixes[0].text if plan.fixes else None
    return "; or ".join(sufficient[:limit])


def _held_gib(plan: Any, phase: str, labels: tuple[str, ...]) -> float:
    """GiB of the items of ``phase`` with one of ``labels`` (0 when the plan has no such phase)."""
    held = plan.phases.get(phase)
    return sum(i.gib or 0.0 for i in held.items if i.label in labels) if held is not None else 0.0


def kept_buffers_hint(plan: Any, phase: str) -> str:
    """``; refit.keep_buffers_gb: 0 frees ...`` where the phase holds the IPC halves kept between refits."""
    kept = _held_gib(plan, phase, (KEPT_BUFFERS_LABEL,))
    return f"; refit.keep_buffers_gb: 0 frees the {kept:.2f} GiB of IPC halves kept between refits" if kept else ""


def _refit_hint(ctx: Context) -> Optional[str]:
    """The plan's fixes for a refit that does not fit, and what the KV cache mapped during the refit frees (it is
    there only because a switch keeps it there)."""
    hint = _fix_hint(ctx.plan)
    kv = _held_gib(ctx.plan, "refit", (KV_KEPT_AWAKE.label, KV_WOKEN_DURING_TRANSFER.label))
    if not kv:
        return hint
    key = "keep_kv_cache_awake" if ctx.recipe.refit.keep_kv_cache_awake else "wake_kv_during_transfer"
    freed = f"refit.{key}: false frees the {kv:.2f} GiB of vLLM's KV cache mapped during the refit"
    return f"{hint}; or {freed}" if hint else freed


def kept_awake_hint(ctx: Context, phase: str) -> str:
    """``; refit.keep_weights_awake: false frees ...`` (and ``refit.keep_kv_cache_awake: false frees ...``) where the
    phase holds vLLM's weights (its KV cache) only because they are kept awake (vLLM's own sleep takes them off the
    GPU)."""
    refit = ctx.recipe.refit
    if not refit.keep_weights_awake:
        return ""
    hint = ""
    if refit.keep_kv_cache_awake:
        kv = _held_gib(ctx.plan, phase, (KV_KEPT_AWAKE.label,))
        if kv:
            hint = f"; refit.keep_kv_cache_awake: false frees the {kv:.2f} GiB of vLLM's KV cache kept on the GPU"
    kept = _held_gib(ctx.plan, phase, (VLLM_SHARD_LABEL, DRAFTER_LABEL))
    if kept:
        hint += f"; refit.keep_weights_awake: false frees the {kept:.2f} GiB of vLLM weights kept on the GPU"
    return hint


@rule("RLC210", "each IPC ping-pong half must hold the largest exported tensor", severities=("error",),
      needs=("plan",),
      rationale="The refit buffer is free × buffer_memory_ratio (or buffer_gb), split into two ping-pong halves; "
                "a tensor must fit one half. Fused expert stacks are the largest tensors of big MoE models "
                "(Qwen3.5-397B: experts.gate_up_proj = 512 × 2 × 1024 × 4096 × 2 B = 8 GiB) and their size is set "
                "by the architecture: a larger vLLM EP does not shrink them (the exporter stacks all experts).",
      seed="NeMo-RL #2471 failure 2: 'AssertionError: Parameter model.language_model.layers.0.mlp.experts.gate_up_proj "
           "too large for buffer: 8589934592 > 6263046144' (ratio 0.3; the // 2 ping-pong split was missed).",
      fixes="Raise buffer_memory_ratio within the window the plan names, or free memory first: a larger "
            "generation EP, enforce_eager, vLLM's KV cache asleep at the refit (refit.keep_kv_cache_awake and "
            "refit.wake_kv_during_transfer off; see `rlc plan`).")
def buffer_half(ctx: Context) -> None:
    plan = ctx.plan
    check = plan.checks.get("buffer")
    if check is None or check.ok:
        return
    r = plan.refit
    name, size = r.wire
    what = (
        "the largest tensor on the wire (FP8 rollouts)" if r.wire_largest is not None else "the largest exported tensor"
    )
    ctx.error(f"refit buffer: each ping-pong half is {r.per_side / GIB:.2f} GiB ({r.per_side / 1e9:.2f} GB = "
              f"{r.buffer_source} / 2) but {what} {name} is "
              f"{size / GIB:.2f} GiB ({size} bytes); the transfer would assert "
              f"'{size} > {r.per_side}'", _buffer_path(ctx), hint=_refit_hint(ctx))


@rule("RLC211", "the export staging site must have room to stack the largest tensor", severities=("error",),
      needs=("plan",),
      rationale="After both buffer halves are allocated, the exporter all-gathers the largest tensor's pieces "
                "(e.g. every expert across EP) and torch.stack()s them: the tensor is needed AGAIN on top of its "
                "gathered pieces. A larger buffer leaves less room here, and a half that only just exceeds the "
                "tensor fragments the caching allocator (NeMo-RL #2471: ratio 0.45 → +5.75 GiB reserved-but-unusable). "
                "Judged only when the buffer half already holds the tensor (RLC210).",
      seed="NeMo-RL #2471 attempt 1 (ratio 0.5): 'torch.OutOfMemoryError: CUDA out of memory. "
           "Tried to allocate 8.00 GiB. "
           "GPU 0: total 79.11 GB, free 6.76 GB. Megatron worker process: 44.90 GB. vLLM process: 27.40 GB.' at "
           "model_bridge.py:815 _accumulate_grouped_export; attempt 5 (ratio 0.45): fragmentation 7.04 GB.",
      fixes="Use a ratio inside the plan's window, or free memory (larger generation EP, enforce_eager, vLLM's KV "
            "cache asleep at the refit).")
def staging_site(ctx: Context) -> None:
    plan = ctx.plan
    check, buffer = plan.checks.get("stack"), plan.checks.get("buffer")
    if check is None or check.ok or (buffer is not None and not buffer.ok):
        return
    r = plan.refit
    ctx.error(f"export staging: after the IPC buffer (2 × {r.per_side / GIB:.2f} GiB) the exporter holds the "
              f"gathered pieces of {r.largest_name} ({r.gathered / GIB:.2f} GiB) and torch.stack needs "
              f"{r.largest / GIB:.2f} GiB more, but only {r.free_at_stack / GIB:.2f} GiB would be free "
              f"({r.free_at_refit / GIB:.2f} free at refit − {2 * r.per_side / GIB:.2f} buffer − "
              f"{r.gathered / GIB:.2f} gathered − {r.staging_overhead / GIB:.2f} staging − "
              f"{r.fragmentation / GIB:.2f} fragmentation)", _buffer_path(ctx), hint=_refit_hint(ctx))


@rule("RLC212", "CUDA-graph residue after step 1 can eat the refit margin", severities=("warning",),
      needs=("plan",),
      rationale="With enforce_eager off, vLLM records CUDA graphs as it meets new shapes; their buffers are not "
                "released by sleep and by step 2 they hold several GiB more than at the first refit. A refit that "
                "passes with less margin than that variation fails intermittently from step 2 on.",
      seed="NeMo-RL #2471 failure 3: 'Step 1 refit ran cleaner than Step 2' with EP 128 / ratio 0.4; CUDA graphs add "
           "'~10–15 GB of non-cumem buffers that CuMemAllocator.sleep() cannot release'.",
      fixes="enforce_eager: true (costs ~30–40% generation throughput); or widen the margin (larger generation "
            "EP).")
def graph_margin(ctx: Context) -> None:
    plan = ctx.plan
    r = plan.refit
    if r is None or ctx.recipe.generation.enforce_eager or r.tolerance_gib is None:
        return
    if r.tolerance_gib >= plan.graph_uncertainty_gib:
        return
    levers = [f.text.split(";")[0] for f in plan.fixes if f.key in ("generation.enforce_eager", "refit.sleep_level")]
    ctx.warning(
        f"refit passes now (per side {r.buffer_margin / GIB:+.2f} GiB, staging site {r.stack_margin / GIB:+.2f} "
        f"GiB) but {r.tolerance_gib:.2f} GiB more vLLM residue would break it; with enforce_eager off the "
        f"CUDA-graph residue after step 1 varies by ~{plan.graph_uncertainty_gib:.0f} GiB",
        "generation.enforce_eager",
        hint="; or ".join(levers) or "enforce_eager: true",
    )


@rule("RLC213", "tight refit with sleep level 1 where level 2 would free GPU memory at the refit",
      severities=("warning",), needs=("plan",),
      rationale="Sleep level 1 backs vLLM's weights up in host memory, level 2 discards them. Whether that frees "
                "GPU memory at the refit depends on what the refit wakes first: NeMo-RL and the bundled runtime "
                "wake the weights (wake_up(tags=['weights'])) before sizing the buffer, and vLLM re-creates the "
                "discarded allocations then, so in every vLLM version of the sleep table the shard is on the GPU "
                "at the refit at either level and this rule stays silent (level 2 still saves the host copy, "
                "RLC219). It warns only where the planned version's level 2 leaves the shard off the GPU.",
      seed="NeMo-RL #2471 failure 3: sleep(level=2) + enforce_eager took vLLM's residue from ~24 GB to ~7 GB "
           "(measured while asleep).",
      fixes="refit.sleep_level: 2, where the plan shows it frees memory at the refit.")
def sleep_level(ctx: Context) -> None:
    plan = ctx.plan
    r = plan.refit
    if r is None or ctx.recipe.refit.sleep_level != 1 or not ctx.recipe.generation.enforce_eager:
        return  # with enforce_eager off RLC212 already names the levers
    if r.tolerance_gib is None or r.tolerance_gib >= plan.graph_uncertainty_gib:
        return
    lever = next((f for f in plan.fixes if f.key == "refit.sleep_level"), None)
    if lever is None:
        return  # level 2 frees nothing at the refit in this vLLM version (the weights are woken first)
    ctx.warning(f"refit margin is only {r.tolerance_gib:.2f} GiB of free memory with sleep_level 1",
                "refit.sleep_level", hint=lever.text.split(";")[0])


@rule("RLC214", "vLLM's weights must fit in gpu_memory_utilization", severities=("error",), needs=("plan",),
      rationale="gpu_memory_utilization caps vLLM's pool (weights + KV cache + activations) while it is awake; "
                "if the weight shard alone exceeds it there is no KV cache and the engine refuses to start. "
                "Colocated, the rest of the GPU must also hold what Megatron keeps after the refit: the bundled "
                "runtime keeps the bf16 parameters there unless refit.offload_params_for_generation moves them "
                "to host memory (as NeMo-RL, verl, slime and SkyRL do before they generate).",
      seed="vLLM engine start-up ('No available memory for the cache blocks'); NeMo-RL #2471 attempt 2 shows the "
           "knob only sizes the KV cache.",
      fixes="Raise gpu_memory_utilization, or shard vLLM further (TP / EP / PP); where generation overfills the GPU "
            "only with the trainer's parameters on it, set refit.offload_params_for_generation: true.")
def generation_fits(ctx: Context) -> None:
    plan = ctx.plan
    for key in ("generate_fit", "generate_total"):
        check = plan.checks.get(key)
        if check is not None and check.ok is False:
            if key == "generate_total" and plan.generate_fix is not None and plan.generate_fix.sufficient:
                # generation overfills only because the trainer's parameters stay on the GPU
                ctx.error(check.text + " with the trainer's bf16 parameters on the GPU", plan.generate_fix.key,
                          hint=plan.generate_fix.text)
                continue
            hint = "raise gpu_memory_utilization or a larger vLLM TP / EP" if key == "generate_fit" else \
                "lower gpu_memory_utilization"
            if key == "generate_total" and plan.generate_fix is not None:
                hint += f"; {plan.generate_fix.text}"
            if key == "generate_total":
                hint += kept_buffers_hint(plan, "generate")
            ctx.error(check.text, "generation.gpu_memory_utilization", hint=hint)


@rule("RLC229", "vLLM's KV cache must hold one request of max_model_len tokens", severities=("error",),
      needs=("plan",),
      rationale="vLLM refuses to start when its KV cache cannot hold one request as long as max_model_len: the "
                "cache is what gpu_memory_utilization leaves beside the weights and the profiled activations (or "
                "kv_cache_memory_bytes). The plan counts at least what one such request takes per GPU (the layers "
                "that keep every token: 2 × KV heads on the rank × head dim, or the latent and rotary key of "
                "multi-latent attention, in the cache's dtype) against at most what the cache can get (the budget "
                "less the weight shard, the activations not taken off), so it fires only where vLLM cannot start. "
                "Long-context recipes meet it when they raise max_model_len without more memory or more tensor "
                "parallelism.",
      seed="vLLM 0.22 vllm/v1/core/kv_cache_utils.py ('To serve at least one request with the model's max seq len "
           "(...), (... GiB KV cache is needed, which is larger than the available KV cache memory').",
      fixes="Raise generation.gpu_memory_utilization (or kv_cache_memory_bytes), shard the KV heads over more vLLM "
            "tensor parallelism, or lower generation.max_model_len.")
def kv_cache_holds_a_request(ctx: Context) -> None:
    check = ctx.plan.checks.get("generate_kv_request")
    if check is None or check.ok is not False or check.need_gib is None or check.have_gib is None:
        return
    r = ctx.recipe
    per_token = check.need_gib / r.generation.max_model_len  # GiB a token
    fits = max(0, int(check.have_gib / per_token)) if per_token > 0 else 0
    key = "generation.kv_cache_memory_bytes" if r.generation.kv_cache_memory_bytes is not None else \
        "generation.gpu_memory_utilization"
    ctx.error(f"vLLM's KV cache cannot hold one request: {check.text}; vLLM refuses to start ('To serve at least "
              "one request with the model's max seq len')", key,
              hint=f"lower generation.max_model_len to at most {fits}, give the KV cache at least "
                   f"{check.need_gib - check.have_gib:.2f} GiB more per GPU, or raise parallelism.generation.tp")


@rule("RLC215", "the train step must fit (parameters, grads, optimizer state, vLLM asleep)",
      severities=("error", "warning"), needs=("plan",),
      rationale="Megatron holds bf16 params and grads and, with the distributed optimizer, 12 bytes per "
                "parameter of fp32 master + Adam moments sharded over DP (experts over expert-DP) while vLLM "
                "sleeps on the same GPU, and the last pipeline stage the loss's fp32 logits and log-softmax of one "
                "micro batch (2 × tokens × vocabulary / TP × 4 bytes). If that alone exceeds the GPU, no "
                "activation memory is left. With generation.backend: megatron the plan also counts the step's "
                "saved activations of one micro batch (an estimate after Korthikanti et al. 2022, Table 2, an "
                "upper bound): the step without the estimate must fit (error); with it, a step that does not fit "
                "is a warning.",
      seed="First principles; residues from the calibration table.",
      fixes="More pipeline / expert parallelism, or more data parallelism for the optimizer shards (vLLM's sleep "
            "level does not change the train step: both levels take the weight shard off the GPU, unless "
            "refit.keep_weights_awake keeps it there); for the "
            "activations, training.activation_checkpointing: full, a smaller micro batch, or more TP with "
            "sequence_parallel.")
def train_fits(ctx: Context) -> None:
    check = ctx.plan.checks.get("train_fit")
    megatron = ctx.plan.backend == "megatron"
    if check is not None and check.ok is False:
        ctx.error(check.text + ("" if megatron else " (other activations not yet counted)"), "parallelism.train",
                  hint="raise PP / EP or DP" + kept_buffers_hint(ctx.plan, "train") + kept_awake_hint(ctx, "train"))
        return
    estimated = ctx.plan.checks.get("train_activations_fit")
    if estimated is not None and estimated.ok is False:
        ctx.warning(estimated.text, "training.activation_checkpointing",
                    hint="training.activation_checkpointing: full, a smaller training.micro_batch_size (or "
                         "training.sequence_packing.train_mb_tokens), or more parallelism.train.tp with "
                         "sequence_parallel: true")


#: The HF config.json key that states each architecture fact (for the "set this key" hint).
FACT_KEYS = {
    "num_layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab": "vocab_size",
    "tied_embeddings": "tie_word_embeddings", "num_experts": "num_experts (n_routed_experts)",
    "experts_per_tok": "num_experts_per_tok", "moe_intermediate": "moe_intermediate_size",
    "shared_expert_intermediate": "shared_expert_intermediate_size (moe_shared_expert_intermediate_size)",
    "dense_intermediate": "intermediate_size", "layer_kinds": "layer_types (hybrid_override_pattern)",
    "mtp_num_layers": "num_nextn_predict_layers (mtp_num_hidden_layers)",
    "mtp_shared_embedding": "mtp_use_dedicated_embeddings", "mtp_layer_kinds": "mtp_hybrid_override_pattern",
    "expert_export": "(the checkpoint's expert layout)",
}


#: The config key that states a fact, where a family names it differently from FACT_KEYS' first name.
_FAMILY_KEYS = {
    "nemotron_h": {
        "num_experts": "n_routed_experts",
        "shared_expert_intermediate": "moe_shared_expert_intermediate_size",
        "layer_kinds": "hybrid_override_pattern",
        "mtp_num_layers": "num_nextn_predict_layers",
    },
    "deepseek_v3": {
        "num_experts": "n_routed_experts",
        "shared_expert_intermediate": "n_shared_experts",
        "mtp_num_layers": "num_nextn_predict_layers",
    },
    "glm4_moe": {
        "num_experts": "n_routed_experts",
        "shared_expert_intermediate": "n_shared_experts",
        "mtp_num_layers": "num_nextn_predict_layers",
    },
    "qwen3_5_moe": {"mtp_num_layers": "mtp_num_hidden_layers"},
}


def override_key(family: str, fact: str) -> str:
    """The ``model.overrides`` key that supplies ``fact`` for a model of ``family``."""
    return _FAMILY_KEYS.get(family, {}).get(fact) or FACT_KEYS.get(fact, fact).split(" ")[0]


@rule("RLC216", "a model fact the plan needs is stated by no source", severities=("error", "warning"),
      needs=("facts",),
      rationale="The layout checks and the memory plan are computed from the model's architecture: layers, widths, "
                "heads, vocabulary, whether the output layer shares the embedding, experts, MTP. rlc reads them from "
                "the checkpoint's own config.json (its folder, the Hugging Face cache, the Hub) and the shipped "
                "catalog, and guesses none. A plan missing one would check nothing where it matters and read as a "
                "pass, so the recipe does not compile until the fact is supplied.",
      seed="rlc/compiler/catalog/models/SOURCES.md (Nemotron-3-Ultra's geometry is not public; Nemotron-3-Super's "
           "tie_word_embeddings was missing from the catalog).",
      fixes="Make the checkpoint's config.json reachable (model.checkpoint: a folder holding it on this machine, or "
            "the Hugging Face cache: `huggingface-cli download MODEL config.json`), or set the missing keys under "
            "model.overrides (e.g. model.overrides: {tie_word_embeddings: false}), or point model.config at the "
            "real config.json.")
def unknown_figures(ctx: Context) -> None:
    facts = ctx.facts
    missing = list(getattr(facts, "unknown", ()) or ())
    if not missing:  # figures not computed for another reason: say which, the facts are all there
        for item in (ctx.plan.unknown if ctx.plan is not None else ()):
            ctx.warning(f"memory plan: {item} — not checked", "model.id")
        return
    keys = [override_key(facts.family, f) for f in missing]
    named = ", ".join(f"{f} ({k})" for f, k in zip(missing, keys))
    looked = "; ".join(facts.searched) or facts.source
    block = ", ".join(k + ": ..." for k in keys if not k.startswith("("))
    ctx.error(f"{facts.model_id}: the plan needs {named}, which no source rlc read states. rlc looked in: "
              f"{looked}", "model.id",
              hint=f"set model.overrides: {{{block}}} from the model's config.json, or make the checkpoint's "
                   "config.json reachable (model.checkpoint: a folder holding it; or the Hugging Face cache: "
                   "`huggingface-cli download MODEL config.json`)")


@rule("RLC218", "model facts taken from a related catalog entry or overridden", severities=("info",),
      needs=("facts",),
      rationale="An Instruct / Base / FP8 release of a catalogued model has the same architecture, so it is "
                "planned with the base entry; model.overrides replace facts of the entry. Both are stated so a "
                "reader of the plan knows which facts it used.",
      seed="Catalog lookup (rlc/compiler/catalog/models.py).",
      fixes="Nothing to fix; set model.config to plan from the checkpoint's own config.json instead.")
def facts_provenance(ctx: Context) -> None:
    for note in getattr(ctx.facts, "notes", ()) or ():
        if "checkpoint variant" in note or note.startswith("model.overrides"):
            ctx.info(note, "model.overrides" if note.startswith("model.overrides") else "model.id")


@rule("RLC217", "calibration measured on another GPU", severities=("info",), needs=("plan",),
      rationale="Contexts, residues and fragmentation are calibrated per GPU type and library version; when none "
                "exists for this GPU the planner uses the nearest entry and says so.",
      seed="rlc/compiler/planner/calibration.yaml.",
      fixes="Run once with calibration records on (docs/planner.md) and add an entry.")
def calibration_fallback(ctx: Context) -> None:
    for note in ctx.plan.notes:
        if note.startswith("no calibration measured"):
            ctx.info(note, "cluster.gpu")


@rule("RLC219", "host memory per node must hold sleep level 1's weight copy and the offloaded optimizer",
      severities=("error", "info"), needs=("plan",),
      rationale="vLLM's sleep level 1 copies every GPU's weight shard into pinned host memory (each allocation "
                "in a block PyTorch rounds up to a power of two: about 1.4 × the weights of an MoE shard), and "
                "offload_optimizer_for_refit moves gradients and Adam moments (and the fp32 master weights with the "
                "precision-aware optimizer) there for the refit. On a node that is the per-GPU figure times the GPUs "
                "per node; above Ray's memory-monitor threshold (95 % of host memory by default) Ray kills workers. "
                "Level 2 discards the weights instead: the refit re-sends every weight anyway. refit.verify_every's "
                "check adds its host memory to the refit phase: a few shards per GPU with bf16 rollouts, the whole "
                "export and two copies of vLLM's weights per GPU with FP8 rollouts.",
      seed="vime #191: GLM-4.5-Air on 16 × GB200, sleep level 1 peaked at 841 of 882 GB host memory (95 %) and Ray "
           "killed the job; level 2 peaked at ~520 GB. NeMo-RL PR #2523: Nemotron-Super ran out of CPU memory on a "
           "cluster with ~50 GB less host memory per node until sleep level 2.",
      fixes="refit.sleep_level: 2 (frees the weight copy); set cluster.host_memory_gib to the nodes' real memory; "
            "or fewer GPUs per node / larger vLLM sharding; refit.verify_every: 0 where the check is what fills it. "
            "(Info: with training.offload_copies_gradients the plan "
            "counts gradient copies the bundled runtime does not make, and says how much.)")
def host_memory(ctx: Context) -> None:
    host = ctx.plan.host
    if host is None:
        return
    grads = host.item_gib("Megatron grads (offloaded)")
    if ctx.recipe.training.offload_copies_gradients and grads:
        ctx.info(f"the plan counts {grads:.1f} GiB per node of gradient copies in host memory (the framework this "
                 "recipe describes backs the gradient buffers up); the bundled runtime frees them instead (they "
                 f"hold nothing between the optimizer step and the next zero_grad), so it uses {grads:.1f} GiB "
                 "less host memory than planned", "training.offload_copies_gradients",
                 hint="set training.offload_copies_gradients: false to plan the bundled runtime's host memory")
    if host.limit_gib is None:
        ctx.info(f"host memory per node not checked: {host.node_source}", "cluster.host_memory_gib")
        return
    if host.ok:
        return
    copy = host.item_gib("vLLM weight copy (sleep level 1)")
    check = host.item_gib(VERIFY_CHECK_LABEL)
    parts = ", ".join(f"{i.label} {i.gib:.0f}" for i in host.items if i.gib)
    level_2 = bool(copy) and not ctx.recipe.generation.drafts_with_mtp  # level 2 discards the MTP drafter (RLC314)
    over = host.used_gib - host.limit_gib
    if check >= over and check >= copy:
        path = "refit.verify_every"
        hint = (f"the bit-exact check takes {check:.0f} GiB per node"
                + (" (FP8 rollouts gather the whole export on every GPU)" if ctx.recipe.generation.precision == "fp8"
                   else "") + "; run it on a smaller model or layout, or set refit.verify_every: 0")
    elif level_2:
        path = "refit.sleep_level"
        hint = f"sleep_level: 2 frees the {copy:.0f} GiB weight copy per node (then {host.used_gib - copy:.0f} GiB)"
    else:
        path = "cluster.host_memory_gib"
        hint = ("set cluster.host_memory_gib to the nodes' real memory, or use fewer GPUs per node"
                + ("; sleep level 2 would discard the MTP drafter's weights (RLC314)" if copy else ""))
    ctx.error(f"host memory per node in the {host.phase} phase: {host.used_gib:.0f} GiB ({parts}) > "
              f"{host.limit_gib:.0f} GiB, Ray's 95 % memory-monitor threshold of {host.node_gib:.0f} GiB "
              f"({host.node_source})", path, hint=hint)


@rule("RLC220", "vLLM's after-sleep residue grows over steps in this vLLM version (MoE)",
      severities=("error", "warning"), needs=("plan", "facts"),
      rationale="With vLLM 0.20 the memory a sleeping MoE engine keeps grew from step to step (4.1 → 11.6 → 25 GiB), "
                "so a train step that fits at step 1 runs out of memory from step 2, in the logprob / loss pass "
                "whose fp32 logits over the whole vocabulary are the largest activation at tensor parallelism 1. "
                "The planner adds the reported growth (runtime calibration records, per step) to the train step "
                "with the loss's logits (train_late) and to the logprob pass (logprob_late). A larger trainer TP "
                "splits the logits and the dense weights. A run that fits at step 1 and runs out of memory at step "
                "2 still fails, so this is an error where the growth was recorded on the planned vLLM version's "
                "release series; the sleep table carries it to later versions as a projection, and there it is a "
                "warning (SkyRL's published Qwen3-30B-A3B run on vLLM 0.26.0 ran steps the projection puts 0.1 GiB "
                "over the GPU).",
      seed="NeMo-RL #2619: Qwen3.5-35B-A3B on 2 × 8 GPUs, trainer TP1 / EP16, OOM in the logprob path after the "
           "vLLM 0.17.1 → 0.20.0 bump; fixed by TP2 with expert_tensor_parallel_size 1 and sequence_parallel.",
      fixes="Raise parallelism.train.tp (with sequence_parallel: true and etp: 1), or keep the vLLM version whose "
            "residue does not grow; record calibration from your own runs to replace the reported growth.")
def residue_growth(ctx: Context) -> None:
    plan = ctx.plan
    recorded = plan.residue_growth_recorded
    where = (
        ""
        if recorded
        else f"; the growth was recorded on another vLLM release and is projected onto {plan.vllm_version}"
    )
    for key, fix in (("train_late_fit", plan.late_fix), ("logprob_late_fit", plan.logprob_fix)):
        check = plan.checks.get(key)
        if check is None or check.ok is not False:
            continue
        if key == "logprob_late_fit" and plan.checks.get("logprob_fit") is not None \
                and plan.checks["logprob_fit"].ok is False:
            continue  # RLC222 already reports the pass at step 1
        hint = fix.text if fix is not None else \
            "raise parallelism.train.tp with sequence_parallel: true, or PP / EP to shrink the per-GPU state"
        hint += kept_awake_hint(ctx, "train" if key == "train_late_fit" else "logprob")
        message = (f"{check.text}: it fits at step 1 but not once the residue has grown (vLLM "
                   f"{plan.vllm_version}){where}")
        path = "parallelism.train.tp" if key == "train_late_fit" or fix is None else fix.key
        (ctx.error if recorded else ctx.warning)(message, path, hint=hint)


@rule("RLC222", "the logprob pass must fit (trainer, reference policy, fp32 logits, vLLM asleep)",
      severities=("error",), needs=("plan",),
      rationale="Before each update the trainer computes the policy's logprobs and, with a KL penalty, the "
                "reference policy's, forward only, in micro-batches of training.logprob_batch_size sequences. The "
                "GPU then holds the trainer as the refit left it, the reference policy's parameters (on the GPU for "
                "its pass also with training.offload_reference_policy, which brings them from host memory) and the "
                "pass's fp32 logits over the whole vocabulary: 2 × batch × sequence × vocabulary / TP × 4 bytes on "
                "the last pipeline stage, the largest activation of the pass. The logprob batch is the knob "
                "production runs turn when this pass runs out of memory (NeMo-RL's policy.logprob_batch_size).",
      seed="First principles (rlc/compiler/planner/memory.py: the logprob phase); NeMo-RL's logprob_batch_size.",
      fixes="Lower training.logprob_batch_size to the value the plan names; if one sequence's logits do not fit, "
            "raise parallelism.train.tp (it splits the vocabulary).")
def logprob_fits(ctx: Context) -> None:
    check = ctx.plan.checks.get("logprob_fit")
    if check is None or check.ok is not False:
        return
    fix = ctx.plan.logprob_fix
    path = fix.key if fix is not None else "training.logprob_batch_size"
    ctx.error(check.text + " (other activations not yet counted)", path,
              hint=(fix.text if fix is not None else "lower training.logprob_batch_size or raise parallelism.train.tp")
              + kept_buffers_hint(ctx.plan, "logprob") + kept_awake_hint(ctx, "logprob"))
