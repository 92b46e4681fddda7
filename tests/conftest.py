"""Suite-wide hooks: the CI skip guard (``skip_guard``: with RLC_STRICT_SKIPS=1 an unexpected skip fails the run),
and model facts that never depend on this machine: no Hub request (``HF_HUB_OFFLINE``) and an empty Hugging Face
cache, so a developer's own cache cannot change what a test plans."""
from __future__ import annotations

import os
import tempfile

from tests.skip_guard import pytest_runtest_logreport, pytest_sessionfinish  # noqa: F401 - pytest hooks


def pytest_configure(config):
    """Before collection (some modules compile recipes at import): no Hub, an empty cache. A run of only the GPU
    tests keeps the host's own Hugging Face settings; a run that mixes them with other folders does not (the CPU
    tests among them expect no Hub and an empty cache whatever else runs)."""
    if config.args and all("tests/gpu" in str(arg) for arg in config.args):
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="rlc-test-hf-cache-")
