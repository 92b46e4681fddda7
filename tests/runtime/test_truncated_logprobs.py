"""The trainer's logprobs under the rollout engine's cuts (min-p, top-k, top-p): the kept set against an independent
reading of the semantics (megatron-core's descending form of top-p), the logprob and its gradient against autograd
through a masked log-softmax, and the same numbers from a vocabulary split over two and three real gloo ranks
(rows padded to a multiple of the ranks, chunked rows)."""
from __future__ import annotations

import pytest
import torch

from rlc.contract.sampling_truncation import Truncation
from rlc.runtime.policy import truncated_logprobs as T
from tests.gloo_ranks import run_ranks

ROWS, VOCAB = 7, 48
CASES = [Truncation(top_p=0.9), Truncation(top_k=5), Truncation(top_k=12, top_p=0.8), Truncation(min_p=0.1),
         Truncation(min_p=0.05, top_k=20, top_p=0.7), Truncation(top_k=VOCAB)]


def reference_keep(logits: torch.Tensor, t: Truncation) -> torch.Tensor:
    """The cuts written the other way round: descending order, a token kept while the mass before it is < top_p."""
    x = logits.double().clone()
    if t.min_p:
        p = x.softmax(-1)
        x[p < p.amax(-1, keepdim=True) * t.min_p] = float("-inf")
    if 0 < t.top_k < x.shape[-1]:
        kth = x.sort(-1, descending=True).values[:, t.top_k - 1:t.top_k]
        x[x < kth] = float("-inf")
    if t.top_p < 1:
        desc, order = x.sort(-1, descending=True)
        before = desc.softmax(-1).cumsum(-1) - desc.softmax(-1)
        drop = before >= t.top_p
        drop[:, 0] = False
        x.scatter_(-1, order, desc.masked_fill(drop, float("-inf")))
    return x > float("-inf")


def logits_and_targets(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=g) * 3
    target = torch.randint(0, VOCAB, (ROWS,), generator=g)
    target[0] = int(logits[0].argmax())  # one sure to be kept
    return logits, target


def reference(logits: torch.Tensor, target: torch.Tensor, t: Truncation) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(x.masked_fill(~reference_keep(logits, t), float("-inf")), -1)
    lp = lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    weights = torch.arange(1.0, ROWS + 1)
    torch.where(torch.isfinite(lp), lp * weights, torch.zeros_like(lp)).sum().backward()
    assert x.grad is not None
    return lp.detach(), x.grad


@pytest.mark.parametrize("t", CASES, ids=lambda t: t.describe().replace(" ", "").replace(",", "-"))
def test_kept_set_matches_the_semantics(t: Truncation):
    for seed in range(5):
        logits, _ = logits_and_targets(seed)
        keep = T.keep_mask(logits, t)
        assert torch.equal(keep, reference_keep(logits, t))
        assert keep.any(-1).all()  # the most likely token always stays


def test_cuts_keep_what_they_say():
    logits, _ = logits_and_targets()
    assert (T.keep_mask(logits, Truncation(top_k=5)).sum(-1) == 5).all()
    nucleus = T.keep_mask(logits, Truncation(top_p=0.9))
    kept_mass = (logits.softmax(-1) * nucleus).sum(-1)
    assert (kept_mass >= 0.9).all() and (nucleus.sum(-1) < VOCAB).all()
    assert T.keep_mask(logits, Truncation()).all()


@pytest.mark.parametrize("t", CASES, ids=lambda t: t.describe().replace(" ", "").replace(",", "-"))
def test_logprob_and_gradient_match_autograd(t: Truncation, monkeypatch):
    monkeypatch.setattr(T, "CHUNK_ROWS", 3)  # rows cut in three chunks
    logits, target = logits_and_targets()
    want_lp, want_grad = reference(logits, target, t)
    x = logits.clone().requires_grad_(True)
    lp = T.truncated_logprobs(x, target, t)
    weights = torch.arange(1.0, ROWS + 1)
    torch.where(torch.isfinite(lp), lp * weights, torch.zeros_like(lp)).sum().backward()
    assert torch.equal(torch.isfinite(lp), torch.isfinite(want_lp))
    torch.testing.assert_close(lp[torch.isfinite(lp)], want_lp[torch.isfinite(want_lp)])
    torch.testing.assert_close(x.grad, want_grad)


def test_a_target_outside_the_cut_is_minus_inf_with_no_gradient():
    logits, target = logits_and_targets()
    t = Truncation(top_k=3)
    keep = T.keep_mask(logits, t)
    target[1] = int((~keep[1]).nonzero()[0])
    x = logits.clone().requires_grad_(True)
    lp = T.truncated_logprobs(x, target, t)
    assert lp[1] == float("-inf") and torch.isfinite(lp[0])
    torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp)).sum().backward()
    assert x.grad is not None and torch.equal(x.grad[1], torch.zeros(VOCAB))
    assert (x.grad[0][~keep[0]] == 0).all()


def test_untruncated_equals_the_plain_log_softmax():
    logits, target = logits_and_targets()
    want = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(T.truncated_logprobs(logits, target, Truncation()), want)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"logits \(7,\) must be \[rows, vocab slice\]"):
        T.truncated_logprobs(torch.zeros(7), torch.zeros(7, dtype=torch.long), Truncation(top_k=2))


def _rank(rank: int, world: int, t: Truncation) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    T.CHUNK_ROWS = 2
    logits, target = logits_and_targets()
    width = VOCAB // world
    x = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
    lp = T.truncated_logprobs(x, target, t, group=dist.group.WORLD)
    weights = torch.arange(1.0, ROWS + 1)
    torch.where(torch.isfinite(lp), lp * weights, torch.zeros_like(lp)).sum().backward()
    assert x.grad is not None
    return lp.detach(), x.grad


@pytest.mark.parametrize("world", [2, 3])
def test_vocabulary_split_over_ranks_gives_the_same_logprobs_and_gradients(world: int, tmp_path):
    t = Truncation(min_p=0.02, top_k=20, top_p=0.8)
    got = run_ranks(_rank, world, tmp_path, t)
    logits, target = logits_and_targets()
    want_lp, want_grad = reference(logits, target, t)
    width = VOCAB // world
    for rank, (lp, grad) in enumerate(got):
        assert torch.equal(torch.isfinite(lp), torch.isfinite(want_lp))
        torch.testing.assert_close(lp[torch.isfinite(lp)], want_lp[torch.isfinite(want_lp)])
        torch.testing.assert_close(grad, want_grad[:, rank * width:(rank + 1) * width])
