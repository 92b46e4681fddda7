"""One refit on the consumer's side (:meth:`RefitConsumer.receive <rlc.runtime.refit.consumer.RefitConsumer.receive>`):
the buffers and trainer storages it opens, the manifest it checks every bucket against, the loads, and its metrics.
The protocol and its ordering rules are described in :mod:`rlc.runtime.refit.consumer`."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from rlc.runtime.refit.buffers import Buffer, torch_dtype
from rlc.runtime.refit.bucket_planner import SLOT_ONEOFF, SLOT_ZERO_COPY, event_slot
from rlc.runtime.refit.channel import Channel
from rlc.runtime.refit.errors import RefitError, RefitProtocolError, RefitTimeoutError
from rlc.runtime.refit.manifest import ManifestTracker
from rlc.runtime.refit.metrics import ConsumerMetrics
from rlc.runtime.refit.protocol import (
    Ack,
    Begin,
    BucketMeta,
    BucketMsg,
    Done,
    End,
    EntryMeta,
    Share,
)
from rlc.runtime.refit.zero_copy import StackedViews

if TYPE_CHECKING:
    from rlc.runtime.refit.consumer import LoadWeights, RefitConsumer


class ConsumerRun:
    """State of one ``receive``: opened buffers, manifest, metrics."""

    def __init__(self, consumer: RefitConsumer, load_weights: LoadWeights, copy_buckets: bool = False,
                 on_begin: Callable[[], None] | None = None) -> None:
        self.c = consumer
        self.copy_buckets = copy_buckets
        self.on_begin = on_begin
        assert consumer._chan is not None and consumer._hello is not None  # the caller checked prepare() ran
        self.chan: Channel = consumer._chan
        self.hello = consumer._hello
        self.load_weights = load_weights
        # Mappings kept from the previous refit belong to this one until it ends well.
        self.buffers: dict[int, Buffer] = consumer._kept
        consumer._kept = {}

    def execute(self) -> ConsumerMetrics:
        c, hello = self.c, self.hello
        msg, _ = self.chan.recv("the producer's begin (is the trainer rank on this GPU calling send?)")
        if not isinstance(msg, Begin) or msg.refit_id <= c._last_refit_id:
            raise RefitProtocolError(f"{c.name}: expected begin of a new refit, got {msg}")
        refit_id = msg.refit_id
        c._last_refit_id = refit_id
        t_start = time.perf_counter()
        # both ends order the buckets on the device only when the producer says it does (it opened our events)
        ordered = msg.device_ordered and c.device_ordered
        if msg.device_ordered and not ordered:
            raise RefitProtocolError(f"{c.name}: the producer orders the buckets with device events this consumer "
                                     "has not paired")
        m = ConsumerMetrics(refit_id=refit_id, producer_rank=hello.producer_rank, device_key=c.device_key,
                            device_ordered=ordered)
        tracker = ManifestTracker(c._expected_by_name, hello.producer_rank, hello.device_key, refit_id)
        foreign = hello.metadata_source_rank != hello.producer_rank
        c._emit("begin", 0)
        if self.on_begin is not None:
            self.on_begin()
        while True:
            t0 = time.perf_counter()
            msg, payload = self.chan.recv(f"bucket {m.num_buckets} or end of refit {refit_id}")
            m.wait_seconds += time.perf_counter() - t0
            if isinstance(msg, End):  # sent right behind the last bucket: read only once every bucket is acked
                break
            if isinstance(msg, Share):
                self._open_storage(msg, payload, m)
                continue
            if not isinstance(msg, BucketMsg):
                raise RefitProtocolError(f"{c.name}: expected a bucket, got {msg.kind!r}")
            own = msg.meta
            c._emit("recv", own.index)
            # The buffer is always this GPU's; the metadata is this GPU's producer's unless the
            # legacy/fault-injection mode points elsewhere (then the manifest check must catch it).
            meta = c._foreign_meta(refit_id, own.index) if foreign else own
            if own.slot == SLOT_ZERO_COPY:  # frees no buffer: not acked (Done covers it)
                loaded = self._load_zero_copy(meta, own.index, tracker, ordered, m)
            else:
                loaded = self._load_packed(msg, payload, meta, tracker, ordered, m)
                c._emit("ack", own.index)  # before sending, so a cross-process event log stays causal
                self.chan.send(Ack(refit_id=refit_id, index=own.index, loaded_bytes=loaded))
            m.num_buckets += 1
            m.num_tensors += len(meta.entries)
            m.bytes += loaded
        c._emit("end", m.num_buckets - 1)
        if msg.refit_id != refit_id:
            raise RefitProtocolError(f"{c.name}: end of refit {msg.refit_id} during refit {refit_id}")
        unknown = [s for s in msg.kept_slots if s not in (0, 1) or s not in self.buffers]
        if unknown:
            raise RefitProtocolError(f"{c.name}: the producer keeps slot(s) {unknown}, which this consumer has not opened")
        unmapped = [s for s in msg.kept_storages if s not in c._storages]
        if unmapped:
            raise RefitProtocolError(f"{c.name}: the producer keeps storage(s) {unmapped}, which this consumer has not "
                                     "mapped")
        t0 = time.perf_counter()
        c.backend.synchronize()  # every load is complete: the weights are whole, and the buffers free
        m.sync_seconds = time.perf_counter() - t0
        c._emit("synced", m.num_buckets - 1)
        t0 = time.perf_counter()
        kept = {s: self.buffers.pop(s) for s in msg.kept_slots}
        self.release_all(check=True)
        for buf in kept.values():
            buf.check_no_live_views(c.name)
        c._kept = kept
        m.buffers_kept = len(kept)
        self._close_storages(keep=set(msg.kept_storages))
        m.storages_kept = len(c._storages)
        m.open_seconds += time.perf_counter() - t0
        tracker.finish(msg.num_buckets, msg.num_tensors, msg.total_bytes)
        m.seconds = time.perf_counter() - t_start
        c._emit("done", m.num_buckets - 1)  # before sending, so a cross-process event log stays causal
        self.chan.send(Done(refit_id=refit_id, consumer_metrics=m.to_dict()))
        return m

    def _open_storage(self, msg: Share, payload: bytes | None, m: ConsumerMetrics) -> None:
        """Map a trainer storage the producer shared (zero-copy views are read from it)."""
        c, ref = self.c, msg.ref
        if payload is None:
            raise RefitProtocolError(f"{c.name}: storage {ref.storage} was shared without a handle")
        if ref.storage in c._storages:
            raise RefitProtocolError(f"{c.name}: storage {ref.storage} was shared twice")
        t0 = time.perf_counter()
        c._storages[ref.storage] = c.backend.open_shared(ref, payload, f"trainer storage {ref.storage}")
        m.open_seconds += time.perf_counter() - t0
        m.storages_opened += 1

    def _load_packed(self, msg: BucketMsg, payload: bytes | None, meta: BucketMeta, tracker: ManifestTracker,
                     ordered: bool, m: ConsumerMetrics) -> int:
        """Load a bucket packed into a buffer (opened first if the bucket opens one); returns the bytes loaded."""
        c, own = self.c, msg.meta
        if msg.open is not None:
            if payload is None:
                raise RefitProtocolError(f"{c.name}: bucket {own.index} opens a buffer but carries no handle")
            t0 = time.perf_counter()
            old = self.buffers.pop(msg.open.slot, None)
            if old is not None:
                old.check_no_live_views(c.name)
                old.close()
            label = f"slot{msg.open.slot}/refit{own.refit_id}"
            self.buffers[msg.open.slot] = self._open(msg.open, payload, label)
            m.open_seconds += time.perf_counter() - t0
            m.buffers_opened += 1
        buf = self.buffers.get(own.slot)
        if buf is None:
            raise RefitProtocolError(f"{c.name}: bucket {own.index} uses slot {own.slot}, which was never opened")
        tracker.check_bucket(meta, buf.nbytes)
        c._emit("load_start", own.index)
        t1 = time.perf_counter()
        if ordered:  # the bucket's bytes are packed (on the device) before the loads read them
            c.backend.wait_event(c._pack_events[event_slot(own.slot)])
        source: Buffer = _BucketCopy.of(buf, meta.entries) if self.copy_buckets else buf
        weights = [(e.name, source.view(e.offset, e.nbytes, e.shape, torch_dtype(e.dtype), e.name)) for e in meta.entries]
        loaded = sum(int(t.numel()) * t.element_size() for _, t in weights)
        if loaded != meta.nbytes:
            raise RefitProtocolError(f"{c.name}: bucket {own.index} sliced {loaded} bytes, metadata says {meta.nbytes}")
        self.load_weights(weights)
        del weights, source
        if ordered and own.slot != SLOT_ONEOFF:  # the producer's next pack into the half waits for this
            c.backend.record_event(c._load_events[own.slot])
        else:  # loads have read the buffer before the producer may overwrite (or free) it
            c.backend.synchronize()
        m.load_seconds += time.perf_counter() - t1
        buf.check_no_live_views(c.name)
        c._emit("load_end", own.index)
        if own.slot == SLOT_ONEOFF:
            t0 = time.perf_counter()
            self.buffers.pop(SLOT_ONEOFF).close()  # before the ack: the producer frees it on ack
            m.open_seconds += time.perf_counter() - t0
        return loaded

    def _load_zero_copy(self, meta: BucketMeta, index: int, tracker: ManifestTracker, ordered: bool,
                        m: ConsumerMetrics) -> int:
        """Load a bucket of zero-copy views, each read where the trainer holds it; returns the bytes loaded."""
        c = self.c
        used = {sid for e in meta.entries for sid, _ in e.locations}
        mapped = {sid: c._storages[sid].nbytes for sid in used if sid in c._storages}
        tracker.check_bucket(meta, 0, mapped)
        c._emit("load_start", index)
        t1 = time.perf_counter()
        if ordered:  # the trainer's writes to these storages come before the loads read them
            c.backend.wait_event(c._pack_events[event_slot(SLOT_ZERO_COPY)])
        weights = [(e.name, self._view_in_place(e)) for e in meta.entries]
        loaded = sum(e.nbytes for e in meta.entries)
        self.load_weights(weights)
        del weights
        if not ordered:
            c.backend.synchronize()
        m.load_seconds += time.perf_counter() - t1
        for sid in used:
            c._storages[sid].check_no_live_views(c.name)
        c._emit("load_end", index)
        m.zero_copy_tensors += len(meta.entries)
        return loaded

    def _view_in_place(self, e: EntryMeta) -> Any:
        """What the loader gets for a zero-copy entry: a view of the trainer storage it lies in; for a stacked one,
        its parts' views (:class:`StackedViews`) where the loader takes them (the fused transfer's), else the stack
        of them (one copy). With ``copy_buckets`` the loader may keep what it gets: a private copy."""
        storages, dtype = self.c._storages, torch_dtype(e.dtype)
        if not e.parts:
            view = storages[e.storage].view(e.offset, e.nbytes, e.shape, dtype, e.name)
            return view.clone() if self.copy_buckets else view
        locations = e.part_locations
        part_bytes, part_shape = e.nbytes // len(locations), e.shape[1:]
        stack = StackedViews([storages[sid].view(offset, part_bytes, part_shape, dtype, f"{e.name}[{i}]")
                              for i, (sid, offset) in enumerate(locations)])
        if getattr(self.load_weights, "takes_stacked_views", False) and not self.copy_buckets:
            return stack
        return stack.materialize()

    def _close_storages(self, keep: set[int]) -> None:
        """Close the mappings of trainer storages the producer does not keep (a leaked view raises)."""
        c = self.c
        for sid in [s for s in c._storages if s not in keep]:
            buf = c._storages.pop(sid)
            buf.check_no_live_views(c.name)
            buf.close()

    def _open(self, ref, payload: bytes, label: str) -> Buffer:
        """Map the producer's buffer; if it is already gone, the producer failed: report its error."""
        try:
            return self.c.backend.open(ref, payload, label)
        except OSError as exc:
            # The producer frees its buffers when it aborts, which can race with this open. Its
            # error message is then already on the way: wait briefly so the real cause is raised.
            # Messages already queued behind it (later buckets) are skipped: this refit is lost anyway.
            deadline = time.monotonic() + 5.0
            try:
                while time.monotonic() < deadline:
                    self.chan.recv(f"the producer's error after its buffer {label} vanished", timeout_s=1.0)
            except RefitTimeoutError:
                pass
            raise RefitProtocolError(f"{self.c.name}: cannot open the producer's buffer {label}: {exc}") from exc

    def release_all(self, check: bool) -> None:
        """Close every mapping of the producer's buffers; with ``check``, leaked views raise."""
        buffers, self.buffers = self.buffers, {}
        errors = []
        for buf in buffers.values():
            try:
                if check:
                    buf.check_no_live_views(self.c.name)
                buf.close()
            except RefitError as e:
                errors.append(e)
        if errors and check:
            raise errors[0]


class _BucketCopy(Buffer):
    """A private copy of one bucket's byte range of a shared buffer (one device copy), sliced like the
    buffer: offsets stay the bucket's. Its views are not tracked: whoever keeps them keeps the copy alive,
    and the shared buffer is free for the producer as soon as the copy is made."""

    def __init__(self, tensor: torch.Tensor, start: int, end: int, label: str) -> None:
        super().__init__(tensor, end - start, label)
        self.start = start

    @classmethod
    def of(cls, buf: Buffer, entries: Any) -> "_BucketCopy":
        if buf.tensor is None:
            raise RefitProtocolError(f"buffer {buf.label} is closed")
        start = min((e.offset for e in entries), default=0)
        end = max((e.offset + e.nbytes for e in entries), default=start)
        return cls(buf.tensor[start:end].clone(), start, end, buf.label + "/copy")

    def view(self, offset: int, nbytes: int, shape: Any, dtype: torch.dtype, name: str = "",
             track: bool = True) -> torch.Tensor:
        return super().view(offset - self.start, nbytes, shape, dtype, name, track=False)

    def close(self) -> None:
        self.tensor = None
