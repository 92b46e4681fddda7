"""Suite-wide hooks: the CI skip guard (``skip_guard``: with RLC_STRICT_SKIPS=1 an unexpected skip fails the run)."""
from __future__ import annotations

from skip_guard import pytest_runtest_logreport, pytest_sessionfinish  # noqa: F401 - pytest hooks
