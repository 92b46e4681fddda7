"""Per-GPU shard math, checked against a second implementation written from the rules (one layer at a
time, each rule spelled out) and against the model's total parameter count, for the catalog's
families (dense, tied, MoE, MTP, MLA, hybrid Mamba) under any layout.

The planner's stage shards decide every memory number of the plan; a single wrong division (experts
by EP instead of EP × ETP, the replicated norms dropped, the MTP embedding replica on the wrong
stage) must fail here."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlc.compiler import catalog
from rlc.compiler.planner.layout import GenerationLayout, TrainLayout
from rlc.compiler.planner.shards import megatron_stage_shards, vllm_stage_shards

MODELS = ["Qwen/Qwen3.5-397B-A17B", "deepseek-ai/DeepSeek-V3", "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B",
          "openai/gpt-oss-20b", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B", "zai-org/GLM-4.5-Air", "Qwen/Qwen3-30B-A3B"]
FACTS = {m: catalog.model_facts(m, Path(".")) for m in MODELS}


def _layer_sums(f, indices):
    tp = rep = exp = 0
    for i in indices:  # one layer at a time
        split = f.layer_split(f.layer_kinds[i])
        tp, rep, exp = tp + split.tp, rep + split.replicated, exp + split.expert
    return tp, rep, exp


def reference_megatron(f, layout: TrainLayout) -> list[tuple[int, int, int]]:
    """(dense, expert, vocab copies) per stage, from the rules in docs/planner.md."""
    stages = layout.stage_layers(f.num_layers)
    vocab = f.vocab * f.hidden // layout.tp  # one vocabulary matrix, split by TP
    out = []
    for s, indices in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        tp, rep, exp = _layer_sums(f, indices)
        copies = 0
        if first:
            copies += 1  # the word embedding
        if last and not f.tied_embeddings:
            copies += 1  # the output layer
        if last and f.tied_embeddings and not first:
            copies += 1  # tied: the last stage keeps its own copy of the embedding as output weight
        if last and f.mtp_num_layers:
            block = f.mtp_block_split()
            tp += block.tp * f.mtp_num_layers
            rep += block.replicated * f.mtp_num_layers
            exp += block.expert * f.mtp_num_layers
            if f.mtp_shared_embedding is False:
                copies += 1  # the MTP block's own embedding
            elif not f.tied_embeddings and not first:
                copies += 1  # NeMo-RL #2471 failure 1: MTP replicates the word embedding on the last stage
        out.append((tp // layout.tp + rep + copies * vocab, exp // (layout.ep * layout.etp), copies))
    return out


def reference_vllm(f, layout: GenerationLayout, drafter_blocks: int) -> list[tuple[int, int, int]]:
    stages = layout.stage_layers(f.num_layers)
    vocab = f.vocab * f.hidden // layout.tp
    expert_shards = layout.ep if layout.ep > 1 else layout.tp  # experts split by EP, or by TP without EP
    out = []
    for s, indices in enumerate(stages):
        first, last = s == 0, s == len(stages) - 1
        tp, rep, exp = _layer_sums(f, indices)
        copies = (1 if first else 0) + (1 if last and (not f.tied_embeddings or not first) else 0)
        if last and drafter_blocks:
            block = f.vllm_mtp_block_split()
            tp, rep, exp = (tp + block.tp * drafter_blocks, rep + block.replicated * drafter_blocks,
                            exp + block.expert * drafter_blocks)
            if len(stages) > 1:
                copies += 1  # the drafter's own embedding (vLLM shares the model's only when PP == 1)
        out.append((tp // layout.tp + rep + copies * vocab, exp // expert_shards, copies))
    return out


@pytest.mark.parametrize("model", MODELS)
def test_one_gpu_holds_the_whole_model(model):
    """TP = PP = EP = 1: the shard is the model's total (HF view, MTP included) but its final norm."""
    f = FACTS[model]
    one = TrainLayout(world=1, tp=1, pp=1, cp=1, ep=1, etp=1, vpp=1, first=None, last=None, sequence_parallel=False)
    (shard,) = megatron_stage_shards(f, one)
    assert shard.params == f.param_counts()["total"] - f.hidden
    (gen,) = vllm_stage_shards(f, GenerationLayout(world=1, tp=1, pp=1, ep=1, dp=1), f.mtp_num_layers)
    assert gen.params == shard.params - (
        f.mtp_num_layers and (f.mtp_block_split().total - f.vllm_mtp_block_split().total)
    )


layouts = st.fixed_dictionaries({
    "tp": st.sampled_from([1, 2, 4, 8]), "pp": st.sampled_from([1, 2, 3, 4, 8]), "ep": st.sampled_from([1, 2, 4, 8]),
    "etp": st.sampled_from([1, 2]), "vpp": st.sampled_from([1, 2]),
    "first": st.one_of(st.none(), st.integers(1, 6)), "last": st.one_of(st.none(), st.integers(1, 6)),
})


@settings(max_examples=150, deadline=None)
@given(model=st.sampled_from(MODELS), kw=layouts)
def test_megatron_shards_match_the_rules_stage_by_stage(model, kw):
    f = FACTS[model]
    first = kw["first"] if kw["pp"] > 1 else None
    last = kw["last"] if kw["pp"] > 2 else None
    layout = TrainLayout(world=kw["tp"] * kw["pp"] * kw["ep"] * kw["etp"], tp=kw["tp"], pp=kw["pp"], cp=1,
                         ep=kw["ep"], etp=kw["etp"], vpp=kw["vpp"], first=first, last=last, sequence_parallel=True)
    shards = megatron_stage_shards(f, layout)
    assert [(s.dense, s.expert, s.vocab_copies) for s in shards] == reference_megatron(f, layout)
    assert [s.layers for s in shards] == layout.stage_layer_counts(f.num_layers)
    assert [s.mtp_blocks for s in shards] == [0] * (len(shards) - 1) + [f.mtp_num_layers]


@settings(max_examples=150, deadline=None)
@given(model=st.sampled_from(MODELS), tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 3, 4]),
       ep=st.sampled_from([1, 2, 4, 8, 16]), drafter=st.sampled_from([0, 1]))
def test_vllm_shards_match_the_rules_stage_by_stage(model, tp, pp, ep, drafter):
    f = FACTS[model]
    blocks = drafter * f.mtp_num_layers
    layout = GenerationLayout(world=tp * pp * ep, tp=tp, pp=pp, ep=ep, dp=ep)
    assert layout.expert_shards == (ep if ep > 1 else tp)
    shards = vllm_stage_shards(f, layout, blocks)
    assert [(s.dense, s.expert, s.vocab_copies) for s in shards] == reference_vllm(f, layout, blocks)
    assert [s.mtp_blocks for s in shards] == [0] * (len(shards) - 1) + [blocks]


def test_the_mtp_embedding_replica_is_on_the_last_stage_only_with_pp():
    """NeMo-RL #2471 failure 1: Qwen3.5-397B (untied, MTP sharing the embedding) on PP 8 holds the word
    embedding on stage 0, and the output layer plus the MTP replica on stage 7."""
    f = FACTS["Qwen/Qwen3.5-397B-A17B"]
    layout = TrainLayout(world=256, tp=8, pp=8, cp=1, ep=32, etp=1, vpp=1, first=6, last=6, sequence_parallel=True)
    copies = [s.vocab_copies for s in megatron_stage_shards(f, layout)]
    assert copies == [1, 0, 0, 0, 0, 0, 0, 2]
    one_stage = TrainLayout(world=32, tp=8, pp=1, cp=1, ep=32, etp=1, vpp=1, first=None, last=None,
                            sequence_parallel=True)
    assert [s.vocab_copies for s in megatron_stage_shards(f, one_stage)] == [2]


def test_experts_split_over_ep_times_etp():
    f = FACTS["Qwen/Qwen3-30B-A3B"]
    base = dict(world=64, tp=2, pp=1, cp=1, vpp=1, first=None, last=None, sequence_parallel=True)
    by_ep = megatron_stage_shards(f, TrainLayout(ep=8, etp=1, **base))[0].expert
    by_ep_etp = megatron_stage_shards(f, TrainLayout(ep=8, etp=2, **base))[0].expert
    assert by_ep == 2 * by_ep_etp == f.param_counts()["routed_experts"] // 8
