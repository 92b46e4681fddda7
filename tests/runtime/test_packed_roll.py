"""The MTP block's one-token left shift of a packed row, whole-row, against the per-sequence shift megatron-core
0.19 does at context parallelism 1 (written out below as its loop does it), on rows with empty sequences, one-token
sequences and tokens past the last boundary."""
from __future__ import annotations

import types

import pytest
import torch

from rlc.runtime.policy import packed_roll
from rlc.runtime.policy.packed_roll import install, roll_packed_left, whole_row_roll


def per_sequence_roll(tensor, shifts, dims, packed_seq_params, cp_group=None):
    """megatron-core 0.19's ``_roll_tensor_packed_seq`` at CP 1: roll each sequence, zero its last position."""
    assert shifts == -1 and dims in (-1, tensor.dim() - 1)
    cu = packed_seq_params.cu_seqlens_q
    rolled = tensor.clone()
    for i in range(len(cu) - 1):
        start, end = int(cu[i]), int(cu[i + 1])
        seq = torch.roll(tensor[..., start:end], shifts=shifts, dims=dims)
        seq[..., shifts:] = 0
        rolled[..., start:end] = seq
    return rolled, rolled.sum()


def packed(cu):
    return types.SimpleNamespace(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))


ROWS = [
    [0, 5, 6, 6, 14],          # a one-token and an empty sequence
    [0, 0, 3, 10],             # an empty first sequence
    [0, 4, 9],                 # 3 positions past the last boundary (a 12-token row)
    [0, 12],                   # one sequence
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],  # twelve one-token sequences
]


@pytest.mark.parametrize("cu", ROWS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.bool])
def test_whole_row_shift_equals_the_per_sequence_shift(cu, dtype):
    gen = torch.Generator().manual_seed(len(cu))
    length = 12 if cu[-1] <= 12 else cu[-1]
    row = torch.randint(1, 50, (2, length), generator=gen)
    row = row.to(dtype) if dtype is not torch.bool else row % 2 == 1
    want, want_sum = per_sequence_roll(row, -1, -1, packed(cu))
    got, got_sum = roll_packed_left(row, packed(cu).cu_seqlens_q)
    assert got.dtype == row.dtype
    assert torch.equal(got, want), (cu, got, want)
    assert torch.equal(got_sum, want_sum)


def test_a_wrong_shift_is_caught_by_the_comparison():
    """The negative control: a plain roll (boundaries ignored) differs from the per-sequence shift."""
    row = torch.arange(1, 13).unsqueeze(0)
    want, _ = per_sequence_roll(row, -1, -1, packed(ROWS[0]))
    assert not torch.equal(torch.roll(row, -1, -1), want)


def test_gradients_flow_like_the_per_sequence_shift():
    cu = packed(ROWS[0])
    x = torch.randn(1, 14, requires_grad=True)
    y = torch.randn(1, 14, requires_grad=True)
    (roll_packed_left(x, cu.cu_seqlens_q)[0] * torch.arange(14.0)).sum().backward()
    (per_sequence_roll(y, -1, -1, cu)[0] * torch.arange(14.0)).sum().backward()
    assert torch.equal(x.grad, y.grad)


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_calls_it_does_not_cover_go_to_the_original():
    calls = []

    def original(tensor, shifts, dims, packed_seq_params, cp_group=None):
        calls.append((shifts, dims, cp_group.size() if cp_group else 1))
        return tensor, tensor.sum()

    roll = whole_row_roll(original)
    row = torch.arange(12.0).unsqueeze(0)
    roll(row, -1, -1, packed(ROWS[2]), None)
    roll(row, -1, 1, packed(ROWS[2]), _Group(1))
    assert calls == []  # both covered
    roll(row, -1, -1, packed(ROWS[2]), _Group(2))  # context parallel
    roll(row, 1, -1, packed(ROWS[2]), None)  # another shift
    roll(row.unsqueeze(-1), -1, 1, packed(ROWS[2]), None)  # not the last dimension
    assert calls == [(-1, -1, 2), (1, -1, 1), (-1, 1, 1)]


def test_install_wraps_once_and_leaves_a_module_without_the_function_alone():
    module = types.ModuleType("mtp")
    module._roll_tensor_packed_seq = per_sequence_roll
    assert install(module) is True
    wrapped = module._roll_tensor_packed_seq
    assert wrapped is not per_sequence_roll and wrapped.rlc_original is per_sequence_roll
    assert install(module) is True and module._roll_tensor_packed_seq is wrapped  # not wrapped twice
    assert install(types.ModuleType("older")) is False
    assert packed_roll.PACKED_ROLL == "_roll_tensor_packed_seq"
