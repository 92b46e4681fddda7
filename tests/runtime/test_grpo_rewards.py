"""Reward functions and ``reward.function`` resolution."""

from __future__ import annotations

import sys
import textwrap

import pytest
from rlc.runtime.grpo import rewards as R


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("The answer is #### 1,234", "1234", 1.0),
        ("#### 1,234", "1,234", 1.0),
        ("It costs $72.00", "72", 1.0),
        ("so 72.0", "72", 1.0),
        ("Total: 72.", "72", 1.0),
        ("#### $72", "#### 72", 1.0),  # GSM8K-style ground truth read the same way
        ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "72", 1.0),
        ("<think>maybe 5, or 9?</think>The answer is 7", "7", 1.0),
        ("<think>maybe 5, or 7?</think>The answer is 9", "7", 0.0),  # number in thinking does not count
        ("checking 7 ... </think> final: 12", "12", 1.0),  # <think> was in the prompt
        ("<think>I think it is 12 but", "12", 0.0),  # never finished thinking: no answer
        ("The temperature fell to -5 degrees", "-5", 1.0),
        ("The temperature fell to -5 degrees", "5", 0.0),
        ("a loss of $-3", "-3", 1.0),
        ("I don't know", "3", 0.0),
        ("", "3", 0.0),
        ("#### 3 (I also considered 4)", "3", 1.0),  # strict #### wins over the last number
        ("first 3 then 4", "3", 0.0),  # last number
        ("1,2,3", "3", 1.0),  # a list, not 123
        ("ratio is 0.50", "0.5", 1.0),
        ("about 2.5", "2", 0.0),
        ("3-2 leaves 1", "1", 1.0),
    ],
)
def test_math_reward(completion: str, answer: str, expected: float) -> None:
    assert R.math_reward("q", completion, answer) == expected


def test_math_and_gsm8k_are_the_same_builtin() -> None:
    assert R.resolve_reward("math") is R.resolve_reward("gsm8k") is R.math_reward


def test_math_strict_needs_the_marker() -> None:
    assert R.math_reward("q", "it is 72", "72", strict=True) == 0.0
    assert R.math_reward("q", "it is #### 72", "72", strict=True) == 1.0


def test_math_non_numeric_ground_truth_compares_text() -> None:
    assert R.math_reward("q", "yes 1", "yes") == 0.0
    assert R.math_reward("q", "no number", "n/a") == 0.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("$1,234.00", "1234"),
        ("72.0", "72"),
        ("72.", "72"),
        ("-3.50", "-3.5"),
        ("−4", "-4"),
        ("0.0", "0"),
        ("-0", "0"),
        ("abc", None),
        ("1-2", None),
        ("12345678901234567890", "12345678901234567890"),
    ],
)
def test_normalize_number(text: str, expected: str | None) -> None:
    assert R.normalize_number(text) == expected


def test_strip_thinking_variants() -> None:
    assert R.strip_thinking("<think>a</think>b<think>c</think>d").split() == ["b", "d"]
    assert R.strip_thinking("a</think>b") == "b"
    assert R.strip_thinking("a<think>b") == "a"
    assert R.strip_thinking("<THINK>x</THINK>y").strip() == "y"


def test_exact_prefix_first_char() -> None:
    assert R.exact_match_reward("p", "  42\n", "42") == 1.0
    assert R.exact_match_reward("p", "42 apples", "42") == 0.0
    assert R.prefix_match_reward("p", " 7<eos>", "7") == 1.0
    assert R.prefix_match_reward("p", "17", "7") == 0.0
    assert R.prefix_match_reward("p", "7", "") == 0.0  # an empty answer never matches
    assert R.first_char_reward("p", " 7x", "75") == 1.0
    assert R.first_char_reward("p", "", "7") == 0.0


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(
        textwrap.dedent(
            """
            NOT_A_FUNCTION = 3

            def length_penalty(prompt, completion, answer, *, scale=1.0, **kwargs):
                return -scale * len(completion)

            def no_kwargs(prompt, completion, answer):
                return 1.0

            def returns_text(prompt, completion, answer, **kwargs):
                return "good"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "myrewards.scoring"
    for name in [m for m in sys.modules if m.startswith("myrewards")]:
        del sys.modules[name]


@pytest.mark.parametrize("sep", [":", "."])
def test_user_function_resolution(user_module: str, sep: str) -> None:
    fn = R.make_reward_fn(f"{user_module}{sep}length_penalty", {"scale": 2.0})
    assert fn("p", "abc", "x") == -6.0


def test_unknown_module_error_names_key_and_fix(user_module: str) -> None:
    with pytest.raises(R.RewardFunctionError) as err:
        R.resolve_reward("nonexistent_pkg_xyz.mod:fn")
    msg = str(err.value)
    assert "reward.function" in msg and "nonexistent_pkg_xyz.mod" in msg and "PYTHONPATH" in msg


def test_missing_attribute_lists_candidates(user_module: str) -> None:
    with pytest.raises(R.RewardFunctionError) as err:
        R.resolve_reward(f"{user_module}:lenght_penalty")
    msg = str(err.value)
    assert "reward.function" in msg and "'lenght_penalty'" in msg and "length_penalty" in msg


def test_not_callable(user_module: str) -> None:
    with pytest.raises(R.RewardFunctionError, match="not a function"):
        R.resolve_reward(f"{user_module}:NOT_A_FUNCTION")


def test_unknown_builtin_lists_builtins() -> None:
    with pytest.raises(R.RewardFunctionError) as err:
        R.resolve_reward("mathh")
    assert "exact_match" in str(err.value) and "reward.function" in str(err.value)
    with pytest.raises(R.RewardFunctionError):
        R.resolve_reward("  ")


def test_kwargs_checked_against_signature(user_module: str) -> None:
    with pytest.raises(R.RewardFunctionError) as err:
        R.make_reward_fn(f"{user_module}:no_kwargs", {"scale": 1})
    assert "reward.kwargs" in str(err.value)
    # built-ins swallow unknown kwargs, known ones are bound
    fn = R.make_reward_fn("math", {"strict": True})
    assert fn("q", "72", "72") == 0.0 and fn("q", "#### 72", "72") == 1.0


def test_score_validates_outputs(user_module: str) -> None:
    good = R.make_reward_fn("exact_match")
    assert R.score(good, ["p", "p"], ["a", "b"], ["a", "a"]) == [1.0, 0.0]
    bad = R.make_reward_fn(f"{user_module}:returns_text")
    with pytest.raises(R.RewardFunctionError, match="must return a float"):
        R.score(bad, ["p"], ["c"], ["a"])
    with pytest.raises(R.RewardFunctionError, match="finite"):
        R.score(lambda p, c, a: float("nan"), ["p"], ["c"], ["a"])
    with pytest.raises(ValueError, match="same length"):
        R.score(good, ["p"], ["c", "d"], ["a"])
