"""The pinned host blocks of a weight copy: powers of two (PyTorch's pinned allocator rounds nothing up), less
than one granule above the bytes they hold, few of them; the runtime allocates these sizes, the planner sums them."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlc.contract.host_blocks import GRANULE, pinned_blocks, pinned_bytes


def power_of_two_ceil(n: int) -> int:
    """PyTorch's ``c10::llvm::PowerOf2Ceil``, the size its pinned allocator hands out for ``n`` bytes."""
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 44))
def test_blocks_are_powers_of_two_that_hold_the_bytes_with_less_than_a_granule_spare(nbytes):
    blocks = pinned_blocks(nbytes)
    assert all(power_of_two_ceil(b) == b >= GRANULE for b in blocks)
    assert blocks == sorted(blocks, reverse=True) and len(set(blocks)) == len(blocks)
    total = pinned_bytes(nbytes)
    assert total == sum(blocks) and nbytes <= total < nbytes + GRANULE
    assert len(blocks) <= max(1, (total // GRANULE).bit_length())
    # what the allocator hands out for these blocks is what the plan counts: nothing rounded up
    assert sum(power_of_two_ceil(b) for b in blocks) == total


def test_a_single_pinned_tensor_would_round_up_where_the_blocks_do_not():
    nbytes = 402_817_024  # a 0.2B bf16 reference policy
    assert power_of_two_ceil(nbytes) == 512 << 20  # 27 % more host memory
    assert pinned_bytes(nbytes) == 193 * GRANULE  # 404,750,336: 0.5 % more
    assert pinned_blocks(nbytes) == [256 << 20, 128 << 20, 2 << 20]


def test_edge_sizes():
    assert pinned_blocks(0) == [] and pinned_bytes(0) == 0
    assert pinned_blocks(1) == [GRANULE] and pinned_blocks(GRANULE) == [GRANULE]
    assert pinned_blocks(GRANULE + 1) == [2 * GRANULE]
    assert pinned_blocks(3 * GRANULE) == [2 * GRANULE, GRANULE]
    assert pinned_blocks(100, granule=64) == [128]
    with pytest.raises(ValueError, match="granule"):
        pinned_blocks(10, granule=3)
    with pytest.raises(ValueError):
        pinned_blocks(-1)
