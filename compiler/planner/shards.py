"""Per-GPU parameter shards: what one GPU of each pipeline stage holds, in Megatron and in vLLM.

Megatron (trainer): dense matrices split by TP, routed experts by EP × ETP, the word embedding on
the first stage, the output layer and the MTP blocks on the last; with MTP or tied embeddings and
PP > 1 the last stage also holds a copy of the word embedding (the copy NeMo-RL #2471 failure 1 is
about). vLLM (generation): dense by TP, routed experts by the expert-sharding degree (EP, or TP
when EP is off), embedding on the first and ``lm_head`` on the last of its own pipeline stages.
vLLM loads MTP weights only as the drafter of MTP speculative decoding (``drafter_blocks``): the
checkpoint's MTP blocks on its last stage, sharded like a decoder layer (``eh_proj`` whole where vLLM's
MTP module keeps it whole, :meth:`ModelFacts.vllm_mtp_block_split`), sharing the model's embedding and
``lm_head`` (vLLM ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``); with PP > 1 vLLM loads the
drafter's own embedding, counted as one more vocabulary matrix there.

Simplification: when KV heads < TP, both engines replicate KV heads instead of splitting them; the
few MB this adds per layer are not counted.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from rlc.compiler.model import ModelFacts, ParamSplit
from rlc.compiler.planner.layout import GenerationLayout, TrainLayout


@dataclass(frozen=True)
class StageShard:
    """Parameters (elements) one GPU of a pipeline stage holds."""

    stage: int
    layers: int  # decoder layers on this stage
    dense: int  # non-expert parameters on one GPU (optimizer sharded over DP × CP)
    expert: int  # routed-expert parameters on one GPU (optimizer sharded over expert DP)
    vocab_copies: int  # how many vocab × hidden matrices (each / TP) are among ``dense``
    mtp_blocks: int  # MTP blocks on this stage
    vocab_params: int  # elements of those matrices on this GPU (``vocab_copies`` × vocab × hidden / TP)

    @property
    def linear_params(self) -> int:
        """Parameters outside the embedding and output matrices: the linear layers (attention, MLP, experts) and
        the norms and routers among them, which are small and counted with them."""
        return self.params - self.vocab_params

    @property
    def params(self) -> int:
        return self.dense + self.expert


def _layers_split(facts: ModelFacts, indices: list[int]) -> Optional[ParamSplit]:
    """Parameters of the decoder layers at ``indices``: each distinct layer kind counted once, times
    how often it occurs (a stage has a few kinds and dozens of layers)."""
    kinds = facts.layer_kinds
    if kinds is None:
        return None
    total = ParamSplit()
    for kind, n in Counter(kinds[i] for i in indices).items():
        split = facts.layer_split(kind)
        if split is None:
            return None
        total = total + split.times(n)
    return total


#: Plans of many recipes (``rlc lint``) and the planner's what-if fixes share models and layouts;
#: facts and layouts are frozen values, so their shards are computed once per process.
_SHARD_CACHE = 256


@lru_cache(maxsize=_SHARD_CACHE)
def megatron_stage_shards(facts: ModelFacts, layout: TrainLayout) -> Optional[tuple[StageShard, ...]]:
    """One :class:`StageShard` per Megatron pipeline stage, or ``None`` when facts are missing."""
    if facts.num_layers is None or facts.layer_kinds is None or facts.vocab is None or facts.hidden is None:
        return None
    if facts.tied_embeddings is None or facts.mtp_num_layers is None:
        return None
    vocab = facts.vocab * facts.hidden // layout.tp
    mtp = facts.mtp_num_layers
    mtp_block = facts.mtp_block_split() if mtp else ParamSplit()
    if mtp_block is None:
        return None
    expert_shards = layout.ep * layout.etp
    stages = layout.stage_layers(facts.num_layers)
    out = []
    for s, indices in enumerate(stages):
        split = _layers_split(facts, indices)
        if split is None:
            return None
        first, last = s == 0, s == len(stages) - 1
        copies = 0
        if first:
            copies += 1  # word embedding
        if last:
            if not facts.tied_embeddings:
                copies += 1  # output layer
            elif not first:
                copies += 1  # tied: the last stage holds a copy of the embedding as output weight
            if mtp:
                split = split + mtp_block.times(mtp)
                if facts.mtp_shared_embedding is False:
                    copies += 1  # dedicated MTP embedding
                elif not first and not facts.tied_embeddings:
                    copies += 1  # MTP-replicated word embedding (NeMo-RL #2471 failure 1)
        expert = split.expert // expert_shards
        dense = split.tp // layout.tp + split.replicated + copies * vocab
        out.append(StageShard(stage=s, layers=len(indices), dense=dense, expert=expert, vocab_copies=copies,
                              mtp_blocks=mtp if last else 0, vocab_params=copies * vocab))
    return tuple(out)


@lru_cache(maxsize=_SHARD_CACHE)
def vllm_stage_shards(facts: ModelFacts, layout: GenerationLayout,
                      drafter_blocks: int = 0) -> Optional[tuple[StageShard, ...]]:
    """One :class:`StageShard` per vLLM pipeline stage (weights only), or ``None`` when unknown.

    ``drafter_blocks``: MTP blocks vLLM's speculative-decoding drafter loads (0: no MTP drafter); they are
    counted on the last stage (``mtp_blocks``)."""
    if facts.num_layers is None or facts.layer_kinds is None or facts.vocab is None or facts.hidden is None:
        return None
    if facts.tied_embeddings is None:
        return None
    drafter = facts.vllm_mtp_block_split() if drafter_blocks else ParamSplit()
    if drafter is None:
        return None
    vocab = facts.vocab * facts.hidden // layout.tp
    stages = layout.stage_layers(facts.num_layers)
    out = []
    for s, indices in enumerate(stages):
        split = _layers_split(facts, indices)
        if split is None:
            return None
        first, last = s == 0, s == len(stages) - 1
        copies = (1 if first else 0) + (1 if last and (not facts.tied_embeddings or not first) else 0)
        if last and drafter_blocks:
            split = split + drafter.times(drafter_blocks)
            if len(stages) > 1:
                copies += 1  # the drafter's own embedding: vLLM shares the model's only when PP == 1
        dense = split.tp // layout.tp + split.replicated + copies * vocab
        out.append(StageShard(stage=s, layers=len(indices), dense=dense,
                              expert=split.expert // layout.expert_shards, vocab_copies=copies,
                              mtp_blocks=drafter_blocks if last else 0, vocab_params=copies * vocab))
    return tuple(out)
