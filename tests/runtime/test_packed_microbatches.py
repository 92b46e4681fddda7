"""CPU tests of sequence packing: the bin-packing algorithms, the packed row's boundaries, the
unpacking back to the rollout layout, and the context-parallel partitioning."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from rlc.contract.sequence_packing import pad_multiples  # noqa: E402
from rlc.runtime.policy import batches as B  # noqa: E402
from rlc.runtime.policy import bin_packing as BP  # noqa: E402
from rlc.runtime.policy import packing as P  # noqa: E402

ALGOS = ("concatenative", "first_fit_decreasing", "first_fit_shuffle", "modified_first_fit_decreasing",
         "modified_ffd")


# --------------------------------------------------------------------------- bin packing


def _check_bins(bins, lengths, capacity):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths))), "every sequence in exactly one bin"
    assert all(b for b in bins)
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("seed", range(6))
def test_every_algorithm_places_each_sequence_once_within_the_budget(algorithm, seed):
    rng = random.Random(seed)
    capacity = rng.choice([64, 100, 512])
    lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 120))]
    bins = BP.pack(lengths, capacity, algorithm, seed=seed)
    _check_bins(bins, lengths, capacity)
    assert len(bins) >= -(-sum(lengths) // capacity)


def test_concatenative_keeps_the_order_as_nemo_rl_documents():
    lengths = [4, 1, 3, 2, 1, 3, 4, 5]
    assert BP.pack(lengths, 5, "concatenative") == [[0, 1], [2, 3], [4, 5], [6], [7]]
    assert BP.pack(lengths, 8, "concatenative") == [[0, 1, 2], [3, 4, 5], [6], [7]]


def test_first_fit_decreasing_and_mffd_pack_tightly_where_concatenation_does_not():
    lengths = [6, 6, 6, 4, 4, 4]  # pairs of 6 + 4 fill bins of 10 exactly; in order, 4 + 4 share a bin
    assert len(BP.pack(lengths, 10, "concatenative")) == 4
    for algorithm in ("first_fit_decreasing", "modified_first_fit_decreasing"):
        bins = BP.pack(lengths, 10, algorithm)
        assert len(bins) == 3 and all(sum(lengths[i] for i in b) == 10 for b in bins)


def test_mffd_fills_bins_with_pairs_of_small_items():
    # two large items (> C/2) and four small ones (C/6, C/3]: MFFD puts two small ones next to each large one
    lengths = [70, 70, 20, 20, 25, 25]
    bins = BP.pack(lengths, 120, "modified_first_fit_decreasing")
    _check_bins(bins, lengths, 120)
    assert len(bins) == 2


def test_mffd_is_never_worse_than_concatenation_on_random_batches():
    rng = random.Random(7)
    for _ in range(50):
        lengths = [rng.randint(8, 512) for _ in range(64)]
        assert len(BP.pack(lengths, 1024, "modified_first_fit_decreasing")) <= len(
            BP.pack(lengths, 1024, "concatenative")
        )


def test_shuffle_is_seeded_so_every_rank_packs_alike():
    lengths = list(range(1, 60))
    assert BP.pack(lengths, 100, "first_fit_shuffle", seed=3) == BP.pack(lengths, 100, "first_fit_shuffle", seed=3)
    assert BP.pack(lengths, 100, "first_fit_shuffle", seed=3) != BP.pack(lengths, 100, "first_fit_shuffle", seed=4)


def test_a_sequence_longer_than_the_budget_names_the_key_and_the_size():
    with pytest.raises(BP.PackingError, match=r"raise training.sequence_packing.train_mb_tokens to at least 130"):
        BP.pack([10, 130], 128, "first_fit_decreasing", budget_key="training.sequence_packing.train_mb_tokens")
    with pytest.raises(BP.PackingError, match="not one of"):
        BP.pack([10], 128, "best_fit")


def test_split_to_moves_single_sequences_and_stops_at_one_per_bin():
    bins = BP.split_to([[0, 1, 2], [3]], 4)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3] and len(bins) == 4
    assert BP.split_to([[0], [1]], 5) == [[0], [1]]


# --------------------------------------------------------------------------- the packed row


def _batch(lengths, prompt=2, seed=0):
    """A rollout batch whose sequence ``i`` has ``lengths[i]`` tokens (``prompt`` of them prompt)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, lps = [], [], []
    for n in lengths:
        ids = torch.randint(3, 50, (n,), generator=g).tolist()
        prompts.append(ids[:prompt])
        responses.append(ids[prompt:])
        lps.append((-torch.rand(n - prompt, generator=g)).tolist())
    adv = torch.randn(len(lengths), generator=g).tolist()
    return B.pack_rollouts(prompts, responses, lps, adv, pad_id=1, pad_to_multiple=16).tensors()


def test_pack_rollouts_records_each_sequence_length():
    b = _batch([5, 9, 3])
    assert b["lengths"].tolist() == [5, 9, 3]
    assert P.sequence_lengths(b) == [5, 9, 3]


def test_boundaries_positions_and_labels_of_a_packed_row():
    lengths = [5, 9, 3]
    b = _batch(lengths)
    bin_ = P.layout_bin([2, 0, 1], [3, 5, 9], pad_multiples(tp=2, sequence_parallel=True, cp=2))  # multiple 8
    assert bin_.cu_seqlens == (0, 8, 16, 32) and bin_.total == 32 and bin_.max_seqlen == 16
    packed = P.pack_tokens(b["tokens"], bin_, pad_id=0)
    for k, (row, n) in enumerate(zip(bin_.rows, bin_.lengths)):
        a, e = bin_.cu_seqlens[k], bin_.cu_seqlens[k + 1]
        assert packed["tokens"][a : a + n].tolist() == b["tokens"][row, :n].tolist()
        assert packed["tokens"][a + n : e].eq(0).all()
        assert packed["positions"][a:e].tolist() == list(range(e - a))  # restart at every sequence
        assert packed["labels"][a : a + n - 1].tolist() == b["tokens"][row, 1:n].tolist()  # next token, same sequence
    # every real token of the batch in exactly one place
    real = sorted(t for row, n in zip(range(3), lengths) for t in b["tokens"][row, :n].tolist())
    mask = torch.zeros(32, dtype=torch.bool)
    for k, n in enumerate(bin_.lengths):
        mask[bin_.cu_seqlens[k] : bin_.cu_seqlens[k] + n] = True
    assert sorted(packed["tokens"][mask].tolist()) == real and int(mask.sum()) == sum(lengths)


def test_unpack_of_pack_is_the_identity_on_every_predicted_position():
    lengths = [7, 2, 12, 4]
    b = _batch(lengths)
    x = torch.randn(b["mask"].shape)
    bin_ = P.layout_bin([3, 1, 0, 2], [4, 2, 7, 12], pad_multiples(tp=1, sequence_parallel=False, cp=1))
    index, valid = P.unpack_index(bin_, x.shape[1])
    back = P.unpack(P.pack_per_token(x, bin_), index, valid)
    for k, row in enumerate(bin_.rows):
        n = lengths[row]
        assert torch.equal(back[k, : n - 1], x[row, : n - 1])
        assert back[k, n - 1 :].eq(0).all()
    # the loss's positions (the response) are all predicted positions
    for k, row in enumerate(bin_.rows):
        assert bool(valid[k][b["mask"][row] > 0].all())


def _toy_logprobs(tokens, labels, segment_ids):
    """A causal toy model: position t's logits depend on its token and the sum of the tokens of its own
    sequence up to t; returns the logprob of ``labels``."""
    vocab = 64
    cum = torch.zeros_like(tokens, dtype=torch.float64)
    for s in segment_ids.unique().tolist():
        where = segment_ids == s
        cum[where] = tokens[where].double().cumsum(0)
    w = torch.arange(vocab, dtype=torch.float64)
    logits = torch.sin(cum.unsqueeze(-1) * 0.01 * (w + 1)) + torch.cos(tokens.double().unsqueeze(-1) * (w + 2) * 0.1)
    return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def test_packed_logprobs_unpack_to_the_padded_layout():
    """The same causal computation on the padded rows and on the packed row gives the same ``[N, L-1]``
    logprobs at every predicted position: labels, boundaries and unpacking line up."""
    lengths = [6, 11, 3, 8]
    b = _batch(lengths, seed=1)
    tokens = b["tokens"]
    padded = torch.stack([_toy_logprobs(tokens[i, :-1], tokens[i, 1:], torch.zeros(tokens.shape[1] - 1))
                          for i in range(len(lengths))])
    bins = P.plan_bins([lengths], 0, 16, "first_fit_decreasing", pad_multiples(tp=1, sequence_parallel=False, cp=2))
    assert len(bins) >= 2
    seen = []
    for bin_ in bins:
        mb = P.packed_microbatch(b, bin_)
        seg = torch.repeat_interleave(torch.arange(len(bin_.rows)),
                                      torch.tensor([e - a for a, e in zip(bin_.cu_seqlens, bin_.cu_seqlens[1:])]))
        lp_row = _toy_logprobs(mb["tokens"][0], mb["labels"][0], seg)
        got = P.unpack(lp_row, mb["unpack_index"], mb["unpack_valid"])
        for k, row in enumerate(bin_.rows):
            n = lengths[row]
            assert torch.allclose(got[k, : n - 1], padded[row, : n - 1], rtol=0, atol=1e-12)
            assert torch.equal(mb["mask"][k], b["mask"][row]) and mb["advantages"][k] == b["advantages"][row]
        seen += list(bin_.rows)
    assert sorted(seen) == list(range(len(lengths)))


# --------------------------------------------------------------------------- planning a rank's bins


def test_every_data_parallel_rank_runs_as_many_micro_batches():
    pad = pad_multiples(tp=1, sequence_parallel=False, cp=1)
    shards = [[100] * 8, [10] * 8]  # rank 0 needs 8 bins of 128, rank 1 one
    plans = [P.plan_bins(shards, r, 128, "first_fit_decreasing", pad) for r in range(2)]
    assert [len(p) for p in plans] == [8, 8]
    assert not any(b.filler for b in plans[1]) and sorted(i for b in plans[1] for i in b.rows) == list(range(8))
    shards = [[100] * 8, [10] * 3]  # three sequences cannot fill eight bins: five fillers
    plan = P.plan_bins(shards, 1, 128, "first_fit_decreasing", pad)
    assert len(plan) == 8 and sum(b.filler for b in plan) == 5 and sum(b.real_tokens for b in plan) == 30


def test_the_interleaved_pipeline_gets_a_multiple_of_pp_micro_batches():
    pad = pad_multiples(tp=1, sequence_parallel=False, cp=1)
    plan = P.plan_bins([[100] * 5], 0, 128, "first_fit_decreasing", pad, count_multiple=4)
    assert len(plan) == 8 and sum(b.filler for b in plan) == 3


def test_a_filler_bin_counts_nothing():
    b = _batch([5, 6])
    filler = P.layout_bin([0], [5], pad_multiples(tp=1, sequence_parallel=False, cp=1), filler=True)
    mb = P.packed_microbatch(b, filler)
    assert mb["num_real"] == 0 and mb["mask"].sum() == 0 and mb["advantages"].abs().sum() == 0


def test_pipeline_parallel_bins_share_one_length():
    pad = pad_multiples(tp=1, sequence_parallel=False, cp=2)
    shards = [[30, 7, 12, 64, 3, 5], [8, 9, 10, 11, 12, 13]]
    for rank in range(2):
        bins = P.plan_bins(shards, rank, 64, "modified_first_fit_decreasing", pad, common_length=True)
        assert {b.total for b in bins} == {64}
        for b in bins:
            assert all((e - a) % 4 == 0 for a, e in zip(b.cu_seqlens, b.cu_seqlens[1:]))


def test_fp8_pads_the_row_to_the_gemm_multiple():
    pad = pad_multiples(tp=2, sequence_parallel=True, cp=1, fp8_recipe="blockwise")
    assert (pad.sequence, pad.row) == (2, 256)
    assert P.layout_bin([0, 1], [5, 9], pad).cu_seqlens == (0, 6, 256)


# --------------------------------------------------------------------------- context parallelism


def test_cp_partition_matches_the_zigzag_of_each_sequence():
    cu = (0, 8, 12)
    assert P.cp_partition_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert P.cp_partition_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def _reference_cp_tokens(seq: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """NeMo-RL's ``_get_tokens_on_this_cp_rank`` for one sequence (chunks r and 2·CP−1−r)."""
    c = seq.shape[0] // (2 * cp_size)
    return torch.cat(
        [seq[cp_rank * c : (cp_rank + 1) * c], seq[(2 * cp_size - 1 - cp_rank) * c : (2 * cp_size - cp_rank) * c]]
    )


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_ranks_hold_every_token_once_with_equal_causal_work(cp):
    rng = random.Random(cp)
    lengths = [rng.randint(1, 90) for _ in range(9)]
    bin_ = P.layout_bin(list(range(9)), lengths, pad_multiples(tp=2, sequence_parallel=True, cp=cp))
    T = bin_.total
    parts = [P.cp_partition_indices(bin_.cu_seqlens, cp, r) for r in range(cp)]
    assert all(p.numel() == T // cp for p in parts)
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(T))
    positions = torch.cat([torch.arange(e - a) for a, e in zip(bin_.cu_seqlens, bin_.cu_seqlens[1:])])
    work = [int((positions[p] + 1).sum()) for p in parts]  # keys each query attends to under causal masking
    assert len(set(work)) == 1
    row = torch.arange(T)
    for r in range(cp):
        expected = torch.cat(
            [_reference_cp_tokens(row[a:e], r, cp) for a, e in zip(bin_.cu_seqlens, bin_.cu_seqlens[1:])]
        )
        assert torch.equal(parts[r], expected)


def test_cp_gather_restores_the_packed_order():
    lengths = [13, 4, 21]
    bin_ = P.layout_bin([0, 1, 2], lengths, pad_multiples(tp=1, sequence_parallel=False, cp=2))
    values = torch.randn(bin_.total)
    gathered = torch.cat([values[P.cp_partition_indices(bin_.cu_seqlens, 2, r)] for r in range(2)])
    assert torch.equal(gathered[P.cp_restore_index(bin_.cu_seqlens, 2)], values)


def test_cp_microbatch_is_the_ranks_share_of_the_packed_row_and_unpacks_whole():
    lengths = [9, 14, 5]
    b = _batch(lengths, seed=2)
    bin_ = P.plan_bins([lengths], 0, 64, "first_fit_decreasing", pad_multiples(tp=1, sequence_parallel=False, cp=2))[0]
    whole = P.packed_microbatch(b, bin_)
    shares = [P.packed_microbatch(b, bin_, cp_size=2, cp_rank=r) for r in range(2)]
    for r, mb in enumerate(shares):
        local = P.cp_partition_indices(bin_.cu_seqlens, 2, r)
        for key in ("tokens", "position_ids", "labels"):
            assert torch.equal(mb[key][0], whole[key][0][local])
        assert mb["tokens"].shape[1] == bin_.total // 2
        assert torch.equal(mb["cu_seqlens"], whole["cu_seqlens"])  # the whole row's boundaries, as TE takes them
    # per-position values computed on each rank's share, gathered in rank order, restore the whole row
    lp_whole = torch.randn(bin_.total)
    gathered = torch.cat([lp_whole[P.cp_partition_indices(bin_.cu_seqlens, 2, r)] for r in range(2)])
    restored = gathered[shares[0]["cp_restore"]]
    assert torch.equal(P.unpack(restored, whole["unpack_index"], whole["unpack_valid"]),
                       P.unpack(lp_whole, whole["unpack_index"], whole["unpack_valid"]))


def test_cp_needs_sequences_cut_into_two_chunks_per_rank():
    with pytest.raises(ValueError, match="2 × CP = 4"):
        P.cp_partition_indices((0, 6), 2, 0)


def _cp_worker(rank: int, world: int, lengths: list[int]) -> tuple[float, list[float]]:
    """One CP rank: its share of a packed row's per-position values, gathered and unpacked, a loss that is
    the same on every rank, and the gradient of the rank's own share."""
    import torch.distributed as dist

    bin_ = P.layout_bin(list(range(len(lengths))), lengths, pad_multiples(tp=1, sequence_parallel=False, cp=world))
    whole = torch.linspace(-1.0, 1.0, bin_.total, dtype=torch.float64)
    local = whole[P.cp_partition_indices(bin_.cu_seqlens, world, rank)].clone().requires_grad_(True)
    packed = P.gather_context_parallel(local, dist.group.WORLD)[P.cp_restore_index(bin_.cu_seqlens, world)]
    index, valid = P.unpack_index(bin_, max(lengths) - 1)
    loss = (P.unpack(packed, index, valid) ** 2).sum()
    loss.backward()
    assert local.grad is not None
    return loss.item(), local.grad.tolist()


def test_cp_gather_backward_gives_each_rank_the_gradient_of_its_own_positions(tmp_path):
    """Two gloo ranks: the loss on the gathered row is the same on both, and the gradients of the two
    shares, put back in packed order, are the gradient of the same loss computed on the whole row."""
    from tests.gloo_ranks import run_ranks

    lengths = [9, 4, 15]
    out = run_ranks(_cp_worker, 2, tmp_path, lengths)
    bin_ = P.layout_bin([0, 1, 2], lengths, pad_multiples(tp=1, sequence_parallel=False, cp=2))
    whole = torch.linspace(-1.0, 1.0, bin_.total, dtype=torch.float64).requires_grad_(True)
    index, valid = P.unpack_index(bin_, max(lengths) - 1)
    loss = (P.unpack(whole, index, valid) ** 2).sum()
    loss.backward()
    assert out[0][0] == pytest.approx(loss.item()) and out[1][0] == pytest.approx(loss.item())
    grad = torch.zeros(bin_.total, dtype=torch.float64)
    for r in range(2):
        grad[P.cp_partition_indices(bin_.cu_seqlens, 2, r)] = torch.tensor(out[r][1], dtype=torch.float64)
    assert torch.allclose(grad, whole.grad, rtol=0, atol=1e-12) and grad.abs().sum() > 0


# --------------------------------------------------------------------------- the policy worker's planning


def _worker(dp_size: int, dp_rank: int, cp: int, cp_rank: int, budget: int):
    from pathlib import Path

    import yaml

    from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker

    cfg = yaml.safe_load(
        (Path(__file__).resolve().parents[1] / "gpu" / "tiny_runtime.yaml").read_text(encoding="utf-8")
    )
    cfg["training"]["sequence_packing"].update(enabled=True, train_mb_tokens=budget, logprob_mb_tokens=budget)
    cfg["train_parallel"].update(cp=cp, dp=dp_size)
    w = MegatronPolicyWorker(cfg, rank=0, world_size=dp_size * cp)  # no GPU work before setup()
    w.coords = {"dp_size": dp_size, "dp_rank": dp_rank, "cp_rank": cp_rank}
    return w


def test_the_worker_plans_the_same_micro_batches_on_every_rank_of_a_shard():
    lengths = [5, 40, 17, 33, 8, 61, 12, 29, 3, 50, 44, 7]
    b = _batch(lengths, seed=3)
    dp, cp, budget = 2, 2, 64
    key = "training.sequence_packing.train_mb_tokens"
    plans = {(d, r): _worker(dp, d, cp, r, budget)._packed_microbatches(b, (1, 6), budget, key)
             for d in range(dp) for r in range(cp)}
    counts = {len(mbs) for mbs in plans.values()}
    assert len(counts) == 1  # every DP rank runs as many micro batches
    for d in range(dp):
        shard = B.take(B.dp_shard(b, d, dp), 1, 6)
        a, c = plans[(d, 0)], plans[(d, 1)]
        real = sorted(int(i) for mb in a for i in mb["rows"][: mb["num_real"]])
        assert real == list(range(5))  # each row of the optimizer step's slice once
        for m0, m1 in zip(a, c):  # the two CP ranks: one bin, complementary halves of its row
            assert torch.equal(m0["rows"], m1["rows"]) and torch.equal(m0["cu_seqlens"], m1["cu_seqlens"])
            assert m0["tokens"].shape[1] == m1["tokens"].shape[1] == m0["seq_length"] // 2
            for k, row in enumerate(m0["rows"][: m0["num_real"]].tolist()):
                assert torch.equal(m0["mask"][k], shard["mask"][row])
            whole = P.pack_tokens(shard["tokens"], P.layout_bin(m0["rows"].tolist(),
                                                                [int(shard["lengths"][i]) for i in m0["rows"]],
                                                                pad_multiples(tp=1, sequence_parallel=False, cp=2)))
            both = torch.cat([m0["tokens"][0], m1["tokens"][0]])[m0["cp_restore"]]
            if m0["num_real"]:
                assert torch.equal(both, whole["tokens"])
