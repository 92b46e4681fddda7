"""The CPU learning study's fast path (benchmarks/tiny_moe_learning_study.py) computes what a full forward of
each padded rollout row computes: the same log-probs, the same gradient, the same tokens per expert."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import tiny_moe_learning_study as study  # noqa: E402

from rlc.runtime import toy  # noqa: E402


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return study.build_model(study.VARIANTS["moe"], tmp_path_factory.mktemp("moe"))


def _rows(prompts, prompt_of, t1, t2, width=study.PAD_TO):
    """The runtime's rollout rows: prompt, response, right padding to ``width`` (rlc.runtime.policy.batches)."""
    rows = torch.full((len(prompt_of), width), toy.PAD_ID, dtype=torch.int64)
    rows[:, :5] = prompts[torch.tensor(prompt_of)]
    rows[:, 5] = t1
    rows[:, 6] = torch.where(t2 >= 0, t2, torch.full_like(t2, toy.PAD_ID))
    return rows


def test_moe_checkpoint_is_the_toy_builders(moe):
    assert moe.config.vocab_size == toy.vocab_size()  # build_toy_model uses the tokenizer's size, not the config's
    biases = [r.e_score_correction_bias for r in study._routers(moe)]
    assert len(biases) == 3 and all(b.dtype == torch.float32 and 29.8 < float(b.mean()) < 30.2 for b in biases)


def test_one_forward_gives_the_full_rows_logprobs_and_gradient(moe):
    prompts = torch.tensor([toy.char_ids(t) for t in ("1+2=", "3+4=", "9+9=")])
    prompt_of = [0, 0, 0, 1, 1, 2, 2, 2, 2, 1, 0, 2]
    gen = torch.Generator().manual_seed(3)
    moe.zero_grad()
    t1, t2, lp, _ = study.rollout_and_logprobs(moe, prompts, prompt_of, gen)
    weights = torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp)
    (lp * weights * torch.stack([torch.ones_like(lp[:, 0]), (t2 >= 0).float()], 1)).sum().backward()
    fast = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    moe.zero_grad()
    rows = _rows(prompts, prompt_of, t1, t2)
    full = torch.log_softmax(moe(input_ids=rows).logits.float(), -1)[:, 4:6].gather(-1, rows[:, 5:7, None]).squeeze(-1)
    mask = torch.stack([torch.ones_like(full[:, 0]), (t2 >= 0).float()], 1)
    assert torch.allclose(lp * mask, full * mask, atol=1e-5)
    (full * weights * mask).sum().backward()
    ref = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    assert fast.keys() == ref.keys() and len(ref) > 50
    for name, g in ref.items():
        assert torch.allclose(fast[name], g, rtol=1e-4, atol=1e-7 + 1e-4 * float(g.abs().max())), name
    moe.zero_grad()


def test_routing_counts_match_the_padded_rows(moe):
    counter = study.RoutingCounter(moe)
    prompts = torch.tensor([toy.char_ids(t) for t in ("5+5=", "0+7=")])
    prompt_of = [0, 1, 1, 0, 1, 0, 0]
    gen = torch.Generator().manual_seed(5)
    counter.armed = True
    with torch.no_grad():
        t1, t2, _, (cache, row_of) = study.rollout_and_logprobs(moe, prompts, prompt_of, gen, counter)
        rest = torch.full((len(prompt_of), study.PAD_TO - 6), toy.PAD_ID, dtype=torch.int64)
        rest[:, 0] = torch.where(t2 >= 0, t2, torch.full_like(t2, toy.PAD_ID))
        counter.weights = torch.ones(rest.numel(), dtype=torch.float64)
        study._continue(moe, cache, row_of, rest)
    fast = [c.clone() for c in counter.counts]
    for c in counter.counts:
        c.zero_()
    counter.weights = None
    with torch.no_grad():
        moe(input_ids=_rows(prompts, prompt_of, t1, t2))
    counter.armed = False
    assert all(torch.equal(a, b) for a, b in zip(fast, counter.counts))
    assert all(float(c.sum()) == len(prompt_of) * study.PAD_TO * 2 for c in fast)  # top-2 of every token


def test_bias_update_is_megatrons_sign_rule(moe):
    counter = study.RoutingCounter(moe)
    before = [r.e_score_correction_bias.clone() for r in counter.routers]
    counter.counts = [torch.tensor([5.0, 1, 1, 1, 0, 0, 0, 0], dtype=torch.float64) for _ in counter.routers]
    counter.update(1e-3)
    for r, b in zip(counter.routers, before):
        step = (r.e_score_correction_bias - b).tolist()
        assert step[0] == pytest.approx(-1e-3, abs=1e-5) and step[4] == pytest.approx(1e-3, abs=1e-5)
        assert step[1] == 0.0  # at the mean load (1 token): sign(0) leaves the bias
    assert all(float(c.sum()) == 0 for c in counter.counts)
