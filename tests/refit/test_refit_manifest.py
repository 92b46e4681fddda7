"""Completion manifest and message framing (pure Python; metadata built by the real planner)."""
from __future__ import annotations

import dataclasses

import pytest

from rlc.runtime.refit.bucket_planner import plan_refit
from rlc.runtime.refit.errors import RefitManifestError, RefitProtocolError
from rlc.runtime.refit.manifest import ManifestTracker
from rlc.runtime.refit.protocol import BucketMeta, BucketMsg, BufferRef, EntryMeta, Hello, decode, encode
from rlc.runtime.refit.specs import TensorSpec

HALF = 4096


def _rank_specs(rank: int) -> list[TensorSpec]:
    """Two ranks with different tensors (names differ per EP rank) and different orders, same sizes."""
    experts = [0, 1, 2, 3] if rank == 0 else [7, 5, 6, 4]
    specs = [TensorSpec(f"layers.{rank}.experts.{e}.w", (16, 32), "bfloat16") for e in experts]
    specs.append(TensorSpec(f"layers.{rank}.gate.e_score_correction_bias", (8,), "float32"))
    return specs


def _metas(rank: int, refit_id: int = 1) -> tuple[list[TensorSpec], list[BucketMeta]]:
    specs = _rank_specs(rank)
    plan = plan_refit(specs, 1 << 30, buffer_memory_ratio=None, buffer_gb=2 * HALF / (1 << 30), alignment_bytes=256)
    metas = [
        BucketMeta(
            refit_id=refit_id,
            index=b.index,
            slot=b.slot,
            producer_rank=rank,
            device_key=f"GPU-{rank}",
            buffer_bytes=b.buffer_bytes,
            entries=[
                EntryMeta(e.spec.name, e.offset, list(e.spec.shape), e.spec.dtype, e.spec.nbytes) for e in b.entries
            ],
        )
        for b in plan.buckets
    ]
    return specs, metas


def _tracker(rank: int, refit_id: int = 1) -> ManifestTracker:
    return ManifestTracker(_rank_specs(rank), rank, f"GPU-{rank}", refit_id)


def _totals(metas):
    return len(metas), sum(len(m.entries) for m in metas), sum(m.nbytes for m in metas)


def test_own_metadata_passes_and_counts_every_byte():
    specs, metas = _metas(1)
    assert len(metas) >= 2
    t = _tracker(1)
    for m in metas:
        t.check_bucket(m, HALF)
    report = t.finish(*_totals(metas))
    assert report.num_tensors == len(specs) and report.total_bytes == sum(s.nbytes for s in specs)


def test_swapped_rank_metadata_is_caught_before_loading():
    """SkyRL #1816: consumer of rank 0 slicing with rank 1's metadata (and vice versa)."""
    _, metas0 = _metas(0)
    _, metas1 = _metas(1)
    for tracker, foreign in ((_tracker(0), metas1), (_tracker(1), metas0)):
        with pytest.raises(RefitManifestError) as exc:
            tracker.check_bucket(foreign[0], HALF)
        msg = str(exc.value)
        assert f"from producer rank {foreign[0].producer_rank}" in msg
        assert "per_rank_ipc_metadata" in msg and foreign[0].entries[0].name in msg


def test_foreign_names_are_caught_even_with_forged_provenance():
    """The name check stands on its own: rank 1's slicing relabelled as rank 0's still fails."""
    _, metas1 = _metas(1)
    forged = dataclasses.replace(metas1[0], producer_rank=0, device_key="GPU-0")
    with pytest.raises(RefitManifestError, match=r"did not announce at prepare"):
        _tracker(0).check_bucket(forged, HALF)


@pytest.mark.parametrize("forge", ["device_key", "producer_rank"])
def test_provenance_is_checked_on_rank_and_gpu_separately(forge):
    """A bucket with this rank's own names but another GPU's key (or another rank on this GPU) is
    refused: a consumer must never slice a buffer announced for a different device."""
    _, metas = _metas(0)
    other = {"device_key": "GPU-7", "producer_rank": 7}[forge]
    forged = dataclasses.replace(metas[0], **{forge: other})
    with pytest.raises(RefitManifestError) as exc:
        _tracker(0).check_bucket(forged, HALF)
    assert "carries slicing metadata from producer rank" in str(exc.value) and str(other) in str(exc.value)
    _tracker(0).check_bucket(metas[0], HALF)  # the unforged bucket passes


def test_duplicate_tensor_is_caught():
    _, metas = _metas(0)
    t = _tracker(0)
    t.check_bucket(metas[0], HALF)
    dup = dataclasses.replace(metas[0], index=1)
    with pytest.raises(RefitManifestError, match="delivered twice"):
        t.check_bucket(dup, HALF)


def test_missing_tensor_is_caught_at_the_end():
    _, metas = _metas(0)
    t = _tracker(0)
    for m in metas[:-1]:
        t.check_bucket(m, HALF)
    with pytest.raises(RefitManifestError, match=r"never arrived: 'layers.0"):
        t.finish(*_totals(metas[:-1]))


def test_wrong_byte_count_or_dtype_is_caught():
    _, metas = _metas(0)
    e = metas[0].entries[0]
    for bad in (e._replace(nbytes=e.nbytes - 2), e._replace(dtype="float16")):
        m = dataclasses.replace(metas[0], entries=[bad, *metas[0].entries[1:]])
        with pytest.raises(RefitManifestError, match="was announced as bfloat16"):
            _tracker(0).check_bucket(m, HALF)


def test_overlap_and_out_of_bounds_are_caught():
    _, metas = _metas(0)
    a, b = metas[0].entries[:2]
    overlapping = dataclasses.replace(metas[0], entries=[a, b._replace(offset=a.offset + 2)])
    with pytest.raises(RefitManifestError, match="overlaps"):
        _tracker(0).check_bucket(overlapping, HALF)
    last = metas[0].entries[-1]
    past = dataclasses.replace(metas[0], entries=[*metas[0].entries[:-1], last._replace(offset=HALF - 256)])
    with pytest.raises(RefitManifestError, match="runs past"):
        _tracker(0).check_bucket(past, HALF)
    with pytest.raises(RefitManifestError, match="describes a 4096-byte buffer"):
        _tracker(0).check_bucket(metas[0], HALF - 256)


def test_out_of_order_stale_refit_and_wrong_totals_are_caught():
    _, metas = _metas(0)
    with pytest.raises(RefitManifestError, match="expected bucket 0"):
        _tracker(0).check_bucket(metas[1], HALF)
    with pytest.raises(RefitManifestError, match="belongs to refit 1"):
        _tracker(0, refit_id=2).check_bucket(metas[0], HALF)
    t = _tracker(0)
    for m in metas:
        t.check_bucket(m, HALF)
    n, k, nbytes = _totals(metas)
    with pytest.raises(RefitManifestError, match="producer says it sent"):
        t.finish(n, k, nbytes + 1)


def test_bucket_message_round_trip_with_handle_payload():
    _, metas = _metas(0)
    msg = BucketMsg(meta=metas[0], open=BufferRef(slot=0, nbytes=HALF, backend="cuda_ipc", device_key="GPU-0"))
    frames = encode(msg, b"\x80handle")
    assert frames[0].startswith(b"{")  # JSON header, no pickle
    back, payload = decode(frames)
    assert back == msg and payload == b"\x80handle"


def test_decode_rejects_unknown_fields_and_kinds():
    frames = encode(Hello(1, "s", 0, "k", "shm", 1, [], 0, None, "bfloat16", []))
    tampered = frames[0].replace(b'"session"', b'"sessionx"')
    with pytest.raises(RefitProtocolError, match="unknown fields"):
        decode([tampered])
    with pytest.raises(RefitProtocolError, match="undecodable"):
        decode([b'{"kind":"nope"}'])
