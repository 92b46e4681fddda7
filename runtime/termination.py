"""Stopping a run on SIGTERM: what ``scancel``, SLURM's time limit and a container stop send the driver.

Ray's driver installs a handler of its own for SIGTERM that prints a native stack dump and exits with status 1, the
code this runtime gives a refused ``runtime.yaml``. Once Ray is connected the driver installs :func:`install`
instead: the signal interrupts whatever the driver waits on as a ``KeyboardInterrupt`` (the one exception Ray's
blocking calls turn a signal into), the driver stops its workers and exits with :data:`EXIT_TERMINATED` (128 +
SIGTERM, the shell's convention), and a second SIGTERM during that shutdown ends the process at once.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Optional

#: The driver's exit code when a SIGTERM stopped it.
EXIT_TERMINATED = 128 + int(signal.SIGTERM)


class TerminationWatch:
    """Turns the first SIGTERM into a ``KeyboardInterrupt`` in the driver's main thread and remembers it."""

    def __init__(self) -> None:
        self.received: Optional[str] = None  # the signal's name once one arrived

    def install(self) -> bool:
        """Take over SIGTERM (after ``ray.init``, which installs its own); False where it cannot (not the main
        thread, e.g. a run embedded in a test)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        signal.signal(signal.SIGTERM, self._on_signal)
        return True

    def _on_signal(self, signum: int, _frame: Optional[FrameType]) -> None:
        self.received = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)  # a second one during the shutdown ends the process
        raise KeyboardInterrupt(self.received)

    def report(self) -> str:
        """The lines that end the log of a run a signal stopped."""
        return (f"\nrlc.runtime: run stopped by {self.received} (scancel, the job's time limit or a container "
                "stop): the workers were stopped; a restart resumes from the last checkpoint\n")


__all__ = ["EXIT_TERMINATED", "TerminationWatch"]
