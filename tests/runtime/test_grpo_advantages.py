"""Group-normalised advantages."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from rlc.runtime.grpo.advantages import as_groups, group_advantages, group_has_signal, reward_metrics  # noqa: E402

reward_values = st.sampled_from([0.0, 0.5, 1.0, -1.0, 0.1, 2.0, 0.3])
groups = st.integers(min_value=2, max_value=6).flatmap(
    lambda g: st.lists(st.lists(reward_values, min_size=g, max_size=g), min_size=1, max_size=6)
)


@settings(max_examples=60, deadline=None)
@given(groups, st.booleans(), st.booleans())
def test_advantages_sum_to_zero_per_group(rows, loo, normalize) -> None:
    adv = group_advantages(rows, leave_one_out=loo, normalize=normalize)
    assert adv.shape == (len(rows), len(rows[0]))
    assert adv.dtype == torch.float32
    scale = max(1.0, adv.abs().max().item())
    assert torch.allclose(adv.double().sum(dim=1), torch.zeros(len(rows), dtype=torch.float64), atol=1e-5 * scale)


@settings(max_examples=60, deadline=None)
@given(groups)
def test_leave_one_out_formula(rows) -> None:
    adv = group_advantages(rows, leave_one_out=True, normalize=False).double()
    for i, row in enumerate(rows):
        signal = any(x != row[0] for x in row)
        for j, r in enumerate(row):
            others = row[:j] + row[j + 1 :]
            expected = r - sum(others) / len(others) if signal else 0.0
            assert adv[i, j].item() == pytest.approx(expected, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(groups, st.booleans())
def test_equal_reward_groups_get_exactly_zero(rows, loo) -> None:
    rows = [row if k % 2 else [row[0]] * len(row) for k, row in enumerate(rows)]
    adv = group_advantages(rows, leave_one_out=loo, normalize=True)
    signal = group_has_signal(rows)
    for k, row in enumerate(rows):
        if not signal[k]:
            assert torch.equal(adv[k], torch.zeros(len(row)))
        else:
            assert adv[k].abs().sum() > 0


def test_constant_group_with_rounding_prone_value_is_zero() -> None:
    # mean(0.1, 0.1, 0.1) != 0.1 in floating point; dividing the residue by eps must not leak out
    adv = group_advantages([[0.1, 0.1, 0.1]], leave_one_out=False, normalize=True)
    assert torch.equal(adv, torch.zeros(1, 3))


def test_normalised_values_match_hand_computation() -> None:
    rows = [[1.0, 0.0, 0.0, 1.0]]
    adv = group_advantages(rows, leave_one_out=False, normalize=True, eps=0.0)
    std = torch.tensor(rows[0]).std().item()  # unbiased: sqrt(1/3)
    assert adv[0].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    loo = group_advantages(rows, leave_one_out=True, normalize=False)
    # G/(G-1) * (r - mean)
    assert loo[0].tolist() == pytest.approx([4 / 3 * 0.5, -4 / 3 * 0.5, -4 / 3 * 0.5, 4 / 3 * 0.5])


def test_each_group_is_normalised_by_its_own_std() -> None:
    # Two groups with different spreads, worked by hand. Group 1: mean 1, unbiased std 1 (r - mean =
    # -1, 0, 1). Group 2: mean 5, unbiased std 3 (r - mean = -3, 0, 3). Per-group normalisation gives
    # both groups -1, 0, 1; one std over the whole batch (about 2.8) would not.
    rows = [[0.0, 1.0, 2.0], [2.0, 5.0, 8.0]]
    adv = group_advantages(rows, leave_one_out=False, normalize=True, eps=0.0)
    assert adv.tolist() == [[-1.0, 0.0, 1.0], [-1.0, 0.0, 1.0]]
    loo = group_advantages(rows, leave_one_out=True, normalize=True, eps=0.0)
    assert loo.flatten().tolist() == pytest.approx([-1.5, 0.0, 1.5, -1.5, 0.0, 1.5])  # G/(G-1) = 3/2


@settings(max_examples=60, deadline=None)
@given(groups)
def test_leave_one_out_normalised_is_mean_baseline_scaled_by_g_over_g_minus_1(rows) -> None:
    # the documented equivalence (docs/reference.md, grpo.normalize_advantages): not RLOO
    g = len(rows[0])
    loo = group_advantages(rows, leave_one_out=True, normalize=True).double()
    grpo = group_advantages(rows, leave_one_out=False, normalize=True).double()
    assert torch.allclose(loo, grpo * g / (g - 1), rtol=1e-5, atol=1e-5)


def test_reference_states_the_leave_one_out_equivalence_and_names_approx_kl() -> None:
    from pathlib import Path

    reference = (Path(__file__).resolve().parents[2] / "docs" / "reference.md").read_text(encoding="utf-8")
    assert "mean-baseline GRPO scaled by G/(G−1)" in reference and "not RLOO" in reference
    assert "`approx_kl` is the k3 estimate of KL(old ‖ new)" in reference


def test_mean_baseline_single_generation_is_zero_and_loo_needs_two() -> None:
    assert torch.equal(group_advantages([[1.0], [0.0]], leave_one_out=False, normalize=True), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="generations_per_prompt >= 2"):
        group_advantages([[1.0], [0.0]], leave_one_out=True, normalize=False)


def test_bad_shapes_and_values() -> None:
    with pytest.raises(ValueError, match="num_prompts, generations_per_prompt"):
        group_advantages([1.0, 2.0], leave_one_out=False, normalize=False)
    with pytest.raises(ValueError, match="finite"):
        group_advantages([[1.0, float("nan")]], leave_one_out=False, normalize=False)
    with pytest.raises(ValueError, match="generations_per_prompt=3"):
        as_groups([1.0, 2.0, 3.0, 4.0], 3)


def test_as_groups_is_prompt_major() -> None:
    g = as_groups([1, 2, 3, 4, 5, 6], 3)
    assert g.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_reward_metrics() -> None:
    m = reward_metrics([[1.0, 0.0], [1.0, 1.0]])
    assert m["reward/mean"] == pytest.approx(0.75)
    assert m["reward/groups_with_signal"] == pytest.approx(0.5)
    assert m["reward/min"] == 0.0 and m["reward/max"] == 1.0


def test_advantages_from_config() -> None:
    from rlc.contract.runtime_config import (DynamicSamplingConfig, GrpoConfig, RewardScalingConfig,
                                         RewardShapingConfig)

    grpo = GrpoConfig(
        prompts_per_step=1,
        generations_per_prompt=2,
        max_steps=1,
        normalize_advantages=False,
        leave_one_out=True,
        dynamic_sampling=DynamicSamplingConfig(enabled=False, max_gen_batches=1, batch_multiplier=1.0),
        reward_scaling=RewardScalingConfig(enabled=False, source_min=0.0, source_max=1.0, target_min=0.0,
                                           target_max=1.0),
        reward_shaping=RewardShapingConfig(enabled=False, overlong_buffer_length=128, overlong_buffer_penalty=1.0,
                                           max_response_length=None, stop_properly_penalty_coef=None),
        max_gen_kl=0.0,
        seed=0,
    )
    from rlc.runtime.grpo.advantages import advantages_from_config

    assert advantages_from_config([[1.0, 0.0]], grpo).tolist() == [[1.0, -1.0]]
