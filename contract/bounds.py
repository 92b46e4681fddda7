"""The limits every key path, value and interpolation rlc resolves stays within.

One set of limits for the three places that build a tree from text a user typed: ``--set KEY=VALUE``
and ``extends:`` in the compiler, the NeMo-RL importer's OmegaConf interpolations and Hydra-style
overrides, and ``python -m rlc.runtime runtime.yaml KEY=VALUE``. Without them a ``--set`` key 30,000
levels deep ran for minutes and gigabytes before a ``RecursionError``, an interpolation chain ended
in one, and ``${mul:'A',3e8}`` built a 300-million-character string.

* :func:`key_path_problem`: a dotted key path at most :data:`MAX_KEY_CHARS` long and
  :data:`MAX_DEPTH` levels deep.
* :func:`value_problem`: a value (as parsed from YAML, aliases counted at every use) of at most
  :data:`MAX_NODES` nodes, :data:`MAX_DEPTH` levels and :data:`MAX_TEXT` characters.
* :class:`TimeLimit`: a wall-clock bound (``SIGALRM``, main thread on POSIX) on a resolution whose
  cost the two checks above cannot see in advance (interpolations that refer to each other).

Pure Python; the compiler and the runtime both import it.
"""
from __future__ import annotations

from types import FrameType, TracebackType
from typing import Any

#: Deepest nesting of a key path or a value (recipes nest four or five levels).
MAX_DEPTH = 64
#: Longest key path, in characters.
MAX_KEY_CHARS = 1024
#: Most nodes (mappings, lists, scalars) one value may expand to, aliases counted at every use.
MAX_NODES = 20_000
#: Most characters in the strings of one value (a resolved interpolation included).
MAX_TEXT = 1 << 20
#: Wall-clock seconds one resolution (all interpolations of a config) may take.
RESOLVE_SECONDS = 10.0


class BoundsError(ValueError):
    """A key path, value or resolution beyond the limits; the message says which and the limit."""


def key_path_problem(text: str) -> str | None:
    """Why the key path ``text`` (``a.b[0].c``) is beyond the limits, or ``None``."""
    if len(text) > MAX_KEY_CHARS:
        return f"the key path is {len(text)} characters long; rlc reads key paths of at most {MAX_KEY_CHARS}"
    depth = text.count(".") + text.count("[") + 1
    if depth > MAX_DEPTH:
        return f"the key path is {depth} levels deep; recipes nest at most {MAX_DEPTH} levels"
    return None


def value_problem(value: Any) -> str | None:
    """Why ``value`` (plain data from a YAML or JSON parser) is beyond the limits, or ``None``.
    Shared and recursive references are followed at every use, as a consumer that copies the value
    would (a recursive one always ends at :data:`MAX_NODES`)."""
    nodes = chars = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            return f"the value has more than {MAX_NODES} items (aliases count at every use)"
        if depth > MAX_DEPTH:
            return f"the value nests more than {MAX_DEPTH} levels deep"
        if isinstance(node, str):
            chars += len(node)
        elif isinstance(node, dict):
            for k, v in node.items():
                chars += len(k) if isinstance(k, str) else 0
                stack.append((v, depth + 1))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)
        if chars > MAX_TEXT:
            return f"the value holds more than {MAX_TEXT} characters"
    return None


def text_problem(text: str) -> str | None:
    """Why one string (a resolver's result, an override's value) is too long, or ``None``."""
    if len(text) > MAX_TEXT:
        return f"{len(text)} characters, more than the {MAX_TEXT} rlc resolves"
    return None


class TimeLimit:
    """``with TimeLimit(seconds):`` raises :class:`BoundsError` in the block once ``seconds`` pass.

    Uses ``SIGALRM``, so it bounds the block only in the main thread on POSIX (elsewhere it bounds
    nothing, and the node and size limits still hold). Libraries may wrap the exception in their
    own; ``expired`` says whether the limit is what ended the block.

    Python discards an exception raised where nothing can receive it (a garbage-collector callback,
    ``__del__``, a weakref callback), and a signal handler's exception lands wherever the main thread
    happens to be. So after the first alarm the timer repeats every :data:`REPEAT_SECONDS` until
    the block ends: one discarded alarm cannot let the block run on unbounded."""

    #: Interval of the alarms after the first, while the block is still running.
    REPEAT_SECONDS = 0.05

    def __init__(self, seconds: float | None = None, what: str = "resolving") -> None:
        self.seconds = RESOLVE_SECONDS if seconds is None else seconds
        self.what = what
        self.expired = False
        self._armed = False
        self._old_handler: Any = None

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        self.expired = True
        raise BoundsError(f"{self.what} took longer than {self.seconds:g} s (references that expand "
                          "exponentially, or a cycle)")

    def __enter__(self) -> TimeLimit:
        import signal  # noqa: PLC0415 - only where a limit is set (not on every command's import path)
        import threading  # noqa: PLC0415

        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGALRM, self._on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.seconds, self.REPEAT_SECONDS)
            self._armed = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._armed:
            import signal  # noqa: PLC0415 - (imported by __enter__ already)

            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old_handler)
            self._armed = False
