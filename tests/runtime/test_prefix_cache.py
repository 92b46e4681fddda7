"""The vLLM worker's prefix-cache bookkeeping (``rlc.runtime.generation.prefix_cache``): a reset runs only when a
request ran since the last one, a refused reset is tried again, and a reset in the background is waited for by
whatever uses the engine next, so that a rollout can never start on a cache the old weights filled."""
from __future__ import annotations

import threading

import pytest

from rlc.runtime.generation.prefix_cache import PrefixCache


class Engine:
    """Counts resets; ``refuse`` makes the next one fail as vLLM's does while blocks are in use; ``gate`` holds a
    reset until it is set."""

    def __init__(self) -> None:
        self.resets = 0
        self.refuse = False
        self.gate: threading.Event | None = None
        self.started = threading.Event()

    def reset_prefix_cache(self) -> bool:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.resets += 1
        return not self.refuse


def test_a_reset_runs_only_when_a_request_ran_since_the_last_one():
    engine = Engine()
    cache = PrefixCache(engine.reset_prefix_cache)
    assert cache.reset() and engine.resets == 1  # unknown at first: reset
    assert cache.reset() and engine.resets == 1 and cache.skipped == 1
    cache.used()
    assert cache.reset() and engine.resets == 2
    cache.used()
    cache.cleared()  # vLLM's own sleep cleared it
    assert cache.reset() and engine.resets == 2


def test_a_refused_reset_leaves_the_cache_used_and_is_tried_again():
    engine = Engine()
    cache = PrefixCache(engine.reset_prefix_cache)
    engine.refuse = True
    assert cache.reset() is False and not cache.clean
    engine.refuse = False
    assert cache.reset() and engine.resets == 2 and cache.clean


def test_a_reset_in_the_background_is_waited_for_before_the_next_rollout():
    engine = Engine()
    engine.gate = threading.Event()
    cache = PrefixCache(engine.reset_prefix_cache)
    cache.used()
    cache.reset_in_background()
    assert engine.started.wait(10) and not cache.clean  # running in its thread, not finished
    done = threading.Event()

    def next_rollout() -> None:
        cache.used()
        done.set()

    rollout = threading.Thread(target=next_rollout)
    rollout.start()
    assert not done.wait(0.2)  # the rollout waits for the reset ...
    engine.gate.set()
    rollout.join(10)
    assert done.is_set() and engine.resets == 1
    assert not cache.clean  # ... so the reset's end cannot mark the new rollout's cache clean
    assert cache.reset() and engine.resets == 2


def test_the_reset_after_the_refit_finds_the_background_reset_done():
    engine = Engine()
    cache = PrefixCache(engine.reset_prefix_cache)
    cache.used()
    cache.reset_in_background()  # released after generation
    assert cache.reset() and engine.resets == 1 and cache.skipped == 1  # the synchronizer's reset after the refit
    cache.reset_in_background()  # nothing ran since: nothing to start
    assert cache.settle() == 0.0 and engine.resets == 1


def test_a_failed_background_reset_is_raised_by_the_next_use():
    def broken() -> bool:
        raise ValueError("engine gone")

    cache = PrefixCache(broken)
    cache.reset_in_background()
    with pytest.raises(RuntimeError, match="prefix cache reset failed: engine gone"):
        cache.settle()
    assert not cache.clean and cache.settle() == 0.0
