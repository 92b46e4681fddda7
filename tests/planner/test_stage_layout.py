"""Pipeline stage split and shards (property tests)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rlc.compiler.planner.layout import GenerationLayout, TrainLayout
from rlc.compiler.planner.shards import megatron_stage_shards, vllm_stage_shards


def tl(**kw):
    base = dict(world=256, tp=8, pp=8, cp=1, ep=32, etp=1, vpp=1, first=None, last=None, sequence_parallel=True)
    base.update(kw)
    return TrainLayout(**base)


def test_nemo_rl_2471_stage_split_and_dp():
    layout = tl(first=6, last=6)
    assert layout.stage_layer_counts(60) == [6, 8, 8, 8, 8, 8, 8, 6]
    assert (layout.dp, layout.expert_dp, layout.dense_optimizer_shards) == (4, 1, 4)


def test_vpp_interleaves_chunks():
    layout = tl(pp=2, vpp=2, world=16)
    assert layout.stage_layers(8) == [[0, 1, 4, 5], [2, 3, 6, 7]]


@given(layers=st.integers(1, 200), pp=st.integers(1, 16), vpp=st.integers(1, 4),
       first=st.one_of(st.none(), st.integers(1, 12)), last=st.one_of(st.none(), st.integers(1, 12)))
def test_stage_layers_partition_every_layer_once(layers, pp, vpp, first, last):
    layout = tl(pp=pp, vpp=vpp, first=first if pp > 1 else None, last=last if pp > 2 else None)
    stages = layout.stage_layers(layers)
    flat = sorted(i for s in stages for i in s)
    counts = layout.stage_layer_counts(layers)
    assert len(stages) == pp and [len(s) for s in stages] == counts
    if sum(counts) == layers:
        assert flat == list(range(layers))


def test_megatron_shards_sum_to_model(qwen397):
    layout = tl(first=6, last=6)
    shards = megatron_stage_shards(qwen397, layout)
    counts = qwen397.param_counts()
    # Every expert is held by exactly EP x ETP x expert-DP ranks per stage; dense params by TP x DP.
    experts = sum(s.expert for s in shards) * layout.ep * layout.etp
    assert experts == counts["routed_experts"] + 512 * 3 * 1024 * 4096  # + the MTP block's experts
    assert shards[-1].mtp_blocks == 1 and shards[-1].vocab_copies == 2 and shards[0].vocab_copies == 1


def test_vllm_expert_shard_halves_with_ep(qwen397):
    w = {
        ep: max(s.params for s in vllm_stage_shards(qwen397, GenerationLayout(256, 16, 1, ep, 16)))
        for ep in (64, 128, 256)
    }
    per_expert_all_layers = 60 * 3 * 1024 * 4096
    assert w[64] - w[128] == 4 * per_expert_all_layers
    assert w[128] - w[256] == 2 * per_expert_all_layers
