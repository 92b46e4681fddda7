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


def test_scorer_scores_aligned_lists() -> None:
    scorer = R.RewardScorer(R.make_reward_fn("exact_match"))
    assert scorer.score(["p", "p"], ["a", "b"], ["a", "a"]) == [1.0, 0.0]
    assert scorer.take_metrics() == {"reward/failures": 0.0, "reward/failure_fraction": 0.0}
    with pytest.raises(ValueError, match="same length"):
        scorer.score(["p"], ["c", "d"], ["a"])


def test_huge_integer_is_scored_not_raised() -> None:
    # int(str) refuses more than 4300 digits (CPython's limit); the math reward must not go near it
    digits = "7" * 5000
    assert R.math_reward("q", f"The answer is {digits}", digits) == 1.0
    assert R.math_reward("q", f"The answer is {digits}", "7") == 0.0
    assert R.normalize_number("-000" + digits + ".500") == "-" + digits + ".5"


def test_a_failing_sample_is_scored_counted_and_logged_once(user_module: str) -> None:
    def picky(prompt: str, completion: str, answer: str) -> float:
        if completion == "boom":
            raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")
        if completion == "text":
            return "good"  # type: ignore[return-value]
        if completion == "nan":
            return float("nan")
        return 1.0

    warnings: list[str] = []
    scorer = R.RewardScorer(picky, failure_reward=-1.0, warn=warnings.append)
    rewards = scorer.score(["p"] * 5, ["ok", "boom", "text", "nan", "ok"], ["a"] * 5)
    assert rewards == [1.0, -1.0, -1.0, -1.0, 1.0]
    assert len(warnings) == 1  # one example per step, not one line per failure
    assert "sample 1" in warnings[0] and "ValueError" in warnings[0] and "4300 digits" in warnings[0]
    assert "'boom'" in warnings[0] and "reward.failure_reward" in warnings[0]
    assert scorer.score(["p"], ["boom"], ["a"]) == [-1.0]  # same step, second batch: still one example
    assert len(warnings) == 1
    assert scorer.take_metrics() == {"reward/failures": 4.0, "reward/failure_fraction": 4 / 6}
    # the next step starts from zero and logs its own example
    assert scorer.score(["p"], ["ok"], ["a"]) == [1.0]
    assert scorer.take_metrics() == {"reward/failures": 0.0, "reward/failure_fraction": 0.0}
    assert scorer.score(["p"], ["text"], ["a"]) == [-1.0]
    assert len(warnings) == 2 and "must be a float" in warnings[1]


def test_default_failure_reward_is_zero_and_a_user_function_cannot_end_the_run(user_module: str) -> None:
    scorer = R.RewardScorer(R.make_reward_fn(f"{user_module}:returns_text"))
    assert scorer.score(["p", "p"], ["c", "d"], ["a", "a"]) == [0.0, 0.0]
    assert scorer.take_metrics()["reward/failures"] == 2.0


def test_math_reward_survives_adversarial_completions_through_the_scorer() -> None:
    scorer = R.RewardScorer(R.make_reward_fn("math"))
    nasty = ["9" * 20000, "<think>" * 5000, "\\boxed{" * 5000, "#### " + "1" * 10000, "$" * 10000, ",1" * 5000]
    rewards = scorer.score(["q"] * len(nasty), nasty, ["9" * 20000] + ["1"] * (len(nasty) - 1))
    assert rewards[0] == 1.0
    assert scorer.take_metrics()["reward/failures"] == 0.0  # the built-in itself never raises on these


# --------------------------------------------------------------------------- answer priority


@pytest.mark.parametrize(
    "completion, expected",
    [
        # 1. a \boxed{} answer after the thinking wins over #### and over later numbers
        ("\\boxed{42} ... I checked it 3 times", "42"),
        ("#### 7 but really \\boxed{42}, 3 ways", "42"),
        ("\\boxed{1} then \\boxed{42} and 5", "42"),  # the last box
        ("<think>\\boxed{9}</think> so #### 42, checked 3 times", "42"),  # a box inside the thinking does not count
        ("<think>\\boxed{9}</think> the answer is 42", "42"),
        ("\\boxed{72\\text{ apples}}", "72"),
        ("\\boxed{\\$1,234.00}", "1234"),
        ("\\boxed{\\frac{1}{2}} and 7", "\\frac{1}{2}"),  # not a plain number: its text, not the last number
        ("\\boxed{42 and then never closed", "42"),  # an unclosed box is no box: the last number
        # 2. then the last ####
        ("#### 42 (I also considered 4)", "42"),
        ("#### 1 then #### 42, 5 6", "42"),
        # 3. then the last number
        ("first 3 then 42", "42"),
    ],
)
def test_answer_priority_boxed_then_marker_then_last_number(completion: str, expected: str) -> None:
    assert R.extract_answer(completion) == expected


def test_strict_accepts_a_box_or_a_marker_only() -> None:
    assert R.extract_answer("it is 42", strict=True) is None
    assert R.extract_answer("it is \\boxed{42}", strict=True) == "42"
    assert R.extract_answer("it is #### 42", strict=True) == "42"


def test_boxed_ground_truth_is_read_the_same_way() -> None:
    assert R.math_reward("q", "so \\boxed{72}. Checked 3 times", "\\boxed{72}") == 1.0
    assert R.math_reward("q", "so \\boxed{72}. Checked 3 times", "#### 72") == 1.0


# --------------------------------------------------------------------------- linear thinking strip


def _best_of(repeats: int, fn) -> float:
    import time

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def test_strip_thinking_is_linear_in_unclosed_tags() -> None:
    # Work, not wall time: stripping 8000 unclosed tags is compared with one linear scan of the same
    # text in the same run. A quadratic strip (each unclosed tag searched to the end of the text) is
    # ~4000x the scan; a linear one ~5x. The bound (100x) leaves room for a loaded machine either way.
    import re

    text = "<think>\n" * 8000 + "the answer is 7"
    assert R.strip_thinking(text) == ""
    scan = re.compile("<think>", re.IGNORECASE)
    baseline = _best_of(5, lambda: scan.findall(text))
    strip = _best_of(5, lambda: R.strip_thinking(text))
    assert strip < 100 * baseline, f"strip_thinking took {strip * 1e3:.2f} ms, a linear scan {baseline * 1e3:.3f} ms"


def test_strip_thinking_keeps_semantics_on_mixed_tags() -> None:
    assert R.strip_thinking("a<think>x<think>y</think>b").split() == ["a", "b"]  # nested open is reasoning
    assert R.strip_thinking("x</think>a<think>b</think>c</think>d") == "d"
    assert R.strip_thinking("a<think>b</think>c<think>d") == "a c"
    assert R.strip_thinking("no tags") == "no tags"
    assert R.strip_thinking("</think>" * 3 + "z") == "z"
