"""The vectorised host side of sequence packing equals the per-sequence code it replaced, value for value.

``Reference`` holds the earlier implementations verbatim (per-sequence Python loops): building the rollout
batch, packing a bin's tokens, the unpack index, the context-parallel partition, a packed micro batch,
planning a rank's bins, and ``response_values``. Random batches (lengths, prompts, budgets, algorithms,
padding multiples, CP, DP shards, filler bins, routes) go through both; every tensor must be equal in
value, dtype and shape.
"""
from __future__ import annotations

import multiprocessing
import random
from typing import Any, Sequence

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rlc.contract.sequence_packing import PadMultiples, pad_multiples, round_up  # noqa: E402
from rlc.runtime.policy import batches as B  # noqa: E402
from rlc.runtime.policy import bin_packing  # noqa: E402
from rlc.runtime.policy import packing as P  # noqa: E402
from rlc.runtime.policy import routes as R  # noqa: E402

ALGOS = ("concatenative", "first_fit_decreasing", "first_fit_shuffle", "modified_first_fit_decreasing")


class Reference:
    """The per-sequence implementations, as they were."""

    @staticmethod
    def pack_rollouts(prompt_ids, response_ids, gen_logprobs, advantages, *, pad_id, pad_to_multiple=16):
        n = len(prompt_ids)
        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
        L = B.padded_length(max(lengths), pad_to_multiple)
        tokens = torch.full((n, L), int(pad_id), dtype=torch.int64)
        mask = torch.zeros((n, L - 1), dtype=torch.float32)
        glp = torch.zeros((n, L - 1), dtype=torch.float32)
        for i, (p, r, lp) in enumerate(zip(prompt_ids, response_ids, gen_logprobs)):
            Pn, Rn = len(p), len(r)
            tokens[i, :Pn] = torch.as_tensor(list(p), dtype=torch.int64)
            if Rn:
                tokens[i, Pn : Pn + Rn] = torch.as_tensor(list(r), dtype=torch.int64)
                mask[i, Pn - 1 : Pn - 1 + Rn] = 1.0
                glp[i, Pn - 1 : Pn - 1 + Rn] = torch.as_tensor(list(lp), dtype=torch.float32)
        return {"tokens": tokens, "mask": mask, "gen_logprobs": glp,
                "advantages": torch.as_tensor(list(advantages), dtype=torch.float32),
                "lengths": torch.as_tensor(lengths, dtype=torch.int64)}

    @staticmethod
    def pack_tokens(tokens, b, pad_id=0):
        T = b.total
        out_tokens = torch.full((T,), int(pad_id), dtype=torch.int64)
        labels = torch.zeros(T, dtype=torch.int64)
        positions = torch.empty(T, dtype=torch.int64)
        for k, (row, n) in enumerate(zip(b.rows, b.lengths)):
            a, e = b.cu_seqlens[k], b.cu_seqlens[k + 1]
            seq = tokens[row, :n]
            out_tokens[a : a + n] = seq
            labels[a : a + n - 1] = seq[1:]
            positions[a:e] = torch.arange(e - a)
        return {"tokens": out_tokens, "positions": positions, "labels": labels}

    @staticmethod
    def unpack_index(b, width):
        k = len(b.rows)
        j = torch.arange(width, dtype=torch.int64).expand(k, width)
        starts = torch.tensor(b.cu_seqlens[:-1], dtype=torch.int64).unsqueeze(1)
        lens = torch.tensor(b.lengths, dtype=torch.int64).unsqueeze(1)
        valid = j < (lens - 1)
        index = torch.where(valid, starts + j, torch.zeros_like(j))
        return index, valid

    @staticmethod
    def cp_partition_indices(cu_seqlens, cp_size, cp_rank):
        if cp_size == 1:
            return torch.arange(int(cu_seqlens[-1]), dtype=torch.int64)
        starts, sizes = [], []
        for a, e in zip(cu_seqlens, cu_seqlens[1:]):
            n = int(e) - int(a)
            c = n // (2 * cp_size)
            starts += [int(a) + cp_rank * c, int(a) + (2 * cp_size - 1 - cp_rank) * c]
            sizes += [c, c]
        parts = [torch.arange(s, s + n, dtype=torch.int64) for s, n in zip(starts, sizes) if n > 0]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    @classmethod
    def cp_restore_index(cls, cu_seqlens, cp_size):
        order = torch.cat([cls.cp_partition_indices(cu_seqlens, cp_size, r) for r in range(cp_size)])
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel(), dtype=torch.int64)
        return restore

    @classmethod
    def packed_microbatch(cls, batch, b, *, cp_size=1, cp_rank=0, pad_id=0):
        tokens = batch["tokens"]
        packed = cls.pack_tokens(tokens, b, pad_id)
        local = cls.cp_partition_indices(b.cu_seqlens, cp_size, cp_rank)
        index, valid = cls.unpack_index(b, tokens.shape[1] - 1)
        mb: dict[str, Any] = {
            "tokens": packed["tokens"][local].unsqueeze(0),
            "position_ids": packed["positions"][local].unsqueeze(0),
            "labels": packed["labels"][local].unsqueeze(0),
            "cu_seqlens": torch.tensor(b.cu_seqlens, dtype=torch.int32),
            "max_seqlen": b.max_seqlen,
            "unpack_index": index,
            "unpack_valid": valid,
            "rows": torch.tensor(b.rows, dtype=torch.int64),
            "num_real": 0 if b.filler else len(b.rows),
        }
        if cp_size > 1:
            mb["cp_restore"] = cls.cp_restore_index(b.cu_seqlens, cp_size)
        rows = list(b.rows)
        for key, value in batch.items():
            if key in mb or not isinstance(value, torch.Tensor) or key == "tokens":
                continue
            part = value[rows]
            if b.filler and key in P.PER_TOKEN_LOSS_KEYS:
                part = torch.zeros_like(part)
            mb[key] = part
        return mb

    @staticmethod
    def plan_bins(shard_lengths: Sequence[Sequence[int]], rank: int, budget: int, algorithm: str, pad: PadMultiples, *,
                  seed: int = 0, common_length: bool = False, count_multiple: int = 1) -> list[P.PackedBin]:
        planned = []
        for lengths in shard_lengths:
            padded = [round_up(n, pad.sequence) for n in lengths]
            planned.append(bin_packing.pack(padded, budget, algorithm, seed=seed))
        count = round_up(max((len(b) for b in planned), default=0), count_multiple)
        mine = bin_packing.split_to(planned[rank], count)
        lengths = list(shard_lengths[rank])
        fillers = count - len(mine)
        total = None
        if common_length:
            total = max(P.layout_bin(b, [shard[i] for i in b], pad).total
                        for shard, bins in zip(shard_lengths, planned) for b in bins)
        out = [P.layout_bin(b, [lengths[i] for i in b], pad, total) for b in mine]
        if fillers:
            out.extend([P.layout_bin([0], [lengths[0]], pad, total, filler=True)] * fillers)
        return out

    @staticmethod
    def response_values(per_token, mask):
        return [row[m > 0].tolist() for row, m in zip(per_token, mask)]


def _lists(rng: random.Random, n: int, lo: int, hi: int, empty_responses: bool = True):
    prompts, responses, lps, adv = [], [], [], []
    for _ in range(n):
        total = rng.randint(lo, hi)
        p = rng.randint(1, total) if empty_responses else rng.randint(1, max(1, total - 1))
        ids = [rng.randrange(0, 151_000) for _ in range(total)]
        prompts.append(ids[:p])
        responses.append(ids[p:])
        lps.append([-rng.random() * 20 for _ in range(total - p)])
        adv.append(rng.gauss(0.0, 1.0))
    return prompts, responses, lps, adv


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("seed", range(8))
def test_pack_rollouts_equals_the_per_sample_code(seed):
    rng = random.Random(seed)
    lists = _lists(rng, rng.randint(1, 60), 1, rng.choice([8, 40, 300]))
    multiple = rng.choice([1, 16, 64])
    pad = rng.randint(0, 5)
    got = B.pack_rollouts(*lists, pad_id=pad, pad_to_multiple=multiple).tensors()
    ref = Reference.pack_rollouts(*lists, pad_id=pad, pad_to_multiple=multiple)
    _assert_same(got, ref)
    # the response positions, read back per sample, are the generation's logprobs rounded to float32
    assert B.response_values(got["gen_logprobs"], got["mask"]) == Reference.response_values(ref["gen_logprobs"],
                                                                                            ref["mask"])


def _random_batch(rng: random.Random, n: int, hi: int) -> dict:
    batch = B.pack_rollouts(*_lists(rng, n, 2, hi, empty_responses=False), pad_id=rng.randint(0, 3)).tensors()
    width = batch["mask"].shape[1]
    batch["old_logprobs"] = -torch.rand(n, width)
    batch["ref_logprobs"] = -torch.rand(n, width)
    batch["routed_experts"] = torch.randint(0, 8, (n, width, 3, 2), dtype=torch.uint8)
    return batch


@pytest.mark.parametrize("seed", range(10))
def test_packed_micro_batches_equal_the_per_sequence_code(seed):
    rng = random.Random(100 + seed)
    dp = rng.choice([1, 2, 4])
    batch = _random_batch(rng, dp * rng.randint(1, 24), rng.choice([12, 90, 260]))
    cp = rng.choice([1, 1, 2, 4])
    tp = rng.choice([1, 2])
    pad = pad_multiples(tp=tp, sequence_parallel=tp > 1, cp=cp,
                        fp8_recipe=rng.choice([None, None, "blockwise", "tensorwise"]))
    algorithm = rng.choice(ALGOS)
    longest = round_up(int(batch["lengths"].max()), pad.sequence)
    budget = rng.choice([longest, 2 * longest, 5 * longest])
    shards = [B.dp_shard(batch, d, dp) for d in range(dp)]
    lengths = [P.sequence_lengths(sh) for sh in shards]
    kwargs = {"seed": rng.randint(0, 99), "common_length": rng.random() < 0.3,
              "count_multiple": rng.choice([1, 1, 2, 4])}
    for rank in range(dp):
        bins = P.plan_bins(lengths, rank, budget, algorithm, pad, **kwargs)
        assert bins == Reference.plan_bins(lengths, rank, budget, algorithm, pad, **kwargs)
        for cp_rank in range(cp):  # a whole pass at once, as the worker builds it
            together = P.packed_microbatches(shards[rank], bins, cp_size=cp, cp_rank=cp_rank, pad_id=3)
            assert len(together) == len(bins)
            for mb, b in zip(together, bins):
                _assert_same(mb, Reference.packed_microbatch(shards[rank], b, cp_size=cp, cp_rank=cp_rank, pad_id=3))
        for b in bins:
            for width in (1, 37, batch["mask"].shape[1]):
                for got, ref in zip(P.unpack_index(b, width), Reference.unpack_index(b, width)):
                    assert got.dtype == ref.dtype and torch.equal(got, ref)
            for cp_rank in range(cp):
                got = P.packed_microbatch(shards[rank], b, cp_size=cp, cp_rank=cp_rank, pad_id=7)
                _assert_same(got, Reference.packed_microbatch(shards[rank], b, cp_size=cp, cp_rank=cp_rank, pad_id=7))
                for size, r in ((cp, cp_rank), (1, 0)):
                    assert torch.equal(R.micro_batch_routes(got, num_experts=8, cp_size=size, cp_rank=r),
                                       R.micro_batch_routes(Reference.packed_microbatch(shards[rank], b, cp_size=size,
                                                                                        cp_rank=r), num_experts=8,
                                                            cp_size=size, cp_rank=r))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_partition_and_restore_equal_the_per_sequence_code(cp):
    rng = random.Random(cp)
    for _ in range(20):
        sizes = [2 * cp * rng.randint(1, 30) for _ in range(rng.randint(1, 40))]
        cu = [0] + list(np.cumsum(sizes).tolist())
        for r in range(cp):
            assert torch.equal(P.cp_partition_indices(cu, cp, r), Reference.cp_partition_indices(cu, cp, r))
            assert torch.equal(P.cp_partition_indices(torch.tensor(cu, dtype=torch.int32), cp, r),
                               Reference.cp_partition_indices(cu, cp, r))
        assert torch.equal(P.cp_restore_index(cu, cp), Reference.cp_restore_index(cu, cp))


def test_concat_ranges_skips_empty_ranges():
    starts = torch.tensor([5, 0, 9, 2, 40])
    sizes = torch.tensor([3, 0, 1, 4, 0])
    assert P.concat_ranges(starts, sizes).tolist() == [5, 6, 7, 9, 2, 3, 4, 5]
    assert P.concat_ranges(starts, torch.zeros(5, dtype=torch.int64)).numel() == 0


def test_a_plan_is_reused_only_where_it_is_the_same():
    pad = pad_multiples(tp=1, sequence_parallel=False, cp=1)
    lengths = [[random.Random(i).randint(1, 100) for i in range(200)]]
    a = P.plan_bins(lengths, 0, 256, "first_fit_decreasing", pad, seed=1)
    b = P.plan_bins(lengths, 0, 256, "first_fit_decreasing", pad, seed=2)
    assert a == b and a is not b  # deterministic algorithm: the seed does not matter; callers get their own list
    a.clear()
    assert P.plan_bins(lengths, 0, 256, "first_fit_decreasing", pad, seed=1) == b
    shuffled = [P.plan_bins(lengths, 0, 256, "first_fit_shuffle", pad, seed=s) for s in (1, 2, 1)]
    assert shuffled[0] == shuffled[2] != shuffled[1]
    assert shuffled[1] == Reference.plan_bins(lengths, 0, 256, "first_fit_shuffle", pad, seed=2)
    other = [lengths[0][:-1] + [lengths[0][-1] % 100 + 1]]
    assert P.plan_bins(other, 0, 256, "first_fit_decreasing", pad) == Reference.plan_bins(other, 0, 256,
                                                                                         "first_fit_decreasing", pad)


def _pack_in_child(queue) -> None:
    b = P.layout_bin([1, 0], [5, 5], pad_multiples(tp=1, sequence_parallel=False, cp=2))
    mb = P.packed_microbatch(_CHILD_BATCH, b, cp_size=2, cp_rank=1)
    queue.put(mb["tokens"].tolist())


_CHILD_BATCH = B.pack_rollouts([[3, 4], [5, 6, 7]], [[8, 9, 10], [11, 12]], [[-1.0] * 3, [-1.0] * 2], [1.0, 1.0],
                               pad_id=0).tensors()


def test_a_process_forked_after_packing_can_still_pack():
    """Packing in the parent must not leave it with a thread pool a forked child inherits locked (torch's
    CPU ``repeat_interleave`` does): the child packs too and answers in time."""
    b = P.layout_bin([0, 1], [5, 5], pad_multiples(tp=1, sequence_parallel=False, cp=2))
    P.packed_microbatch(_CHILD_BATCH, b, cp_size=2, cp_rank=0)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_pack_in_child, args=(queue,))
    proc.start()
    try:
        got = queue.get(timeout=60)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    b = P.layout_bin([1, 0], [5, 5], pad_multiples(tp=1, sequence_parallel=False, cp=2))
    assert got == Reference.packed_microbatch(_CHILD_BATCH, b, cp_size=2, cp_rank=1)["tokens"].tolist()


def _reference_gen_kl_metrics(gen_logprobs, train_logprobs, mask):
    """The metrics as computed over the whole padded tensors."""
    keep = mask > 0
    n = keep.sum()
    d = train_logprobs.to(torch.float64) - gen_logprobs.to(torch.float64)
    d = torch.where(keep, d, torch.zeros_like(d))
    kl = 0.0 if n.item() == 0 else ((torch.exp(d.clamp(max=50.0)) - d - 1.0).sum() / n).item()
    diff = (train_logprobs.double() - gen_logprobs.double()).abs()[mask.to(torch.bool)]
    return {"gen_kl": kl, "gen_logprob_abs_diff_mean": diff.mean().item() if diff.numel() else 0.0,
            "gen_logprob_abs_diff_max": diff.max().item() if diff.numel() else 0.0}


@pytest.mark.parametrize("seed", range(4))
def test_gen_kl_metrics_read_only_the_generated_tokens(seed):
    """Computed on the generated tokens alone: the differences' mean and max are the same numbers; the
    k3 mean sums the same terms without the padding's zeros (float64, equal to rounding); NaN in the
    padding never reaches them."""
    from rlc.runtime.grpo.loss import gen_kl, gen_kl_metrics

    g = torch.Generator().manual_seed(seed)
    n, width = 64, 300
    lengths = torch.randint(0, width, (n,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    gen = -torch.rand(n, width, generator=g) * 4
    train = gen + 0.3 * torch.randn(n, width, generator=g)
    train[mask == 0] = float("nan")
    got, want = gen_kl_metrics(gen, train, mask), _reference_gen_kl_metrics(gen, train, mask)
    assert got["gen_logprob_abs_diff_mean"] == want["gen_logprob_abs_diff_mean"]
    assert got["gen_logprob_abs_diff_max"] == want["gen_logprob_abs_diff_max"]
    assert got["gen_kl"] == pytest.approx(want["gen_kl"], rel=1e-12) and got["gen_kl"] > 0
    assert gen_kl(gen, train, mask) == got["gen_kl"]
    empty = torch.zeros(n, width)
    assert gen_kl_metrics(gen, train, empty) == _reference_gen_kl_metrics(gen, train, empty)
