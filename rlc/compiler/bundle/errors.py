"""Errors of the bundle writer."""
from __future__ import annotations


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
