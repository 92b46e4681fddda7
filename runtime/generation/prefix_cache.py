"""When a vLLM engine's prefix cache needs resetting, and resetting it off the critical path.

After a refit the prefix cache holds keys and values computed with the old weights, so it must be empty before the
next rollout. vLLM's reset walks every block of the KV pool in Python (``BlockPool.reset_prefix_cache``), so its cost
follows the pool's block count: 70-85 ms on an H200 for a small model whose 13.7 GiB pool holds 1.8 million blocks,
a few milliseconds at most for Qwen3-8B's 11,300. Two things make most of those resets unnecessary or free:

* A reset is needed only if a request ran since the last one. vLLM's own sleep (levels 1 and 2) already clears the
  cache; the reset after the refit then has nothing to clear and is skipped.
* rlc's KV-only sleep (``refit.keep_weights_awake``) and ``refit.keep_kv_cache_awake`` reset when the engine is
  released after generation, in a thread, while the trainer computes its logprobs and trains: nothing can be cached
  between the end of a rollout and the next one. Every later use of the engine waits for that thread first
  (:meth:`settle`).

The engine itself is passed in as its reset function (``vllm.LLM.reset_prefix_cache``, which returns whether it
reset: it refuses while blocks are still in use, and the cache then counts as used).
"""
from __future__ import annotations

from typing import Callable

from rlc.runtime.generation.background import BackgroundCall


class PrefixCache:
    """Whether the engine's prefix cache holds anything, and its reset (see the module docstring)."""

    def __init__(self, reset: Callable[[], object]) -> None:
        self._reset = reset
        self.clean = False  # nothing cached since the last reset (unknown before the first: not clean)
        self.resets = 0  # resets actually run
        self.skipped = 0  # resets asked for with nothing to clear
        self._pending: BackgroundCall | None = None

    def used(self) -> None:
        """Requests are about to run: whatever they cache needs a reset before the weights change."""
        self.settle()
        self.clean = False

    def cleared(self) -> None:
        """The engine cleared its cache itself (vLLM's sleep)."""
        self.settle()
        self.clean = True

    def reset(self) -> bool:
        """Reset now, unless nothing was cached since the last reset; True when the cache is empty afterwards."""
        self.settle()
        if self.clean:
            self.skipped += 1
            return True
        self._run()
        return self.clean

    def reset_in_background(self) -> None:
        """Start the reset in a thread (nothing to do when the cache is empty); :meth:`settle` collects it."""
        self.settle()
        if self.clean:
            self.skipped += 1
            return
        self._pending = BackgroundCall(self._run, "prefix cache reset")
        self._pending.start()

    def settle(self) -> float:
        """Wait for a reset running in the background (and raise its error); returns the seconds waited."""
        pending, self._pending = self._pending, None
        return pending.join() if pending is not None else 0.0

    def _run(self) -> None:
        self.clean = bool(self._reset())
        self.resets += 1


__all__ = ["PrefixCache"]
