"""The clipped GRPO policy loss and the generation/trainer logprob check (gen-KL).

Shapes: per-token tensors are ``[batch, seq]`` over the *generated* tokens (prompt tokens masked
out); ``advantages`` is ``[batch]`` (one per sequence, broadcast over its tokens) or ``[batch, seq]``;
``mask`` is 1 for tokens that count.

Policy term, per token, with ``ratio = exp(clamp(logprobs - old_logprobs, ±max_log_ratio))``::

    pg = max(-ratio * A, -clamp(ratio, 1 - ratio_clip_low, 1 + ratio_clip_high) * A)
    pg = min(pg, -clip_ratio_c * A)   where A < 0, with dual-clip (loss.clip_ratio_c set)

``loss.ratio_clip_low`` / ``loss.ratio_clip_high`` are the clip *epsilons* (0.2 / 0.28 clip the ratio
to [0.8, 1.28]; asymmetric "clip-higher"). ``old_logprobs`` are the trainer's logprobs before the
update (or vLLM's generation logprobs when the step makes a single update). Dual-clip (Ye et al.
2020, "Mastering Complex Control in MOBA Games with Deep RL"; verl's ``clip_ratio_c``) bounds the
loss of a token with a negative advantage whose ratio ran far above 1.

KL penalty (``loss.kl_penalty > 0``), per token, towards the reference policy, with
``d = ref_logprobs - logprobs``: k1 = ``-d``, k2 = ``d**2 / 2``, k3 = ``exp(d) - d - 1`` (Schulman's
estimators of KL(pi || ref) from samples of pi; k3 is unbiased and non-negative), weighted by
``loss.kl_weighting`` (``sampling``: ``exp(logprobs - sg(logprobs))``, value 1, whose gradient adds the
score-function term ``k · ∇logprobs``; ``on_policy``: ``exp(logprobs - gen_logprobs)``) and bounded by
``loss.kl_clamp``.

Reduction: ``loss.token_level`` averages over every token of the batch (sum / token count);
otherwise each sequence is averaged over its tokens first, then sequences are averaged. Under
gradient accumulation or data parallelism pass ``normalizer`` (the global token count, or the global
sequence count for the sequence-level mean) so that summing the micro-batch losses gives the
global-batch mean instead of a mean of means.
"""

from __future__ import annotations

import torch
from rlc.contract.kl_term import KL_LOG_RATIO_BOUND
from rlc.contract.runtime_config import LossConfig

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (see module docstring)."""
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        # clamp the exponent: a huge d only makes the penalty infinite, not more informative
        return torch.exp(d.clamp(max=KL_LOG_RATIO_BOUND)) - d - 1.0
    raise ValueError(f"loss.kl_estimator: {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where, not multiply: a NaN or inf at a masked position must not reach the sum (NaN * 0 is NaN)
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum()


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, token_level: bool, normalizer: float | None) -> torch.Tensor:
    if token_level:
        denom = mask.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=per_token.dtype)
        return _masked_sum(per_token, mask) / denom.clamp(min=1.0)
    tokens_per_seq = mask.sum(dim=-1)
    per_seq = torch.where(mask > 0, per_token, torch.zeros_like(per_token)).sum(dim=-1) / tokens_per_seq.clamp(min=1.0)
    if normalizer is None:
        nonempty = (tokens_per_seq > 0).to(per_token.dtype)
        return (per_seq * nonempty).sum() / nonempty.sum().clamp(min=1.0)
    return per_seq.sum() / max(float(normalizer), 1.0)


def _check_shapes(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"grpo_loss: logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [batch, seq] shape"
        )
    if advantages.dim() == logprobs.dim() - 1 and advantages.shape == logprobs.shape[:-1]:
        return advantages.unsqueeze(-1)
    if advantages.shape == logprobs.shape:
        return advantages
    raise ValueError(
        f"grpo_loss: advantages {tuple(advantages.shape)} must be per sequence {tuple(logprobs.shape[:-1])} "
        f"or per token {tuple(logprobs.shape)}"
    )


def _check_config(cfg: LossConfig) -> None:
    if cfg.ratio_clip_low < 0 or cfg.ratio_clip_high < 0 or cfg.ratio_clip_low >= 1:
        raise ValueError(
            f"loss.ratio_clip_low={cfg.ratio_clip_low} / loss.ratio_clip_high={cfg.ratio_clip_high}: clip epsilons "
            "must be >= 0 and ratio_clip_low < 1 (0.2 clips the ratio at 0.8)"
        )
    if cfg.clip_ratio_c is not None and not cfg.clip_ratio_c > 1.0:
        raise ValueError(
            f"loss.clip_ratio_c={cfg.clip_ratio_c}: the dual-clip constant must be > 1 (3.0 is usual); "
            "set it to null to turn dual-clip off"
        )
    if not cfg.max_log_ratio > 0:
        raise ValueError(f"loss.max_log_ratio={cfg.max_log_ratio}: must be > 0 (20 is usual)")
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"loss.kl_estimator: {cfg.kl_estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


def policy_loss_per_token(
    log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped policy loss, and where the clip and the dual clip bind (bool tensors).

    ``log_ratio`` is clamped to ``±loss.max_log_ratio`` before ``exp``; with ``loss.clip_ratio_c``
    the loss of a token with a negative advantage is at most ``-clip_ratio_c * A`` (dual-clip).
    """
    ratio = torch.exp(log_ratio.clamp(-cfg.max_log_ratio, cfg.max_log_ratio))
    clipped = ratio.clamp(1.0 - cfg.ratio_clip_low, 1.0 + cfg.ratio_clip_high)
    loss_unclipped = -ratio * advantages
    loss_clipped = -clipped * advantages
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    # the clipped branch is active (and the gradient zero) where it is strictly larger
    clip_active = loss_clipped > loss_unclipped
    dual_active = torch.zeros_like(clip_active)
    if cfg.clip_ratio_c is not None:
        loss_dual = -cfg.clip_ratio_c * advantages
        dual_active = (advantages < 0) & (per_token > loss_dual)
        per_token = torch.where(dual_active, loss_dual, per_token)
    return per_token, clip_active, dual_active


def _kl_weight(logprobs: torch.Tensor, ref: torch.Tensor, gen_logprobs: torch.Tensor | None, keep: torch.Tensor,
               cfg: LossConfig) -> torch.Tensor:
    """The per-token weight of the KL estimate (``loss.kl_weighting``): ``exp(logπ − sg(logπ))`` (``sampling``) or
    ``exp(logπ − log π_engine)`` (``on_policy``), both differentiable in ``logprobs`` so the KL's gradient gets the
    score-function term of sampling from the policy; detached where |log(ref / policy)| exceeds
    :data:`~rlc.contract.kl_term.KL_LOG_RATIO_BOUND`, and 0 where it is not finite (as NeMo-RL's ``calculate_kl``)."""
    if cfg.kl_weighting == "on_policy":
        if gen_logprobs is None:
            raise ValueError("grpo_loss: loss.kl_weighting on_policy needs gen_logprobs (the rollout engine's "
                             "logprobs of the sampled tokens)")
        gen = torch.where(keep, gen_logprobs.detach().to(logprobs.dtype), torch.zeros_like(logprobs))
        weight = torch.exp((logprobs - gen).clamp(-cfg.max_log_ratio, cfg.max_log_ratio))
    elif cfg.kl_weighting == "sampling":
        weight = torch.exp(logprobs - logprobs.detach())
    else:
        raise ValueError(f"loss.kl_weighting: {cfg.kl_weighting!r} is not one of none, sampling, on_policy")
    weight = torch.where((ref - logprobs).detach().abs() <= KL_LOG_RATIO_BOUND, weight, weight.detach())
    return torch.nan_to_num(weight, nan=0.0, posinf=0.0, neginf=0.0)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    gen_logprobs: torch.Tensor | None = None,
    normalizer: float | None = None,
    truncated: bool = False,
    kl_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO loss (a scalar to ``backward()``) and its metrics (plain floats).

    With ``loss.importance_sampling_correction`` each token's policy term is weighted by
    ``min(exp(old_logprobs - gen_logprobs), loss.importance_sampling_cap)`` (no gradient): the
    rollout engine sampled from its own distribution, the trainer scores the tokens under its own,
    and the truncated ratio corrects the difference (``gen_logprobs`` are the engine's logprobs of the
    sampled tokens; metrics ``is_weight_mean`` / ``is_weight_max``).

    Masked positions are excluded with ``where`` before any arithmetic, so padding holding NaN or inf
    (in logprobs, old or reference logprobs, or per-token advantages) changes neither the loss nor
    the gradient.

    ``truncated``: the rollouts sampled from a truncated distribution (min-p, top-k, top-p) and ``logprobs`` /
    ``old_logprobs`` are the trainer's under the same cuts. A sampled token the trainer's cuts leave out (``-inf``
    in either) leaves the policy term (metric ``truncation_miss_fraction``; it still counts in ``normalizer``, as
    in NeMo-RL). ``kl_logprobs``: the policy's logprobs under the full distribution for the KL term, whose
    reference logprobs are the full distribution's (default ``logprobs``).

    Metrics: ``loss/policy``, ``loss/kl_ref`` (when penalised), ``clip_fraction`` (tokens whose
    gradient the clip removed) with its ``clip_low_fraction`` / ``clip_high_fraction`` split,
    ``dual_clip_fraction`` (tokens capped by ``loss.clip_ratio_c``), ``approx_kl`` (k3 estimate of
    KL(old || new), masked mean), ``ratio_mean`` and ``ratio_max`` over the masked tokens, and
    ``num_tokens``.
    """
    adv = _check_shapes(logprobs, old_logprobs, advantages, mask)
    _check_config(cfg)
    if logprobs.dtype in (torch.float16, torch.bfloat16):
        # exp(new - old) in bf16 rounds ratios near 1 by ~0.4%: comparable to the clip range
        logprobs = logprobs.float()
    dtype = logprobs.dtype
    valid = mask > 0
    keep = valid
    if truncated:
        keep = valid & torch.isfinite(logprobs.detach()) & torch.isfinite(old_logprobs.detach())
    m = keep.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    new = torch.where(keep, logprobs, zero)
    # loss.force_on_policy_ratio: the ratio is exactly 1 and its gradient the policy's own
    old = new.detach() if cfg.force_on_policy_ratio else torch.where(keep, old_logprobs.detach().to(dtype), zero)
    adv = torch.where(keep, adv.detach().to(dtype), zero)
    log_ratio = new - old
    per_token, clip_active, dual_active = policy_loss_per_token(log_ratio, adv, cfg)
    metrics: dict[str, float] = {}
    if cfg.importance_sampling_correction:
        if gen_logprobs is None:
            raise ValueError("grpo_loss: loss.importance_sampling_correction needs gen_logprobs (the rollout "
                             "engine's logprobs of the sampled tokens)")
        gen = torch.where(keep, gen_logprobs.detach().to(dtype), zero)
        weight = torch.exp((old - gen).clamp(-cfg.max_log_ratio, cfg.max_log_ratio)).clamp(
            max=cfg.importance_sampling_cap)
        weight = torch.where(keep, weight, zero)
        per_token = per_token * weight
        with torch.no_grad():
            metrics["is_weight_mean"] = (_masked_sum(weight, m) / m.sum().clamp(min=1.0)).item()
            metrics["is_weight_max"] = weight.max().item() if bool(keep.any()) else 0.0
    policy_loss = _reduce(per_token, m, cfg.token_level, normalizer)
    loss = policy_loss
    if cfg.kl_penalty > 0:
        if ref_logprobs is None:
            raise ValueError("grpo_loss: loss.kl_penalty > 0 needs ref_logprobs (the reference model's logprobs)")
        kl_new = new if kl_logprobs is None else torch.where(valid, kl_logprobs.to(dtype), zero)
        kl_keep = keep if kl_logprobs is None else valid
        ref = torch.where(kl_keep, ref_logprobs.detach().to(dtype), zero)
        kl = kl_estimate(kl_new, ref, cfg.kl_estimator)
        if cfg.kl_weighting != "none":
            kl = kl * _kl_weight(kl_new, ref, gen_logprobs, kl_keep, cfg)
        if cfg.kl_clamp is not None:
            kl = kl.clamp(-cfg.kl_clamp, cfg.kl_clamp)
        kl_loss = _reduce(kl, kl_keep.to(dtype), cfg.token_level, normalizer)
        loss = loss + cfg.kl_penalty * kl_loss
        metrics["loss/kl_ref"] = kl_loss.item()

    with torch.no_grad():
        n = m.sum()
        n_safe = n.clamp(min=1.0)
        ratio = torch.exp(log_ratio.detach().clamp(-cfg.max_log_ratio, cfg.max_log_ratio))
        active = clip_active & keep
        low = active & (ratio < 1.0 - cfg.ratio_clip_low)
        high = active & (ratio > 1.0 + cfg.ratio_clip_high)
        # k3 with d = log(new/old): (ratio - 1) - log(ratio), estimates KL(old || new) from old's samples
        approx_kl = kl_estimate(old, new.detach(), "k3")
        masked_ratio = torch.where(keep, ratio, torch.full_like(ratio, -torch.inf))
        metrics.update(
            {
                "loss/policy": policy_loss.item(),
                "loss/total": loss.item(),
                "clip_fraction": (active.sum() / n_safe).item(),
                "clip_low_fraction": (low.sum() / n_safe).item(),
                "clip_high_fraction": (high.sum() / n_safe).item(),
                "dual_clip_fraction": ((dual_active & keep).sum() / n_safe).item(),
                "approx_kl": (_masked_sum(approx_kl, m) / n_safe).item(),
                "ratio_mean": (_masked_sum(ratio, m) / n_safe).item(),
                "ratio_max": masked_ratio.max().item() if n > 0 else 0.0,
                "num_tokens": n.item(),
            }
        )
        if truncated:
            metrics["truncation_miss_fraction"] = ((valid & ~keep).sum() / valid.sum().clamp(min=1)).item()
    return loss, metrics


# --------------------------------------------------------------------------- gen-KL


class GenKLExceeded(RuntimeError):
    """vLLM's sampling logprobs and the trainer's logprobs disagree beyond ``grpo.max_gen_kl``."""


def gen_kl(gen_logprobs: torch.Tensor, train_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean per-token KL(p_gen || p_train) on the generated tokens, with the k3 estimator.

    The tokens were sampled from vLLM's distribution p_gen, so with ``d = log p_train - log p_gen``
    the k3 estimate ``exp(d) - d - 1`` is unbiased for KL(p_gen || p_train), non-negative per token,
    and exactly 0 when the two sets of logprobs agree. Both must be logprobs of the *same*
    distribution: the same temperature scaling on both sides (vLLM returns raw-logit logprobs unless
    told otherwise). Returns 0.0 for an empty mask.
    """
    d = _generated_difference(gen_logprobs, train_logprobs, mask)
    return _k3_mean(d) if d.numel() else 0.0


def _generated_difference(gen_logprobs: torch.Tensor, train_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log p_train - log p_gen`` in float64 at the generated tokens (``mask > 0``), 1-D: only those
    positions are read (the padding may hold anything, NaN included, and is most of a long batch)."""
    if gen_logprobs.shape != train_logprobs.shape or gen_logprobs.shape != mask.shape:
        raise ValueError(
            f"gen_kl: gen_logprobs {tuple(gen_logprobs.shape)}, train_logprobs {tuple(train_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must have the same shape"
        )
    where = (mask > 0).reshape(-1).nonzero().squeeze(1)  # row-major, as boolean indexing reads them

    def at(x: torch.Tensor) -> torch.Tensor:
        return x.detach().reshape(-1).index_select(0, where).to(torch.float64)

    return at(train_logprobs) - at(gen_logprobs)


def _k3_mean(d: torch.Tensor) -> float:
    k3 = torch.exp(d.clamp(max=50.0)) - d - 1.0
    return (k3.sum() / d.numel()).item()


def gen_kl_metrics(gen_logprobs: torch.Tensor, train_logprobs: torch.Tensor, mask: torch.Tensor, *,
                   truncated: bool = False) -> dict[str, float]:
    """``gen_kl`` plus the mean and max absolute logprob difference on the masked tokens.

    ``truncated``: the engine sampled under min-p / top-k / top-p cuts and ``train_logprobs`` are the trainer's under
    the same cuts; a token the trainer's cuts leave out (``-inf``) is left out of the three and counted in
    ``gen_truncation_miss_fraction`` (the policy loss leaves it out too). Without truncation a ``-inf`` counts, and
    makes the gen-KL infinite: it means the trainer gives a sampled token no probability at all."""
    d = _generated_difference(gen_logprobs, train_logprobs, mask)
    out: dict[str, float] = {}
    if truncated:
        finite = torch.isfinite(d)
        out["gen_truncation_miss_fraction"] = (1.0 - finite.double().mean().item()) if d.numel() else 0.0
        d = d[finite]
    diff = d.abs()
    return {
        "gen_kl": _k3_mean(d) if d.numel() else 0.0,
        "gen_logprob_abs_diff_mean": diff.mean().item() if diff.numel() else 0.0,
        "gen_logprob_abs_diff_max": diff.max().item() if diff.numel() else 0.0,
        **out,
    }


def check_gen_kl(value: float, *, step: int, threshold: float, detail: dict[str, float] | None = None) -> None:
    """Raise ``GenKLExceeded`` when ``value`` > ``threshold`` (``grpo.max_gen_kl``; 0 disables).

    A large gen-KL means vLLM is not sampling from the weights being trained, so the policy gradient is
    silently off-policy; the report lists the causes seen in practice.
    """
    if threshold <= 0:
        return
    if value <= threshold:  # False for NaN, which is reported
        return
    extra = ""
    if detail:
        extra = " (" + ", ".join(f"{k}={v:.4g}" for k, v in sorted(detail.items())) + ")"
    raise GenKLExceeded(
        f"gen-KL {value:.4g} at step {step} exceeds grpo.max_gen_kl={threshold:g}{extra}: vLLM's sampling "
        "logprobs and the trainer's logprobs of the same tokens disagree, so training is off-policy on a "
        "different model than the one being updated. Likely causes:\n"
        "  - stale weights in vLLM: the refit read parameters before the distributed optimizer's deferred "
        "all-gather (overlap_param_gather); enable refit.sync_params_before_refit (NeMo-RL #4086)\n"
        "  - wrong slicing metadata in the refit: each producer rank's buffer sliced with rank 0's "
        "names/offsets (EP>16 or PP>2); enable refit.per_rank_ipc_metadata (SkyRL #1816)\n"
        "  - dtype mismatch: a parameter that must stay fp32 (e.g. MoE router bias "
        "e_score_correction_bias) sent as bf16; add it to refit.fp32_params, and check model.dtype "
        "matches vLLM's dtype\n"
        "  - logprobs of different distributions: temperature applied on one side only\n"
        "At step 0 (before any update) a high value points at model loading/conversion, not the refit. "
        "Set grpo.max_gen_kl: 0 to disable this check."
    )
