"""`TimeLimit` ends its block even when its first alarm lands where Python discards exceptions.

A signal handler's exception is raised wherever the main thread is at that moment; inside a
garbage-collector callback or a ``__del__`` Python prints "Exception ignored" and goes on. A test
suite that installs a gc callback (Hypothesis does) once let an exponential interpolation run past
its one-second limit until another limit stopped it."""
from __future__ import annotations

import time

import pytest

from rlc.contract.bounds import BoundsError, TimeLimit


class _SlowFinalizer:
    """An object whose ``__del__`` outlasts the limit, so the first alarm is raised inside it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __del__(self) -> None:
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            pass


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_plain_block_ends_at_the_limit():
    start = time.monotonic()
    with pytest.raises(BoundsError, match="took longer than 0.1 s"), TimeLimit(0.1) as limit:
        _spin(5.0)
    assert limit.expired and time.monotonic() - start < 2.0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_alarm_discarded_in_a_finalizer_does_not_let_the_block_run_on():
    start = time.monotonic()
    with pytest.raises(BoundsError), TimeLimit(0.1) as limit:
        slow = _SlowFinalizer(0.3)
        del slow  # the first alarm fires inside __del__ and is discarded
        _spin(5.0)
    assert limit.expired
    assert time.monotonic() - start < 2.0, "the block ran on after a discarded alarm"


def test_the_timer_is_off_after_the_block():
    with TimeLimit(0.05):
        pass
    _spin(0.3)  # an alarm still armed would raise here
