"""Clipped GRPO loss, KL estimators and the gen-KL check."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rlc.contract.runtime_config import LossConfig  # noqa: E402
from rlc.runtime.grpo.loss import (  # noqa: E402
    GenKLExceeded,
    check_gen_kl,
    gen_kl,
    gen_kl_metrics,
    grpo_loss,
    kl_estimate,
)


def cfg(low=0.2, high=0.28, kl=0.0, est="k3", token_level=True, clip_c=None, max_log_ratio=20.0,
        is_correction=False, is_cap=2.0, kl_weighting="none", kl_clamp=None, force=False) -> LossConfig:
    return LossConfig(
        ratio_clip_low=low, ratio_clip_high=high, kl_penalty=kl, kl_estimator=est, token_level=token_level,
        clip_ratio_c=clip_c, max_log_ratio=max_log_ratio, importance_sampling_correction=is_correction,
        importance_sampling_cap=is_cap, kl_weighting=kl_weighting, kl_clamp=kl_clamp, force_on_policy_ratio=force,
    )


def _grad(new: torch.Tensor, old, adv, mask, c, **kw):
    new = new.clone().requires_grad_(True)
    loss, metrics = grpo_loss(new, old, adv, mask, c, **kw)
    loss.backward()
    return loss, metrics, new.grad


def test_on_policy_loss_is_minus_mean_advantage_and_gradient() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.9, 0.3, 0.2]], dtype=torch.float64))
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    loss, m, grad = _grad(lp, lp, adv, mask, cfg())
    n = mask.sum()
    expected = -(adv[:, None] * mask).sum() / n
    assert loss.item() == pytest.approx(expected.item())
    assert torch.allclose(grad, -(adv[:, None] * mask) / n)
    assert m["ratio_mean"] == pytest.approx(1.0) and m["ratio_max"] == pytest.approx(1.0)
    assert m["clip_fraction"] == 0.0 and m["approx_kl"] == pytest.approx(0.0, abs=1e-12)
    assert m["num_tokens"] == 5


def test_asymmetric_clip_zeroes_gradient_only_where_it_binds() -> None:
    old = torch.zeros(1, 6, dtype=torch.float64)
    # ratios: 1.5 (above 1.28), 1.1 (inside), 0.5 (below 0.8), 1.25 (inside the high eps, outside a symmetric 0.2)
    ratios = torch.tensor([[1.5, 1.1, 0.5, 1.25, 1.5, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 6, dtype=torch.float64)
    _, m, grad = _grad(torch.log(ratios), old, adv, mask, cfg(low=0.2, high=0.28))
    g = grad[0]
    # A > 0: clipped above 1 + high -> no gradient; below 1 - low -> still pushed up (unclipped branch)
    assert g[0] == 0 and g[1] != 0 and g[2] != 0 and g[3] != 0
    # A < 0: above the range keeps the gradient (pessimistic branch); below 1 - low is clipped
    assert g[4] != 0 and g[5] == 0
    assert m["clip_fraction"] == pytest.approx(2 / 6)
    assert m["clip_high_fraction"] == pytest.approx(1 / 6) and m["clip_low_fraction"] == pytest.approx(1 / 6)
    assert m["ratio_max"] == pytest.approx(1.5)
    # with a symmetric 0.2 the 1.25 ratio is clipped too
    _, m_sym, grad_sym = _grad(torch.log(ratios), old, adv, mask, cfg(low=0.2, high=0.2))
    assert grad_sym[0, 3] == 0 and m_sym["clip_fraction"] == pytest.approx(3 / 6)


def test_token_level_vs_sequence_level_mean() -> None:
    old = torch.zeros(2, 4, dtype=torch.float64)
    adv = torch.tensor([1.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    tok, _ = grpo_loss(old.clone(), old, adv, mask, cfg(token_level=True))
    seq, _ = grpo_loss(old.clone(), old, adv, mask, cfg(token_level=False))
    assert tok.item() == pytest.approx(-(1 * 1 + 3 * 4) / 5)
    assert seq.item() == pytest.approx(-(1 + 3) / 2)


def test_empty_sequences_do_not_count_in_sequence_mean() -> None:
    old = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.float64)
    loss, m = grpo_loss(old.clone(), old, torch.tensor([2.0, 5.0], dtype=torch.float64), mask, cfg(token_level=False))
    assert loss.item() == pytest.approx(-2.0) and m["num_tokens"] == 2


@pytest.mark.parametrize("token_level", [True, False])
def test_normalizer_makes_microbatch_losses_add_up(token_level: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    new = torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.1
    old = torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.1
    adv = torch.randn(6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).to(torch.float64)
    mask[:, 0] = 1
    c = cfg(token_level=token_level)
    full, _ = grpo_loss(new, old, adv, mask, c)
    norm = mask.sum().item() if token_level else 6
    parts = sum(
        grpo_loss(new[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], c, normalizer=norm)[0]
        for i in (0, 2, 4)
    )
    assert parts.item() == pytest.approx(full.item())


def test_kl_estimators_match_formulas() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    d = ref - lp
    assert torch.allclose(kl_estimate(lp, ref, "k1"), lp - ref)
    assert torch.allclose(kl_estimate(lp, ref, "k2"), 0.5 * d**2)
    assert torch.allclose(kl_estimate(lp, ref, "k3"), torch.exp(d) - d - 1)
    with pytest.raises(ValueError, match="loss.kl_estimator"):
        kl_estimate(lp, ref, "k4")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-8, 0), min_size=1, max_size=8), st.lists(st.floats(-8, 0), min_size=1, max_size=8))
def test_k3_and_k2_are_non_negative(a, b) -> None:
    n = min(len(a), len(b))
    lp, ref = torch.tensor(a[:n], dtype=torch.float64), torch.tensor(b[:n], dtype=torch.float64)
    assert (kl_estimate(lp, ref, "k3") >= -1e-12).all()
    assert (kl_estimate(lp, ref, "k2") >= 0).all()


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_penalty_is_added(est: str) -> None:
    lp = torch.log(torch.tensor([[0.5, 0.4]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.3, 0.6]], dtype=torch.float64))
    mask = torch.ones(1, 2, dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    base, _ = grpo_loss(lp, lp, adv, mask, cfg())
    pen, m = grpo_loss(lp, lp, adv, mask, cfg(kl=0.1, est=est), ref_logprobs=ref)
    kl = kl_estimate(lp, ref, est).mean().item()
    assert m["loss/kl_ref"] == pytest.approx(kl)
    assert pen.item() == pytest.approx(base.item() + 0.1 * kl)


def test_bad_inputs_are_reported() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(x, x, torch.zeros(2), torch.ones(2, 3), cfg(kl=0.1))
    with pytest.raises(ValueError, match="same"):
        grpo_loss(x, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), cfg())
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(x, x, torch.zeros(3), torch.ones(2, 3), cfg())
    with pytest.raises(ValueError, match="ratio_clip_low"):
        grpo_loss(x, x, torch.zeros(2), torch.ones(2, 3), cfg(low=1.0))
    with pytest.raises(ValueError, match="kl_estimator"):
        grpo_loss(x, x, torch.zeros(2), torch.ones(2, 3), cfg(est="kl"))


def test_per_token_advantages_accepted() -> None:
    x = torch.zeros(1, 2, dtype=torch.float64)
    loss, _ = grpo_loss(
        x, x, torch.tensor([[1.0, 3.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64), cfg()
    )
    assert loss.item() == pytest.approx(-2.0)


# --------------------------------------------------------------------------- loss options


def test_dual_clip_caps_negative_advantage_tokens_and_is_off_by_default() -> None:
    old = torch.zeros(1, 4, dtype=torch.float64)
    ratios = torch.tensor([[10.0, 2.0, 10.0, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 2.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    off, m_off, g_off = _grad(torch.log(ratios), old, adv, mask, cfg())
    on, m_on, g_on = _grad(torch.log(ratios), old, adv, mask, cfg(clip_c=3.0))
    # off: A<0 with ratio 10 costs 10 and keeps its gradient
    assert off.item() == pytest.approx((10.0 + 2.0 - 2.0 * 1.28 + 0.8) / 4)
    assert g_off[0, 0] != 0 and m_off["dual_clip_fraction"] == 0.0
    # on: capped at -c * A = 3, no gradient there; ratio 2 (< c) and positive advantages are untouched
    assert on.item() == pytest.approx((3.0 + 2.0 - 2.0 * 1.28 + 0.8) / 4)
    assert g_on[0, 0] == 0 and g_on[0, 1] == g_off[0, 1] and g_on[0, 2] == g_off[0, 2]
    assert m_on["dual_clip_fraction"] == pytest.approx(1 / 4)
    with pytest.raises(ValueError, match="loss.clip_ratio_c"):
        grpo_loss(old, old, adv, mask, cfg(clip_c=1.0))


def test_log_ratio_is_bounded_before_exp() -> None:
    # a token whose new logprob is 100 nats above the old one: exp overflows float32 to inf
    new = torch.tensor([[0.0, -1.0]], dtype=torch.float32)
    old = torch.tensor([[-100.0, -1.0]], dtype=torch.float32)
    adv = torch.tensor([-1.0])
    mask = torch.ones(1, 2)
    loss, m = grpo_loss(new, old, adv, mask, cfg(max_log_ratio=20.0))
    assert math.isfinite(loss.item()) and math.isfinite(m["approx_kl"])
    assert loss.item() == pytest.approx((math.exp(20.0) + 1.0) / 2, rel=1e-5)
    assert m["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)
    small, _ = grpo_loss(new, old, adv, mask, cfg(max_log_ratio=5.0))
    assert small.item() == pytest.approx((math.exp(5.0) + 1.0) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="loss.max_log_ratio"):
        grpo_loss(new, old, adv, mask, cfg(max_log_ratio=0.0))


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf")])
def test_garbage_at_masked_positions_changes_neither_loss_nor_gradient(token_level: bool, garbage: float) -> None:
    gen = torch.Generator().manual_seed(3)
    new = torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.2 - 1.0
    old = new + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.2
    ref = new + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.2
    adv = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.float64)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    c = cfg(kl=0.1, token_level=token_level, clip_c=3.0)
    clean_loss, clean_m, clean_grad = _grad(new, old, adv, mask, c, ref_logprobs=ref)
    pad = mask == 0
    dirty = [t.masked_fill(pad, garbage) for t in (new, old, adv, ref)]
    loss, m, grad = _grad(dirty[0], dirty[1], dirty[2], mask, c, ref_logprobs=dirty[3])
    assert loss.item() == clean_loss.item()
    assert torch.equal(grad, clean_grad) and torch.equal(grad[pad], torch.zeros(int(pad.sum()), dtype=grad.dtype))
    for key, value in clean_m.items():
        assert m[key] == value, key
    assert gen_kl(dirty[1], dirty[0], mask) == gen_kl(old, new, mask)


# --------------------------------------------------------------------------- gen-KL


def test_gen_kl_zero_when_equal_and_ignores_masked_tokens() -> None:
    g = torch.log(torch.rand(3, 4) * 0.9 + 0.05)
    mask = torch.ones(3, 4)
    assert gen_kl(g, g.clone(), mask) == 0.0
    t = g.clone()
    t[:, -1] -= 10.0  # garbage on padding
    mask[:, -1] = 0
    assert gen_kl(g, t, mask) == 0.0
    assert gen_kl(g, t, torch.zeros(3, 4)) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        gen_kl(g, t[:, :2], mask)


def test_gen_kl_estimates_kl_of_generation_from_its_samples() -> None:
    gen = torch.Generator().manual_seed(1)
    p_gen = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    p_train = torch.tensor([0.4, 0.35, 0.2, 0.05], dtype=torch.float64)
    tokens = torch.multinomial(p_gen, 200_000, replacement=True, generator=gen)
    est = gen_kl(p_gen.log()[tokens][None], p_train.log()[tokens][None], torch.ones(1, tokens.numel()))
    exact = (p_gen * (p_gen / p_train).log()).sum().item()  # KL(gen || train)
    reverse = (p_train * (p_train / p_gen).log()).sum().item()
    assert est == pytest.approx(exact, rel=0.05)
    assert abs(est - exact) < abs(est - reverse)


def test_gen_kl_metrics_and_check() -> None:
    g = torch.tensor([[-1.0, -2.0]])
    t = torch.tensor([[-1.5, -2.0]])
    m = gen_kl_metrics(g, t, torch.ones(1, 2))
    d = -0.5
    assert m["gen_kl"] == pytest.approx((math.exp(d) - d - 1) / 2)
    assert m["gen_logprob_abs_diff_max"] == pytest.approx(0.5)
    assert m["gen_logprob_abs_diff_mean"] == pytest.approx(0.25)

    check_gen_kl(0.005, step=3, threshold=0.01)
    check_gen_kl(5.0, step=3, threshold=0.0)  # disabled
    with pytest.raises(GenKLExceeded) as err:
        check_gen_kl(0.5, step=7, threshold=0.01, detail={"gen_logprob_abs_diff_max": 3.2})
    msg = str(err.value)
    for needle in (
        "step 7",
        "0.5",
        "grpo.max_gen_kl=0.01",
        "NeMo-RL #4086",
        "SkyRL #1816",
        "dtype",
        "gen_logprob_abs_diff_max=3.2",
    ):
        assert needle in msg
    with pytest.raises(GenKLExceeded):
        check_gen_kl(float("nan"), step=1, threshold=0.01)


def test_bf16_inputs_are_computed_in_fp32_and_grad_flows_back() -> None:
    new = torch.tensor([[-1.0, -0.5]], dtype=torch.bfloat16, requires_grad=True)
    old = torch.tensor([[-1.004, -0.5]], dtype=torch.bfloat16)
    loss, m = grpo_loss(new, old, torch.tensor([1.0]), torch.ones(1, 2), cfg())
    assert loss.dtype == torch.float32
    loss.backward()
    assert new.grad is not None and new.grad.dtype == torch.bfloat16
    expected = math.exp(new[0, 0].float().item() - old[0, 0].float().item())
    assert m["ratio_max"] == pytest.approx(expected, rel=1e-6)


def test_importance_sampling_correction_weights_tokens_by_the_truncated_ratio() -> None:
    # on-policy (new == old): the per-token loss is -A; with IS each token is scaled by min(exp(old - gen), cap)
    old = torch.log(torch.tensor([[0.5, 0.25, 0.1]], dtype=torch.float64))
    gen = torch.log(torch.tensor([[0.25, 0.25, 0.01]], dtype=torch.float64))  # ratios 2, 1, 10 -> capped 2, 1, 1.5
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    plain, _, _ = _grad(old, old, adv, mask, cfg())
    loss, metrics, grad = _grad(old, old, adv, mask, cfg(is_correction=True, is_cap=1.5), gen_logprobs=gen)
    weights = torch.tensor([1.5, 1.0, 1.5], dtype=torch.float64)
    assert torch.allclose(loss, -(weights * adv).mean())
    assert torch.allclose(grad, -weights / 3 * torch.ones(1, 3, dtype=torch.float64))
    assert metrics["is_weight_max"] == 1.5 and abs(metrics["is_weight_mean"] - 4 / 3) < 1e-12
    assert not torch.allclose(loss, plain)


def test_importance_sampling_correction_needs_the_engine_logprobs() -> None:
    lp = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="gen_logprobs"):
        grpo_loss(lp, lp, torch.ones(1, dtype=torch.float64), torch.ones(1, 2), cfg(is_correction=True))


def test_truncated_tokens_the_trainer_cut_leaves_out_leave_the_policy_term() -> None:
    """Under min-p / top-k / top-p a sampled token the trainer's cut leaves out is -inf in its logprobs: without
    ``truncated`` such a token enters with a ratio clamped at ``max_log_ratio``; with it the token leaves the policy
    term (no gradient, counted) and the other tokens' loss and gradient are those of the batch without it, under
    the same normaliser."""
    new = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.9, 0.3, 0.2]], dtype=torch.float64))
    old = new.detach().clone() + 0.05
    old[0, 1] = float("-inf")  # outside the cut when the old logprobs were taken
    new_cut = new.clone()
    new_cut[1, 2] = float("-inf")  # outside it now
    adv, mask = torch.tensor([1.0, -2.0], dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    broken, _ = grpo_loss(new_cut, old, adv, mask, cfg(), normalizer=6.0)
    loss, metrics, grad = _grad(new_cut, old, adv, mask, cfg(), truncated=True, normalizer=6.0)
    kept = mask.clone()
    kept[0, 1] = kept[1, 2] = 0
    want, _, want_grad = _grad(new, torch.where(kept > 0, old, new), adv, kept, cfg(), normalizer=6.0)
    assert loss.item() == pytest.approx(want.item()) and broken.item() != pytest.approx(want.item())
    assert torch.equal(grad, want_grad) and grad[0, 1] == 0 and grad[1, 2] == 0
    assert metrics["truncation_miss_fraction"] == pytest.approx(2 / 6) and metrics["num_tokens"] == 4


def test_the_kl_term_compares_full_distributions_under_truncation() -> None:
    """``kl_logprobs`` (the policy under the full distribution) meet the reference's full-distribution logprobs at
    every valid token, a token outside the cut included; the policy term keeps the truncated logprobs."""
    full = torch.log(torch.tensor([[0.5, 0.25, 0.1]], dtype=torch.float64)).requires_grad_(True)
    cut = torch.log(torch.tensor([[0.6, 0.4, 0.0]], dtype=torch.float64))  # the 0.1 token is outside the cut
    ref = full.detach() - 0.1
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    loss, metrics = grpo_loss(cut, cut, adv, mask, cfg(kl=0.5, est="k1"), ref_logprobs=ref, truncated=True,
                              kl_logprobs=full)
    assert metrics["loss/kl_ref"] == pytest.approx(0.1)  # k1 = logprobs - ref at all three tokens
    loss.backward()
    assert full.grad is not None and torch.allclose(full.grad, torch.full((1, 3), 0.5 / 3, dtype=torch.float64))


def test_gen_kl_leaves_out_tokens_outside_the_trainers_cut_only_when_truncated() -> None:
    gen = torch.log(torch.tensor([[0.5, 0.25, 0.2]], dtype=torch.float64))
    train = gen.clone()
    train[0, 2] = float("-inf")
    mask = torch.ones(1, 3)
    assert gen_kl_metrics(gen, train, mask)["gen_kl"] == float("inf")
    cut = gen_kl_metrics(gen, train, mask, truncated=True)
    assert cut["gen_kl"] == 0.0 and cut["gen_logprob_abs_diff_max"] == 0.0
    assert cut["gen_truncation_miss_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("weighting", ["sampling", "on_policy"])
def test_kl_weighting_adds_the_score_function_term_to_the_kl_gradient(weighting) -> None:
    """NeMo-RL's own check of its KL backward (NeMo-RL #2506), on the same numbers: the KL term's gradient is
    ``beta · w · (k3 + ∂k3/∂logπ) / N``, with ``w`` 1 (``sampling``) or exp(logπ − log π_engine) (``on_policy``);
    without weighting it is ``beta · ∂k3/∂logπ / N``."""
    curr = torch.tensor([[-1.2, -0.7]], dtype=torch.float64)
    prev = torch.tensor([[-1.0, -0.8]], dtype=torch.float64)
    gen = torch.tensor([[-1.5, -0.4]], dtype=torch.float64)
    ref = torch.tensor([[-0.9, -1.1]], dtype=torch.float64)
    adv, mask, beta = torch.tensor([[0.4, -0.2]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64), 0.3

    def grad(kl: float, weighting: str) -> torch.Tensor:
        return _grad(curr, prev, adv, mask, cfg(kl=kl, kl_weighting=weighting), ref_logprobs=ref,
                     gen_logprobs=gen)[2]

    log_ratio = ref - curr
    k3, dk3 = torch.exp(log_ratio) - 1 - log_ratio, 1 - torch.exp(log_ratio)
    weight = torch.exp(curr - gen) if weighting == "on_policy" else torch.ones_like(curr)
    torch.testing.assert_close(grad(beta, weighting) - grad(0.0, weighting), beta * weight * (k3 + dk3) / 2)
    torch.testing.assert_close(grad(beta, "none") - grad(0.0, "none"), beta * dk3 / 2)
    _, metrics = grpo_loss(curr, prev, adv, mask, cfg(kl=beta, kl_weighting="sampling"), ref_logprobs=ref)
    assert metrics["loss/kl_ref"] == pytest.approx(k3.mean().item())  # the value is the estimate's


def test_kl_clamp_bounds_each_token_and_stops_its_gradient() -> None:
    curr = torch.tensor([[-0.1, -0.2]], dtype=torch.float64)
    ref = torch.tensor([[-0.1, -14.0]], dtype=torch.float64)  # k3 of the second token ≈ 12.8
    mask, adv = torch.ones(1, 2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    _, metrics, g = _grad(curr, curr, adv, mask, cfg(kl=1.0, kl_clamp=10.0), ref_logprobs=ref)
    assert metrics["loss/kl_ref"] == pytest.approx((0.0 + 10.0) / 2)
    assert g[0, 1] == 0.0
    _, free, _ = _grad(curr, curr, adv, mask, cfg(kl=1.0), ref_logprobs=ref)
    assert free["loss/kl_ref"] > 6.0


def test_on_policy_kl_weighting_needs_the_engine_logprobs() -> None:
    x = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="kl_weighting on_policy needs gen_logprobs"):
        grpo_loss(x, x, torch.zeros(1), torch.ones(1, 2), cfg(kl=0.1, kl_weighting="on_policy"), ref_logprobs=x)


def test_a_forced_ratio_is_one_whatever_the_old_logprobs_say() -> None:
    """``loss.force_on_policy_ratio``: the loss and gradient of the on-policy case (old = new) even where the old
    logprobs sit outside the clip range; without it those tokens are clipped."""
    new = torch.log(torch.tensor([[0.5, 0.25, 0.1]], dtype=torch.float64))
    old = new - torch.tensor([[0.0, 0.5, -0.5]], dtype=torch.float64)
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    forced, fm, fg = _grad(new, old, adv, mask, cfg(force=True))
    on_policy, _, og = _grad(new, new, adv, mask, cfg())
    assert forced.item() == pytest.approx(on_policy.item()) and torch.equal(fg, og)
    assert fm["clip_fraction"] == 0.0 and fm["ratio_max"] == 1.0
    _, clipped, _ = _grad(new, old, adv, mask, cfg())
    assert clipped["clip_fraction"] > 0
