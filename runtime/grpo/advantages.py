"""Group-normalised GRPO advantages.

Rewards come shaped ``[num_prompts, generations_per_prompt]``: one row (a *group*) per prompt. Each
sample's advantage is its reward minus a baseline computed from its own group:

- mean baseline (``grpo.leave_one_out: false``): ``A_i = r_i - mean(r)``
- leave-one-out (``grpo.leave_one_out: true``): ``A_i = r_i - mean(r_j, j != i)
  = G / (G - 1) * (r_i - mean(r))``

With ``grpo.normalize_advantages`` the advantages are divided by ``std(r) + eps``, the group's
Bessel-corrected (unbiased) standard deviation. Either way the advantages of a group sum to zero.

A group whose rewards are all equal carries no learning signal: its advantages are exactly zero
(tested with exact equality, not ``std < eps``, so rounding in the mean cannot leak a tiny advantage
that the std division would then blow up).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlc.contract.runtime_config import GrpoConfig

DEFAULT_EPS = 1e-6


def as_groups(rewards: Sequence[float] | torch.Tensor, generations_per_prompt: int) -> torch.Tensor:
    """Reshape flat per-sample rewards (prompt-major) into ``[num_prompts, generations_per_prompt]``."""
    flat = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if generations_per_prompt < 1:
        raise ValueError(f"grpo.generations_per_prompt must be >= 1, got {generations_per_prompt}")
    if flat.numel() % generations_per_prompt:
        raise ValueError(
            f"{flat.numel()} rewards do not split into groups of grpo.generations_per_prompt="
            f"{generations_per_prompt}; the samples of each prompt must be contiguous and complete"
        )
    return flat.reshape(-1, generations_per_prompt)


def _check_groups(rewards: torch.Tensor | Sequence[Sequence[float]]) -> torch.Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() != 2:
        raise ValueError(f"rewards must be shaped [num_prompts, generations_per_prompt], got shape {tuple(r.shape)}")
    if not torch.isfinite(r).all():
        bad = torch.nonzero(~torch.isfinite(r))[0].tolist()
        raise ValueError(
            f"reward at [prompt {bad[0]}, generation {bad[1]}] is {r[bad[0], bad[1]].item()}; rewards must be finite"
        )
    return r


def group_has_signal(rewards: torch.Tensor | Sequence[Sequence[float]]) -> torch.Tensor:
    """Bool ``[num_prompts]``: True where the group's rewards are not all equal (non-zero std)."""
    r = _check_groups(rewards)
    return (r != r[:, :1]).any(dim=1)


def group_advantages(
    rewards: torch.Tensor | Sequence[Sequence[float]],
    *,
    leave_one_out: bool,
    normalize: bool,
    eps: float = DEFAULT_EPS,
    spread: torch.Tensor | Sequence[Sequence[float]] | None = None,
) -> torch.Tensor:
    """Advantages ``[num_prompts, generations_per_prompt]`` (float32) for grouped rewards.

    ``leave_one_out`` needs at least two generations per prompt; ``normalize`` divides by the group's
    unbiased std plus ``eps`` (a single-generation group has no std and gets zero advantage). ``spread``: the
    rewards whose std divides and whose agreement zeroes a group (default ``rewards``): with reward shaping and
    dynamic sampling the rewards before the shaping, as NeMo-RL takes them (``grpo.reward_shaping``).
    """
    r = _check_groups(rewards)
    s = r if spread is None else _check_groups(spread)
    if s.shape != r.shape:
        raise ValueError(f"spread {tuple(s.shape)} must have the rewards' shape {tuple(r.shape)}")
    num_prompts, g = r.shape
    if num_prompts == 0:
        return torch.zeros((0, g), dtype=torch.float32)
    if leave_one_out and g < 2:
        raise ValueError(
            "grpo.leave_one_out needs grpo.generations_per_prompt >= 2 (the baseline is the mean of the "
            f"other samples), got {g}; raise generations_per_prompt or set leave_one_out: false"
        )
    mean = r.mean(dim=1, keepdim=True)
    if leave_one_out:
        baseline = (r.sum(dim=1, keepdim=True) - r) / (g - 1)
    else:
        baseline = mean
    adv = r - baseline
    if normalize:
        std = s.std(dim=1, keepdim=True, unbiased=True) if g > 1 else torch.zeros_like(mean)
        adv = adv / (std + eps)
    adv = torch.where(group_has_signal(s)[:, None], adv, torch.zeros_like(adv))
    return adv.to(torch.float32)


def advantages_from_config(rewards: torch.Tensor | Sequence[Sequence[float]], grpo: GrpoConfig) -> torch.Tensor:
    """``group_advantages`` with ``grpo.leave_one_out`` / ``grpo.normalize_advantages`` (``GrpoConfig``)."""
    return group_advantages(rewards, leave_one_out=grpo.leave_one_out, normalize=grpo.normalize_advantages)


def reward_metrics(rewards: torch.Tensor | Sequence[Sequence[float]]) -> dict[str, float]:
    """Per-step reward statistics for the metrics log (plain floats)."""
    r = _check_groups(rewards)
    if r.numel() == 0:
        return {"reward/mean": 0.0, "reward/std": 0.0, "reward/groups_with_signal": 0.0}
    signal = group_has_signal(r)
    return {
        "reward/mean": r.mean().item(),
        "reward/std": r.std(unbiased=False).item(),
        "reward/min": r.min().item(),
        "reward/max": r.max().item(),
        "reward/groups_with_signal": signal.double().mean().item(),
    }
