"""rlc's GRPO math against a second, independent implementation of the published formulas.

The reference below is written token by token in plain Python (``math``, lists, no torch, nothing
imported from rlc) from the papers and verl's documented definitions:

- GRPO advantages (Shao et al. 2024, DeepSeekMath; verl ``compute_grpo_outcome_advantage``):
  ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the unbiased std of the prompt's group, or
  ``r_i - mean(r)`` without normalisation; a group whose rewards are all equal has ``A = 0``.
- Leave-one-out baseline (Kool et al. 2019; RLOO, Ahmadian et al. 2024):
  ``A_i = r_i - 1/(G-1) * sum_{j != i} r_j``.
- Clipped surrogate (Schulman et al. 2017, PPO) with asymmetric clip epsilons (Yu et al. 2025,
  DAPO "clip-higher"), per token: ``L = max(-A*rho, -A*clip(rho, 1-eps_low, 1+eps_high))`` with
  ``rho = exp(clip(logp - logp_old, -b, b))``; dual-clip (Ye et al. 2020): where ``A < 0``,
  ``L = min(L, -c*A)``. Its derivative in ``logp`` is ``-A*rho`` where the unclipped branch is taken
  and ``|logp - logp_old| < b``, else 0.
- Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"; verl's ``tis_imp_ratio_cap``): each token's policy term and its gradient
  are weighted by ``min(exp(logp_old - logp_gen), cap)``.
- Aggregation (verl ``agg_loss``): "token-mean" ``sum(L) / #tokens``; "seq-mean-token-mean" the mean
  over non-empty sequences of each sequence's token mean; with a global normaliser the sum is
  divided by it instead, so micro-batch losses add up to the batch loss.
- KL estimators (Schulman 2020, "Approximating KL Divergence"), with ``x ~ p`` and
  ``log r = log q(x) - log p(x)``: ``k1 = -log r``, ``k2 = (log r)^2 / 2``, ``k3 = (r - 1) - log r``.
  The penalty estimates KL(policy || reference); ``approx_kl`` is k3 of KL(old || new); gen-KL is k3
  of KL(generation || trainer).

Inputs are randomised (hypothesis draws the seeds and the switches): padding, ties, all-equal
groups, asymmetric clips, dual-clip, log-ratios beyond the bound. Padded positions hold NaN in what
rlc receives; the reference never looks at them.
"""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rlc.contract.runtime_config import LossConfig  # noqa: E402
from rlc.runtime.grpo.advantages import group_advantages  # noqa: E402
from rlc.runtime.grpo.loss import gen_kl, grpo_loss, kl_estimate  # noqa: E402

EPS = 1e-6  # the advantage normaliser's epsilon (verl's default)
REL = 1e-9  # float64 on both sides: agreement to rounding

# --------------------------------------------------------------------------- the reference


def ref_advantages(rows: list[list[float]], *, leave_one_out: bool, normalize: bool) -> list[list[float]]:
    out = []
    for row in rows:
        g = len(row)
        if all(r == row[0] for r in row):
            out.append([0.0] * g)
            continue
        mean = sum(row) / g
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (g - 1))
        adv = []
        for r in row:
            baseline = (sum(row) - r) / (g - 1) if leave_one_out else mean
            a = r - baseline
            adv.append(a / (std + EPS) if normalize else a)
        out.append(adv)
    return out


def ref_kl(logp: float, logq: float, estimator: str) -> float:
    """Estimate of KL(p || q) from one sample of p."""
    log_r = logq - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return log_r * log_r / 2
    return (math.exp(log_r) - 1) - log_r


def ref_token(logp: float, old: float, a: float, c: dict) -> tuple[float, float, bool, bool]:
    """(loss, d loss / d logp, clipped, dual-clipped) of one token."""
    d = logp - old
    bounded = max(-c["max_log_ratio"], min(c["max_log_ratio"], d))
    rho = math.exp(bounded)
    clipped_rho = max(1 - c["low"], min(1 + c["high"], rho))
    unclipped_loss, clipped_loss = -a * rho, -a * clipped_rho
    loss, grad = unclipped_loss, (-a * rho if abs(d) < c["max_log_ratio"] else 0.0)
    clipped = clipped_loss > unclipped_loss
    if clipped:
        loss, grad = clipped_loss, 0.0
    dual = False
    if c["clip_c"] is not None and a < 0 and loss > -c["clip_c"] * a:
        loss, grad, dual = -c["clip_c"] * a, 0.0, True
    return loss, grad, clipped, dual


def ref_loss(seqs: list[dict], c: dict, normalizer: float | None = None) -> dict:
    """Loss, its gradient per token, and the metrics, over sequences of valid tokens only."""
    per_seq = []
    for s in seqs:
        tokens = []
        for t in range(len(s["logp"])):
            loss, grad, clipped, dual = ref_token(s["logp"][t], s["old"][t], s["adv"][t], c)
            if c["is_cap"] is not None:
                d_gen = max(-c["max_log_ratio"], min(c["max_log_ratio"], s["old"][t] - s["gen"][t]))
                weight = min(math.exp(d_gen), c["is_cap"])
                loss, grad = loss * weight, grad * weight
            kl = ref_kl(s["logp"][t], s["ref"][t], c["estimator"])
            # d/dlogp of the KL penalty: k1 -> 1, k2 -> -(ref - logp), k3 -> 1 - exp(ref - logp)
            log_r = s["ref"][t] - s["logp"][t]
            kl_grad = {"k1": 1.0, "k2": -log_r, "k3": 1.0 - math.exp(log_r)}[c["estimator"]]
            tokens.append((loss, grad, clipped, dual, kl, kl_grad))
        per_seq.append(tokens)
    n_tokens = sum(len(t) for t in per_seq)
    if c["token_level"]:
        denom = normalizer if normalizer is not None else n_tokens
        weights = [[1.0 / max(denom, 1.0)] * len(t) for t in per_seq]
    else:
        nonempty = sum(1 for t in per_seq if t)
        denom = normalizer if normalizer is not None else nonempty
        weights = [[1.0 / (len(t) * max(denom, 1.0))] * len(t) if t else [] for t in per_seq]
    policy = sum(w * tok[0] for ws, ts in zip(weights, per_seq) for w, tok in zip(ws, ts))
    kl = sum(w * tok[4] for ws, ts in zip(weights, per_seq) for w, tok in zip(ws, ts))
    grads = [[w * (tok[1] + c["kl"] * tok[5]) for w, tok in zip(ws, ts)] for ws, ts in zip(weights, per_seq)]
    flat = [tok for ts in per_seq for tok in ts]
    approx = [ref_kl(s["old"][t], s["logp"][t], "k3") for s in seqs for t in range(len(s["logp"]))]
    n = max(len(flat), 1)
    return {
        "loss": policy + c["kl"] * kl,
        "policy": policy,
        "kl": kl,
        "grads": grads,
        "clip_fraction": sum(tok[2] for tok in flat) / n,
        "dual_clip_fraction": sum(tok[3] for tok in flat) / n,
        "approx_kl": sum(approx) / n,
    }


def ref_gen_kl(gen: list[list[float]], train: list[list[float]]) -> float:
    values = [ref_kl(g, t, "k3") for gs, ts in zip(gen, train) for g, t in zip(gs, ts)]
    return sum(values) / len(values) if values else 0.0


# --------------------------------------------------------------------------- random inputs


def random_rewards(rng: random.Random) -> list[list[float]]:
    g = rng.randint(2, 8)
    kind = rng.choice(["binary", "ties", "continuous", "unrepresentable"])
    rows = []
    for _ in range(rng.randint(1, 6)):
        if kind == "binary":
            row = [float(rng.random() < 0.5) for _ in range(g)]
        elif kind == "ties":
            row = [rng.choice([0.0, 0.5, 1.0]) for _ in range(g)]
        elif kind == "continuous":
            row = [rng.gauss(0, 3) for _ in range(g)]
        else:
            row = [0.1] * g  # mean(0.1, ...) != 0.1 in floating point
        if rng.random() < 0.25:
            row = [row[0]] * g  # an all-equal group
        rows.append(row)
    return rows


def random_batch(rng: random.Random, *, per_token_adv: bool) -> list[dict]:
    """Sequences of valid tokens (some empty); log-ratios mostly small, some far beyond 1."""
    seqs = []
    for _ in range(rng.randint(1, 6)):
        length = rng.choice([0, 1, 2, 5, 8]) if rng.random() < 0.3 else rng.randint(1, 8)
        logp = [-rng.expovariate(1.0) - 1e-3 for _ in range(length)]
        spread = rng.choice([0.05, 0.3, 3.0])
        old = [lp - max(-14.0, min(14.0, rng.gauss(0, spread))) for lp in logp]
        ref = [lp + rng.gauss(0, 0.5) for lp in logp]
        gen = [x + rng.gauss(0, rng.choice([0.01, 0.5])) for x in old]
        a = rng.gauss(0, 1.5)
        adv = [rng.gauss(0, 1.5) if per_token_adv else a for _ in range(length)]
        seqs.append({"logp": logp, "old": old, "ref": ref, "gen": gen, "adv": adv})
    return seqs


def random_config(rng: random.Random) -> dict:
    return {
        "low": rng.choice([0.1, 0.2, 0.3]),
        "high": rng.choice([0.2, 0.28, 0.5]),
        "clip_c": rng.choice([None, 1.5, 3.0, 10.0]),
        "max_log_ratio": rng.choice([0.5, 2.0, 20.0]),
        "estimator": rng.choice(["k1", "k2", "k3"]),
        "kl": rng.choice([0.0, 0.05]),
        "token_level": rng.random() < 0.5,
        "is_cap": rng.choice([None, 1.0, 2.0]),
    }


def to_tensors(seqs: list[dict], *, per_token_adv: bool):
    """rlc's padded [batch, seq] inputs, NaN at every padded position."""
    width = max(1, max(len(s["logp"]) for s in seqs))
    nan = float("nan")

    def pad(key: str) -> torch.Tensor:
        return torch.tensor([s[key] + [nan] * (width - len(s[key])) for s in seqs], dtype=torch.float64)

    mask = torch.tensor([[1.0] * len(s["logp"]) + [0.0] * (width - len(s["logp"])) for s in seqs], dtype=torch.float64)
    if per_token_adv:
        adv = pad("adv")
    else:
        adv = torch.tensor([s["adv"][0] if s["adv"] else 0.0 for s in seqs], dtype=torch.float64)
    return pad("logp"), pad("old"), pad("ref"), pad("gen"), adv, mask


def loss_config(c: dict) -> LossConfig:
    return LossConfig(
        ratio_clip_low=c["low"], ratio_clip_high=c["high"], kl_penalty=c["kl"], kl_estimator=c["estimator"],
        token_level=c["token_level"], clip_ratio_c=c["clip_c"], max_log_ratio=c["max_log_ratio"],
        importance_sampling_correction=c["is_cap"] is not None, importance_sampling_cap=c["is_cap"] or 2.0,
        kl_weighting="none", kl_clamp=None, force_on_policy_ratio=False,
    )


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


# --------------------------------------------------------------------------- the comparisons


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans(), st.booleans())
def test_advantages_match_the_reference(seed: int, leave_one_out: bool, normalize: bool) -> None:
    rows = random_rewards(random.Random(seed))
    got = group_advantages(rows, leave_one_out=leave_one_out, normalize=normalize, eps=EPS).double().tolist()
    want = ref_advantages(rows, leave_one_out=leave_one_out, normalize=normalize)
    for got_row, want_row, row in zip(got, want, rows):
        for x, y in zip(got_row, want_row):
            # rlc returns float32: agreement to float32 rounding of the reference value
            assert math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6), (row, got_row, want_row)
        if all(r == row[0] for r in row):
            assert got_row == [0.0] * len(row)  # exactly zero, not eps-small


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_loss_gradient_and_metrics_match_the_reference(seed: int, per_token_adv: bool) -> None:
    rng = random.Random(seed)
    seqs, c = random_batch(rng, per_token_adv=per_token_adv), random_config(rng)
    logp, old, ref, gen, adv, mask = to_tensors(seqs, per_token_adv=per_token_adv)
    logp.requires_grad_(True)
    loss, metrics = grpo_loss(logp, old, adv, mask, loss_config(c), ref_logprobs=ref, gen_logprobs=gen)
    loss.backward()
    want = ref_loss(seqs, c)
    assert close(loss.item(), want["loss"]), (loss.item(), want["loss"], c)
    assert close(metrics["loss/policy"], want["policy"])
    if c["kl"] > 0:
        assert close(metrics["loss/kl_ref"], want["kl"])
    assert close(metrics["clip_fraction"], want["clip_fraction"])
    assert close(metrics["dual_clip_fraction"], want["dual_clip_fraction"])
    assert close(metrics["approx_kl"], want["approx_kl"])
    assert metrics["num_tokens"] == sum(len(s["logp"]) for s in seqs)
    for i, s in enumerate(seqs):
        for t in range(len(s["logp"])):
            assert close(logp.grad[i, t].item(), want["grads"][i][t]), (i, t, c)
        assert all(logp.grad[i, len(s["logp"]) :] == 0)  # padding gets no gradient


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_micro_batches_with_a_global_normaliser_add_up_to_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    seqs, c = random_batch(rng, per_token_adv=False), random_config(rng)
    logp, old, ref, gen, adv, mask = to_tensors(seqs, per_token_adv=False)
    normalizer = float(mask.sum()) if c["token_level"] else float((mask.sum(-1) > 0).sum())
    cut = rng.randint(0, len(seqs))
    total = 0.0
    for lo, hi in ((0, cut), (cut, len(seqs))):
        if hi > lo:
            part, _ = grpo_loss(logp[lo:hi], old[lo:hi], adv[lo:hi], mask[lo:hi], loss_config(c),
                                ref_logprobs=ref[lo:hi], gen_logprobs=gen[lo:hi], normalizer=normalizer)
            total += part.item()
    assert close(total, ref_loss(seqs, c)["loss"])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["k1", "k2", "k3"]))
def test_kl_estimators_match_the_reference(seed: int, estimator: str) -> None:
    rng = random.Random(seed)
    p = [-rng.expovariate(0.5) for _ in range(16)]
    q = [x + rng.gauss(0, 2) for x in p]
    got = kl_estimate(torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64), estimator)
    for value, lp, lq in zip(got.tolist(), p, q):
        assert close(value, ref_kl(lp, lq, estimator))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_gen_kl_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    seqs = random_batch(rng, per_token_adv=False)
    train, _, _, gen, _, mask = to_tensors(seqs, per_token_adv=False)
    want = ref_gen_kl([s["gen"] for s in seqs], [s["logp"] for s in seqs])
    assert close(gen_kl(gen, train, mask), want)
