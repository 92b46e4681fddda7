"""Errors of the bundle writer."""
from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")


class BundleError(Exception):
    """A recipe value or an output folder that stops the bundle from being written.

    ``key`` is the recipe key path at fault (``None`` for IO problems). ``kind`` is ``"recipe"``
    (the CLI exits 1) or ``"io"`` (exit 2: existing non-bundle folder, unwritable place).
    The message always says what to change.
    """

    def __init__(self, message: str, key: str | None = None, kind: str = "recipe") -> None:
        if kind not in ("recipe", "io"):
            raise ValueError(f"unknown BundleError kind {kind!r}")
        self.key, self.kind = key, kind
        super().__init__(message)

    @property
    def exit_code(self) -> int:
        """1 for recipe problems, 2 for IO problems (the ``rlc`` exit-code convention)."""
        return 1 if self.kind == "recipe" else 2


class Problems(list):
    """The bundle-stage problems of one recipe, collected so that every one is reported at once.

    Each check runs through :meth:`attempt`: a :class:`BundleError` it raises is kept and the next
    check still runs. :meth:`raise_first` turns the collection back into an exception for callers
    that write a bundle (the CLI has reported them all by then, through ``rlc.compiler.api.check``).
    """

    def attempt(self, check: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``check(*args, **kwargs)``, or ``None`` after recording the :class:`BundleError` it raised."""
        try:
            return check(*args, **kwargs)
        except BundleError as exc:
            self.append(exc)
            return None

    def raise_first(self) -> None:
        """Raise the first problem, if any."""
        if self:
            raise self[0]
