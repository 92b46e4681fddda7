"""Refit producer: one per trainer rank; packs *its own* exported tensors and sends *its own* metadata.

Usage (inside a Megatron worker; the exporter is Megatron-Bridge's ``export_hf_weights``)::

    producer = RefitProducer(cfg.refit, session=job_id, rank=rank, world_size=world,
                             export_dtype=cfg.model.dtype)            # CUDA IPC on the current GPU
    producer.prepare(specs)                      # once, or whenever the export list changes
    metrics = producer.send(bridge.export_hf_weights(model))   # every refit
    logger.log(metrics.to_dict())

``send`` measures free memory, plans the halves (failing before any transfer if a tensor cannot
be placed), then streams: each tensor is copied into the current ping-pong half (or a one-off
buffer) in the wire dtype; a full bucket is sent with its metadata while the next one is packed
into the other half; a half is reused only after the consumer acked the bucket that used it.
``End`` follows the last bucket at once, without waiting for its ack (the consumer handles messages in
order: it reads ``End`` after acking every bucket); the producer then collects the acks still owed,
freeing a one-off buffer on its ack, and the consumer, having verified its manifest, answers ``Done``
(or an error, raised here): one round trip at the end of a refit, not two.

On CUDA the two ends order their copies on the device, not on the host: the producer marks each
packed bucket with an interprocess event that the consumer's stream waits on, and the consumer marks
each loaded half with one that the producer's stream waits on before packing into it again. Neither
process waits for the GPU per bucket, so the acks travel while the device copies; the consumer waits
for the device once, before ``Done``. (Buffers of synchronous backends are ordered by the acks alone.)

With ``prepare(specs, zero_copy=names)`` (``refit.zero_copy_views``) the named tensors, views of the trainer's
parameters, are not packed: the consumer maps the storage each lives in (once; again only when the trainer moved
it) and reads the tensor where it is, so it crosses in one copy instead of two and never needs a one-off buffer.
They travel in buckets of their own (metadata only), marked by an event that orders the consumer's reads after
the trainer's last writes; the trainer must not write its parameters until ``send`` has returned, which is after
the consumer's final device wait. A zero-copy bucket frees no buffer, so the consumer does not ack it: only packed
buckets are acked (each ack is a message on the consumer's critical path; Qwen3-8B's refit has ~14 such buckets).

The two halves (and the consumer's mappings of them) are created once and kept for the next refit
while both together are at most ``keep_buffers_max_bytes`` (default ``refit.keep_buffers_gb``): no
allocation, no IPC handle export or open per refit. They are replaced when the plan needs bigger halves than the kept
ones, and released by ``close``. Buffers above the limit, and one-off buffers for tensors larger
than a half, are allocated per refit and freed at its end, so large buffers never stay resident
while the generation engine is awake.
"""
from __future__ import annotations

import os
import time
from collections import deque
from typing import Any, Callable, Iterable, Sequence

import torch
import zmq

from rlc.contract import refit_buffer
from rlc.runtime.refit.bucket_planner import (
    EVENT_SLOTS,
    HALVES,
    SLOT_ONEOFF,
    SLOT_ZERO_COPY,
    Bucket,
    BucketPacker,
    RefitPlan,
    effective_alignment,
    event_slot,
    plan_refit,
)
from rlc.runtime.refit.buffers import Buffer, BufferBackend, byte_offset, make_backend, torch_dtype
from rlc.runtime.refit.channel import Channel, bind, close_socket, endpoint, new_socket
from rlc.runtime.refit.errors import RefitError, RefitProtocolError, RefitRemoteError, RefitTimeoutError
from rlc.runtime.refit.sources import StackedParts, copy_export
from rlc.runtime.refit.metrics import RefitMetrics, fixes_active
from rlc.runtime.refit.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Begin,
    BucketMeta,
    BucketMsg,
    BufferRef,
    Done,
    End,
    EntryMeta,
    Hello,
    HelloAck,
    Share,
    Subscribe,
    decode,
    encode,
)
from rlc.runtime.refit.specs import TensorSpec, specs_to_json, wire_specs
from rlc.runtime.refit.zero_copy import SharedStorages, why_not_zero_copy

EventHook = Callable[[str, int], None]

def keep_buffers_bytes(refit_cfg: Any) -> int:
    """``refit.keep_buffers_gb`` as bytes: both ping-pong halves together up to this size stay allocated (and
    mapped by the consumer) between refits (:func:`rlc.contract.refit_buffer.halves_kept`); larger halves are
    allocated per refit. Resident while the generation engine is awake."""
    return refit_buffer.keep_buffers_bytes(refit_cfg.keep_buffers_gb)


class RefitProducer:
    """Streams one trainer rank's weights to the generation worker on the same GPU."""

    #: A bucket of zero-copy views goes out once it reads this many bytes (or a half's worth, if more): few
    #: messages per refit, and the consumer starts copying before the export ends.
    zero_copy_bucket_bytes: int = 256 << 20

    def __init__(
        self,
        refit_cfg: Any,
        *,
        session: str,
        rank: int,
        world_size: int,
        export_dtype: str,
        backend: BufferBackend | None = None,
        device: Any = None,
        device_key: str | None = None,
        timeout_s: float = 600.0,
        socket_dir: str = "/tmp",
        reserve_bytes: int = 0,
        free_bytes: int | None = None,
        event_hook: EventHook | None = None,
        metadata_source_rank: int | None = None,
        metadata_subscribers: int | None = None,
        empty_cache: bool = True,
        keep_buffers_max_bytes: int | None = None,
        extra_fp32_params: Sequence[str] = (),
        keep_shared_storages: bool = True,
    ) -> None:
        """
        Args:
            refit_cfg: the resolved ``RefitConfig`` (sizing, alignment, fp32 patterns, transport, switches).
            session: shared by producer and consumer (job id); part of the socket names.
            rank / world_size: this producer's rank in the refit group (node-local for the legacy
                rank-0 metadata mode, whose relay is an ``ipc://`` socket).
            export_dtype: wire dtype of floating tensors not matched by ``refit_cfg.fp32_params``.
            backend: buffer backend; default from ``refit_cfg.transport`` (``device`` for CUDA,
                ``device_key`` for shm).
            timeout_s: longest wait for the consumer at any step (dead peer -> error, never a hang).
            reserve_bytes: memory the planner leaves free besides the buffers (exporter working set).
            free_bytes: fixed free memory for planning (tests); default: measured at each refit.
            event_hook: ``hook(event, bucket_index)`` for ``pack_start``, ``pack_end``, ``send`` (just
                before sending), ``ack`` (when the consumer's ack is read), ``free_oneoff`` (a one-off buffer
                freed), ``end`` (just before sending ``End``; the index is the last bucket's) and ``done`` (when
                the consumer's ``Done`` is read).
            metadata_source_rank: whose slicing metadata the consumer is told to use. Default: this
                rank when ``refit_cfg.per_rank_ipc_metadata`` else 0 (the SkyRL #1816 bug, reproduced
                on purpose so the manifest check can be shown to catch it). Set explicitly only
                for fault-injection proofs.
            metadata_subscribers: how many foreign consumers slice with *this* rank's metadata.
                Default: ``world_size - 1`` for rank 0 in the legacy mode, else 0.
            empty_cache: after each refit, return the allocator's cached blocks to the device
                (``torch.cuda.empty_cache``) so the waking generation engine, whose allocations
                bypass this process's caching allocator, can use the memory the buffers used.
            keep_buffers_max_bytes: keep both halves allocated (and mapped by the consumer) from one
                refit to the next while together they are at most this many bytes; 0 releases them
                after every refit. Default: ``refit_cfg.keep_buffers_gb``.
            extra_fp32_params: fnmatch patterns that also travel in fp32 besides ``refit_cfg.fp32_params``
                (the block scales of FP8 rollouts).
            keep_shared_storages: the consumer keeps its mappings of the trainer storages zero-copy views are read
                from until the next refit (no new handle per refit). False closes them at the end of every refit:
                a mapped storage cannot give its memory back, so a trainer that frees its parameters after the
                refit (``refit.offload_params_for_generation``) must not have them kept.
        """
        self.cfg = refit_cfg
        self.session = session
        self.rank = rank
        self.world_size = world_size
        self.export_dtype = export_dtype
        self.backend = backend or make_backend(refit_cfg.transport, device=device, device_key=device_key)
        self.device_key = self.backend.device_key
        self.timeout_s = timeout_s
        self.socket_dir = socket_dir
        self.reserve_bytes = reserve_bytes
        self.free_bytes = free_bytes
        self.event_hook = event_hook
        legacy = not refit_cfg.per_rank_ipc_metadata
        if metadata_source_rank is None:
            metadata_source_rank = 0 if legacy else rank
        if metadata_subscribers is None:
            metadata_subscribers = world_size - 1 if (legacy and rank == 0) else 0
        self.metadata_source_rank = metadata_source_rank
        self.metadata_subscribers = metadata_subscribers
        self.empty_cache = empty_cache
        self.keep_buffers_max_bytes = (keep_buffers_bytes(refit_cfg) if keep_buffers_max_bytes is None
                                       else keep_buffers_max_bytes)
        self.fp32_patterns = [*refit_cfg.fp32_params, *extra_fp32_params]
        self._kept: dict[int, Buffer] = {}  # ping-pong halves kept from the previous refit (slot -> buffer)
        self._last_plan: RefitPlan | None = None  # for the current export list (reset by prepare)
        self.name = f"refit producer rank {rank} (GPU {self.device_key})"
        self._chan: Channel | None = None
        self._relay: zmq.Socket | None = None
        self._subscriber_ids: list[bytes] = []
        self._specs: list[TensorSpec] = []  # the packed ones (zero-copy views take no buffer space)
        self._expected: dict[str, TensorSpec] = {}
        self._zero_copy: frozenset[str] = frozenset()
        self._storages = SharedStorages(self.backend, keep=keep_shared_storages)
        self._refit_id = 0
        self._broken: str | None = None
        # Device ordering (CUDA): this side's "packed" events per slot, the consumer's "loaded" events per half.
        self._pack_events: list[Any] = []
        self._pack_handles: list[str] = []
        self._load_events: list[Any] = []
        self._mapped_during_refit = 0  # what the consumer maps during every refit (HelloAck)

    # ------------------------------------------------------------------ setup

    @property
    def endpoint(self) -> str:
        return endpoint(self.session, self.device_key, socket_dir=self.socket_dir)

    def _relay_endpoint(self, rank: int) -> str:
        return endpoint(self.session, f"meta-rank{rank}", socket_dir=self.socket_dir)

    def _emit(self, event: str, index: int) -> None:
        if self.event_hook is not None:
            self.event_hook(event, index)

    def prepare(self, specs: Sequence[TensorSpec], zero_copy: Iterable[str] = ()) -> None:
        """Announce this rank's export list (exporter specs, in export order) to its consumer.

        ``zero_copy``: names of tensors the exporter yields as plain, contiguous views of storages the consumer may
        map (the trainer's parameters); those that travel in the dtype they are exported in are read in place.

        Blocks until the consumer on the same GPU key answered (``timeout_s``). Call again if the
        export list changes; the consumer must call ``prepare`` at the same time.
        """
        self._check_usable()
        wire = wire_specs(specs, self.export_dtype, self.fp32_patterns)
        asked = set(zero_copy)
        zero = frozenset(w.name for w, s in zip(wire, specs) if w.name in asked and w.dtype == s.dtype)
        effective_alignment(self.cfg.alignment_bytes, wire)  # fail fast on a bad alignment
        if self._chan is None:
            sock = new_socket(zmq.PAIR)
            bind(sock, self.endpoint)
            self._chan = Channel(sock, self.name, self.timeout_s)
            self._chan.peer_name = "its consumer"
        if not self._pack_handles:
            self._pack_events, self._pack_handles = self.backend.export_events(len(EVENT_SLOTS))
        if self.metadata_subscribers and self._relay is None:
            self._relay = new_socket(zmq.ROUTER)
            bind(self._relay, self._relay_endpoint(self.rank))
        hello = Hello(
            protocol_version=PROTOCOL_VERSION,
            session=self.session,
            producer_rank=self.rank,
            device_key=self.device_key,
            backend=self.backend.name,
            producer_pid=os.getpid(),
            specs=specs_to_json(wire),
            metadata_source_rank=self.metadata_source_rank,
            metadata_endpoint=None
            if self.metadata_source_rank == self.rank
            else self._relay_endpoint(self.metadata_source_rank),
            export_dtype=self.export_dtype,
            fp32_params=list(self.fp32_patterns),
            pack_events=list(self._pack_handles),
        )
        try:
            self._chan.send(hello, timeout_s=self.timeout_s)
            ack, _ = self._chan.recv("the consumer's hello_ack")
            if not isinstance(ack, HelloAck):
                raise RefitProtocolError(f"{self.name}: expected hello_ack, got {ack.kind!r}")
            if ack.device_key != self.device_key:
                raise RefitProtocolError(
                    f"{self.name}: the consumer that answered is on {ack.device_key}, not on this GPU; producer "
                    "and consumer must be colocated"
                )
            self._chan.peer_pid = ack.consumer_pid
            if ack.load_events and len(ack.load_events) != len(HALVES):
                raise RefitProtocolError(
                    f"{self.name}: the consumer announced {len(ack.load_events)} load events, expected {len(HALVES)}"
                )
            self._load_events = self.backend.open_events(ack.load_events) if self._pack_events else []
            self._mapped_during_refit = max(int(ack.mapped_during_refit), 0)
            self._accept_subscribers()
        except BaseException as e:
            self._broken = f"prepare failed: {e}"
            raise
        self._specs = [w for w in wire if w.name not in zero]
        self._expected = {s.name: s for s in wire}
        self._zero_copy = zero
        self._last_plan = None

    def _accept_subscribers(self) -> None:
        self._subscriber_ids = []
        deadline = time.monotonic() + self.timeout_s
        while len(self._subscriber_ids) < self.metadata_subscribers:
            assert self._relay is not None
            if self._relay.poll(200, zmq.POLLIN):
                ident, *frames = self._relay.recv_multipart()
                msg, _ = decode(frames)
                if not isinstance(msg, Subscribe):
                    raise RefitProtocolError(f"{self.name}: expected subscribe on the metadata relay, got {msg.kind!r}")
                self._subscriber_ids.append(ident)
            elif time.monotonic() > deadline:
                raise RefitTimeoutError(
                    f"{self.name}: only {len(self._subscriber_ids)} of {self.metadata_subscribers} consumers "
                    f"subscribed to this rank's metadata within {self.timeout_s:g} s"
                )

    def _check_usable(self) -> None:
        if self._broken:
            raise RefitError(
                f"{self.name} is unusable after an earlier failure ({self._broken[:300]}); create a new producer "
                "and consumer pair (new session)"
            )

    # ------------------------------------------------------------------ refit

    def plan(self, free_bytes: int | None = None) -> RefitPlan:
        """The plan ``send`` would use now (free memory measured unless given).

        Measured free memory does not include the halves this producer keeps from the previous
        refit; they are counted as available (a refit reuses them), so keeping them does not shrink
        the plan. Kept halves are reused when they are no bigger than the halves the knobs allow now.
        """
        return self._plan(self._available(self._kept) if free_bytes is None else free_bytes, self._kept)

    def _available(self, kept: dict[int, Buffer]) -> int:
        """Memory a refit can plan with: measured free memory plus the ``kept`` halves it reuses (a
        fixed ``free_bytes`` given at construction is taken as it is), less what the consumer maps during the
        refit (its KV cache woken during the transfer): measured before ``begin``, the free memory still holds it."""
        free = self.free_bytes if self.free_bytes is not None else (
            self.backend.free_memory() + sum(b.nbytes for b in kept.values()))
        return free - self._mapped_during_refit

    def _plan(self, free_bytes: int, kept: dict[int, Buffer]) -> RefitPlan:
        """``plan_refit`` with this producer's knobs; ``kept`` halves are reused when they fit the plan,
        and the previous plan's buckets when the halves have the same size (same export list)."""
        plan = plan_refit(
            self._specs,
            free_bytes,
            buffer_memory_ratio=self.cfg.buffer_memory_ratio,
            buffer_gb=self.cfg.buffer_gb,
            alignment_bytes=self.cfg.alignment_bytes,
            reserve_bytes=self.reserve_bytes,
            keep_half_bytes=next(iter(kept.values())).nbytes if kept else None,
            previous=self._last_plan,
        )
        self._last_plan = plan
        return plan

    @property
    def kept_bytes(self) -> int:
        """Bytes of the halves kept allocated between refits."""
        return sum(b.nbytes for b in self._kept.values())

    def _free(self) -> int:
        return self.free_bytes if self.free_bytes is not None else self.backend.free_memory()

    @property
    def zero_copy_names(self) -> frozenset[str]:
        """The tensors read in place by the consumer (``prepare``'s ``zero_copy`` that travel as exported)."""
        return self._zero_copy

    def release_buffers(self) -> None:
        """Free the kept halves (their mappings on the consumer side close at its next refit or close)."""
        kept, self._kept = self._kept, {}
        for buf in kept.values():
            buf.close()
        if kept:
            self.backend.collect()
            if self.empty_cache:
                self.backend.release_cached()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> RefitMetrics:
        """Stream one refit; returns its metrics. Raises (and tells the consumer) on any failure."""
        self._check_usable()
        if self._chan is None:
            raise RefitProtocolError(f"{self.name}: call prepare(specs) before send()")
        self._refit_id += 1
        run = _ProducerRun(self, self._refit_id)
        try:
            return run.execute(named_tensors)
        except BaseException as e:
            self._broken = f"refit {self._refit_id} failed: {e}"
            if not isinstance(e, RefitRemoteError):
                self._chan.try_send_error(str(e), where=self.name)
            raise
        finally:
            run.release_all()

    def close(self) -> None:
        """Release the kept halves, forget the shared storages and close the sockets."""
        self._storages.clear()
        try:
            self.release_buffers()
        except Exception:  # pragma: no cover - best effort at shutdown
            pass
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        if self._relay is not None:
            close_socket(self._relay)
            self._relay = None


class _ProducerRun:
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

