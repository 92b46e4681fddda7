"""Refit consumer: one per generation worker; opens its own GPU's buffers and loads bucket by bucket.

Usage (inside the vLLM worker extension)::

    consumer = RefitConsumer(session=job_id)          # CUDA IPC on the current GPU
    consumer.prepare()                                # pairs with the producer on the same GPU
    metrics = consumer.receive(lambda ws: model_runner.model.load_weights(weights=ws))

``receive`` handles one refit: for each bucket it opens new buffers, checks the bucket's metadata
against the manifest its own producer announced at ``prepare`` (provenance, names, shapes, bytes,
bounds), calls ``load_weights`` with zero-copy views, verifies that no view outlived ``load_weights``
(the half is overwritten two buckets later), and acks. On CUDA the loads wait on the device for the
producer's "packed" event and mark a "loaded" event that the producer's next pack into the half waits
on, so the ack does not wait for the device; the consumer waits for the device once, before ``Done``
(and before acking a one-off buffer, which the producer frees on the ack). With
``copy_buckets=True`` each bucket is first copied out of the shared buffer in one device copy and
``load_weights`` gets views of that copy, which it may keep: vLLM's layerwise reload (FP8 rollouts)
holds a layer's tensors until the layer is complete, possibly several buckets later. ``End`` comes right
behind the last bucket (the producer does not wait for its ack); messages are handled in order, so it is
read once every bucket is loaded and acked. At the end it checks that every expected tensor arrived
exactly once and closes every buffer mapping except those of the halves the producer keeps for the
next refit (``End.kept_slots``): their handles are opened once and reused. ``close`` releases them.

Zero-copy views (``refit.zero_copy_views``): a ``Share`` message maps one of the trainer's storages, and a
zero-copy bucket's tensors are views of those mappings (after a device wait for the producer's event, so the
trainer's writes come first); ``load_weights`` copies from the trainer's memory directly. The mappings the
producer names in ``End.kept_storages`` stay open for the next refit, the others are closed at its end.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import zmq

from rlc.runtime.refit.buffers import Buffer, BufferBackend, make_backend, torch_dtype
from rlc.runtime.refit.bucket_planner import EVENT_SLOTS, HALVES, SLOT_ONEOFF, SLOT_ZERO_COPY, event_slot
from rlc.runtime.refit.channel import Channel, endpoint, new_socket
from rlc.runtime.refit.errors import RefitError, RefitProtocolError, RefitRemoteError, RefitTimeoutError
from rlc.runtime.refit.manifest import ManifestTracker
from rlc.runtime.refit.metrics import ConsumerMetrics
from rlc.runtime.refit.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Begin,
    BucketMeta,
    BucketMsg,
    Done,
    End,
    EntryMeta,
    Hello,
    HelloAck,
    Share,
    Subscribe,
)
from rlc.runtime.refit.specs import TensorSpec, specs_from_json
from rlc.runtime.refit.zero_copy import StackedViews

LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], Any]
EventHook = Callable[[str, int], None]


class RefitConsumer:
    """Receives one producer's weights on the same GPU and hands them to ``load_weights``."""

    def __init__(
        self,
        *,
        session: str,
        transport: str = "cuda_ipc",
        backend: BufferBackend | None = None,
        device: Any = None,
        device_key: str | None = None,
        timeout_s: float = 600.0,
        socket_dir: str = "/tmp",
        event_hook: EventHook | None = None,
    ) -> None:
        """
        Args:
            session: same string as the producer's (job id).
            transport / backend: ``"cuda_ipc"`` (current GPU, or ``device``) or ``"shm"`` (``device_key``).
            timeout_s: longest wait for the producer at any step.
            event_hook: ``hook(event, bucket_index)`` for ``begin`` (the producer's ``Begin`` read; index 0),
                ``recv``, ``load_start``, ``load_end``, ``ack`` (emitted just before the ack is sent), ``end`` (the
                producer's ``End`` read), ``synced`` (every load complete on the device) and ``done`` (just before
                ``Done`` is sent); the last three carry the last bucket's index.
        """
        self.backend = backend or make_backend(transport, device=device, device_key=device_key)
        self.device_key = self.backend.device_key
        self.session = session
        self.timeout_s = timeout_s
        self.socket_dir = socket_dir
        self.event_hook = event_hook
        self.name = f"refit consumer (GPU {self.device_key})"
        self._chan: Channel | None = None
        self._meta_chan: Channel | None = None
        self._hello: Hello | None = None
        self._expected: list[TensorSpec] = []
        self._last_refit_id = 0
        self._broken: str | None = None
        self._kept: dict[int, Buffer] = {}  # mappings of the producer's kept halves (slot -> buffer)
        self._storages: dict[int, Buffer] = {}  # mappings of trainer storages (zero-copy views), by the producer's id
        # Device ordering (CUDA): the producer's "packed" events per slot, this side's "loaded" events per half.
        self._pack_events: list[Any] = []
        self._pack_handles: list[str] = []
        self._load_events: list[Any] = []
        self._load_handles: list[str] = []

    @property
    def expected(self) -> list[TensorSpec]:
        """The wire export list announced by this GPU's producer."""
        return list(self._expected)

    @property
    def producer_rank(self) -> int:
        if self._hello is None:
            raise RefitProtocolError(f"{self.name}: prepare() has not run")
        return self._hello.producer_rank

    def _emit(self, event: str, index: int) -> None:
        if self.event_hook is not None:
            self.event_hook(event, index)

    def _check_usable(self) -> None:
        if self._broken:
            raise RefitError(
                f"{self.name} is unusable after an earlier failure ({self._broken[:300]}); create a new "
                "producer and consumer pair (new session)"
            )

    def prepare(self, mapped_during_refit: int = 0) -> list[TensorSpec]:
        """Pair with the producer on this GPU key and receive its export list (blocks up to ``timeout_s``).

        ``mapped_during_refit``: bytes this side maps on the device during every refit, from its beginning (the
        ``on_begin`` of :meth:`receive`); the producer sizes its buffers without them."""
        self._check_usable()
        if self._chan is None:
            sock = new_socket(zmq.PAIR)
            sock.connect(endpoint(self.session, self.device_key, socket_dir=self.socket_dir))
            self._chan = Channel(sock, self.name, self.timeout_s)
            self._chan.peer_name = "its producer"
        try:
            msg, _ = self._chan.recv("the producer's hello (is the trainer rank on this GPU calling prepare?)")
            if not isinstance(msg, Hello):
                raise RefitProtocolError(f"{self.name}: expected hello, got {msg.kind!r}")
            if msg.protocol_version != PROTOCOL_VERSION or msg.session != self.session:
                raise RefitProtocolError(
                    f"{self.name}: producer speaks protocol {msg.protocol_version} for session {msg.session!r}; "
                    f"this consumer speaks {PROTOCOL_VERSION} for {self.session!r}"
                )
            if msg.device_key != self.device_key or msg.backend != self.backend.name:
                raise RefitProtocolError(
                    f"{self.name}: producer rank {msg.producer_rank} is on {msg.device_key} ({msg.backend}); "
                    f"this consumer is on {self.device_key} ({self.backend.name})"
                )
            self._chan.peer_pid = msg.producer_pid
            self._chan.name = f"refit consumer of producer rank {msg.producer_rank} (GPU {self.device_key})"
            self.name = self._chan.name
            if msg.metadata_source_rank != msg.producer_rank:
                self._subscribe(msg)
            self._pair_events(msg.pack_events)
            self._chan.send(HelloAck(device_key=self.device_key, consumer_pid=os.getpid(),
                                     load_events=list(self._load_handles), mapped_during_refit=mapped_during_refit))
        except BaseException as e:
            self._broken = f"prepare failed: {e}"
            raise
        self._hello = msg
        self._expected = specs_from_json(msg.specs)
        return self.expected

    def _pair_events(self, pack_handles: list[str]) -> None:
        """Open the producer's "packed" events and make this side's "loaded" ones (once per producer); none
        when the producer has none or this backend's copies are synchronous."""
        if pack_handles == self._pack_handles:
            return
        if pack_handles and len(pack_handles) != len(EVENT_SLOTS):
            raise RefitProtocolError(
                f"{self.name}: the producer announced {len(pack_handles)} packed events, expected {len(EVENT_SLOTS)}"
            )
        self._pack_events = self.backend.open_events(pack_handles) if pack_handles else []
        self._pack_handles = list(pack_handles)
        if self._pack_events and not self._load_events:
            self._load_events, self._load_handles = self.backend.export_events(len(HALVES))
        if not (self._pack_events and self._load_events):  # no load events answered: the producer waits per bucket
            self._pack_events, self._load_events, self._load_handles = [], [], []

    @property
    def device_ordered(self) -> bool:
        """Buckets are ordered by device events (no wait for the device per bucket)."""
        return bool(self._pack_events and self._load_events)

    def _subscribe(self, hello: Hello) -> None:
        """Slice with another rank's metadata (legacy rank-0 mode / fault injection)."""
        if hello.metadata_endpoint is None:
            raise RefitProtocolError(f"{self.name}: foreign metadata source without an endpoint")
        if self._meta_chan is None:
            sock = new_socket(zmq.DEALER)
            sock.connect(hello.metadata_endpoint)
            self._meta_chan = Channel(sock, self.name + " metadata relay", self.timeout_s)
            self._meta_chan.peer_name = f"producer rank {hello.metadata_source_rank}'s metadata relay"
        self._meta_chan.send(Subscribe(device_key=self.device_key, consumer_pid=os.getpid()))

    def _foreign_meta(self, refit_id: int, index: int) -> BucketMeta:
        assert self._meta_chan is not None
        while True:
            msg, _ = self._meta_chan.recv(f"metadata of bucket {index} from the metadata source rank")
            if not isinstance(msg, BucketMsg):
                raise RefitProtocolError(f"{self.name}: unexpected {msg.kind!r} on the metadata relay")
            if (msg.meta.refit_id, msg.meta.index) == (refit_id, index):
                return msg.meta
            if (msg.meta.refit_id, msg.meta.index) > (refit_id, index):
                raise RefitProtocolError(
                    f"{self.name}: metadata source has no bucket {index} in refit {refit_id} (it sent "
                    f"{msg.meta.refit_id}/{msg.meta.index})"
                )

    def receive(self, load_weights: LoadWeights, *, copy_buckets: bool = False,
                on_begin: Callable[[], None] | None = None) -> ConsumerMetrics:
        """Receive one refit and load it; returns this side's metrics. Raises on any mismatch.

        ``copy_buckets``: hand ``load_weights`` views of a private copy of each bucket (it may keep them).
        ``on_begin``: called once the producer's ``begin`` arrived, before the first bucket: the producer has then
        measured its free memory, so what this starts mapping (``prepare``'s ``mapped_during_refit``) is not in it."""
        self._check_usable()
        if self._chan is None or self._hello is None:
            raise RefitProtocolError(f"{self.name}: call prepare() before receive()")
        run = _ConsumerRun(self, load_weights, copy_buckets, on_begin)
        try:
            return run.execute()
        except BaseException as e:
            self._broken = f"refit failed: {e}"
            run.release_all(check=False)
            self._release_kept()
            if not isinstance(e, RefitRemoteError):
                self._chan.try_send_error(str(e), where=self.name)
            raise

    def _release_kept(self) -> None:
        kept, self._kept = self._kept, {}
        storages, self._storages = self._storages, {}
        for buf in [*kept.values(), *storages.values()]:
            try:
                buf.close()
            except RefitError:
                pass

    def close(self) -> None:
        self._release_kept()
        for chan in (self._chan, self._meta_chan):
            if chan is not None:
                chan.close()
        self._chan = self._meta_chan = None


class _ConsumerRun:
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
        tracker = ManifestTracker(c._expected, hello.producer_rank, hello.device_key, refit_id)
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
