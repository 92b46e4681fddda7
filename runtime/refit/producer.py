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
from typing import Any, Callable, Iterable, Sequence

import torch
import zmq

from rlc.contract import refit_buffer
from rlc.runtime.refit.bucket_planner import (
    EVENT_SLOTS,
    HALVES,
    RefitPlan,
    effective_alignment,
    plan_refit,
)
from rlc.runtime.refit.buffers import Buffer, BufferBackend, make_backend
from rlc.runtime.refit.channel import Channel, bind, close_socket, endpoint, new_socket
from rlc.runtime.refit.errors import RefitError, RefitProtocolError, RefitRemoteError, RefitTimeoutError
from rlc.runtime.refit.metrics import RefitMetrics
from rlc.runtime.refit.producer_run import ProducerRun
from rlc.runtime.refit.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    Subscribe,
    decode,
)
from rlc.runtime.refit.specs import TensorSpec, specs_to_json, wire_specs
from rlc.runtime.refit.zero_copy import SharedStorages

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
        run = ProducerRun(self, self._refit_id)
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
