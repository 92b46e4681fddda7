"""One refit buffer formula: the planner predicts the half the runtime allocates."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import dataclasses

from rlc.compiler.planner.refit_math import _per_side
from rlc.compiler.recipe_types import RefitSection, section_from_data
from rlc.compiler.schema import with_defaults
from rlc.contract.refit_buffer import GIB, align_down, align_up, half_bytes
from rlc.runtime.refit.bucket_planner import size_buffers


#: The recipe's refit section with every schema default (each test sets the sizing keys it varies).
REFIT = section_from_data(RefitSection, with_defaults({"refit": {}})["refit"], "refit")


@settings(max_examples=200, deadline=None)
@given(free=st.integers(min_value=1, max_value=200 * GIB), ratio=st.floats(min_value=0.001, max_value=0.95),
       align_exp=st.integers(min_value=0, max_value=21))
def test_planner_and_runtime_size_the_same_half_from_a_ratio(free, ratio, align_exp):
    align = 1 << align_exp
    refit = dataclasses.replace(REFIT, buffer_memory_ratio=ratio, buffer_gb=None, alignment_bytes=align)
    predicted, _, _ = _per_side(free, refit)
    allocated = size_buffers(free, buffer_memory_ratio=ratio, buffer_gb=None, alignment=align).configured_half_bytes
    assert predicted == allocated == half_bytes(free, buffer_memory_ratio=ratio, buffer_gb=None, alignment=align)
    assert predicted % align == 0 and 2 * predicted <= free * ratio


@settings(max_examples=100, deadline=None)
@given(gb=st.floats(min_value=0.01, max_value=60.0), align_exp=st.integers(min_value=0, max_value=21))
def test_planner_and_runtime_size_the_same_half_from_buffer_gb(gb, align_exp):
    align = 1 << align_exp
    free = 100 * GIB
    refit = dataclasses.replace(REFIT, buffer_gb=gb, alignment_bytes=align)  # buffer_gb wins over the ratio
    predicted, _, _ = _per_side(free, refit)
    allocated = size_buffers(free, buffer_memory_ratio=None, buffer_gb=gb, alignment=align).configured_half_bytes
    assert predicted == allocated


def test_alignment_helpers():
    assert align_up(257, 256) == 512 and align_down(511, 256) == 256 and align_up(0, 256) == 0
