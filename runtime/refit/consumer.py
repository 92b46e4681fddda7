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
from typing import Any, Callable

import torch
import zmq

from rlc.runtime.refit.buffers import Buffer, BufferBackend, make_backend
from rlc.runtime.refit.bucket_planner import EVENT_SLOTS, HALVES
from rlc.runtime.refit.channel import Channel, endpoint, new_socket
from rlc.runtime.refit.errors import RefitError, RefitProtocolError, RefitRemoteError, RefitTimeoutError
from rlc.runtime.refit.manifest import expected_by_name
from rlc.runtime.refit.metrics import ConsumerMetrics
from rlc.runtime.refit.consumer_run import ConsumerRun
from rlc.runtime.refit.protocol import (
    PROTOCOL_VERSION,
    BucketMeta,
    BucketMsg,
    Hello,
    HelloAck,
    Subscribe,
)
from rlc.runtime.refit.specs import TensorSpec, specs_from_json

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
        self._expected_by_name: dict[str, TensorSpec] = {}
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
            expected = specs_from_json(msg.specs)
            by_name = expected_by_name(expected)  # every refit's manifest checks against it
            self._chan.send(HelloAck(device_key=self.device_key, consumer_pid=os.getpid(),
                                     load_events=list(self._load_handles), mapped_during_refit=mapped_during_refit))
        except BaseException as e:
            self._broken = f"prepare failed: {e}"
            if not isinstance(e, (RefitRemoteError, RefitTimeoutError)):  # the producer raises it, not a timeout
                self._chan.try_send_error(str(e), where=self.name)
            raise
        self._hello = msg
        self._expected, self._expected_by_name = expected, by_name
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
        run = ConsumerRun(self, load_weights, copy_buckets, on_begin)
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
