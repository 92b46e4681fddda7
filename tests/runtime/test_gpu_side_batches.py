"""CPU tests of the trainer's batch plumbing, the sampling message formats and metric merging."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from rlc.runtime.recorder import merge_train_metrics  # noqa: E402
from rlc.runtime.generation import sampling as S  # noqa: E402
from rlc.runtime.policy import batches as B  # noqa: E402
from rlc.runtime.policy.refit_source import find_multiple_owners  # noqa: E402
from rlc.runtime.worker_api import Sample, TrainStepResult  # noqa: E402


def test_pack_aligns_logprobs_with_next_token_positions():
    b = B.pack_rollouts([[1, 5, 6]], [[7, 2]], [[-0.5, -0.25]], [1.5], pad_id=0, pad_to_multiple=8).tensors()
    assert b["tokens"].shape == (1, 8)
    assert b["tokens"][0, :5].tolist() == [1, 5, 6, 7, 2]
    # logits at position 2 predict token 3 (=7), at 3 predict token 4 (=2)
    assert b["mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert b["gen_logprobs"][0, 2:4].tolist() == [-0.5, -0.25]
    assert b["advantages"].tolist() == [1.5]
    assert B.response_values(b["gen_logprobs"], b["mask"]) == [[-0.5, -0.25]]


def test_pack_rejects_misaligned_and_too_long():
    with pytest.raises(ValueError, match="aligned"):
        B.pack_rollouts([[1]], [], [], [], pad_id=0)
    with pytest.raises(ValueError, match="logprobs"):
        B.pack_rollouts([[1]], [[2, 3]], [[0.0]], [0.0], pad_id=0)
    with pytest.raises(ValueError, match="max_sequence_length"):
        B.pack_rollouts([[1, 2, 3]], [[4, 5]], [[0.0, 0.0]], [0.0], pad_id=0, max_length=4)


def _batch(n):
    return B.pack_rollouts(
        [[1, 2]] * n, [[3, 4]] * n, [[-1.0, -1.0]] * n, list(range(n)), pad_id=0, pad_to_multiple=4
    ).tensors()


def test_dp_shard_and_microbatches_pad_with_masked_rows():
    b = _batch(6)
    s1 = B.dp_shard(b, 1, 2)
    assert s1["advantages"].tolist() == [3.0, 4.0, 5.0]
    mbs = B.microbatches(s1, 2)
    assert [m["num_real"] for m in mbs] == [2, 1]
    assert mbs[1]["tokens"].shape[0] == 2 and mbs[1]["mask"][1].sum() == 0 and mbs[1]["advantages"][1] == 0
    with pytest.raises(ValueError, match="multiple of train_parallel.dp"):
        B.dp_shard(b, 0, 4)


def test_optimizer_step_slices_cover_local_shard():
    assert B.optimizer_step_slices(8, 8, 2) == [(0, 4)]
    assert B.optimizer_step_slices(8, 4, 2) == [(0, 2), (2, 4)]
    assert B.optimizer_step_slices(6, 100, 1) == [(0, 6)]


def test_sampling_kwargs_and_logprobs_mode():
    sp = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=2, stop=[])
    kw = S.sampling_kwargs(sp, 16, eos_token_id=2)
    assert kw == {
        "n": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_tokens": 2,
        "logprobs": 0,
        "stop_token_ids": [2],
    }
    assert S.logprobs_mode(sp) == "raw_logprobs"
    assert S.logprobs_mode(SimpleNamespace(temperature=0.7, top_p=1.0, top_k=-1)) == "processed_logprobs"
    assert S.sampling_kwargs(SimpleNamespace(temperature=0.7, top_p=0.9, top_k=5, max_tokens=8, stop=["\n"]), 2)[
        "stop"
    ] == ["\n"]


def test_parse_request_output_reads_sampled_token_logprobs():
    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731
    comp = SimpleNamespace(token_ids=[7, 2], logprobs=[{7: lp(-0.1), 9: lp(-3.0)}, {2: lp(-0.2)}], text="7",
                           finish_reason="stop")
    req = SimpleNamespace(
        outputs=[comp], prompt_token_ids=[1, 5, 6], prompt_logprobs=[None, {5: lp(-1.0)}, {6: lp(-2.0)}]
    )
    assert S.parse_request_output(req) == [Sample(token_ids=[7, 2], logprobs=[-0.1, -0.2], text="7",
                                                  finish_reason="stop")]
    assert S.prompt_logprobs_of(req) == [-1.0, -2.0]
    with pytest.raises(ValueError, match="logprobs=0"):
        S.sampled_logprobs([1], None)


def test_merge_train_metrics_sums_losses_and_weights_others():
    a = TrainStepResult(
        loss_sums={"loss/total": 0.25},
        weighted_sums={"clip_fraction": 10.0},
        maxes={"ratio_max": 1.1},
        num_tokens=100.0,
        grad_norm=0.5,
        lr=1e-3,
        optimizer_steps=1,
        train_s=1.0,
    )
    b = TrainStepResult(
        loss_sums={"loss/total": 0.5},
        weighted_sums={"clip_fraction": 30.0},
        maxes={"ratio_max": 1.3},
        num_tokens=100.0,
        grad_norm=0.5,
        lr=1e-3,
        optimizer_steps=1,
        train_s=1.0,
    )
    m = merge_train_metrics([a, b])
    assert m["loss/total"] == 0.75 and m["clip_fraction"] == 0.2 and m["ratio_max"] == 1.3 and m["num_tokens"] == 200
    assert merge_train_metrics([]) == {}


def test_find_multiple_owners_flags_mtp_embedding():
    owned = [
        ["decoder.layers.0.w", "embedding.word_embeddings.weight"],
        ["decoder.layers.1.w", "embedding.word_embeddings.weight"],
    ]
    assert find_multiple_owners(owned) == {"embedding.word_embeddings.weight": [0, 1]}
    assert find_multiple_owners([["a"], ["b"]]) == {}
