"""Dynamic sampling: fill, bookkeeping, exhaustion report, pass-through when disabled."""

from __future__ import annotations

import math
import re

import pytest
from rlc.contract.runtime_config import (DynamicSamplingConfig, GrpoConfig, RewardScalingConfig,
                                         RewardShapingConfig)
from rlc.runtime.grpo.dynamic_sampling import DynamicSampler, DynamicSamplingExhausted


def _sampler(prompts=4, enabled=True, max_batches=3, mult=2.0, lines=None) -> DynamicSampler:
    return DynamicSampler(
        prompts_per_step=prompts,
        enabled=enabled,
        max_gen_batches=max_batches,
        batch_multiplier=mult,
        logger=(lines.append if lines is not None else (lambda s: None)),
    )


def _batch(start: int, pattern: str, g: int = 4):
    """Groups named by index; 's' = signal (mixed rewards), '0'/'1' = all-0 / all-1."""
    groups, rewards = [], []
    for k, c in enumerate(pattern):
        groups.append(f"p{start + k}")
        rewards.append([1.0, 0.0] + [0.0] * (g - 2) if c == "s" else [float(c)] * g)
    return groups, rewards


def test_from_config_and_batch_size() -> None:
    cfg = GrpoConfig(
        prompts_per_step=10,
        generations_per_prompt=4,
        max_steps=1,
        normalize_advantages=True,
        leave_one_out=False,
        dynamic_sampling=DynamicSamplingConfig(enabled=True, max_gen_batches=5, batch_multiplier=1.5),
        reward_scaling=RewardScalingConfig(enabled=False, source_min=0.0, source_max=1.0, target_min=0.0,
                                           target_max=1.0),
        reward_shaping=RewardShapingConfig(enabled=False, overlong_buffer_length=128, overlong_buffer_penalty=1.0,
                                           max_response_length=None, stop_properly_penalty_coef=None),
        max_gen_kl=0.01,
        seed=0,
    )
    s = DynamicSampler.from_config(cfg, logger=lambda _: None)
    assert s.prompts_per_batch == 15 and s.max_gen_batches == 5
    assert _sampler(prompts=3, mult=1.0).prompts_per_batch == 3
    assert _sampler(prompts=3, mult=1.1).prompts_per_batch == 4  # ceil


def test_accumulates_until_full_and_truncates_surplus() -> None:
    lines: list[str] = []
    s = _sampler(prompts=4, max_batches=3, lines=lines)
    s.start_step(7)
    st1 = s.add_batch(*_batch(0, "s00s1000"))
    assert (st1.kept_groups, st1.generated_groups, st1.hit_rate, st1.fill) == (2, 8, 0.25, 0.5)
    assert not s.full
    st2 = s.add_batch(*_batch(8, "ss0s0000"))
    assert st2.cumulative_kept == 5 and s.full
    groups, rewards = s.take()
    assert groups == ["p0", "p3", "p8", "p9"]  # in arrival order, surplus p11 dropped
    assert all(any(x != r[0] for x in r) for r in rewards)
    m = s.metrics()
    assert m["dynamic_sampling/num_gen_batches"] == 2
    assert m["dynamic_sampling/generated_groups"] == 16
    assert m["dynamic_sampling/groups_with_signal"] == 5
    assert m["dynamic_sampling/discarded_zero_std_groups"] == 11
    assert m["dynamic_sampling/discarded_surplus_groups"] == 1
    assert m["dynamic_sampling/hit_rate"] == pytest.approx(5 / 16)
    assert all(isinstance(v, (int, float)) for v in m.values())
    # one log line per batch with per-batch delta, hit rate and cumulative fill
    assert len(lines) == 2
    assert (
        "step 7 batch 1/3" in lines[0] and "kept 2/8" in lines[0] and "25.0%" in lines[0] and "filled 2/4" in lines[0]
    )
    assert "projected" in lines[0]
    assert "filled 4/4" in lines[1]


def test_exhaustion_message_quotes_rate_fill_and_levers() -> None:
    s = _sampler(prompts=8, max_batches=2, mult=1.0)
    s.start_step(3)
    s.add_batch(*_batch(0, "s0000000"))
    with pytest.raises(DynamicSamplingExhausted) as err:
        s.add_batch(*_batch(8, "s1000000"))
    msg = str(err.value)
    assert "step 3" in msg and "2/8" in msg and "12.5%" in msg  # fill and measured hit rate (2 of 16)
    for lever in (
        "grpo.dynamic_sampling.max_gen_batches",
        "grpo.dynamic_sampling.batch_multiplier",
        "grpo.prompts_per_step",
    ):
        assert lever in msg
    # suggested max_gen_batches covers the measured need (8 / (0.125 * 8) = 8 batches) with margin
    suggested = int(re.search(r"max_gen_batches: 2 -> (\d+)", msg).group(1))
    assert suggested >= 8
    mult = float(re.search(r"batch_multiplier: 1 -> ([\d.]+)", msg).group(1))
    # with the suggested multiplier, 2 batches at 12.5% fill 8 groups
    assert 0.125 * 2 * math.ceil(8 * mult) >= 8
    assert "all-0" in msg  # why groups were discarded (too hard)


def test_exhaustion_with_no_signal_points_at_reward_and_sampling() -> None:
    s = _sampler(prompts=2, max_batches=1, mult=1.0)
    s.start_step(1)
    with pytest.raises(DynamicSamplingExhausted) as err:
        s.add_batch(*_batch(0, "00"))
    assert "reward.function" in str(err.value) and "temperature" in str(err.value)


def test_collect_runs_batches_of_the_right_size() -> None:
    asked: list[int] = []
    s = _sampler(prompts=3, max_batches=5, mult=2.0)
    counter = iter(range(1000))

    def generate(n: int):
        asked.append(n)
        pattern = "ss" + "0" * (n - 2)  # two groups with signal per batch
        return _batch(next(counter) * 100, pattern)

    groups, rewards = s.collect(1, generate)
    assert asked == [6, 6] and len(groups) == 3 and len(rewards) == 3
    assert groups == ["p0", "p1", "p100"]


def test_disabled_passes_everything_through() -> None:
    s = _sampler(prompts=4, enabled=False, max_batches=0, mult=0.0)
    s.start_step(0)
    assert s.prompts_per_batch == 4
    s.add_batch(*_batch(0, "0s1s"))
    assert s.full
    groups, _ = s.take()
    assert groups == ["p0", "p1", "p2", "p3"]
    m = s.metrics()
    assert m["dynamic_sampling/hit_rate"] == 0.5 and m["dynamic_sampling/discarded_zero_std_groups"] == 0


def test_misuse_is_reported() -> None:
    s = _sampler()
    with pytest.raises(RuntimeError, match="start_step"):
        s.add_batch(["a"], [[1.0]])
    s.start_step(0)
    with pytest.raises(ValueError, match="2 groups but 1 reward rows"):
        s.add_batch(["a", "b"], [[1.0, 0.0]])
    with pytest.raises(RuntimeError, match="keep adding"):
        s.take()
    with pytest.raises(ValueError, match="max_gen_batches"):
        _sampler(max_batches=0)
    with pytest.raises(ValueError, match="batch_multiplier"):
        _sampler(mult=0.0)
