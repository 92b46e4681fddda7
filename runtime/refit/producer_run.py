"""One refit on the producer's side (:meth:`RefitProducer.send <rlc.runtime.refit.producer.RefitProducer.send>`):
the buffers it packs into, the bookkeeping of the acks still owed, the zero-copy buckets it describes, and its
metrics. The protocol and its ordering rules are described in :mod:`rlc.runtime.refit.producer`."""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable

import torch
import zmq

from rlc.contract import refit_buffer
from rlc.runtime.refit.bucket_planner import (
    SLOT_ONEOFF,
    SLOT_ZERO_COPY,
    Bucket,
    BucketPacker,
    event_slot,
)
from rlc.runtime.refit.buffers import Buffer, byte_offset, torch_dtype
from rlc.runtime.refit.channel import Channel
from rlc.runtime.refit.errors import RefitProtocolError
from rlc.runtime.refit.sources import StackedParts, copy_export
from rlc.runtime.refit.metrics import RefitMetrics, fixes_active
from rlc.runtime.refit.protocol import (
    Ack,
    Begin,
    BucketMeta,
    BucketMsg,
    BufferRef,
    Done,
    End,
    EntryMeta,
    Share,
    encode,
)
from rlc.runtime.refit.specs import TensorSpec
from rlc.runtime.refit.zero_copy import why_not_zero_copy

if TYPE_CHECKING:
    from rlc.runtime.refit.producer import RefitProducer


class ProducerRun:
    """State of one ``send``: buffers, ack bookkeeping, metrics."""

    def __init__(self, producer: RefitProducer, refit_id: int) -> None:
        self.p = producer
        assert producer._chan is not None  # the caller checked prepare() ran
        self.chan: Channel = producer._chan
        self.refit_id = refit_id
        # The kept halves belong to this refit until it ends well (then they are kept again).
        self.halves: dict[int, Buffer] = producer._kept
        producer._kept = {}
        self.last_bucket_of: dict[int, int] = {0: -1, 1: -1}
        self.oneoff: tuple[int, Buffer] | None = None
        self.owed: deque[int] = deque()  # packed buckets sent and not acked yet, in index order
        self.sent = -1
        self.pending_open: dict[int, tuple[BufferRef, bytes]] = {}  # slot -> handle not yet sent
        self.zero_copy: list[EntryMeta] = []  # zero-copy views of the bucket not yet sent
        self.zero_copy_bytes = 0
        self.storages_used: set[int] = set()
        self.allocated_bytes = sum(b.nbytes for b in self.halves.values())
        self.peak_bytes = self.allocated_bytes
        self.released = False
        self.metrics = RefitMetrics(
            refit_id=refit_id,
            producer_rank=producer.rank,
            device_key=producer.device_key,
            transport=producer.backend.name,
            fixes=fixes_active(producer.cfg, producer.metadata_source_rank, producer.rank),
        )

    # ---------------------------------------------------------------- helpers

    def _observe_free(self) -> None:
        if self.p.free_bytes is None:
            free = self.p.backend.free_memory()
            self.metrics.min_free_bytes = min(self.metrics.min_free_bytes, free)

    @property
    def device_ordered(self) -> bool:
        """Buckets are ordered by device events (no host wait for the device per bucket)."""
        return bool(self.p._load_events)

    def _wait_ack(self, index: int) -> None:
        """Read the acks of every packed bucket up to ``index`` (zero-copy buckets are not acked)."""
        t0 = time.perf_counter()
        while self.owed and self.owed[0] <= index:
            expected = self.owed[0]
            msg, _ = self.chan.recv(f"the ack of bucket {expected} (refit {self.refit_id})")
            if not isinstance(msg, Ack) or msg.refit_id != self.refit_id or msg.index != expected:
                raise RefitProtocolError(
                    f"{self.p.name}: expected ack of bucket {expected} of refit {self.refit_id}, got {msg}"
                )
            self.owed.popleft()
            self.p._emit("ack", msg.index)
            if self.oneoff is not None and self.oneoff[0] == msg.index:
                self._close_oneoff()
        self.metrics.wait_ack_seconds += time.perf_counter() - t0

    def _acquire(self, bucket_index: int, slot: int, nbytes: int) -> Buffer:
        """The buffer for a bucket that opens now; waits for the ack that frees it."""
        if slot == SLOT_ONEOFF:
            if self.oneoff is not None:
                self._wait_ack(self.oneoff[0])  # frees the previous one-off
            return self._allocate(SLOT_ONEOFF, nbytes, f"oneoff#{bucket_index}", bucket_index)
        previous = self.last_bucket_of[slot]
        self._wait_ack(previous)
        if previous >= 0 and self.device_ordered:
            self.p.backend.wait_event(self.p._load_events[slot])  # the consumer's loads out of it come first
        self.last_bucket_of[slot] = bucket_index
        if slot not in self.halves:
            return self._allocate(slot, nbytes, f"half{slot}", bucket_index)
        return self.halves[slot]

    def _drop_mismatched_halves(self, half_bytes: int) -> None:
        """Kept halves of another size than this refit's plan are freed (new ones replace them)."""
        stale = [slot for slot, buf in self.halves.items() if buf.nbytes != half_bytes]
        if not stale:
            return
        t0 = time.perf_counter()
        for slot in stale:
            buf = self.halves.pop(slot)
            self.allocated_bytes -= buf.nbytes
            buf.close()
        self.p.backend.collect()
        self.metrics.alloc_seconds += time.perf_counter() - t0

    def _allocate(self, slot: int, nbytes: int, label: str, bucket_index: int) -> Buffer:
        t0 = time.perf_counter()
        buf, payload = self.p.backend.allocate(nbytes, f"{label}/refit{self.refit_id}/rank{self.p.rank}")
        self.metrics.alloc_seconds += time.perf_counter() - t0
        self.metrics.buffers_allocated += 1
        if slot == SLOT_ONEOFF:
            self.oneoff = (bucket_index, buf)
        else:
            self.halves[slot] = buf
        self.pending_open[slot] = (BufferRef(slot, nbytes, self.p.backend.name, self.p.device_key), payload)
        self.allocated_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        self._observe_free()
        return buf

    def _mark(self, slot: int) -> float:
        """Order the consumer's reads of a bucket in ``slot`` after this process's writes queued so far (an event
        its stream waits on, or a device wait where there are none); returns the seconds it took."""
        t0 = time.perf_counter()
        if self.device_ordered:  # the consumer's stream waits for this mark before reading the bucket
            self.p.backend.record_event(self.p._pack_events[event_slot(slot)])
        else:  # the bytes are on the device before the consumer reads them
            self.p.backend.synchronize()
        return time.perf_counter() - t0

    def _post(self, meta: BucketMeta, ref: BufferRef | None = None, payload: bytes | None = None) -> None:
        """Send a bucket's metadata (and the handle of the buffer it opens) to the consumer."""
        self.p._emit("send", meta.index)  # before sending, so a cross-process event log stays causal
        self.chan.send(BucketMsg(meta=meta, open=ref), payload)
        self._relay(meta)
        self.sent = meta.index
        if meta.slot != SLOT_ZERO_COPY:
            self.owed.append(meta.index)
        self.metrics.num_buckets += 1

    def _send_bucket(self, bucket: Bucket) -> None:
        self.metrics.pack_seconds += self._mark(bucket.slot)
        self.p._emit("pack_end", bucket.index)
        meta = BucketMeta(
            refit_id=self.refit_id,
            index=bucket.index,
            slot=bucket.slot,
            producer_rank=self.p.rank,
            device_key=self.p.device_key,
            buffer_bytes=bucket.buffer_bytes,
            entries=[EntryMeta(e.spec.name, e.offset, list(e.spec.shape), e.spec.dtype, e.spec.nbytes) for e in bucket.entries],
        )
        ref, payload = self.pending_open.pop(bucket.slot, (None, None))
        self._post(meta, ref, payload)
        self.metrics.num_oneoff_buckets += bucket.slot == SLOT_ONEOFF

    def _relay(self, meta: BucketMeta) -> None:
        """Legacy / fault-injection mode: this rank's metadata also goes to foreign consumers."""
        if not self.p._subscriber_ids:
            return
        assert self.p._relay is not None
        frames = encode(BucketMsg(meta=meta, open=None))
        for ident in self.p._subscriber_ids:
            try:
                self.p._relay.send_multipart([ident, *frames], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass

    def _add_zero_copy(self, spec: TensorSpec, tensor: Any, packer: BucketPacker) -> None:
        """Describe a view of a trainer storage (shared with the consumer first if it is new) for the next zero-copy
        bucket; the bucket goes out once it reads ``zero_copy_bucket_bytes`` (or a half's worth, if more)."""
        t0 = time.perf_counter()
        parts = tensor.parts if isinstance(tensor, StackedParts) else [tensor]
        for part in parts:
            why = why_not_zero_copy(part, spec.dtype, self.p.backend.device)
            if why is not None:
                raise RefitProtocolError(
                    f"{self.p.name}: tensor {spec.name!r} was announced as a zero-copy view but "
                    f"{'a part of it' if len(parts) > 1 else 'it'}: {why}; the exporter must yield it as a contiguous "
                    "view of a trainer parameter, or a stack of such views (refit.zero_copy_views)")
        locations = []
        for part in parts:
            storage, ref, payload = self.p._storages.id_of(part)
            if ref is not None:
                self.chan.send(Share(ref), payload)
                self.metrics.storages_shared += 1
            self.storages_used.add(storage)
            locations += [storage, byte_offset(part)]
        stacked = tuple(locations) if isinstance(tensor, StackedParts) else ()
        self.zero_copy.append(EntryMeta(spec.name, locations[1], list(spec.shape), spec.dtype, spec.nbytes,
                                        locations[0], stacked))
        self.zero_copy_bytes += spec.nbytes
        self.metrics.zero_copy_tensors += 1
        self.metrics.zero_copy_bytes += spec.nbytes
        self.metrics.zero_copy_seconds += time.perf_counter() - t0
        if self.zero_copy_bytes >= max(packer.half_bytes, self.p.zero_copy_bucket_bytes):
            self._flush_zero_copy(packer)

    def _flush_zero_copy(self, packer: BucketPacker) -> None:
        """Send the zero-copy bucket (after the open packed bucket: buckets go out in index order)."""
        if not self.zero_copy:
            return
        open_bucket = packer.close_open()
        if open_bucket is not None:
            self._send_bucket(open_bucket)
        index = packer.next_index()
        self.metrics.zero_copy_seconds += self._mark(SLOT_ZERO_COPY)  # the trainer's writes come first
        meta = BucketMeta(refit_id=self.refit_id, index=index, slot=SLOT_ZERO_COPY, producer_rank=self.p.rank,
                          device_key=self.p.device_key, buffer_bytes=0, entries=self.zero_copy)
        self.zero_copy, self.zero_copy_bytes = [], 0
        self._post(meta)

    # ---------------------------------------------------------------- main

    def execute(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> RefitMetrics:
        p, m = self.p, self.metrics
        t_start = time.perf_counter()
        m.free_before_bytes = p._available(self.halves)
        m.min_free_bytes = m.free_before_bytes
        plan = p._plan(m.free_before_bytes, self.halves)  # raises RefitPlanError before any transfer
        self._drop_mismatched_halves(plan.sizing.half_bytes)
        m.half_bytes = plan.sizing.half_bytes
        m.buffer_source = plan.sizing.source
        m.device_ordered = self.device_ordered
        m.warnings.extend(plan.warnings)
        self.chan.send(Begin(refit_id=self.refit_id, plan=plan.summary(), device_ordered=self.device_ordered))
        packer = BucketPacker(plan.sizing.half_bytes, plan.sizing.alignment)
        done: set[str] = set()
        iterator = iter(named_tensors)
        while True:
            t0 = time.perf_counter()
            try:
                name, tensor = next(iterator)
            except StopIteration:
                m.export_seconds += time.perf_counter() - t0
                break
            m.export_seconds += time.perf_counter() - t0
            spec = self._check_tensor(name, tensor, done)
            done.add(name)
            m.num_tensors += 1
            m.bytes += spec.nbytes
            if name in p._zero_copy:
                self._add_zero_copy(spec, tensor, packer)
                del tensor
                continue
            step = packer.add(spec)
            if step.flushed is not None:
                self._send_bucket(step.flushed)
            pl = step.placement
            nbytes = step.closed.buffer_bytes if step.closed is not None else packer.half_bytes
            if pl.opens:
                buf = self._acquire(pl.bucket_index, pl.slot, nbytes)
                p._emit("pack_start", pl.bucket_index)
            else:
                buf = self.halves[pl.slot]
            t1 = time.perf_counter()
            view = buf.view(pl.offset, spec.nbytes, spec.shape, torch_dtype(spec.dtype), spec.name, track=False)
            copy_export(view, tensor)  # a tensor, or experts stacked straight into the buffer
            del view
            m.pack_seconds += time.perf_counter() - t1
            if spec.dtype == "float32" and str(tensor.dtype) in ("torch.bfloat16", "torch.float16"):
                m.precision_lost.append(name)
            m.fp32_tensors += spec.dtype == "float32"
            # Drop the exported tensor before asking the exporter for the next one: holding an 8 GiB
            # stacked expert tensor across next() doubles the exporter's peak (NeMo-RL #2471, attempt 1).
            del tensor
            if step.closed is not None:
                self._send_bucket(step.closed)
        self._flush_zero_copy(packer)
        last = packer.finish()
        if last is not None:
            self._send_bucket(last)
        missing = [n for n in p._expected if n not in done]
        if missing:
            raise RefitProtocolError(
                f"{p.name}: the exporter finished without yielding {len(missing)} announced tensor(s): "
                f"{', '.join(map(repr, missing[:8]))}{' ...' if len(missing) > 8 else ''}; call prepare() with "
                "the current export list"
            )
        keep = sorted(self.halves) if refit_buffer.halves_kept(plan.sizing.half_bytes, p.keep_buffers_max_bytes) else []
        # End goes out right behind the last bucket, not after its ack: the consumer handles messages in order, so
        # it reads End once it has loaded and acked every bucket, and the acks still owed cross while End travels.
        p._emit("end", self.sent)
        self.chan.send(End(refit_id=self.refit_id, num_buckets=m.num_buckets, num_tensors=m.num_tensors,
                           total_bytes=m.bytes, kept_slots=keep,
                           kept_storages=p._storages.end_refit(self.storages_used)))
        self._wait_ack(self.sent)  # the acks still owed come before Done; a one-off buffer is freed on its ack
        t0 = time.perf_counter()
        msg, _ = self.chan.recv(f"the consumer's manifest verdict (refit {self.refit_id})")
        m.done_wait_seconds = time.perf_counter() - t0
        if not isinstance(msg, Done) or msg.refit_id != self.refit_id:
            raise RefitProtocolError(f"{p.name}: expected done for refit {self.refit_id}, got {msg}")
        p._emit("done", self.sent)
        m.consumer = dict(msg.consumer_metrics)
        m.buffers_kept = len(keep)
        m.peak_buffer_bytes = self.peak_bytes
        for slot in keep:  # the next refit reuses them; the consumer keeps its mappings of them
            p._kept[slot] = self.halves.pop(slot)
            self.allocated_bytes -= p._kept[slot].nbytes
        self.release_all()
        m.seconds = time.perf_counter() - t_start
        m.gbps = m.bytes / m.seconds / 1e9 if m.seconds > 0 else 0.0
        m.free_after_bytes = p._free()  # after the buffers were released, as before; not part of the refit's time
        if m.precision_lost:
            m.warnings.append(
                f"{len(m.precision_lost)} fp32 parameter(s) reached the producer in 16-bit precision (e.g. "
                f"{m.precision_lost[0]!r}); the wire keeps fp32 but the bits are already lost: export them in fp32 "
                "(SkyRL #1816)"
            )
        return m

    def _check_tensor(self, name: str, tensor: torch.Tensor, done: set[str]) -> TensorSpec:
        spec = self.p._expected.get(name)
        if spec is None:
            raise RefitProtocolError(
                f"{self.p.name}: the exporter yielded {name!r}, which is not in the export list given to prepare() "
                f"({len(self.p._expected)} tensors); call prepare() with the current export list"
            )
        if name in done:
            raise RefitProtocolError(
                f"{self.p.name}: the exporter yielded {name!r} twice; each tensor must be sent exactly once "
                "(NeMo-RL #2471: MTP-replicated embedding on the last PP stage -> refit.dedupe_mtp_embedding)"
            )
        if tuple(tensor.shape) != spec.shape:
            raise RefitProtocolError(
                f"{self.p.name}: tensor {name!r} has shape {list(tensor.shape)}, prepare() announced "
                f"{list(spec.shape)}"
            )
        return spec

    def _close_oneoff(self) -> None:
        assert self.oneoff is not None
        index, buf = self.oneoff
        self.oneoff = None
        self.allocated_bytes -= buf.nbytes
        t0 = time.perf_counter()
        buf.close()
        # CUDA: a freed IPC-shared block stays in torch's limbo until collected; the next one-off
        # must be able to reuse the memory.
        self.p.backend.collect()
        self.metrics.alloc_seconds += time.perf_counter() - t0
        self.p._emit("free_oneoff", index)

    def release_all(self) -> None:
        """Free every buffer this refit allocated (idempotent)."""
        if self.released:
            return
        self.released = True
        t0 = time.perf_counter()
        halves, self.halves = self.halves, {}
        for buf in halves.values():
            self.allocated_bytes -= buf.nbytes
            buf.close()
        if self.oneoff is not None:
            self._close_oneoff()
        try:
            self.p.backend.collect()
            if self.p.empty_cache:
                self.p.backend.release_cached()
        except Exception:  # pragma: no cover - best effort
            pass
        self.metrics.alloc_seconds += time.perf_counter() - t0

