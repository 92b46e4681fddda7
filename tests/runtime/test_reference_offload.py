"""``training.offload_reference_policy`` on CPU tensors: the host copy's bookkeeping and the worker's swap.

:class:`rlc.runtime.policy.host_weights.HostWeights` copies storages once into pinned-style blocks, frees them,
and brings them back for a pass; here the "device" is the CPU and the blocks are plain host tensors, so every
byte can be checked. The worker test runs ``MegatronPolicyWorker.compute_ref_logprobs`` from a compiled
bundle's runtime config with the Megatron forward replaced by a recorder (the one piece that needs a GPU): the
reference weights are on the device during the pass and only then, the trainer's tensors are not touched, and
the pass runs in micro-batches of ``training.logprob_batch_size``.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rlc.contract.host_blocks import pinned_blocks, pinned_bytes  # noqa: E402
from rlc.runtime.policy.host_weights import HostWeights, segments, unique_storages  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KIB = 1024


# --------------------------------------------------------------------------- the layout (pure)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=300), max_size=12), st.sampled_from([16, 64, 128]))
def test_segments_cover_every_byte_of_every_storage_once(sizes, granule):
    blocks = pinned_blocks(sum(sizes), granule)
    pieces = segments(sizes, blocks)
    for index, size in enumerate(sizes):
        mine = [p for p in pieces if p.storage == index]
        assert sum(p.nbytes for p in mine) == size
        assert [p.storage_offset for p in mine] == [sum(p.nbytes for p in mine[:i]) for i in range(len(mine))]
    # the host side: pieces tile the blocks from the start, in order, never past a block's end
    flat = [sum(blocks[:p.block]) + p.block_offset for p in pieces]
    assert flat == [sum(p.nbytes for p in pieces[:i]) for i in range(len(pieces))]
    assert all(p.nbytes > 0 and p.block_offset + p.nbytes <= blocks[p.block] for p in pieces)


def test_a_storage_crossing_a_block_boundary_is_split_there():
    pieces = segments([100, 40], [128, 64])
    assert [(p.storage, p.storage_offset, p.block, p.block_offset, p.nbytes) for p in pieces] == [
        (0, 0, 0, 0, 100), (1, 0, 0, 100, 28), (1, 28, 1, 0, 12)]
    with pytest.raises(ValueError, match="cannot hold"):
        segments([100, 100], [128])


# --------------------------------------------------------------------------- the copy (CPU tensors)


def _module(seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(37, 24), torch.nn.Linear(24, 40), torch.nn.LayerNorm(40),
                            torch.nn.Linear(40, 37, bias=False))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m.to(torch.bfloat16).requires_grad_(False)


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(torch.uint8).flatten().tolist())


def test_swap_in_brings_back_every_byte_and_swap_out_frees_every_storage():
    ref = _module(1)
    before = {n: _raw(p) for n, p in ref.named_parameters()}
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    host = HostWeights(ref.parameters(), pin=False, granule=4 * KIB)
    assert host.nbytes == total and host.host_bytes == pinned_bytes(total, 4 * KIB)
    assert [b.numel() for b in host.blocks] == pinned_blocks(total, 4 * KIB)
    assert host.device_bytes == 0 and all(p.untyped_storage().nbytes() == 0 for p in ref.parameters())
    for _ in range(3):  # round trips stay exact
        assert host.swap_in() == total and host.device_bytes == total
        assert {n: _raw(p) for n, p in ref.named_parameters()} == before
        assert host.swap_in() == 0  # already there: nothing moves
        assert host.swap_out() == total and host.swap_out() == 0
        assert all(p.untyped_storage().nbytes() == 0 for p in ref.parameters())


def test_the_module_computes_the_same_after_a_round_trip():
    ref = _module(2)
    x = torch.randint(0, 37, (3, 5))
    expected = ref(x)
    host = HostWeights(ref.parameters(), pin=False, granule=4 * KIB)
    host.swap_in()
    assert torch.equal(ref(x), expected)


def test_views_and_shared_storages_are_copied_once_and_stay_views():
    base = torch.arange(64, dtype=torch.float32)
    view, other = base[8:24].view(4, 4), torch.linspace(-1, 1, 10, dtype=torch.float64)
    empty = torch.empty(0)
    assert len(unique_storages([base, view, other, empty, base])) == 2
    host = HostWeights([view, base, other, empty], pin=False, granule=64)
    assert host.nbytes == 64 * 4 + 10 * 8
    host.swap_in()
    assert torch.equal(base, torch.arange(64, dtype=torch.float32)) and torch.equal(view, base[8:24].view(4, 4))
    assert view.data_ptr() == base.data_ptr() + 8 * 4
    assert torch.equal(other, torch.linspace(-1, 1, 10, dtype=torch.float64))


def test_other_tensors_are_not_touched():
    """The trainer's weights (here: a second module) keep their storage and bytes through every swap."""
    trainer, ref = _module(3), _module(4)
    before = {n: (_raw(p), p.data_ptr()) for n, p in trainer.named_parameters()}
    host = HostWeights(ref.parameters(), pin=False, granule=4 * KIB)
    host.swap_in()
    host.swap_out()
    assert {n: (_raw(p), p.data_ptr()) for n, p in trainer.named_parameters()} == before


def test_tensors_on_several_devices_are_refused():
    meta = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match="several devices"):
        HostWeights([torch.ones(4), meta], pin=False)


# --------------------------------------------------------------------------- the worker (compiled runtime config)


def _runtime_config(*sets: str) -> dict:
    from rlc.compiler import api, resolve

    result = api.check(ROOT / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml", list(sets))
    assert result.ok, [d.message for d in result.errors]
    return resolve.to_runtime_config(result)


def test_compute_ref_logprobs_swaps_the_reference_in_for_its_pass_only():
    from rlc.runtime.policy.batches import pack_rollouts
    from rlc.runtime.policy.megatron_setup import PolicyModel
    from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker

    cfg = _runtime_config("loss.kl_penalty=0.01", "training.offload_reference_policy=true",
                          "training.logprob_batch_size=3")
    worker = MegatronPolicyWorker(cfg, 0, 1)
    assert worker.cfg.training.offload_reference_policy and worker.cfg.training.logprob_batch_size == 3
    trainer, ref = _module(5), _module(6)
    trainer_bytes = {n: _raw(p) for n, p in trainer.named_parameters()}
    ref_bytes = {n: _raw(p) for n, p in ref.named_parameters()}
    host = HostWeights(ref.parameters(), pin=False, granule=4 * KIB)
    worker._pm = PolicyModel(bridge=None, provider=None, model=[trainer], optimizer=None, ddp_config=None,
                             ref_model=[ref], ref_host=host)
    worker.coords = {"dp_rank": 0, "dp_size": 1, "is_output": True}
    seen: list[tuple[int, int, bool]] = []

    def forward(model, mbs, forward_only, loss_fn):  # stands in for megatron-core's forward-only schedule
        assert model == [ref] and forward_only
        for mb in mbs:
            weights_there = {n: _raw(p) for n, p in ref.named_parameters()} == ref_bytes
            seen.append((int(mb["tokens"].shape[0]), mb["num_real"], weights_there))
        return [torch.zeros(mb["num_real"], mb["tokens"].shape[1] - 1) for mb in mbs]

    worker._run = forward  # type: ignore[method-assign]
    n = 8
    batch = pack_rollouts([[1, 2]] * n, [[3, 4, 5]] * n, [[0.0] * 3] * n, [0.0] * n, pad_id=0)
    out = worker.compute_ref_logprobs(batch)
    assert out.shape == (n, batch.tokens.shape[1] - 1)
    assert seen == [(3, 3, True), (3, 3, True), (3, 2, True)]  # micro-batches of 3, the weights all there
    assert host.device_bytes == 0 and all(p.untyped_storage().nbytes() == 0 for p in ref.parameters())
    assert {n: _raw(p) for n, p in trainer.named_parameters()} == trainer_bytes
    swap = worker.last_reference_swap
    assert swap["bytes_in"] == swap["bytes_out"] == host.nbytes and swap["host_bytes"] == host.host_bytes


def test_a_failing_pass_still_frees_the_reference():
    from rlc.runtime.policy.batches import pack_rollouts
    from rlc.runtime.policy.megatron_setup import PolicyModel
    from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker

    cfg = _runtime_config("loss.kl_penalty=0.01", "training.offload_reference_policy=true")
    worker = MegatronPolicyWorker(cfg, 0, 1)
    ref = _module(7)
    host = HostWeights(ref.parameters(), pin=False, granule=4 * KIB)
    worker._pm = PolicyModel(bridge=None, provider=None, model=[], optimizer=None, ddp_config=None,
                             ref_model=[ref], ref_host=host)

    def broken(model, batch, truncation):
        assert host.device_bytes == host.nbytes
        raise RuntimeError("CUDA out of memory")

    worker._logprobs = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="out of memory"):
        worker.compute_ref_logprobs(pack_rollouts([[1, 2]], [[3]], [[0.0]], [0.0], pad_id=0))
    assert host.device_bytes == 0
