"""Reward functions: the built-ins and the resolution of ``reward.function``.

A reward function scores one completion::

    reward_fn(prompt: str, completion: str, answer: str, **kwargs) -> float

``reward.function`` in ``runtime.yaml`` is either a built-in name (see ``BUILTIN_REWARDS``) or a
user function given as ``package.module:function`` or ``package.module.function``; the module must
be importable where the driver runs (on its ``PYTHONPATH``). ``reward.kwargs`` are bound once by
``make_reward_fn`` and checked against the function's signature before the run starts.

Built-ins:

- ``math`` (alias ``gsm8k``): reasoning-aware numeric answer check. ``<think>…</think>`` is removed
  first, then the answer is the strict ``#### n`` form if present, else the last number in the text.
  Both sides are normalised (``,`` and ``$`` removed, trailing ``.`` dropped, ``72.0`` → ``72``).
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
from decimal import Decimal, InvalidOperation
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

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</think>", re.IGNORECASE)
# One number: an optional sign (not when it follows a word character or ")", so "3-2" is 3 and 2),
# an optional "$" on either side of the sign, then thousands-grouped digits ("1,234,567") or a plain
# digit run, and an optional decimal part ("1,2,3" is three numbers, not 123; ".5" is a number).
_SIGN = r"(?:(?<![\w)])[-−])?"
_NUMBER = _SIGN + r"\$?" + _SIGN + r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + r")")


def strip_thinking(text: str) -> str:
    """Remove reasoning: closed ``<think>…</think>`` blocks, then an unbalanced tag.

    - A stray ``</think>`` (the opening tag was in the prompt, as chat templates that pre-fill
      ``<think>`` do) keeps only the text after the last ``</think>``.
    - A stray ``<think>`` (generation stopped while still thinking) drops everything from it on.
    """
    text = _THINK_BLOCK.sub(" ", text)
    closes = list(_THINK_CLOSE.finditer(text))
    if closes:
        text = text[closes[-1].end() :]
    opened = _THINK_OPEN.search(text)
    if opened:
        text = text[: opened.start()]
    return text


def normalize_number(text: str) -> str | None:
    """Canonical form of one number: ``"$1,234.00"`` → ``"1234"``, ``"-3.50"`` → ``"-3.5"``.

    Returns ``None`` when ``text`` is not a number after removing ``$``, ``,``, blanks and a
    trailing ``.``.
    """
    s = text.strip().replace("−", "-").replace("$", "").replace(",", "").replace(" ", "")
    s = s.rstrip(".")
    if s.count("-") > 1:
        return None
    if "-" in s and not s.startswith("-"):
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str, *, strict: bool = False) -> str | None:
    """The normalised final answer of ``text``, or ``None`` when it holds none.

    Reasoning is stripped (``strip_thinking``); the answer is the last ``#### n``; without one it is
    the last number in the text unless ``strict`` is set.
    """
    text = strip_thinking(text)
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


def score(
    reward_fn: Callable[[str, str, str], float],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    name: str = "reward.function",
) -> list[float]:
    """Score aligned lists; each reward must be a finite real number."""
    if not (len(prompts) == len(completions) == len(answers)):
        raise ValueError(
            f"score: prompts ({len(prompts)}), completions ({len(completions)}) and answers "
            f"({len(answers)}) must have the same length"
        )
    out: list[float] = []
    for i, (p, c, a) in enumerate(zip(prompts, completions, answers, strict=True)):
        value = reward_fn(p, c, a)
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise RewardFunctionError(
                f"{name} returned {value!r} ({type(value).__name__}) for sample {i}; it must return a float"
            ) from None
        if not _math.isfinite(as_float):
            raise RewardFunctionError(f"{name} returned {value!r} for sample {i}; rewards must be finite numbers")
        out.append(as_float)
    return out
