"""Fixtures of the planner/rules tests."""
from __future__ import annotations

import pytest

from rlc.compiler import catalog

from planner_helpers import BASE, RECIPES, load


@pytest.fixture(scope="session")
def qwen397():
    return catalog.model_facts("Qwen/Qwen3.5-397B-A17B", RECIPES)


@pytest.fixture(scope="session")
def h100():
    return catalog.gpu_spec("h100-80gb")


@pytest.fixture(scope="session")
def base_recipe():
    return load(BASE)[0]
