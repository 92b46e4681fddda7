"""The rewards' scaling and length shaping (``grpo.reward_scaling``, ``grpo.reward_shaping``), as NeMo-RL applies them
(``scale_rewards`` in nemo_rl/algorithms/grpo.py, ``apply_reward_shaping`` in nemo_rl/algorithms/reward_functions.py),
one group at a time. Pure Python.

Order: the reward function's scores are scaled (clamped to the source range, mapped onto the target range); those are
the group's rewards, which dynamic sampling and the reward metrics read. The shaping then adds DAPO's overlong
penalty (arXiv 2503.14476) to each, or with ``stop_properly_penalty_coef`` multiplies the reward of a response cut at
the token limit: the shaped rewards are what the advantages' baseline is taken from.
"""
from __future__ import annotations

from collections.abc import Sequence

from rlc.contract.reward_shaping import overlong_window
from rlc.contract.runtime_config import RewardScalingConfig, RewardShapingConfig


def scale_rewards(rewards: Sequence[float], cfg: RewardScalingConfig) -> list[float]:
    """Each reward clamped to ``[source_min, source_max]`` and mapped linearly onto ``[target_min, target_max]``."""
    if not cfg.enabled:
        return [float(r) for r in rewards]
    lo, hi = float(cfg.source_min), float(cfg.source_max)
    if not hi > lo:
        raise ValueError(f"grpo.reward_scaling: source_max {hi:g} must be above source_min {lo:g}")
    span = (float(cfg.target_max) - float(cfg.target_min)) / (hi - lo)
    return [float(cfg.target_min) + (min(max(float(r), lo), hi) - lo) * span for r in rewards]


def overlong_penalty(length: int, cfg: RewardShapingConfig, max_tokens: int) -> float:
    """DAPO's soft overlong punishment of a response of ``length`` tokens (≤ 0): ``−penalty × excess ÷ buffer`` past
    ``max_response_length − overlong_buffer_length`` (``max_response_length`` null: ``max_tokens``)."""
    start, _ = overlong_window(cfg, max_tokens)
    excess = int(length) - start
    return min(-excess / int(cfg.overlong_buffer_length) * float(cfg.overlong_buffer_penalty), 0.0)


def shape_rewards(rewards: Sequence[float], lengths: Sequence[int], finish_reasons: Sequence[str | None],
                  cfg: RewardShapingConfig, max_tokens: int) -> list[float]:
    """The group's shaped rewards (``rewards`` unchanged when the shaping is off). ``lengths``: each response's
    tokens; ``finish_reasons``: the engine's (``length`` where the response hit the token limit)."""
    if not (len(rewards) == len(lengths) == len(finish_reasons)):
        raise ValueError(f"shape_rewards: {len(rewards)} rewards, {len(lengths)} lengths and {len(finish_reasons)} "
                         "finish reasons must be one per response")
    if not cfg.enabled:
        return [float(r) for r in rewards]
    coef = cfg.stop_properly_penalty_coef
    if coef is not None:
        return [float(r) * float(coef) if why == "length" else float(r) for r, why in zip(rewards, finish_reasons)]
    return [float(r) + overlong_penalty(n, cfg, max_tokens) for r, n in zip(rewards, lengths)]


__all__ = ["overlong_penalty", "scale_rewards", "shape_rewards"]
