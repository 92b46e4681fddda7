"""Completion manifest: every expected tensor arrives exactly once, from the right producer (no torch).

At ``prepare`` time each consumer receives, from *its own* producer, the producer's rank, GPU key
and wire export list. ``ManifestTracker`` checks every bucket's metadata against that before a
single byte is loaded, and checks completeness at the end:

* provenance: the metadata was made by this consumer's producer (rank and GPU key) for this
  refit; metadata from another rank is exactly SkyRL #1816's bug (rank 0's names/offsets used to
  slice every other rank's buffer -> correct bytes under wrong names, no crash);
* every name is expected, not seen before in this refit (exactly once);
* shape, dtype and byte count match the announced spec, and the slice lies inside the buffer
  without overlapping its neighbours; a zero-copy view (each part of a stacked one) lies inside a trainer storage
  the producer shared
  (views of one parameter may overlap: they are only read);
* at the end: nothing missing, and the totals match what the producer says it sent.

Anything else raises ``RefitManifestError`` naming the tensor, the ranks and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rlc.runtime.refit.errors import RefitManifestError
from rlc.runtime.refit.protocol import IN_BUFFER, BucketMeta
from rlc.runtime.refit.specs import TensorSpec

_SEED_003_FIX = (
    "each consumer must slice its own GPU's buffer with the metadata of the producer on that GPU "
    "(refit.per_rank_ipc_metadata: true; SkyRL #1816)"
)


def _names_preview(names: Sequence[str], limit: int = 8) -> str:
    names = list(names)
    head = ", ".join(repr(n) for n in names[:limit])
    return head + (f", ... ({len(names)} in all)" if len(names) > limit else "")


@dataclass(frozen=True)
class ManifestReport:
    """Outcome of a complete, verified refit on one consumer."""

    refit_id: int
    num_tensors: int
    total_bytes: int
    num_buckets: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def expected_by_name(expected: Sequence[TensorSpec]) -> dict[str, TensorSpec]:
    """The announced export list by name; duplicate names are refused."""
    by_name = {s.name: s for s in expected}
    if len(by_name) != len(expected):
        raise RefitManifestError("expected export list has duplicate names")
    return by_name


class ManifestTracker:
    """Checks one refit's buckets against the expected list announced by this consumer's producer."""

    def __init__(self, expected: Sequence[TensorSpec] | Mapping[str, TensorSpec], producer_rank: int, device_key: str,
                 refit_id: int) -> None:
        """``expected``: the announced export list, or the same by name (:func:`expected_by_name`, built once per
        ``prepare``, not per refit: ~19,000 names at 30B MoE scale with per-expert tensors)."""
        self.expected = expected if isinstance(expected, Mapping) else expected_by_name(expected)
        self.producer_rank = producer_rank
        self.device_key = device_key
        self.refit_id = refit_id
        self.seen: dict[str, int] = {}  # name -> bucket index
        self.bytes_seen = 0
        self.buckets_seen = 0
        self._next_index = 0

    def _where(self) -> str:
        return f"consumer of producer rank {self.producer_rank} (GPU {self.device_key}), refit {self.refit_id}"

    def check_bucket(self, meta: BucketMeta, buffer_bytes: int, storages: Mapping[int, int] | None = None) -> None:
        """Validate a bucket's metadata before anything is sliced or loaded; records its names.

        ``storages``: for a bucket of zero-copy views, the trainer storages mapped so far (id -> bytes); every entry
        of such a bucket must lie in one of them, every entry of any other bucket in its buffer."""
        where = self._where()
        if meta.producer_rank != self.producer_rank or meta.device_key != self.device_key:
            raise RefitManifestError(
                f"{where}: bucket {meta.index} carries slicing metadata from producer rank {meta.producer_rank} "
                f"(GPU {meta.device_key}), not from this GPU's producer rank {self.producer_rank} "
                f"(GPU {self.device_key}); slicing this buffer with it would load correct bytes under wrong "
                f"names. First names in that metadata: {_names_preview(meta.names, 4)}. Fix: {_SEED_003_FIX}"
            )
        if meta.refit_id != self.refit_id:
            raise RefitManifestError(f"{where}: bucket {meta.index} belongs to refit {meta.refit_id}")
        if meta.index != self._next_index:
            raise RefitManifestError(f"{where}: bucket {meta.index} arrived, expected bucket {self._next_index}")
        self._next_index += 1
        if meta.buffer_bytes > buffer_bytes:
            raise RefitManifestError(
                f"{where}: bucket {meta.index} metadata describes a {meta.buffer_bytes}-byte buffer but the "
                f"opened buffer has {buffer_bytes} bytes"
            )
        end_prev = 0
        for e in sorted(meta.entries, key=lambda e: e.offset):
            spec = self.expected.get(e.name)
            if spec is None:
                raise RefitManifestError(
                    f"{where}: bucket {meta.index} has tensor {e.name!r}, which producer rank "
                    f"{self.producer_rank} did not announce at prepare. Fix: {_SEED_003_FIX}; if the export "
                    "list changed, call prepare() again"
                )
            if e.name in self.seen:
                raise RefitManifestError(
                    f"{where}: tensor {e.name!r} delivered twice (buckets {self.seen[e.name]} and {meta.index}); "
                    "each tensor must arrive exactly once (NeMo-RL #2471: duplicated MTP embedding -> "
                    "refit.dedupe_mtp_embedding)"
                )
            if tuple(e.shape) != spec.shape or e.dtype != spec.dtype or e.nbytes != spec.nbytes:
                raise RefitManifestError(
                    f"{where}: tensor {e.name!r} in bucket {meta.index} is {e.dtype}{list(e.shape)} "
                    f"({e.nbytes} bytes) but was announced as {spec.dtype}{list(spec.shape)} ({spec.nbytes} bytes)"
                )
            if storages is not None or e.storage != IN_BUFFER:
                self._check_in_storage(meta, e, storages)
                continue
            if e.offset < end_prev or e.offset + e.nbytes > buffer_bytes or e.offset < 0:
                raise RefitManifestError(
                    f"{where}: tensor {e.name!r} at offset {e.offset} (+{e.nbytes}) overlaps its neighbour or "
                    f"runs past the {buffer_bytes}-byte buffer of bucket {meta.index}"
                )
            end_prev = e.offset + e.nbytes
        for e in meta.entries:
            self.seen[e.name] = meta.index
            self.bytes_seen += e.nbytes
        self.buckets_seen += 1

    def _check_in_storage(self, meta: BucketMeta, e: Any, storages: Mapping[int, int] | None) -> None:
        where = f"{self._where()}: tensor {e.name!r} in bucket {meta.index}"
        if storages is None:
            raise RefitManifestError(f"{where} names trainer storage {e.storage}, but the bucket is packed into a "
                                     "buffer: only a zero-copy bucket reads from trainer storages")
        if e.storage == IN_BUFFER:
            raise RefitManifestError(f"{where} names no trainer storage, but a zero-copy bucket has no buffer")
        parts = e.part_locations
        if e.parts and (len(e.parts) % 2 or not e.shape or len(parts) != e.shape[0] or e.nbytes % len(parts)
                        or (e.storage, e.offset) != parts[0]):
            raise RefitManifestError(f"{where} is stacked from {len(e.parts) / 2:g} part(s) in trainer storages, "
                                     f"which does not split its shape {list(e.shape)} ({e.nbytes} bytes) into "
                                     "equal parts along its first dimension starting at the entry's own location")
        nbytes = e.nbytes // len(parts) if parts else e.nbytes  # what each location holds
        for storage, offset in e.locations:
            if storage not in storages:
                raise RefitManifestError(f"{where} is read from trainer storage {storage}, which the producer has "
                                         "not shared")
            size = storages[storage]
            if offset < 0 or offset + nbytes > size:
                raise RefitManifestError(f"{where} at offset {offset} (+{nbytes}) runs past trainer storage "
                                         f"{storage} ({size} bytes)")

    def finish(self, num_buckets: int, num_tensors: int, total_bytes: int) -> ManifestReport:
        """Check completeness against the expected list and the producer's announced totals."""
        where = self._where()
        missing = [n for n in self.expected if n not in self.seen]
        if missing:
            raise RefitManifestError(
                f"{where}: {len(missing)} expected tensor(s) never arrived: {_names_preview(missing)}. The "
                "exporter did not yield them, or they went to another consumer. Fix: " + _SEED_003_FIX
            )
        if (num_buckets, num_tensors, total_bytes) != (self.buckets_seen, len(self.seen), self.bytes_seen):
            raise RefitManifestError(
                f"{where}: producer says it sent {num_buckets} buckets / {num_tensors} tensors / {total_bytes} "
                f"bytes, consumer received {self.buckets_seen} / {len(self.seen)} / {self.bytes_seen}"
            )
        return ManifestReport(self.refit_id, len(self.seen), self.bytes_seen, self.buckets_seen)
