"""The reshard plan of a dedicated Megatron inference model in another layout than the trainer's, on plain data:
which ranks hold which slices in each grid, the replicas and their prompt shares, the global expert names, and
the verification's join/cut of tensor-parallel pieces (the inverse of how megatron-core splits them)."""
from __future__ import annotations

import pytest
import torch

from rlc.runtime.generation.reshard_plan import (Grid, Piece, ReshardLayout, Segment, expert_index,
                                                 global_expert_name, prompt_chunks, segments, tp_pieces)
from rlc.runtime.generation.reshard_verify import join_tp, tp_slice

# --------------------------------------------------------------------------- grids


def test_train_tp2_and_inference_tp1_on_two_gpus():
    layout = ReshardLayout(Grid(2, tp=2), Grid(2, tp=1))
    assert layout.direct and layout.replicas == 2
    for rank in (0, 1):
        d = layout.describe(rank)
        assert d["train"] == {"tp_rank": rank, "tp_group": [0, 1], "dp_group": [rank]}
        assert d["inference"] == {"tp_rank": 0, "tp_group": [rank], "dp_group": [0, 1], "replica": rank}


def test_train_ep2_and_inference_ep1_hold_different_experts():
    layout = ReshardLayout(Grid(2, ep=2), Grid(2, ep=1))
    assert layout.describe(0, 8)["train"]["experts"] == [0, 1, 2, 3]
    assert layout.describe(1, 8)["train"]["experts"] == [4, 5, 6, 7]
    assert layout.describe(1, 8)["inference"]["experts"] == list(range(8))
    assert Grid(2, ep=2).ep_group(1) == [0, 1] and Grid(2, ep=2).dp_group(1) == [0, 1]  # dense DP 2 at TP 1


def test_larger_grids_follow_megatron_core_order():
    g = Grid(8, tp=2, ep=2, etp=2)  # dense tp-dp, expert etp-ep-edp
    assert g.tp_group(5) == [4, 5] and g.dp_group(5) == [1, 3, 5, 7] and g.dp == 4
    assert g.ep_group(5) == [5, 7] and g.ep_rank(5) == 0 and g.ep_rank(7) == 1 and g.expert_dp == 2
    assert ReshardLayout(Grid(8, tp=2), Grid(8, tp=2)).replicas == 4
    assert not ReshardLayout(Grid(4, tp=2), Grid(4, tp=2)).direct


@pytest.mark.parametrize("kw, needle", [
    ({"world": 3, "tp": 2}, "not a multiple of TP"),
    ({"world": 2, "ep": 4}, "not a multiple of EP"),
    ({"world": 0}, "world=0"),
])
def test_a_grid_that_does_not_tile_is_refused(kw, needle):
    with pytest.raises(ValueError, match=needle):
        Grid(**kw)


def test_the_two_grids_must_cover_the_same_gpus():
    with pytest.raises(ValueError, match="2 GPUs, the inference grid 4"):
        ReshardLayout(Grid(2, tp=2), Grid(4))


# --------------------------------------------------------------------------- tensor-parallel slices


def test_segments_of_a_strided_split():
    # a gated MLP's linear_fc1 (stride 2) over TP 2: rank 0 holds gate[0:2] then up[0:2]
    assert segments(8, 2, 2) == [[Segment(0, 2), Segment(4, 2)], [Segment(2, 2), Segment(6, 2)]]
    with pytest.raises(ValueError, match="does not split"):
        segments(6, 2, 2)


def test_tp2_to_tp1_pieces():
    # plain split: the TP1 tensor is rank 0's piece then rank 1's
    assert tp_pieces(8, 2, 1, 1, 1, 0) == [Piece(0, 0, 0, 4), Piece(1, 0, 4, 4)]
    # gated MLP (stride 2 on both sides): gate from each rank, then up from each rank
    assert tp_pieces(8, 2, 2, 1, 2, 0) == [Piece(0, 0, 0, 2), Piece(1, 0, 2, 2), Piece(0, 2, 4, 2),
                                           Piece(1, 2, 6, 2)]


def test_tp1_to_tp2_and_tp2_to_tp4_pieces():
    assert tp_pieces(8, 1, 2, 2, 2, 1) == [Piece(0, 2, 0, 2), Piece(0, 6, 2, 2)]
    assert tp_pieces(8, 2, 1, 4, 1, 3) == [Piece(1, 2, 0, 2)]


@pytest.mark.parametrize("full, src, src_stride, dst, dst_stride", [
    (24, 2, 2, 1, 2), (24, 2, 1, 1, 1), (24, 1, 1, 2, 1), (24, 2, 2, 4, 2), (24, 4, 1, 2, 1), (24, 3, 2, 2, 2)])
def test_pieces_rebuild_every_destination_from_the_sources(full, src, src_stride, dst, dst_stride):
    """Following the pieces from the source ranks' local tensors gives each destination rank exactly its
    segments of the full tensor (what megatron-core's LCM tiling moves)."""
    values = list(range(full))
    local_src = [[values[s.start + i] for s in segs for i in range(s.length)] for segs in segments(full, src,
                                                                                                    src_stride)]
    for rank, segs in enumerate(segments(full, dst, dst_stride)):
        want = [values[s.start + i] for s in segs for i in range(s.length)]
        got = [None] * len(want)
        for p in tp_pieces(full, src, src_stride, dst, dst_stride, rank):
            got[p.dst_offset:p.dst_offset + p.length] = local_src[p.src][p.src_offset:p.src_offset + p.length]
        assert got == want


# --------------------------------------------------------------------------- experts


def test_expert_names_map_to_global_indices():
    name = "decoder.layers.1.mlp.experts.linear_fc1.weight3"
    assert expert_index(name) == 3
    assert global_expert_name(name, 1, 8, 2) == "decoder.layers.1.mlp.experts.linear_fc1.weight7"
    assert global_expert_name(name, 0, 8, 2) == name
    dense = "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"
    assert expert_index(dense) is None and global_expert_name(dense, 1, 8, 2) == dense
    with pytest.raises(ValueError, match="do not split"):
        global_expert_name(name, 1, 8, 3)


# --------------------------------------------------------------------------- replicas and prompts


def test_each_replica_gets_its_share_and_the_join_is_the_prompts_order():
    prompts = list(range(7))
    chunks = prompt_chunks(len(prompts), 2)
    assert chunks == [(0, 4), (4, 7)]
    assert [p for a, b in chunks for p in prompts[a:b]] == prompts
    assert prompt_chunks(1, 2) == [(0, 1), (1, 1)]  # an empty share: that engine gets nothing to do
    assert prompt_chunks(128, 2) == [(0, 64), (64, 128)]
    with pytest.raises(ValueError):
        prompt_chunks(4, 0)


# --------------------------------------------------------------------------- the verification's join and cut


def _shards(full: torch.Tensor, dim: int, stride: int, world: int) -> list[torch.Tensor]:
    """How megatron-core splits ``full`` (a strided column split is a per-block split, then a concatenation)."""
    blocks = full.chunk(stride, dim=dim)
    return [torch.cat([b.chunk(world, dim=dim)[r] for b in blocks], dim=dim) for r in range(world)]


@pytest.mark.parametrize("dim, stride, world", [(0, 1, 2), (0, 2, 2), (1, 1, 2), (0, 2, 4), (1, 1, 4)])
def test_join_is_the_inverse_of_the_split(dim, stride, world):
    full = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16).to(torch.bfloat16)
    parts = _shards(full, dim, stride, world)
    assert torch.equal(join_tp(parts, dim, stride), full)
    for r in range(world):
        assert torch.equal(tp_slice(full, dim, stride, world, r), parts[r])
    assert tp_slice(full, dim, stride, 1, 0) is full


def test_a_join_without_the_stride_is_caught():
    """Joining a gated MLP's pieces as a plain split mixes gate and up rows: the comparison would fail."""
    full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    parts = _shards(full, 0, 2, 2)
    assert not torch.equal(join_tp(parts, 0, 1), full)
