"""The trainer's passes on one GPU: the tokens of a micro batch, the fp32 logits of the logprob and loss passes, the
saved activations of a train step, and the logprob micro batch that fits.

Shared by both memory plans (``memory.py`` for the vLLM backend, ``mcore_memory.py`` for megatron-core's engine),
so a micro batch is counted one way everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.layout import TrainLayout
from rlc.compiler.planner.plan import GIB, Fix, Item, gib
from rlc.compiler.recipe_types import Recipe
from rlc.contract.sampling_truncation import Truncation
from rlc.contract.sequence_packing import pad_multiples, round_up

LOGITS_COPIES = 2  # the fp32 logits and the copy the logprob (or the loss's log-softmax) takes
#: With truncated sampling (min-p, top-k, top-p) the rows each TP rank receives to cut, beside the logits and the
#: kept distribution it saves (``rlc.runtime.policy.truncated_logprobs``).
TRUNCATION_COPIES = 1
FP32_BYTES = 4


def logits_copies(recipe: Recipe, *, loss: bool) -> int:
    """The fp32 copies of the logits a logprob pass (``loss`` False) or the loss (True) holds at its peak: the logits
    and their log-softmax; with truncated sampling also the rows each TP rank cuts, and in a loss with a KL penalty
    the untruncated log-softmax of the KL term (the reference policy is compared under the full distribution)."""
    if not Truncation.of(recipe.generation.sampling).active:
        return LOGITS_COPIES
    return LOGITS_COPIES + TRUNCATION_COPIES + (1 if loss and recipe.loss.kl_penalty > 0 else 0)


def logits_bytes(tokens: int, vocab: int, tp: int, copies: int = LOGITS_COPIES) -> int:
    """The fp32 logits of ``tokens`` tokens over the vocabulary (split over TP), with the copies the logprob (or the
    loss's log-softmax) takes (:func:`logits_copies`): the largest activation of the logprob and loss passes
    (bytes, one GPU)."""
    return copies * tokens * vocab * FP32_BYTES // tp


def logits_note(how: str, vocab: int, tp: int, copies: int = LOGITS_COPIES) -> str:
    return f"{copies} × {how} × {vocab} vocab / TP{tp} × {FP32_BYTES} B"


#: The label of the loss's logits in a train phase (both generation backends' plans).
LOSS_LOGITS_LABEL = "fp32 logits + log-softmax of the loss"


def loss_logits_bytes(recipe: Recipe, facts: ModelFacts, tl: TrainLayout, mtp_blocks: int = 0,
                      tokens: Optional[int] = None) -> Optional[int]:
    """The fp32 logits and log-softmax the loss keeps for the backward of one train micro batch (``tokens``, default
    the planned micro batch) on the last pipeline stage: each of its ``mtp_blocks`` MTP blocks computes its own
    where the MTP loss trains (``training.mtp_loss_scale`` > 0). None when the vocabulary is unknown."""
    if facts.vocab is None:
        return None
    if tokens is None:
        tokens, _ = train_microbatch_tokens(recipe, tl)
    mtp = _trained_mtp_blocks(recipe, mtp_blocks)  # an MTP block's loss scores the full distribution
    return (logits_bytes(tokens, facts.vocab, tl.tp, logits_copies(recipe, loss=True))
            + mtp * logits_bytes(tokens, facts.vocab, tl.tp))


def loss_logits_item(recipe: Recipe, facts: ModelFacts, tl: TrainLayout, mtp_blocks: int = 0) -> Optional[Item]:
    """:func:`loss_logits_bytes` as the train phase's item (None when the vocabulary is unknown)."""
    tokens, how = train_microbatch_tokens(recipe, tl)
    loss = loss_logits_bytes(recipe, facts, tl, mtp_blocks, tokens)
    if loss is None or facts.vocab is None:
        return None
    mtp = _trained_mtp_blocks(recipe, mtp_blocks)
    return Item(LOSS_LOGITS_LABEL, gib(loss), "megatron", "params",
                logits_note(how, facts.vocab, tl.tp, logits_copies(recipe, loss=True))
                + (f" (+ {mtp} MTP block(s)' own)" if mtp else ""))


def last_stage_loss(recipe: Recipe, facts: ModelFacts, tl: TrainLayout,
                    figs: list[dict[str, Any]]) -> tuple[int, Optional[Item]]:
    """The last pipeline stage of ``figs`` (one figure per stage) and the loss's logits it holds
    (:func:`loss_logits_item` with that stage's MTP blocks)."""
    last = max(figs, key=lambda f: f["stage"])
    return last["stage"], loss_logits_item(recipe, facts, tl, last["mtp_blocks"])


def _trained_mtp_blocks(recipe: Recipe, mtp_blocks: int) -> int:
    return mtp_blocks if recipe.training.mtp_loss_scale > 0 else 0


# --------------------------------------------------------------------------- micro batches


def train_microbatch_tokens(recipe: Recipe, tl: TrainLayout) -> tuple[int, str]:
    """Tokens of one train micro batch on one GPU, and how: a padded micro batch holds ``micro_batch_size``
    sequences of up to ``max_sequence_length`` tokens; a packed one (``training.sequence_packing``) at most
    ``train_mb_tokens`` tokens padded to the row multiple, of which each context-parallel rank holds 1/CP."""
    return _microbatch_tokens(recipe, tl, recipe.training.micro_batch_size, recipe.train_mb_tokens)


def logprob_microbatch_tokens(recipe: Recipe, tl: TrainLayout) -> tuple[int, str]:
    """Tokens of one logprob micro batch on one GPU, and how: ``training.logprob_batch_size`` sequences of up to
    ``max_sequence_length`` tokens, or, packed, at most ``logprob_mb_tokens`` (as :func:`train_microbatch_tokens`)."""
    return _microbatch_tokens(recipe, tl, recipe.logprob_batch_size, recipe.logprob_mb_tokens,
                              "training.logprob_batch_size")


def pad(recipe: Recipe, tl: TrainLayout) -> Any:
    """The packed micro batch's padding multiples for the trainer's layout (``rlc.contract.sequence_packing``)."""
    t = recipe.training
    return pad_multiples(tp=tl.tp, sequence_parallel=tl.sequence_parallel, cp=tl.cp,
                         fp8_recipe=t.fp8.recipe if t.fp8.enabled else None)


def _microbatch_tokens(recipe: Recipe, tl: TrainLayout, sequences: int, budget: int,
                       key: str = "") -> tuple[int, str]:
    if not recipe.training.sequence_packing.enabled:
        seq = recipe.max_sequence_length
        return sequences * seq, f"{sequences}{f' ({key})' if key else ''} × {seq} tokens"
    row = round_up(budget, pad(recipe, tl).row)
    per_rank = row // tl.cp
    return per_rank, (f"{row} packed tokens / CP{tl.cp}" if tl.cp > 1 else f"{row} packed tokens")


def logprob_fix(used: float, limit: float, logits: int, recipe: Recipe, tl: TrainLayout) -> Fix:
    """The largest logprob micro batch whose logits fit beside the rest of the logprob phase (``used`` GiB with
    ``logits`` bytes of them): ``training.logprob_batch_size`` sequences, or with sequence packing
    ``training.sequence_packing.logprob_mb_tokens`` tokens (at least the longest sequence); where not even one
    sequence's logits fit, a wider trainer TP (it splits the vocabulary)."""
    room = limit - (used - logits / GIB)
    seq = recipe.max_sequence_length
    per_token = logits / GIB / logprob_microbatch_tokens(recipe, tl)[0]  # per token on this GPU
    if recipe.training.sequence_packing.enabled:
        multiples = pad(recipe, tl)
        one_sequence = per_token * round_up(seq, multiples.sequence) / tl.cp  # a row of B tokens puts B / CP here
        budget = int(room // per_token) * tl.cp // multiples.row * multiples.row
        if budget >= round_up(seq, multiples.sequence):
            key = "training.sequence_packing.logprob_mb_tokens"
            return Fix(key, budget, f"{key}: {budget} ({per_token * GIB:.0f} bytes of logits per token, "
                       f"{room:.2f} GiB left for them)", logits / GIB - budget / tl.cp * per_token, True, 0)
    else:
        one_sequence = per_token * seq
        fits = int(room // one_sequence)
        if fits >= 1:
            return Fix("training.logprob_batch_size", fits,
                       f"training.logprob_batch_size: {fits} ({one_sequence:.2f} GiB of logits per sequence, "
                       f"{room:.2f} GiB left for them)", logits / GIB - fits * one_sequence, True, 0)
    return Fix("parallelism.train.tp", tl.tp * 2,
               f"one sequence's fp32 logits ({one_sequence:.2f} GiB) do not fit beside the rest of the phase "
               f"({room:.2f} GiB left): raise parallelism.train.tp (it splits the vocabulary) or pipeline / expert "
               "parallelism", None, False, 2)


# --------------------------------------------------------------------------- the train step's saved activations

# What one transformer layer keeps for its backward pass, per token, in bytes of 16-bit activations: Korthikanti et
# al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Table 2) with FlashAttention (no
# attention-score term), as Megatron-Bridge's theoretical memory estimate counts it (``18 + 4 × MLP width /
# hidden``), and with the MLP's width counted from the model rather than assumed 4 × hidden:
#: hidden-sized bytes tensor parallelism leaves whole unless sequence parallelism splits them: the two layer norms'
#: inputs, the attention block's and the MLP's input, their dropout masks
UNSPLIT_HIDDEN_BYTES = 10
#: hidden-sized bytes tensor parallelism splits: the attention's Q, K, V and the output projection's input
SPLIT_HIDDEN_BYTES = 8
#: bytes per unit of MLP width: the up projection's output and the activation's output (2 bytes each); a gated MLP
#: (SwiGLU) keeps the gate and the up projection's outputs (2 × width) before the activation
MLP_WIDTH_BYTES = {True: 6, False: 4}
#: full recomputation keeps each layer's input (2 bytes per hidden unit) and recomputes one layer at a time
RECOMPUTED_INPUT_BYTES = 2


@dataclass(frozen=True)
class TrainActivations:
    """One train micro batch's saved activations on one GPU of a pipeline stage (bytes), and how they were
    counted."""

    bytes: int
    note: str


def _mlp_width_bytes(facts: ModelFacts, moe: bool, etp: int) -> tuple[int, int]:
    """Bytes of one layer's MLP activations: (per token of the micro batch, the part every TP rank holds a share
    of; per token this GPU routes, the routed experts' part).

    The routed part follows megatron-core's all-to-all dispatcher (``MoEAlltoAllTokenDispatcher``): each GPU routes
    its own tokens (its sequence-parallel shard), sends ``topk`` copies of each over the expert-parallel group and,
    with balanced routing, receives as many; expert tensor parallelism then all-gathers them over its ETP ranks,
    each of which computes ``1 / ETP`` of the expert's width."""
    gated = MLP_WIDTH_BYTES[facts.gated_mlp]
    hidden = facts.hidden or 0
    if not moe:
        return gated * (facts.dense_intermediate or 0), 0
    topk = facts.experts_per_tok or 1
    width = facts.latent_size or hidden  # LatentMoE experts work in the latent width
    # the dispatched copies of the input (topk × ETP × width × 2 B), the experts' MLP activations (topk × ETP tokens
    # at 1/ETP of the width), the router's fp32 scores
    routed = topk * (2 * width * etp + gated * (facts.moe_intermediate or 0)) + FP32_BYTES * (facts.num_experts or 0)
    return gated * (facts.shared_expert_intermediate or 0), routed


def _layer_bytes(facts: ModelFacts, tl: TrainLayout, moe: bool) -> float:
    """Per token of the micro batch, bytes one transformer layer keeps for its backward on one GPU (16-bit
    activations). With sequence parallelism a GPU routes 1/TP of the tokens (megatron-core refuses MoE with tensor
    parallelism but without sequence parallelism in training)."""
    hidden = facts.hidden or 0
    sp = tl.sequence_parallel and tl.tp > 1
    shared, routed = _mlp_width_bytes(facts, moe, max(1, tl.etp))
    split = SPLIT_HIDDEN_BYTES * hidden + shared
    unsplit = UNSPLIT_HIDDEN_BYTES * hidden
    return (unsplit / tl.tp if sp else unsplit) + split / tl.tp + (routed / tl.tp if sp else routed)


def _stage_moe_layers(facts: ModelFacts, tl: TrainLayout, stage: int) -> tuple[int, int]:
    """(dense, MoE) decoder layers on ``stage``."""
    layers = tl.stage_layers(facts.num_layers or 0)[stage]
    if facts.layer_kinds is not None:
        moe = sum(1 for i in layers if facts.layer_kinds[i][1] == "moe")
    elif facts.num_experts:
        moe = sum(1 for i in layers if i >= facts.first_k_dense)
    else:
        moe = 0
    return len(layers) - moe, moe


def train_activations(recipe: Recipe, facts: ModelFacts, tl: TrainLayout, stage: int, mtp_blocks: int,
                      tokens: Optional[tuple[int, str]] = None) -> Optional[TrainActivations]:
    """The saved activations of the train step on one GPU of ``stage`` (an estimate: an upper bound in the spirit
    of Korthikanti et al. Table 2, see the constants above): per decoder layer (and per MTP block, counted as a
    layer of the model's last kind) ``(10 × hidden + 8 × hidden + MLP bytes) / TP`` per token of one micro batch (the
    routed experts' part per token the GPU routes, :func:`_mlp_width_bytes`)
    (``train_microbatch_tokens``, or ``tokens``: how many and how counted), ``training.activation_checkpointing: full``
    keeping only each layer's input plus
    one layer's full set, times the micro batches 1F1B keeps in flight on the stage (``PP − stage``; with virtual
    stages Megatron's interleaving penalty ``1 + (PP − 1) / (PP × VPP)``). The loss's logits are counted apart
    (:func:`logits_bytes`). ``None`` when the model's hidden size or layer count is unknown."""
    if facts.hidden is None or facts.num_layers is None:
        return None
    count, how = tokens if tokens is not None else train_microbatch_tokens(recipe, tl)
    dense, moe = _stage_moe_layers(facts, tl, stage)
    last_moe = bool(facts.num_experts) and (facts.layer_kinds is None or facts.layer_kinds[-1][1] == "moe")
    if mtp_blocks:
        dense, moe = (dense, moe + mtp_blocks) if last_moe else (dense + mtp_blocks, moe)
    per_layer = {False: _layer_bytes(facts, tl, False), True: _layer_bytes(facts, tl, True)}
    full = recipe.training.activation_checkpointing == "full"
    if full:
        sp = tl.sequence_parallel and tl.tp > 1
        kept = RECOMPUTED_INPUT_BYTES * facts.hidden / (tl.tp if sp else 1) * (dense + moe)
        per_token = kept + max(per_layer[k] for k, n in ((False, dense), (True, moe)) if n) if dense + moe else 0.0
    else:
        per_token = dense * per_layer[False] + moe * per_layer[True]
    in_flight = tl.pp - stage
    penalty = 1 + (tl.pp - 1) / (tl.pp * tl.vpp) if tl.vpp > 1 else 1.0
    scale = (2 if recipe.model.dtype == "float32" else 1) * in_flight * penalty
    total = int(per_token * count * scale)
    layers = f"{dense} dense + {moe} MoE layers" if moe else f"{dense} layers"
    kept_how = "full recomputation: each layer's input + one layer" if full else "no recomputation"
    flight = f" × {in_flight * penalty:g} micro batches in flight" if in_flight * penalty != 1 else ""
    return TrainActivations(total, f"{layers} × {how}{flight} ({kept_how}; estimate after Korthikanti et al. "
                                   "Table 2)")


def forward_working_set(recipe: Recipe, facts: ModelFacts, tl: TrainLayout, stage: int, tokens: int) -> Optional[int]:
    """What a forward-only pass (the logprob passes) holds at its peak besides its logits: one layer's activations of
    ``tokens`` tokens at a time (the fullest layer kind on ``stage``, counted as :func:`train_activations` counts a
    layer; nothing is kept for a backward). ``None`` when the hidden size or layer count is unknown."""
    if facts.hidden is None or facts.num_layers is None:
        return None
    dense, moe = _stage_moe_layers(facts, tl, stage)
    kinds = [k for k, n in ((False, dense), (True, moe)) if n] or [bool(facts.num_experts)]
    scale = 2 if recipe.model.dtype == "float32" else 1
    return int(max(_layer_bytes(facts, tl, k) for k in kinds) * tokens * scale)


__all__ = ["FP32_BYTES", "LOGITS_COPIES", "TRUNCATION_COPIES", "logits_copies",
           "TrainActivations", "forward_working_set", "logits_bytes", "logits_note",
           "logprob_fix", "logprob_microbatch_tokens", "pad", "train_activations", "train_microbatch_tokens"]
