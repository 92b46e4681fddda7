"""RLC1xx: world size and every Megatron / vLLM divisibility constraint of the layout."""
from __future__ import annotations

from typing import Optional

from rlc.compiler.planner.layout import generation_layout, train_layout, world_size
from rlc.compiler.rules.engine import Context, rule

T = "parallelism.train"
G = "parallelism.generation"


def _world_text(ctx: Context) -> str:
    c = ctx.recipe.cluster
    return f"{world_size(ctx.recipe)} GPUs (nodes {c.nodes} × gpus_per_node {c.gpus_per_node})"


@rule("RLC101", "trainer layout must tile the world: TP × PP × CP × DP = world", severities=("error",),
      rationale="Megatron builds its process groups from TP, PP, CP and DP; their product must equal the number "
                "of GPUs, so TP × PP × CP has to divide the world size.",
      seed="Megatron-core parallel_state.initialize_model_parallel (world_size % (tp × pp × cp) == 0).",
      fixes="Change cluster.nodes / gpus_per_node, or TP/PP/CP so that their product divides the world.")
def world_divides(ctx: Context) -> None:
    tl = train_layout(ctx.recipe)
    block = tl.tp * tl.pp * tl.cp
    if tl.world % block:
        ctx.error(f"TP{tl.tp} × PP{tl.pp} × CP{tl.cp} = {block} does not divide the world of {_world_text(ctx)}: "
                  f"data parallelism would be {tl.world / block:.3g}", f"{T}.tp",
                  hint=f"use a world size that is a multiple of {block}, or TP × PP × CP dividing {tl.world}")


@rule("RLC102", "expert layout must tile the world: world % (EP × ETP × PP) == 0", severities=("error",),
      rationale="Expert-parallel groups of EP × ETP ranks are formed inside each pipeline stage; the remaining "
                "factor is the expert data-parallel size, which must be a whole number.",
      seed="Megatron-core parallel_state: expert data parallel = world / (EP × ETP × PP).",
      fixes="Pick EP and ETP with EP × ETP × PP dividing the world size.")
def expert_layout(ctx: Context) -> None:
    tl = train_layout(ctx.recipe)
    block = tl.ep * tl.etp * tl.pp
    if tl.world % block:
        ctx.error(
            f"EP{tl.ep} × ETP{tl.etp} × PP{tl.pp} = {block} does not divide the world of {_world_text(ctx)}",
            f"{T}.ep",
            hint=f"choose EP × ETP dividing {tl.world // tl.pp if tl.world % tl.pp == 0 else tl.world}",
        )


@rule("RLC103", "routed experts must split evenly over EP (and their width over ETP)",
      severities=("error", "info"), needs=("facts",),
      rationale="Each expert-parallel rank holds num_experts / EP whole experts, each split ETP ways along the "
                "intermediate dimension; neither may leave a remainder. A dense model has no experts to split.",
      seed="Megatron-core TransformerConfig: num_moe_experts % expert_model_parallel_size == 0.",
      fixes="Use an EP that divides the expert count (e.g. a power of two for 128/256/512 experts); "
            "EP 1 for dense models.")
def experts_divide(ctx: Context) -> None:
    tl, f = train_layout(ctx.recipe), ctx.facts
    if f.num_experts is None:
        if tl.ep > 1:
            ctx.info(f"expert count of {f.model_id} is not known: EP{tl.ep} divisibility not checked", f"{T}.ep")
        return
    if f.num_experts == 0:
        if tl.ep > 1 or tl.etp > 1:
            ctx.error(f"{f.model_id} is a dense model: EP{tl.ep} / ETP{tl.etp} have no experts to split",
                      f"{T}.ep", hint="set parallelism.train.ep: 1 and etp: 1")
        return
    if f.num_experts % tl.ep:
        ctx.error(f"{f.num_experts} experts do not split over EP{tl.ep} ({f.num_experts / tl.ep:.3g} per rank)",
                  f"{T}.ep", hint=f"use an EP dividing {f.num_experts}")
    if tl.etp > 1 and f.moe_intermediate is not None and f.moe_intermediate % tl.etp:
        ctx.error(f"expert intermediate size {f.moe_intermediate} does not split over ETP{tl.etp}", f"{T}.etp")


def _suggest_edges(num_layers: int, pp: int) -> Optional[tuple[int, int]]:
    """Equal first/last-stage layer counts giving the most balanced split (smallest middle stage ≥ edge)."""
    if pp < 3:
        return None
    best = None
    for edge in range(1, num_layers // 2):
        rest = num_layers - 2 * edge
        if rest > 0 and rest % (pp - 2) == 0 and rest // (pp - 2) >= edge:
            middle = rest // (pp - 2)
            if best is None or middle <= best[1]:
                best = (edge, middle)
    return best


@rule("RLC104", "decoder layers must split over the pipeline stages (first/last overrides, VPP)",
      severities=("error", "info"), needs=("facts",),
      rationale="Megatron gives each pipeline stage a whole number of layers: an even split needs layers % PP == 0; "
                "with num_layers_in_first/last_pipeline_stage the remaining layers must split evenly over the "
                "middle stages; with virtual pipeline stages every stage's layer count must divide by VPP.",
      seed="Megatron-core TransformerConfig.__post_init__ (uneven PP and VPP validation); NeMo-RL #2471 runs 60 layers "
           "on PP 8 as 6 + 6×8 + 6.",
      fixes="Set num_layers_in_first/last_pipeline_stage (the message suggests values) or pick a PP dividing "
            "the layers.")
def pipeline_split(ctx: Context) -> None:
    tl, f = train_layout(ctx.recipe), ctx.facts
    if tl.vpp > 1 and tl.pp == 1:
        ctx.error(f"VPP{tl.vpp} needs pipeline parallelism (PP is 1)", f"{T}.vpp", hint="set vpp: 1 or pp > 1")
    overrides = [(name, v) for name, v in (("num_layers_in_first_pipeline_stage", tl.first),
                                           ("num_layers_in_last_pipeline_stage", tl.last)) if v is not None]
    for name, v in overrides:
        if v <= 0:
            ctx.error(f"{name} must be > 0 (Megatron rejects {v})", f"{T}.{name}")
    if tl.pp == 1 and overrides:
        ctx.error("first/last pipeline-stage overrides need PP > 1", f"{T}.{overrides[0][0]}")
        return
    n = f.num_layers
    if n is None:
        if tl.pp > 1:
            ctx.info(f"layer count of {f.model_id} is not public: the split over PP{tl.pp} is not checked",
                     f"{T}.pp")
        return
    if not overrides:
        if n % tl.pp:
            sug = _suggest_edges(n, tl.pp)
            hint = (f"e.g. num_layers_in_first_pipeline_stage: {sug[0]} and num_layers_in_last_pipeline_stage: "
                    f"{sug[0]} ({n} = {sug[0]} + {sug[1]}×{tl.pp - 2} + {sug[0]})") if sug else \
                f"use a PP dividing {n}"
            ctx.error(
                f"{n} layers do not split evenly over PP{tl.pp} ({n / tl.pp:.3g} per stage)", f"{T}.pp", hint=hint
            )
            return
    else:
        rest = n - sum(v for _, v in overrides)
        middle = tl.pp - len(overrides)
        if rest < 0 or (middle == 0 and rest != 0) or (middle and (rest % middle or rest // middle == 0)):
            what = f"{rest} remaining layers over {middle} middle stage(s)" if middle else \
                f"{rest} layers left with no middle stage"
            ctx.error(f"{n} layers with " + ", ".join(f"{k.split('_')[3]}={v}" for k, v in overrides)
                      + f" leave {what}", f"{T}.{overrides[0][0]}",
                      hint="the middle stages must each get the same, non-zero number of layers")
            return
    if tl.vpp > 1:
        for s, count in enumerate(tl.stage_layer_counts(n)):
            if count % tl.vpp:
                ctx.error(f"pipeline stage {s} has {count} layers, not divisible by VPP{tl.vpp}", f"{T}.vpp")
                return


def _heads_checks(ctx: Context, tp: int, path: str, engine: str) -> None:
    f = ctx.facts
    pairs = [("attention heads", f.heads), ("linear-attention key heads", f.linear_key_heads),
             ("linear-attention value heads", f.linear_value_heads), ("Mamba heads", f.mamba_heads),
             ("Mamba groups", f.mamba_groups)]
    kinds = {m for m, _ in (f.layer_kinds or ())}
    relevant = {"attention heads": bool(kinds & {"full_attention", "mla"}) or f.layer_kinds is None,
                "linear-attention key heads": "linear_attention" in kinds,
                "linear-attention value heads": "linear_attention" in kinds,
                "Mamba heads": "mamba" in kinds, "Mamba groups": "mamba" in kinds}
    for label, value in pairs:
        if not relevant[label] or tp == 1:
            continue
        if value is None:
            if label == "attention heads":
                ctx.info(f"{label} of {f.model_id} not known: {engine} TP{tp} divisibility not checked", path)
            continue
        if value % tp:
            ctx.error(f"{value} {label} do not split over {engine} TP{tp}", path,
                      hint=f"use a TP dividing {value}")


@rule("RLC105", "attention, linear-attention and Mamba heads (and the trainer's vocabulary) must split over TP",
      severities=("error", "info"), needs=("facts",),
      rationale="Tensor parallelism gives each rank whole heads (query heads; Gated-DeltaNet key/value heads; "
                "Mamba heads and groups) in both Megatron and vLLM, and each trainer rank vocabulary / TP rows of "
                "the embedding and output layer (vLLM pads its own).",
      seed="Megatron-core attention / GatedDeltaNet / Mamba mixers; vLLM model executors.",
      fixes="Use a TP that divides every head count of the model (the message names the one that does not); "
            "for the trainer also the vocabulary (or pad the checkpoint's vocab_size to a multiple of TP).")
def heads_divide(ctx: Context) -> None:
    _heads_checks(ctx, train_layout(ctx.recipe).tp, f"{T}.tp", "trainer")
    _heads_checks(ctx, generation_layout(ctx.recipe).tp, f"{G}.tp", "vLLM")
    tp, vocab = train_layout(ctx.recipe).tp, ctx.facts.vocab
    if tp > 1 and vocab is not None and vocab % tp:
        ctx.error(f"the vocabulary of {vocab} tokens does not split over trainer TP{tp}: Megatron-Bridge builds the "
                  "embedding and output layer unpadded and megatron-core's vocab-parallel embedding gives each rank "
                  "vocabulary / TP rows", f"{T}.tp",
                  hint=f"use a TP dividing {vocab}, or a checkpoint whose vocab_size is a multiple of {tp}")


@rule("RLC106", "KV heads vs TP: split evenly or replicate evenly", severities=("error", "info"), needs=("facts",),
      rationale="With TP ≤ KV heads each rank gets KV heads / TP of them; with TP > KV heads each KV head is "
                "replicated TP / KV-heads times. Anything else leaves ranks with fractional heads.",
      seed="vLLM QKVParallelLinear (replicates KV heads when tp > num_kv_heads); NeMo-RL #2471 trains Qwen3.5-397B "
           "(2 KV heads) at TP 8 and generates at TP 16.",
      fixes="Pick a TP that divides, or is a multiple of, the number of KV heads.")
def kv_heads(ctx: Context) -> None:
    f = ctx.facts
    if f.kv_heads is None or not any(m == "full_attention" for m, _ in (f.layer_kinds or ())):
        return
    for tp, path, engine in ((train_layout(ctx.recipe).tp, f"{T}.tp", "trainer"),
                             (generation_layout(ctx.recipe).tp, f"{G}.tp", "vLLM")):
        kv = f.kv_heads
        if tp <= 1 or kv % tp == 0:
            continue
        if tp % kv == 0:
            ctx.info(f"{engine} TP{tp} > {kv} KV heads: each KV head is replicated on {tp // kv} ranks", path)
        else:
            ctx.error(f"{kv} KV heads neither split over nor replicate evenly across {engine} TP{tp}", path,
                      hint=f"use a TP dividing {kv} or a multiple of it")


@rule("RLC107", "global batch must be a multiple of micro batch × DP", severities=("error", "warning"),
      rationale="Each optimizer step runs global / (micro × DP) micro-batches on every data-parallel rank; it must "
                "be a whole number. The GRPO step's samples (prompts × generations) should also be a whole number "
                "of global batches, or the last optimizer step of every GRPO step is partial.",
      seed="Megatron num_microbatches_calculator (global_batch_size % (micro_batch_size × dp) == 0).",
      fixes="Make training.global_batch_size a multiple of micro_batch_size × DP (the message gives both).")
def batch_divides(ctx: Context) -> None:
    tl = train_layout(ctx.recipe)
    samples, gbs = ctx.recipe.grpo.samples_per_step, ctx.recipe.global_batch_size
    stated = ctx.recipe.training.global_batch_size is not None
    micro = ctx.recipe.training.micro_batch_size
    unit = micro * tl.dp
    path = "training.global_batch_size" if stated else "grpo.prompts_per_step"
    if gbs % unit:
        lower = gbs // unit * unit
        ctx.error(f"global batch {gbs} is not a multiple of micro batch {micro} × DP {tl.dp} = {unit}", path,
                  hint=f"use {lower} or {lower + unit}" if lower else f"use {unit}")
    if stated and samples % gbs:
        ctx.warning(f"a GRPO step makes {samples} samples (prompts_per_step × generations_per_prompt), not a "
                    f"multiple of global_batch_size {gbs}", "training.global_batch_size")


@rule("RLC108", "MoE with TP > 1 needs sequence parallelism", severities=("error",),
      rationale="Megatron refuses MoE layers under tensor parallelism without sequence parallelism (the token "
                "dispatcher expects sequence-split activations).",
      seed="Megatron-core TransformerConfig: 'When using expert parallelism and tensor parallelism, sequence "
           "parallelism must be used'; Megatron arguments: 'When using MoE and tensor parallelism, sequence "
           "parallelism must be used.'",
      fixes="Set parallelism.train.sequence_parallel: true.")
def moe_needs_sp(ctx: Context) -> None:
    tl = train_layout(ctx.recipe)
    moe = ctx.facts.is_moe if ctx.facts is not None else None
    if tl.tp > 1 and (tl.ep > 1 or moe) and not tl.sequence_parallel:
        ctx.error(f"MoE with TP{tl.tp}" + (f" and EP{tl.ep}" if tl.ep > 1 else "")
                  + " needs sequence_parallel: true", f"{T}.sequence_parallel",
                  hint="set parallelism.train.sequence_parallel: true")


@rule("RLC109", "vLLM engines must cover the same GPUs as the trainer when colocated", severities=("error",),
      rationale="Colocated generation runs one vLLM rank next to each Megatron rank: TP × PP × engines of vLLM "
                "must equal the world size (and TP × PP must divide it).",
      seed="Colocated design (NeMo-RL #2471: 256 GPUs shared by Megatron TP8×PP8×DP4 and vLLM TP16 × 16).",
      fixes="Leave parallelism.generation.dp unset (it defaults to world / (TP × PP)) or make TP × PP × dp = world.")
def vllm_world(ctx: Context) -> None:
    gl = generation_layout(ctx.recipe)
    world = gl.world
    if world % (gl.tp * gl.pp):
        ctx.error(f"vLLM TP{gl.tp} × PP{gl.pp} = {gl.tp * gl.pp} does not divide the world of {_world_text(ctx)}",
                  f"{G}.tp")
        return
    if ctx.recipe.colocated and gl.gpus != world:
        ctx.error(f"colocated vLLM uses TP{gl.tp} × PP{gl.pp} × {gl.dp} engines = {gl.gpus} GPUs, but the trainer "
                  f"uses all {world}", f"{G}.dp", hint=f"set parallelism.generation.dp: {world // (gl.tp * gl.pp)} "
                  "or leave it unset")


@rule("RLC110", "vLLM expert parallelism: EP a multiple of TP, dividing the experts, tiling the engines",
      severities=("error", "info"), needs=("facts",),
      rationale="In vLLM, EP is the expert-sharding degree across TP × (EP / TP) ranks: EP / TP data-parallel "
                "attention replicas of TP ranks each, with the experts split EP ways. So EP must be a multiple of "
                "TP, divide the expert count (whole experts per rank), and EP / TP must divide the number of "
                "engines (EP groups are built from whole TP groups of one pipeline stage). vLLM EP does NOT shrink "
                "the fused tensor the trainer exports (the exporter stacks all experts), only vLLM's weight shard.",
      seed="NeMo-RL #2471: vLLM TP16 with EP 64 / 128 / 256 on 512 experts (8 / 4 / 2 experts per GPU).",
      fixes="Use EP = TP × k with k dividing the engine count and EP dividing the expert count.")
def vllm_ep(ctx: Context) -> None:
    gl, f = generation_layout(ctx.recipe), ctx.facts
    if gl.ep <= 1:
        return
    path = f"{G}.ep"
    if f.num_experts == 0:
        ctx.error(f"{f.model_id} is dense: vLLM EP{gl.ep} has no experts to split", path, hint="set ep: 1")
        return
    if gl.ep % gl.tp:
        ctx.error(f"vLLM EP{gl.ep} is not a multiple of vLLM TP{gl.tp}", path,
                  hint=f"use EP {gl.tp * max(1, gl.ep // gl.tp)} or {gl.tp * (gl.ep // gl.tp + 1)}")
        return
    if f.num_experts is None:
        ctx.info(f"expert count of {f.model_id} is not known: vLLM EP{gl.ep} divisibility not checked", path)
    elif f.num_experts % gl.ep:
        ctx.error(f"{f.num_experts} experts do not split over vLLM EP{gl.ep}", path,
                  hint=f"use an EP dividing {f.num_experts}")
    groups = gl.ep // gl.tp
    if gl.dp % groups:
        ctx.error(f"vLLM EP{gl.ep} spans {groups} TP{gl.tp} groups, which does not divide the {gl.dp} engines",
                  path, hint=f"use an EP of TP × a divisor of {gl.dp}")


@rule("RLC111", "sequence_parallel does nothing at TP 1", severities=("info",),
      rationale="Sequence parallelism splits activations across the tensor-parallel group; with TP 1 there is "
                "no group and Megatron turns it off.",
      seed="Megatron-core (sequence_parallel is disabled when tensor_model_parallel_size == 1).",
      fixes="Remove parallelism.train.sequence_parallel or raise TP.")
def sp_without_tp(ctx: Context) -> None:
    tl = train_layout(ctx.recipe)
    if tl.sequence_parallel and tl.tp == 1:
        ctx.info("sequence_parallel is ignored at TP 1", f"{T}.sequence_parallel")


#: vLLM's switch that turns its max_model_len refusal into a warning (vllm/envs.py).
ALLOW_LONG = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


@rule("RLC112", "sequence lengths within the model's context length (RoPE scaling included)",
      severities=("error", "warning"), needs=("facts",),
      rationale="vLLM refuses a max_model_len above the length the model's config allows (max_position_embeddings, "
                "times the RoPE scaling factor; for YaRN the factor times original_max_position_embeddings), at "
                "engine start, after the queue. Training longer sequences than that runs RoPE positions the model "
                "never saw. With VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in cluster.env vLLM only warns, and so does rlc.",
      seed="vLLM 0.22 vllm/config/model.py _get_and_verify_max_len ('User-specified max_model_len (...) is greater "
           "than the derived max_model_len').",
      fixes="Lower generation.max_model_len (and training.max_sequence_length) to the model's context length, or use "
            "a checkpoint whose config extends it (rope_scaling), or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in "
            "cluster.env knowingly.")
def context_length(ctx: Context) -> None:
    f, r = ctx.facts, ctx.recipe
    limit = f.context_length
    if limit is None:
        return
    allowed = str(r.cluster.env.get(ALLOW_LONG, "")).strip().lower() in ("1", "true")
    emit = ctx.warning if allowed else ctx.error
    tail = f" ({ALLOW_LONG} is set: vLLM only warns)" if allowed else ""
    for path, value, who in (("generation.max_model_len", r.generation.max_model_len, "vLLM refuses it at start"),
                             ("training.max_sequence_length", r.training.max_sequence_length,
                              "the trainer would run positions the model never saw")):
        if value is not None and value > limit:
            emit(f"{path} {value} is longer than {f.model_id}'s context length {limit} ({f.context_length_source}): "
                 f"{who}{tail}", path, hint=f"set {path} to at most {limit}")
