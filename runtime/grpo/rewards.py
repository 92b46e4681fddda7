"""Reward functions: the built-ins and the resolution of ``reward.function``.

A reward function scores one completion::

    reward_fn(prompt: str, completion: str, answer: str, **kwargs) -> float

``reward.function`` in ``runtime.yaml`` is either a built-in name (see ``BUILTIN_REWARDS``) or a
user function given as ``package.module:function`` or ``package.module.function``; the module must
be importable where the driver runs (on its ``PYTHONPATH``). ``reward.kwargs`` are bound once by
``make_reward_fn`` and checked against the function's signature before the run starts.

Built-ins:

- ``math`` (alias ``gsm8k``): reasoning-aware numeric answer check. ``<think>…</think>`` is removed
  first; then the answer is, in this order, the last ``\\boxed{...}``, the last ``#### n``, the
  last number in the text. Both sides are normalised (``,`` and ``$`` removed, trailing ``.``
  dropped, ``72.0`` → ``72``), exactly for any number of digits.
- ``exact_match``: the stripped completion equals the stripped answer.
- ``prefix_match``: the stripped completion starts with the stripped answer (the toy task's reward).
- ``first_char``: the first non-blank character of the completion equals the answer's.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math as _math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

RewardFn = Callable[..., float]

#: Built-in reward functions by name (``reward.function: <name>``).
BUILTIN_REWARDS: dict[str, RewardFn] = {}


class RewardFunctionError(ValueError):
    """``reward.function`` / ``reward.kwargs`` cannot be resolved, or a reward is not a number."""


def register_reward(*names: str) -> Callable[[RewardFn], RewardFn]:
    """Register a built-in reward under one or more names."""

    def deco(fn: RewardFn) -> RewardFn:
        for name in names:
            if name in BUILTIN_REWARDS:
                raise ValueError(f"reward {name!r} is already registered")
            BUILTIN_REWARDS[name] = fn
        return fn

    return deco


# --------------------------------------------------------------------------- math / gsm8k

# One reasoning tag, opening or closing, in any case.
_THINK_TAG = re.compile(r"<(/?)think>", re.IGNORECASE)
# One number: an optional sign (not when it follows a word character or ")", so "3-2" is 3 and 2),
# an optional "$" on either side of the sign, then thousands-grouped digits ("1,234,567") or a plain
# digit run, and an optional decimal part ("1,2,3" is three numbers, not 123; ".5" is a number).
_SIGN = r"(?:(?<![\w)])[-−])?"
_NUMBER = _SIGN + r"\$?" + _SIGN + r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + r")")
# A plain decimal after normalize_number's clean-up: sign, integer digits, fraction digits.
_PLAIN_DECIMAL = re.compile(r"(-?)(\d*)(?:\.(\d*))?")
# What a \boxed{...} answer is parsed from: the command's opening and every brace.
_BOX_TOKEN = re.compile(r"\\boxed\s*\{|[{}]")
# LaTeX that wraps a number inside a box without changing it: \text{...} units, spacing, $ and \$.
_BOX_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{[^{}]*\}")
_BOX_NOISE = re.compile(r"\\[,;:! ]|\\?[$%]|\\left|\\right")


def strip_thinking(text: str) -> str:
    """Remove reasoning: closed ``<think>…</think>`` blocks, then an unbalanced tag.

    - A closed block runs from an opening tag to the nearest closing tag after it (opening tags
      inside it are part of the reasoning) and is replaced by one blank.
    - A stray ``</think>`` (the opening tag was in the prompt, as chat templates that pre-fill
      ``<think>`` do) keeps only the text after the last stray ``</think>``.
    - A stray ``<think>`` (generation stopped while still thinking) drops everything from it on.

    One pass over the tags: linear in the length of the text however many tags are unclosed.
    """
    kept: list[str] = []  # pieces of answer text after the last stray </think>
    piece_start = 0  # where the current piece of answer text starts
    open_at = -1  # position of the opening tag of the block being read, -1 outside reasoning
    for tag in _THINK_TAG.finditer(text):
        closing = tag.group(1) == "/"
        if open_at < 0 and not closing:
            kept.append(text[piece_start : tag.start()])
            open_at = tag.start()
        elif open_at >= 0 and closing:
            kept.append(" ")
            open_at = -1
            piece_start = tag.end()
        elif closing:  # a stray </think>: what came before it was reasoning
            kept.clear()
            piece_start = tag.end()
        # an opening tag inside a block is part of the reasoning
    if open_at < 0:
        kept.append(text[piece_start:])
    return "".join(kept)


def last_boxed(text: str) -> str | None:
    """The content of the ``\\boxed{...}`` that closes last in ``text`` (braces balanced), or ``None``.

    One pass over the braces: an unclosed ``\\boxed{`` is ignored, nested braces (``\\frac{1}{2}``)
    stay in the content.
    """
    open_boxes: list[tuple[bool, int]] = []  # (is a \boxed, where its content starts) per open brace
    found: tuple[int, int] | None = None
    for token in _BOX_TOKEN.finditer(text):
        if token.group() == "}":
            if open_boxes:
                is_box, start = open_boxes.pop()
                if is_box:
                    found = (start, token.start())
            continue
        open_boxes.append((token.group() != "{", token.end()))
    return None if found is None else text[found[0] : found[1]]


def boxed_answer(content: str) -> str:
    """The answer a box holds: its number, normalised, when it holds exactly one; else its text.

    ``\\text{...}`` units, LaTeX spacing and dollar signs are ignored (``72\\text{ apples}`` → ``72``);
    anything else (``\\frac{1}{2}``, ``x = 3, y = 4``) is returned as its whitespace-collapsed text.
    """
    bare = _BOX_NOISE.sub("", _BOX_TEXT.sub("", content)).strip()
    numbers = _NUMBER_RE.findall(bare)
    if len(numbers) == 1 and _NUMBER_RE.sub("", bare).strip() in ("", "=", "."):
        value = normalize_number(numbers[0])
        if value is not None:
            return value
    return " ".join(content.split())


def normalize_number(text: str) -> str | None:
    """Canonical form of one number: ``"$1,234.00"`` → ``"1234"``, ``"-3.50"`` → ``"-3.5"``.

    Returns ``None`` when ``text`` is not a plain decimal number after removing ``$``, ``,``, blanks
    and a trailing ``.``. Exact for any number of digits (string arithmetic, no float or int round trip).
    """
    s = text.strip().replace("−", "-").replace("$", "").replace(",", "").replace(" ", "")
    s = s.rstrip(".")
    plain = _PLAIN_DECIMAL.fullmatch(s)
    if plain is None:
        return None
    sign, whole, fraction = plain.group(1), plain.group(2), plain.group(3) or ""
    if not whole and not fraction:
        return None
    whole = whole.lstrip("0") or "0"
    fraction = fraction.rstrip("0")
    if whole == "0" and not fraction:
        sign = ""  # -0 is 0
    return sign + whole + ("." + fraction if fraction else "")


def extract_answer(text: str, *, strict: bool = False) -> str | None:
    """The normalised final answer of ``text``, or ``None`` when it holds none.

    Reasoning is stripped first (``strip_thinking``), so only what follows the thinking counts. Then,
    in this order of priority:

    1. the last ``\\boxed{...}`` (see ``boxed_answer``),
    2. the last ``#### n``,
    3. the last number in the text, unless ``strict`` is set.
    """
    text = strip_thinking(text)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed_answer(boxed)
    marked = _STRICT_RE.findall(text)
    if marked:
        return normalize_number(marked[-1])
    if strict:
        return None
    numbers = _NUMBER_RE.findall(text)
    if not numbers:
        return None
    return normalize_number(numbers[-1])


@register_reward("math", "gsm8k")
def math_reward(prompt: str, completion: str, answer: str, *, strict: bool = False, **_: Any) -> float:
    """1.0 when the completion's final number equals the ground truth's, else 0.0.

    The ground truth is read the same way (so a full GSM8K solution ending in ``#### 72`` works as
    well as ``72``). A ground truth with no number is compared as stripped text.
    """
    predicted = extract_answer(completion, strict=strict)
    if predicted is None:
        return 0.0
    truth = extract_answer(str(answer))
    if truth is None:
        return 1.0 if predicted == str(answer).strip() else 0.0
    return 1.0 if predicted == truth else 0.0


# --------------------------------------------------------------------------- string matches


@register_reward("exact_match")
def exact_match_reward(prompt: str, completion: str, answer: str, **_: Any) -> float:
    """1.0 when the stripped completion equals the stripped answer."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


@register_reward("prefix_match")
def prefix_match_reward(prompt: str, completion: str, answer: str, **_: Any) -> float:
    """1.0 when the stripped completion starts with the stripped (non-empty) answer."""
    expected = str(answer).strip()
    return 1.0 if expected and completion.strip().startswith(expected) else 0.0


@register_reward("first_char")
def first_char_reward(prompt: str, completion: str, answer: str, **_: Any) -> float:
    """1.0 when the first non-blank character of the completion equals the answer's."""
    got, expected = completion.strip(), str(answer).strip()
    return 1.0 if got and expected and got[0] == expected[0] else 0.0


# --------------------------------------------------------------------------- resolution


def _import_user_function(spec: str) -> RewardFn:
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    elif "." in spec:
        module_name, _, attr = spec.rpartition(".")
    else:
        raise RewardFunctionError(
            f"reward.function: {spec!r} is not a built-in reward ({', '.join(sorted(BUILTIN_REWARDS))}) "
            "and not an importable 'module:function'; fix the name or write it as 'package.module:function'"
        )
    if not module_name or not attr:
        raise RewardFunctionError(f"reward.function: {spec!r} must be 'package.module:function' (both parts non-empty)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardFunctionError(
            f"reward.function: cannot import module {module_name!r} for {spec!r}: {exc}. "
            "Put the module on the driver's PYTHONPATH (e.g. ship it in the bundle and add its folder "
            "to env.PYTHONPATH) or fix the module name"
        ) from exc
    try:
        fn = getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise RewardFunctionError(
            f"reward.function: module {module_name!r} has no attribute {attr!r}; "
            f"callables it defines: {', '.join(public[:20]) or 'none'}"
        ) from None
    if not callable(fn):
        raise RewardFunctionError(f"reward.function: {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def resolve_reward(spec: str) -> RewardFn:
    """The reward function named by ``reward.function``: a built-in name or ``module:function``."""
    spec = spec.strip()
    if not spec:
        raise RewardFunctionError(
            f"reward.function: empty; use a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) or 'module:function'"
        )
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    return _import_user_function(spec)


def make_reward_fn(function: str, kwargs: dict[str, Any] | None = None) -> Callable[[str, str, str], float]:
    """Resolve ``function`` and bind ``kwargs``; checks the call signature before the run starts.

    The returned callable is ``fn(prompt, completion, answer) -> float``.
    """
    fn = resolve_reward(function)
    kwargs = dict(kwargs or {})
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins / C functions: nothing to check
        sig = None
    if sig is not None:
        try:
            sig.bind("prompt", "completion", "answer", **kwargs)
        except TypeError as exc:
            raise RewardFunctionError(
                f"reward.function {function!r} cannot be called as fn(prompt, completion, answer"
                f"{''.join(f', {k}=...' for k in kwargs)}): {exc}. Fix reward.kwargs or the function's "
                "signature (it must take prompt, completion, answer and accept **kwargs)"
            ) from None
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    return bound


@dataclass(frozen=True)
class RewardFailure:
    """One sample the reward function could not score: where, why, and the start of its completion."""

    sample: int
    error: str
    completion_head: str

    def describe(self, name: str) -> str:
        return (
            f"{name} failed on sample {self.sample} of this step: {self.error}; the sample is scored "
            f"reward.failure_reward. Completion starts: {self.completion_head!r}"
        )


def _safe_reward(fn: Callable[[str, str, str], float], prompt: str, completion: str, answer: str) -> float | str:
    """The reward as a finite float, or a one-line description of why there is none."""
    try:
        value = fn(prompt, completion, answer)
    except Exception as exc:  # noqa: BLE001 - any failure of user code on one sample is that sample's
        text = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {text[:300]}"
    try:
        as_float = float(value)
    except (TypeError, ValueError, OverflowError):
        return f"returned {str(value)[:80]!r} ({type(value).__name__}); a reward must be a float"
    if not _math.isfinite(as_float):
        return f"returned {as_float!r}; a reward must be a finite number"
    return as_float


@dataclass
class RewardScorer:
    """Scores completions with a reward function; one sample's failure never ends the run.

    A sample whose reward function raises, or returns something that is not a finite number, is
    scored ``failure_reward`` (``reward.failure_reward``, 0 by default). ``take_metrics()`` reports
    ``reward/failures`` and ``reward/failure_fraction`` since the last call (once per step) and
    ``warn`` receives one example per step: the first failure, with its error and completion start.
    """

    fn: Callable[[str, str, str], float]
    failure_reward: float = 0.0
    name: str = "reward.function"
    warn: Callable[[str], None] | None = None
    _failures: int = 0
    _samples: int = 0
    _example: RewardFailure | None = None

    def score(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        """Rewards for aligned lists (one per completion)."""
        if not (len(prompts) == len(completions) == len(answers)):
            raise ValueError(
                f"score: prompts ({len(prompts)}), completions ({len(completions)}) and answers "
                f"({len(answers)}) must have the same length"
            )
        out: list[float] = []
        for p, c, a in zip(prompts, completions, answers, strict=True):
            reward = _safe_reward(self.fn, p, c, a)
            if isinstance(reward, str):
                if self._example is None:
                    self._example = RewardFailure(self._samples, reward, str(c)[:200])
                    if self.warn is not None:
                        self.warn(self._example.describe(self.name))
                self._failures += 1
                reward = self.failure_reward
            self._samples += 1
            out.append(reward)
        return out

    @property
    def first_failure(self) -> RewardFailure | None:
        """The first failure since the last ``take_metrics`` (the example that was logged)."""
        return self._example

    def take_metrics(self) -> dict[str, float]:
        """Failures since the last call (``reward/failures``, ``reward/failure_fraction``); then reset."""
        metrics = {
            "reward/failures": float(self._failures),
            "reward/failure_fraction": self._failures / self._samples if self._samples else 0.0,
        }
        self._failures, self._samples, self._example = 0, 0, None
        return metrics
