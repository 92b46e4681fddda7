"""Refit wire protocol: message dataclasses and their JSON framing (pure Python, no torch, no zmq).

One producer (a Megatron rank) talks to one consumer (the vLLM worker on the same GPU) over a
ZMQ ``PAIR`` socket. Every message is a multipart ZMQ message: frame 0 is a JSON header
(``{"kind": ..., fields...}``); a message that opens a buffer carries the backend's opaque handle
as frame 1 (a shared-memory name, or the pickled CUDA IPC handle tuple that
``torch.multiprocessing.reductions.reduce_tensor`` produces; nothing else is pickled).

Conversation, per producer/consumer pair::

    prepare:  P -> C  Hello(specs, producer rank, GPU key, metadata source,   C -> P  HelloAck(its "loaded"
                      its "packed" event handles)                                     event handles)
    refit:    P -> C  Begin
              P -> C  Share(storage) + handle frame  (refit.zero_copy_views: a trainer storage not yet mapped)
              P -> C  BucketMsg(k) [+ handle frame if bucket k opens a buffer]  ... (<= 2 in flight)
              C -> P  Ack(k) for a packed bucket (a bucket of zero-copy views frees no buffer: not acked)
              P -> C  End(totals, kept slots and storages), right behind the last bucket (not after its ack)
              C -> P  the acks still owed, in order, then Done(ok | error, consumer metrics) once the consumer
                      has read End (after loading every bucket: it reads in order)
    next refit: buffers of the kept slots (and mappings of the kept storages) are reused on both sides
              (a bucket opens a buffer only when its slot has none or its size changed)
    failure:  either side may send Error(message) instead; the other side raises it.

Per-bucket metadata (``BucketMeta``) always names the producer rank and GPU key it was made by,
so a consumer can tell its own producer's metadata from another rank's (SkyRL #1816).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple, Sequence

from rlc.runtime.refit.errors import RefitProtocolError

PROTOCOL_VERSION = 6

#: ``EntryMeta.storage`` of a tensor packed into its bucket's buffer.
IN_BUFFER = -1


class EntryMeta(NamedTuple):
    """Where one tensor sits: in its bucket's buffer, or (``storage`` >= 0) in a trainer storage the consumer
    mapped (``refit.zero_copy_views``), or, for a tensor stacked from equally shaped parts (a MoE layer's experts),
    part by part in trainer storages (``parts``: storage id, byte offset of each part, flattened; ``storage`` and
    ``offset`` then name the first part). A named tuple: ~19,000 per refit at 30B MoE scale."""

    name: str
    offset: int  # bytes, from the start of the buffer or storage
    shape: list[int]
    dtype: str
    nbytes: int
    storage: int = IN_BUFFER
    parts: Sequence[int] = ()  # [storage, offset] of every part of a stacked view read in place, flattened

    @property
    def part_locations(self) -> list[tuple[int, int]]:
        """``(storage, byte offset)`` of each part of a stacked view read in place (empty for any other tensor)."""
        return list(zip(self.parts[0::2], self.parts[1::2]))

    @property
    def locations(self) -> list[tuple[int, int]]:
        """``(storage, byte offset)`` of every piece the consumer reads: each part of a stacked view, else the tensor
        itself."""
        return self.part_locations or [(self.storage, self.offset)]


@dataclass(frozen=True)
class BucketMeta:
    """Slicing metadata of one bucket, stamped with the producer that packed it."""

    refit_id: int
    index: int
    slot: int  # 0 / 1 ping-pong half, -1 one-off, -2 zero-copy (every entry in a mapped trainer storage)
    producer_rank: int
    device_key: str  # GPU UUID (cuda_ipc) or the shm device key of the producer
    buffer_bytes: int
    entries: list[EntryMeta]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def to_dict(self) -> dict[str, Any]:
        """Plain data; the entries travel as columns (one list per field), which JSON encodes and
        decodes several times faster than one object per tensor (~19,000 per refit at 30B MoE scale)."""
        e = self.entries
        return {
            "refit_id": self.refit_id,
            "index": self.index,
            "slot": self.slot,
            "producer_rank": self.producer_rank,
            "device_key": self.device_key,
            "buffer_bytes": self.buffer_bytes,
            "entries": {
                "name": [x.name for x in e],
                "offset": [x.offset for x in e],
                "shape": [list(x.shape) for x in e],
                "dtype": [x.dtype for x in e],
                "nbytes": [x.nbytes for x in e],
                "storage": [x.storage for x in e],
                # only where a stack is read in place part by part (the per-expert export has ~19,000 entries)
                **({"parts": [list(x.parts) for x in e]} if any(x.parts for x in e) else {}),
            },
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BucketMeta":
        d = dict(d)
        cols = d["entries"]
        try:
            columns = [cols[f] for f in EntryMeta._fields[:-1]]
            if "parts" in cols:
                columns.append([tuple(p) for p in cols["parts"]])
        except (KeyError, TypeError) as exc:
            raise RefitProtocolError(f"bucket metadata entries are not in the column layout: {exc}") from exc
        if len({len(c) for c in columns}) > 1:
            raise RefitProtocolError("bucket metadata entry columns have different lengths")
        d["entries"] = [EntryMeta(*row) for row in zip(*columns)]
        return cls(**d)


@dataclass(frozen=True)
class BufferRef:
    """A buffer the consumer must open for this bucket; the opaque handle travels as frame 1."""

    slot: int
    nbytes: int
    backend: str
    device_key: str


@dataclass(frozen=True)
class StorageRef:
    """A trainer storage the consumer maps and reads zero-copy views from; the opaque handle travels as frame 1."""

    storage: int  # the producer's id for it, named by ``EntryMeta.storage``
    nbytes: int
    backend: str
    device_key: str


@dataclass(frozen=True)
class Message:
    """Base of every message; ``kind`` is the JSON discriminator."""

    kind: ClassVar[str] = ""


@dataclass(frozen=True)
class Hello(Message):
    kind: ClassVar[str] = "hello"
    protocol_version: int
    session: str
    producer_rank: int
    device_key: str
    backend: str
    producer_pid: int
    specs: list[dict[str, Any]]  # wire specs, export order as announced
    metadata_source_rank: int  # whose per-bucket metadata the consumer slices with
    metadata_endpoint: str | None  # ZMQ endpoint of that rank's metadata relay (None: own producer)
    export_dtype: str
    fp32_params: list[str]
    #: Handles of the producer's "bucket packed" events, one per slot (half 0, half 1, one-off, zero-copy); empty
    #: when its backend's copies are synchronous. The consumer waits on them on the device.
    pack_events: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class HelloAck(Message):
    kind: ClassVar[str] = "hello_ack"
    device_key: str
    consumer_pid: int
    #: Handles of the consumer's "bucket loaded" events, one per ping-pong half; empty when the buckets
    #: are ordered by a device wait per bucket instead (no producer events, or a backend without them).
    load_events: list[str] = field(default_factory=list)
    #: Bytes the consumer maps on the device during every refit, from ``begin`` on (vLLM's KV cache woken during
    #: the transfer, ``refit.wake_kv_during_transfer``): the producer plans its buffers without them.
    mapped_during_refit: int = 0


@dataclass(frozen=True)
class Subscribe(Message):
    """Consumer -> a foreign producer's metadata relay (only when it is told to slice with its metadata)."""

    kind: ClassVar[str] = "subscribe"
    device_key: str
    consumer_pid: int


@dataclass(frozen=True)
class Begin(Message):
    kind: ClassVar[str] = "begin"
    refit_id: int
    plan: dict[str, Any]
    #: The producer orders this refit's buckets with the events of hello / hello_ack (it opened the consumer's
    #: "loaded" events); otherwise both ends wait for the device per bucket.
    device_ordered: bool = False


@dataclass(frozen=True)
class BucketMsg(Message):
    kind: ClassVar[str] = "bucket"
    meta: BucketMeta
    open: BufferRef | None = None


@dataclass(frozen=True)
class Share(Message):
    """``refit.zero_copy_views``: map this trainer storage (sent before the first bucket that reads from it)."""

    kind: ClassVar[str] = "share"
    ref: StorageRef


@dataclass(frozen=True)
class Ack(Message):
    kind: ClassVar[str] = "ack"
    refit_id: int
    index: int
    loaded_bytes: int


@dataclass(frozen=True)
class End(Message):
    kind: ClassVar[str] = "end"
    refit_id: int
    num_buckets: int
    num_tensors: int
    total_bytes: int
    #: Ping-pong slots whose buffers the producer keeps for the next refit: the consumer keeps their
    #: mappings open (no new handle next time); every other mapping is closed at the end of the refit.
    kept_slots: list[int] = field(default_factory=list)
    #: Trainer storages whose mappings the consumer keeps for the next refit; every other one is closed.
    kept_storages: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Done(Message):
    kind: ClassVar[str] = "done"
    refit_id: int
    consumer_metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Error(Message):
    kind: ClassVar[str] = "error"
    message: str
    where: str


_KINDS: dict[str, type[Message]] = {
    c.kind: c for c in (Hello, HelloAck, Subscribe, Begin, BucketMsg, Share, Ack, End, Done, Error)
}


#: The messages of every refit whose fields are already plain data (numbers, strings, lists and dicts of them):
#: encoded field by field, without ``asdict``'s deep copy (a refit sends a dozen of them, each on its critical path).
_FLAT_FIELDS: dict[type, tuple[str, ...]] = {c: tuple(f.name for f in fields(c)) for c in (Begin, Ack, End, Done)}


def _plain(msg: Message) -> dict[str, Any]:
    """The message's fields as plain data. A bucket's metadata is built by ``BucketMeta.to_dict``:
    ``asdict`` deep-copies every field and costs more than the transfer for ~19,000 tensors per refit."""
    if isinstance(msg, BucketMsg):
        return {"meta": msg.meta.to_dict(), "open": None if msg.open is None else asdict(msg.open)}
    flat = _FLAT_FIELDS.get(type(msg))
    if flat is not None:
        return {name: getattr(msg, name) for name in flat}
    return asdict(msg)


def encode(msg: Message, payload: bytes | None = None) -> list[bytes]:
    """Message (+ optional handle payload) -> ZMQ frames."""
    body = {"kind": msg.kind, **_plain(msg)}
    frames = [json.dumps(body, separators=(",", ":")).encode("utf-8")]
    if payload is not None:
        frames.append(payload)
    return frames


def decode(frames: list[bytes]) -> tuple[Message, bytes | None]:
    """ZMQ frames -> (message, payload or None)."""
    if not frames:
        raise RefitProtocolError("empty ZMQ message")
    try:
        body = json.loads(frames[0].decode("utf-8"))
        kind = body.pop("kind")
        cls = _KINDS[kind]
    except (ValueError, KeyError) as e:
        raise RefitProtocolError(f"undecodable refit message header {frames[0][:200]!r}: {e}") from e
    names = {f.name for f in fields(cls)}
    unknown = set(body) - names
    if unknown:
        raise RefitProtocolError(f"refit message {kind!r} has unknown fields {sorted(unknown)}: version skew?")
    if cls is BucketMsg:
        body["meta"] = BucketMeta.from_dict(body["meta"])
        if body.get("open") is not None:
            body["open"] = BufferRef(**body["open"])
    if cls is Share:
        body["ref"] = StorageRef(**body["ref"])
    msg = cls(**body)
    payload = frames[1] if len(frames) > 1 else None
    return msg, payload
