"""One call run in a thread beside the caller's work, its outcome collected later (the vLLM worker wakes its KV
cache this way while the refit's weights arrive, ``refit.wake_kv_during_transfer``)."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable


class BackgroundCall:
    """``fn()`` in a thread from :meth:`start` on; :meth:`join` waits for it and raises what it raised."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self.fn = fn
        self.name = name
        self.seconds = 0.0  # how long fn ran
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by join()
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - t0

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} was started twice")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def join(self, raise_error: bool = True) -> float:
        """Wait for the call (if it was started); returns the seconds the caller waited for it. Raises what the
        call raised unless ``raise_error`` is False."""
        if self._thread is None:
            return 0.0
        t0 = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - t0
        if self.error is not None and raise_error:
            raise RuntimeError(f"{self.name} failed: {self.error}") from self.error
        return waited


__all__ = ["BackgroundCall"]
