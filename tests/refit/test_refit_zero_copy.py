"""Zero-copy views (``refit.zero_copy_views``): the consumer reads views of the trainer's parameters where the
trainer holds them, instead of out of the producer's buffers.

Across real processes over shared memory: the synthetic trainer holds the tiny dense model's parameters as views of
two shared segments (as Megatron's DDP holds them in contiguous buffers); the consumer maps the segments once and
loads from them, through the engine's own loader or the replayed load, and must end bit for bit where the packed
refit ends. Then: a parameter moved to a new buffer between refits, mappings closed after every refit, a loader
that keeps what it is handed, and the checks on each end.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from rlc.runtime.refit.bucket_planner import SLOT_ZERO_COPY
from rlc.runtime.refit.errors import RefitManifestError
from rlc.runtime.refit.manifest import ManifestTracker
from rlc.runtime.refit.protocol import BucketMeta, BucketMsg, EntryMeta, Share, StorageRef, decode, encode
from rlc.runtime.refit.sources import RowsOf
from rlc.runtime.refit.specs import TensorSpec
from tests.refit import harness as H

STEPS = 3
#: 2 KiB halves: the embedding, the LM head and the MLP projections need one-off buffers when they are packed.
SMALL_HALVES = {"buffer_gb": 4096 / (1 << 30)}
#: Packed on the wire, not read in place: exported in fp32, they travel in bf16.
CONVERTED = {"model.layers.0.mlp.router_bias", "model.layers.1.mlp.router_bias", "model.rotary_emb.inv_freq"}


def _run(pool, *, replay: bool, zero_copy: bool, steps: int = STEPS, consumer: dict | None = None, **producer):
    s = f"zc-{uuid.uuid4().hex[:8]}"
    fc = pool.submit(H.dense_consumer_main, {"session": s, "replay": replay, "steps": steps, **(consumer or {})})
    fp = pool.submit(H.model_producer_main, {"model": "dense", "session": s, "steps": steps, "zero_copy": zero_copy,
                                             "cfg": SMALL_HALVES, "zero_copy_bucket_bytes": 8192, **producer})
    return fp.result(timeout=90), fc.result(timeout=90)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


@pytest.mark.parametrize("replay", [False, True], ids=["loader", "replayed"])
def test_views_read_in_place_leave_the_engine_where_the_packed_refit_does(pool, replay):
    packed_p, packed_c = map(H.ok, _run(pool, replay=replay, zero_copy=False))
    zero_p, zero_c = map(H.ok, _run(pool, replay=replay, zero_copy=True))
    for step in range(STEPS):
        assert _same(zero_c["params"][step], packed_c["params"][step]) == [], step
    specs = H.dense_specs()
    assert set(zero_p["zero_copy"]) == {s.name for s in specs} - CONVERTED
    larger_than_a_half = [s.name for s in specs if s.nbytes > 2048]  # embedding, LM head, MLP projections
    assert packed_p["metrics"][0]["num_oneoff_buckets"] == len(larger_than_a_half) > 0
    for step, (m, c) in enumerate(zip(zero_p["metrics"], zero_c["metrics"])):
        assert m["zero_copy_tensors"] == len(specs) - len(CONVERTED) == c["zero_copy_tensors"]
        assert m["num_oneoff_buckets"] == 0  # nothing larger than a half is packed any more
        assert m["num_tensors"] == len(specs) and m["bytes"] == packed_p["metrics"][step]["bytes"]
        assert m["storages_shared"] == (2 if step == 0 else 0)  # the trainer's two buffers, shared once
        assert c["storages_opened"] == (2 if step == 0 else 0) and c["storages_kept"] == 2
        # the views travel in buckets of their own, one per 8 KiB of views (zero_copy_bucket_bytes), plus the last
        assert m["num_buckets"] == c["num_buckets"] > m["zero_copy_bytes"] // 8192 >= 4
    if replay:
        assert zero_c["stats"][-1]["direct_tensors"] == packed_c["stats"][-1]["direct_tensors"] > 0


def test_a_parameter_moved_to_a_new_buffer_is_shared_again_and_the_old_mapping_closed(pool):
    moved = {"model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight"}
    packed = H.ok(_run(pool, replay=True, zero_copy=False)[1])
    p, c = map(H.ok, _run(pool, replay=True, zero_copy=True, move_at={1: sorted(moved)}))
    assert [m["storages_shared"] for m in p["metrics"]] == [2, 1, 0]
    assert [m["storages_opened"] for m in c["metrics"]] == [2, 1, 0]
    assert [m["storages_kept"] for m in c["metrics"]] == [2, 3, 3]  # both old buffers still hold other parameters
    for step in range(STEPS):
        assert _same(c["params"][step], packed["params"][step]) == [], step


def test_mappings_not_kept_are_closed_after_every_refit(pool):
    p, c = map(H.ok, _run(pool, replay=False, zero_copy=True, keep_storages=False))
    assert [m["storages_shared"] for m in p["metrics"]] == [2, 2, 2]
    assert [(m["storages_opened"], m["storages_kept"]) for m in c["metrics"]] == [(2, 0)] * STEPS


def test_a_loader_that_keeps_a_view_of_the_trainers_memory_stops_the_refit(pool):
    p, c = _run(pool, replay=False, zero_copy=True, steps=1, consumer={"keep_views": True})
    assert not c["ok"] and c["error_type"] == "RefitLeakError"
    assert "still referenced" in c["error"]
    assert not p["ok"]  # the producer hears of it


def test_the_producer_refuses_a_tensor_it_cannot_describe_in_place():
    from rlc.runtime.refit.zero_copy import why_not_zero_copy

    spec = TensorSpec("w", (4, 6), "bfloat16")
    base = torch.zeros(6, 4, dtype=torch.bfloat16)
    cpu = torch.device("cpu")
    assert why_not_zero_copy(base.t().contiguous(), spec.dtype, cpu) is None
    assert "not contiguous" in why_not_zero_copy(base.t(), spec.dtype, cpu)
    assert "travels as bfloat16" in why_not_zero_copy(torch.zeros(4, 6), spec.dtype, cpu)
    rows = RowsOf(torch.zeros(8, 6, dtype=torch.bfloat16), torch.arange(4))
    assert "not a plain tensor" in why_not_zero_copy(rows, spec.dtype, cpu)
    assert "not on" in why_not_zero_copy(torch.zeros(4, 6, dtype=torch.bfloat16, device="meta"), spec.dtype, cpu)


def _meta(index: int, slot: int, entries: list[EntryMeta]) -> BucketMeta:
    return BucketMeta(refit_id=1, index=index, slot=slot, producer_rank=0, device_key="k", buffer_bytes=0 if
                      slot == SLOT_ZERO_COPY else 4096, entries=entries)


def test_the_manifest_checks_where_a_zero_copy_view_is_read_from():
    specs = [TensorSpec("a", (4,), "bfloat16"), TensorSpec("b", (4,), "bfloat16"), TensorSpec("c", (4,), "bfloat16")]
    tracker = ManifestTracker(specs, 0, "k", 1)
    # two views of the same bytes of one storage are fine (they are only read)
    tracker.check_bucket(_meta(0, SLOT_ZERO_COPY, [EntryMeta("a", 0, [4], "bfloat16", 8, 3),
                                                   EntryMeta("b", 0, [4], "bfloat16", 8, 3)]), 0, {3: 64})
    with pytest.raises(RefitManifestError, match="trainer storage 5, which the producer has not shared"):
        tracker.check_bucket(_meta(1, SLOT_ZERO_COPY, [EntryMeta("c", 0, [4], "bfloat16", 8, 5)]), 0, {3: 64})
    for meta, storages, match in (
            (_meta(1, SLOT_ZERO_COPY, [EntryMeta("c", 60, [4], "bfloat16", 8, 3)]), {3: 64}, "runs past"),
            (_meta(1, SLOT_ZERO_COPY, [EntryMeta("c", 0, [4], "bfloat16", 8)]), {3: 64}, "has no buffer"),
            (_meta(1, 0, [EntryMeta("c", 0, [4], "bfloat16", 8, 3)]), None, "packed into a buffer")):
        with pytest.raises(RefitManifestError, match=match):
            ManifestTracker(specs, 0, "k", 1).check_bucket(replace_index(meta, 0), meta.buffer_bytes, storages)


def test_the_manifest_checks_every_part_of_a_stacked_view():
    specs = [TensorSpec("s", (3, 4), "bfloat16"), TensorSpec("t", (2, 4), "bfloat16")]
    ManifestTracker(specs, 0, "k", 1).check_bucket(  # three parts of 8 bytes in two storages, in any order
        _meta(0, SLOT_ZERO_COPY, [EntryMeta("s", 16, [3, 4], "bfloat16", 24, 3, (3, 16, 4, 0, 3, 0))]), 0,
        {3: 64, 4: 8})
    for entry, match in (
            (EntryMeta("s", 16, [3, 4], "bfloat16", 24, 3, (3, 16, 5, 0, 3, 0)), "storage 5, which the producer"),
            (EntryMeta("s", 16, [3, 4], "bfloat16", 24, 3, (3, 16, 4, 4, 3, 0)), r"offset 4 \(\+8\) runs past"),
            (EntryMeta("s", 16, [3, 4], "bfloat16", 24, 3, (3, 16, 4, 0)), r"2 part\(s\)"),
            (EntryMeta("s", 0, [3, 4], "bfloat16", 24, 3, (3, 16, 4, 0, 3, 0)), "entry's own location")):
        with pytest.raises(RefitManifestError, match=match):
            ManifestTracker(specs, 0, "k", 1).check_bucket(_meta(0, SLOT_ZERO_COPY, [entry]), 0, {3: 64, 4: 8})


def test_a_stack_read_in_place_offers_what_the_fused_copies_ask_of_a_tensor():
    from rlc.runtime.refit.fused import unfuse
    from rlc.runtime.refit.zero_copy import StackedViews

    parts = [torch.arange(12, dtype=torch.float32).reshape(4, 3) + 100 * e for e in range(3)]
    stack, whole = StackedViews(parts), torch.stack(parts)
    assert stack.shape == whole.shape and stack.dtype == whole.dtype
    sliced = stack.narrow(0, 1, 2).narrow(1, 2, 2)  # experts 1-2, rows 2-3: what a tensor-parallel route takes
    assert torch.equal(torch.stack(sliced.parts), whole.narrow(0, 1, 2).narrow(1, 2, 2))
    dst = torch.zeros(2, 2, 3)
    for d, src in sliced.copies_into(dst):
        d.copy_(src)
    assert torch.equal(dst, whole[1:3, 2:4]) and sliced.parts[0].data_ptr() == parts[1][2:].data_ptr()  # no copy
    name = "model.layers.0.mlp.experts.fused_w2"  # [experts, hidden, intermediate]: one down_proj per expert
    split, reference = unfuse(name, stack), unfuse(name, whole)  # what the engine's loader gets, per expert
    assert [n for n, _ in split] == [n for n, _ in reference] and len(split) == 3
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(split, reference))
    assert [t.data_ptr() for _, t in split] == [p.data_ptr() for p in parts]  # views of the parts, no copy
    with pytest.raises(ValueError, match="copied into"):
        stack.copies_into(torch.zeros(3, 4, 4))


def replace_index(meta: BucketMeta, index: int) -> BucketMeta:
    return BucketMeta(meta.refit_id, index, meta.slot, meta.producer_rank, meta.device_key, meta.buffer_bytes,
                      meta.entries)


def test_share_messages_and_storage_columns_cross_the_wire():
    msg, payload = decode(encode(Share(StorageRef(7, 4096, "shm", "k")), b"handle"))
    assert msg == Share(StorageRef(7, 4096, "shm", "k")) and payload == b"handle"
    meta = _meta(2, SLOT_ZERO_COPY, [EntryMeta("a", 256, [4], "bfloat16", 8, 7), EntryMeta("b", 0, [2], "float32", 8),
                                     EntryMeta("s", 64, [2, 2], "bfloat16", 8, 7, (7, 64, 8, 0))])
    got, _ = decode(encode(BucketMsg(meta=meta)))
    assert isinstance(got, BucketMsg) and got.meta == meta
    assert [e.storage for e in got.meta.entries] == [7, -1, 7]
    assert [e.part_locations for e in got.meta.entries] == [[], [], [(7, 64), (8, 0)]]


def test_the_shm_backend_shares_only_its_own_segments():
    from rlc.runtime.refit.buffers import ShmBackend
    from rlc.runtime.refit.errors import RefitProtocolError

    backend = ShmBackend("k")
    segment, _ = backend.allocate(1024, "trainer")
    try:
        param = segment.tensor[256:512].view(torch.bfloat16)
        nbytes, payload = backend.share(param)
        mapped = backend.open_shared(StorageRef(0, nbytes, "shm", "k"), payload, "mapped")
        param.copy_(torch.arange(128, dtype=torch.bfloat16))
        assert torch.equal(mapped.view(256, 256, (128,), torch.bfloat16, track=False), param)
        mapped.close()
        with pytest.raises(RefitProtocolError, match="only segments this process allocated"):
            backend.share(torch.zeros(4))
    finally:
        segment.close()


@pytest.mark.parametrize("keep", [True, False])
def test_the_producers_storage_table_shares_each_storage_once_while_it_is_kept(keep):
    from rlc.runtime.refit.buffers import ShmBackend
    from rlc.runtime.refit.zero_copy import SharedStorages

    backend = ShmBackend("k")
    a, _ = backend.allocate(1024, "a")
    b, _ = backend.allocate(1024, "b")
    try:
        table = SharedStorages(backend, keep=keep)
        first, ref, payload = table.id_of(a.tensor[0:8])
        assert ref is not None and ref.storage == first and ref.nbytes == 1024 and payload
        assert table.id_of(a.tensor[512:520]) == (first, None, None)  # another view of the same storage
        second, ref, _ = table.id_of(b.tensor[0:8])
        assert ref is not None and second != first
        assert table.end_refit({first}) == ([first] if keep else [])
        again, ref, _ = table.id_of(a.tensor[0:8])  # shared anew only when the consumer closed its mapping
        if keep:
            assert (again, ref) == (first, None)
        else:
            assert ref is not None and again not in (first, second)
        assert table.id_of(b.tensor[0:8])[1] is not None  # not read last refit: closed, shared again
    finally:
        a.close()
        b.close()
