"""Routing replay's data: vLLM's routes laid onto the rollout batch's tokens, through DP shards and micro batches,
into the token order Megatron's routers see (``rlc.runtime.policy.routes``, ``batches.pack_rollouts``).

A stand-in "vLLM" routes input token ``j`` of a sequence to experts that depend on the token, its position and the
layer (``route``), and returns them as vLLM 0.22 does: rows for the prompt and every response token but the last,
all decoder layers, zeros in the dense layers. Every check compares against that function, never against the code's
own output.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlc.runtime.generation import sampling as S
from rlc.runtime.policy import batches as B
from rlc.runtime.policy import routes as R

E, K = 8, 2  # routed experts, experts per token
DECODER_LAYERS = 4
MOE_LAYERS = [1, 2, 3]  # first_k_dense_replace: 1, as the tiny DeepSeek-V3


def route(token: int, pos: int, layer: int) -> list[int]:
    """Distinct experts for an input token at a position in a decoder layer."""
    first = (token * 3 + pos * 5 + layer) % E
    return [first, (first + 1 + layer) % E]


def vllm_routes(tokens: list[int], rows: int | None = None, num_experts: int = E) -> np.ndarray:
    """vLLM 0.22's ``CompletionOutput.routed_experts`` for prompt + response ``tokens``: one row per token it fed
    through the model (all but the last), every decoder layer, dense layers zero."""
    n = len(tokens) - 1 if rows is None else rows
    out = np.zeros((n, DECODER_LAYERS, K), dtype=np.uint8 if num_experts <= 256 else np.uint16)
    for j in range(n):
        for layer in MOE_LAYERS:
            out[j, layer] = route(tokens[j], j, layer)
    return out


def rollout(prompts, responses, rows=None):
    routes = [R.compact(vllm_routes(list(p) + list(r), None if rows is None else rows[i]), MOE_LAYERS)
              for i, (p, r) in enumerate(zip(prompts, responses))]
    batch = B.pack_rollouts(prompts, responses, [[-0.5] * len(r) for r in responses], [1.0] * len(prompts),
                            pad_id=0, pad_to_multiple=8, routes=routes, num_experts=E).tensors()
    return batch


PROMPTS = [[11, 12, 13], [21, 22], [31, 32, 33, 34, 35]]
RESPONSES = [[14, 15], [23, 24, 25, 26], [36]]


def test_each_position_carries_the_routes_of_its_input_token_in_every_moe_layer():
    batch = rollout(PROMPTS, RESPONSES)
    routed = batch["routed_experts"]
    n, length = batch["tokens"].shape
    assert routed.shape == (n, length - 1, len(MOE_LAYERS), K) and routed.dtype == torch.uint8
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        tokens = p + r
        for j in range(len(tokens) - 1):  # the positions whose logits predict a real token
            for m, layer in enumerate(MOE_LAYERS):
                assert routed[i, j, m].tolist() == route(tokens[j], j, layer), (i, j, layer)
        # the response's predictions sit at P-1 .. P+R-2, every one of them routed
        assert batch["mask"][i].nonzero().flatten().tolist() == list(range(len(p) - 1, len(tokens) - 1))


def test_positions_without_a_route_hold_distinct_experts_spread_over_all_experts():
    batch = rollout(PROMPTS, RESPONSES)
    routed = batch["routed_experts"]
    i, p, r = 1, PROMPTS[1], RESPONSES[1]
    tail = routed[i, len(p) + len(r) - 1:]  # the last token and the padding
    assert tail.shape[0] > 0
    for row in tail.reshape(-1, K).tolist():
        assert len(set(row)) == K and all(0 <= e < E for e in row)
    used = torch.bincount(R.filler(torch.arange(64), K, E).flatten(), minlength=E)
    assert used.min() == used.max()  # round-robin: every expert as often


def test_a_completion_with_missing_routes_leaves_the_loss_from_the_first_unrouted_position():
    full = rollout(PROMPTS, RESPONSES)
    # sample 1: vLLM returned 3 of its 5 rows (2 prompt + 4 response - 1); sample 2: none at all
    short = [None, 3, 0]
    routes = [R.compact(vllm_routes(p + r, short[i]), MOE_LAYERS) if i != 2 else None
              for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))]
    batch = B.pack_rollouts(PROMPTS, RESPONSES, [[-0.5] * len(r) for r in RESPONSES], [1.0] * 3, pad_id=0,
                            pad_to_multiple=8, routes=routes, num_experts=E).tensors()
    assert torch.equal(batch["mask"][0], full["mask"][0])
    # sample 1: positions 3.. depend on position 3's missing route: its response predictions at 1, 2 stay, 3, 4 go
    assert batch["mask"][1].nonzero().flatten().tolist() == [1, 2]
    assert batch["mask"][2].sum() == 0
    assert torch.equal(batch["routed_experts"][1, :3], full["routed_experts"][1, :3])


def test_no_routes_at_all_is_an_error_naming_the_engine_option():
    with pytest.raises(ValueError, match="enable_return_routed_experts"):
        B.pack_rollouts(PROMPTS, RESPONSES, [[-0.5] * len(r) for r in RESPONSES], [1.0] * 3, pad_id=0,
                        routes=[None, None, None], num_experts=E)


def test_routes_outside_the_expert_range_or_of_another_shape_are_refused():
    bad = R.compact(vllm_routes(PROMPTS[0] + RESPONSES[0]), MOE_LAYERS)
    bad[0, 0, 0] = E
    with pytest.raises(ValueError, match="outside 0..7"):
        R.pack_routes([bad], [3], [2], 8, num_layers=3, topk=K, num_experts=E)
    with pytest.raises(ValueError, match=r"expected \[rows, 2, 2\]"):
        R.pack_routes([bad], [3], [2], 8, num_layers=2, topk=K, num_experts=E)


def test_dp_shards_and_micro_batches_keep_each_rows_routes_and_pad_with_valid_routes():
    prompts = [[10 + i, 20 + i] for i in range(6)]
    responses = [[30 + i] * (1 + i % 3) for i in range(6)]
    batch = rollout(prompts, responses)
    shard = B.dp_shard(batch, 1, 2)  # rows 3, 4, 5
    assert torch.equal(shard["routed_experts"], batch["routed_experts"][3:6])
    mbs = B.microbatches(shard, 2)
    assert [mb["num_real"] for mb in mbs] == [2, 1]
    assert torch.equal(mbs[0]["routed_experts"], batch["routed_experts"][3:5])
    filler_row = mbs[1]["routed_experts"][1]  # the padding row copies row 0 of the micro batch, mask 0
    assert torch.equal(filler_row, batch["routed_experts"][5]) and mbs[1]["mask"][1].sum() == 0
    assert "routed_experts" in B.PER_TOKEN_KEYS


def test_replay_targets_follow_megatrons_sequence_major_token_order():
    batch = rollout(PROMPTS, RESPONSES)
    tokens, routed = batch["tokens"], batch["routed_experts"]
    b, s = tokens.shape
    targets = R.replay_targets(routed, s, num_experts=E)
    assert targets.shape == (len(MOE_LAYERS), s * b, K) and targets.dtype == torch.int64
    # Megatron's router sees the [s, b, h] activations flattened: token t = position t // b of row t % b
    flat = tokens.t().reshape(-1)
    for t in range(s * b):
        pos, row = divmod(t, b)
        length = len(PROMPTS[row]) + len(RESPONSES[row])
        if pos < length - 1:
            for m, layer in enumerate(MOE_LAYERS):
                assert targets[m, t].tolist() == route(int(flat[t]), pos, layer)
        else:
            assert len(set(targets[0, t].tolist())) == K  # a filler route


def test_sequence_parallel_ranks_each_get_their_share_of_the_sequence():
    batch = rollout(PROMPTS, RESPONSES)
    s = batch["tokens"].shape[1]
    whole = R.replay_targets(batch["routed_experts"], s, num_experts=E)
    shares = [R.replay_targets(batch["routed_experts"], s, num_experts=E, sp_rank=r, sp_size=2) for r in range(2)]
    assert torch.equal(torch.cat(shares, dim=1), whole)  # rank r routes positions [r s/2, (r+1) s/2) of every row
    with pytest.raises(ValueError, match="sequence-parallel"):
        R.replay_targets(batch["routed_experts"], s, num_experts=E, sp_size=3)
    with pytest.raises(ValueError, match="micro batch has"):
        R.replay_targets(batch["routed_experts"], s + 4, num_experts=E)


def test_compact_keeps_the_moe_layers_and_many_experts_fit_int16():
    tokens = PROMPTS[0] + RESPONSES[0]
    wide = vllm_routes(tokens, num_experts=512)
    wide[:, 2] += 300  # expert ids above 255
    got = R.compact(wide, MOE_LAYERS)
    assert got.dtype == np.int16 and got.shape == (len(tokens) - 1, 3, K)
    assert got[0, 1].tolist() == [x + 300 for x in route(tokens[0], 0, 2)]
    assert R.routes_dtype(256) == torch.uint8 and R.routes_dtype(257) == torch.int16
    assert R.compact(None, MOE_LAYERS) is None
    with pytest.raises(ValueError, match="covers 4 layers"):
        R.compact(wide, [1, 4])


def test_parse_request_output_keeps_the_moe_layers_of_each_completion():
    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731
    routed = vllm_routes([1, 5, 7, 2])
    comp = SimpleNamespace(token_ids=[7, 2], logprobs=[{7: lp(-0.1)}, {2: lp(-0.2)}], text="7", finish_reason="stop",
                           routed_experts=routed)
    req = SimpleNamespace(outputs=[comp])
    plain = S.parse_request_output(req)
    assert plain[0].routed_experts is None
    (sample,) = S.parse_request_output(req, MOE_LAYERS)
    assert np.array_equal(sample.routed_experts, routed[:, MOE_LAYERS])
    none = SimpleNamespace(**{**vars(comp), "routed_experts": None})
    assert S.parse_request_output(SimpleNamespace(outputs=[none]), MOE_LAYERS)[0].routed_experts is None


class _Router(torch.nn.Module):
    """A module with what the replay reads off Megatron's ``TopKRouter``: ``router_replay`` and ``layer_number``."""

    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.router_replay = object()
        self.layer_number = layer_number


def _chunk(decoder_numbers, mtp=True):
    """A model chunk named as Megatron-Bridge's DDP(Float16Module(GPTModel)) names its modules."""
    gpt = torch.nn.Module()
    gpt.decoder = torch.nn.Module()
    gpt.decoder.layers = torch.nn.ModuleList()
    for n in decoder_numbers:
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        if n is not None:
            layer.mlp.router = _Router(n)
        gpt.decoder.layers.append(layer)
    if mtp:  # the MTP block's router numbers its layer from 1 again
        gpt.mtp = torch.nn.Module()
        gpt.mtp.layers = torch.nn.ModuleList([torch.nn.Module()])
        gpt.mtp.layers[0].mtp_model_layer = torch.nn.Module()
        gpt.mtp.layers[0].mtp_model_layer.mlp = torch.nn.Module()
        gpt.mtp.layers[0].mtp_model_layer.mlp.router = _Router(1)
    wrapper = torch.nn.Module()
    wrapper.module = torch.nn.Module()
    wrapper.module.module = gpt
    return wrapper


def test_the_trainers_moe_layers_are_its_decoder_routers_without_the_mtp_block():
    from rlc.runtime.policy.router_replay import ReplayRouters, decoder_routers, local_moe_layers

    stage0, stage1 = _chunk([None, 2], mtp=False), _chunk([3, 4])  # PP 2: layer 0 dense, the MTP block on stage 1
    assert local_moe_layers([stage0]) == [1] and local_moe_layers([stage1]) == [2, 3]
    assert [n for n, _ in decoder_routers(stage1)] == ["module.module.decoder.layers.0.mlp.router",
                                                       "module.module.decoder.layers.1.mlp.router"]
    replay = ReplayRouters(MOE_LAYERS, num_experts=E, keep_for_recompute=False)
    assert [m for _, _, m in replay.routers(stage1)] == [1, 2]  # index into the routes' M axis
    with pytest.raises(RuntimeError, match=r"decoder layer 4\) is not among the MoE layers vLLM records"):
        replay.routers(_chunk([5], mtp=False))


@pytest.mark.parametrize("cp_size,tp", [(1, 1), (2, 1), (2, 2)])
def test_packed_micro_batches_carry_each_tokens_routes_to_its_packed_position_and_shares(cp_size, tp):
    """Sequence packing (thd): each CP rank's tokens, and each sequence-parallel TP rank's share of them, get
    the routes of exactly those tokens; a sequence's last token and its padding get filler routes."""
    from rlc.contract.sequence_packing import pad_multiples
    from rlc.runtime.policy import packing as P

    batch = rollout(PROMPTS, RESPONSES)
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]
    pad = pad_multiples(tp=tp, sequence_parallel=tp > 1, cp=cp_size)
    b = P.layout_bin([2, 0, 1], [lengths[i] for i in (2, 0, 1)], pad)
    for cp_rank in range(cp_size):
        mb = P.packed_microbatch(batch, b, cp_size=cp_size, cp_rank=cp_rank)
        routes = R.micro_batch_routes(mb, num_experts=E, cp_size=cp_size, cp_rank=cp_rank)
        tokens = mb["tokens"]
        assert routes.shape[:2] == tokens.shape and routes.shape[2:] == (len(MOE_LAYERS), K)
        for t, packed_pos in enumerate(P.cp_partition_indices(b.cu_seqlens, cp_size, cp_rank).tolist()):
            k = max(i for i, start in enumerate(b.cu_seqlens[:-1]) if start <= packed_pos)
            row, j = b.rows[k], packed_pos - b.cu_seqlens[k]
            seq = PROMPTS[row] + RESPONSES[row]
            if j < len(seq) - 1:
                assert int(tokens[0, t]) == seq[j]
                for m, layer in enumerate(MOE_LAYERS):
                    assert routes[0, t, m].tolist() == route(seq[j], j, layer), (cp_rank, t, layer)
            else:
                assert len(set(routes[0, t, 0].tolist())) == K
        # the sequence-parallel ranks split this CP rank's row in order
        shares = [R.replay_targets(routes, tokens.shape[1], num_experts=E, sp_rank=r, sp_size=tp) for r in range(tp)]
        assert torch.equal(torch.cat(shares, dim=1), routes[0].permute(1, 0, 2).long())
