"""Reward scaling and length shaping (``grpo.reward_scaling``, ``grpo.reward_shaping``) as NeMo-RL applies them, and
the advantages that follow: the baseline from the shaped rewards, the spread (with dynamic sampling) from the rewards
before the shaping."""
from __future__ import annotations

import pytest

from rlc.contract.runtime_config import RewardScalingConfig, RewardShapingConfig
from rlc.runtime.grpo.reward_shaping import overlong_penalty, scale_rewards, shape_rewards

torch = pytest.importorskip("torch")
from rlc.runtime.grpo.advantages import group_advantages  # noqa: E402


def scaling(enabled=True, source=(0.0, 1.0), target=(-1.0, 1.0)) -> RewardScalingConfig:
    return RewardScalingConfig(enabled=enabled, source_min=source[0], source_max=source[1], target_min=target[0],
                               target_max=target[1])


def shaping(enabled=True, buffer=1024, penalty=1.0, max_len=8192, coef=None) -> RewardShapingConfig:
    return RewardShapingConfig(enabled=enabled, overlong_buffer_length=buffer, overlong_buffer_penalty=penalty,
                               max_response_length=max_len, stop_properly_penalty_coef=coef)


def test_scaling_clamps_then_maps_the_source_range_onto_the_target():
    assert scale_rewards([0.0, 1.0, 0.25, 1.7, -3.0], scaling()) == [-1.0, 1.0, -0.5, 1.0, -1.0]
    assert scale_rewards([0.3, 7.0], scaling(enabled=False)) == [0.3, 7.0]
    with pytest.raises(ValueError, match="source_max 0 must be above source_min 1"):
        scale_rewards([0.5], scaling(source=(1.0, 0.0)))


def test_dapo_overlong_penalty_grows_over_the_buffer_and_beyond():
    """The Qwen3.5-397B v2 recipe: buffer 1024 before 8192 tokens, penalty 1."""
    cfg = shaping()
    assert overlong_penalty(7168, cfg, 99) == 0.0 and overlong_penalty(100, cfg, 99) == 0.0
    assert overlong_penalty(7680, cfg, 99) == pytest.approx(-0.5)
    assert overlong_penalty(8192, cfg, 99) == pytest.approx(-1.0)
    assert overlong_penalty(9216, cfg, 99) == pytest.approx(-2.0)
    # max_response_length null: measured against generation.sampling.max_tokens
    assert overlong_penalty(1024, shaping(buffer=512, max_len=None), 1024) == pytest.approx(-1.0)
    assert shape_rewards([1.0, 1.0, -1.0], [100, 7680, 8192], ["stop", "stop", "length"], cfg, 99) == \
        [1.0, 0.5, -2.0]


def test_stop_properly_coefficient_scales_only_responses_cut_at_the_limit_instead():
    cfg = shaping(coef=0.25)
    assert shape_rewards([1.0, 1.0], [9000, 9000], ["stop", "length"], cfg, 99) == [1.0, 0.25]
    assert shape_rewards([1.0, 0.5], [9000, 9000], ["length", "length"], shaping(enabled=False), 99) == [1.0, 0.5]
    with pytest.raises(ValueError, match="one per response"):
        shape_rewards([1.0], [1, 2], ["stop"], cfg, 99)


def test_advantages_take_the_baseline_from_the_shaped_rewards_and_the_spread_from_the_rewards_before():
    rewards = [[1.0, 1.0, 0.0, 0.0]]
    shaped = [[1.0, 0.5, 0.0, -0.5]]
    plain = group_advantages(shaped, leave_one_out=False, normalize=True)
    spread = group_advantages(shaped, leave_one_out=False, normalize=True, spread=rewards)
    centred = torch.tensor(shaped[0]) - 0.25
    assert torch.allclose(spread[0], (centred / (torch.tensor(rewards[0]).std() + 1e-6)).float())
    assert torch.allclose(plain[0], (centred / (torch.tensor(shaped[0]).std() + 1e-6)).float())
    # a group whose rewards agree before the shaping carries no signal (dynamic sampling drops it as well)
    flat = group_advantages([[1.0, 0.5]], leave_one_out=False, normalize=False, spread=[[1.0, 1.0]])
    assert torch.equal(flat, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="spread"):
        group_advantages(shaped, leave_one_out=False, normalize=True, spread=[[1.0]])
