"""Fixtures of the bundle tests (helpers live in bundle_helpers.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from bundle_helpers import E2E_RECIPE


@pytest.fixture
def e2e_recipe() -> Path:
    """The 2-node test recipe (tests/slurm/recipes/e2e-2node.yaml)."""
    return E2E_RECIPE
