"""Refit buffer backends: CUDA IPC (production) and CPU shared memory (CI), same interface.

A backend knows its **device key** (the GPU UUID for CUDA IPC; a caller-chosen key for shm), how
much memory is free, how to allocate a buffer and export an opaque handle for it (producer), and
how to open such a handle and slice typed views out of it (consumer).

CUDA IPC: the producer allocates ``torch.empty(n, uint8, device)`` and exports it with
``torch.multiprocessing.reductions.reduce_tensor``; the handle tuple is pickled (this is what
torch produces; nothing else in the protocol is pickled). The consumer finds the local device
index whose UUID equals the producer's (CUDA_VISIBLE_DEVICES may differ between the Megatron and
vLLM processes), patches that index into the rebuild arguments and calls torch's rebuild.

Shared memory: POSIX segments in /dev/shm (registered with the resource tracker so a crashed
producer does not leak them), mmapped and wrapped with ``torch.frombuffer``.
Closing a segment while a view is alive raises, which is how CI catches view leaks.

Zero-copy views (``refit.zero_copy_views``): ``share`` exports the whole storage of one of the trainer's
tensors (CUDA IPC: any storage on the backend's GPU; shared memory: a segment this process allocated with
``allocate``, which is how CPU tests model the trainer's parameters) and ``open_shared`` maps it on the consumer
side, where views are sliced out of it like out of a buffer.
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import pickle
import secrets
import weakref
from abc import ABC, abstractmethod
from multiprocessing import resource_tracker
from typing import Any, Sequence

import torch

from rlc.runtime.refit.errors import RefitLeakError, RefitProtocolError
from rlc.runtime.refit.protocol import BufferRef, StorageRef


_SHM_DIR = "/dev/shm"  # POSIX shared memory on Linux


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise RefitProtocolError(f"unknown dtype {name!r} on the refit wire")
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def free_device_memory(device: int | str | torch.device | None = None) -> int:
    """Free bytes on a CUDA device (``torch.cuda.mem_get_info``), the input of the bucket planner."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def free_shm_memory(path: str = "/dev/shm") -> int:
    """Free bytes of the shared-memory filesystem (the shm backend's 'device memory')."""
    st = os.statvfs(path)
    return int(st.f_bavail * st.f_frsize)


def cuda_index(device: int | str | torch.device | None = None) -> int:
    """Local CUDA device index of ``device`` (None / "cuda" -> the current device)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"refit cuda_ipc backend needs a CUDA device, got {device!r}")
    return torch.cuda.current_device() if dev.index is None else dev.index


def cuda_device_uuid(device: int | str | torch.device | None = None) -> str:
    """The GPU UUID of ``device`` as a string (stable across processes and CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(cuda_index(device)).uuid)


def whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage ``tensor`` lives in, as a 1-D uint8 tensor (byte ``i`` of it is byte ``i`` of the storage)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


def byte_offset(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s first element sits in its storage, in bytes."""
    return int(tensor.storage_offset()) * tensor.element_size()


@functools.lru_cache(maxsize=4096)
def _contiguous(shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """Element count and contiguous strides of ``shape`` (shapes repeat: every expert has the same)."""
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return math.prod(shape), tuple(reversed(strides))


class Buffer:
    """A byte buffer (1-D uint8 tensor) with typed, zero-copy views."""

    def __init__(self, tensor: torch.Tensor, nbytes: int, label: str) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.nbytes = nbytes
        self.label = label
        self._views: list[tuple[str, weakref.ref]] = []
        self._typed: dict[torch.dtype, torch.Tensor | None] = {}  # the whole buffer as each dtype

    def view(self, offset: int, nbytes: int, shape: Sequence[int], dtype: torch.dtype, name: str = "",
             track: bool = True) -> torch.Tensor:
        """A tensor of ``shape``/``dtype`` aliasing ``[offset, offset + nbytes)``; tracked for leaks
        unless ``track`` is False (the producer's own short-lived copy targets)."""
        if self.tensor is None:
            raise RefitProtocolError(f"buffer {self.label} is closed")
        if offset < 0 or offset + nbytes > self.nbytes:
            raise RefitProtocolError(
                f"tensor {name!r}: slice [{offset}, {offset + nbytes}) is outside buffer {self.label} "
                f"({self.nbytes} bytes)"
            )
        t = self._strided(offset, nbytes, tuple(shape), dtype)
        if t is None:
            t = self.tensor[offset : offset + nbytes].view(dtype).view(tuple(shape))
        if track:
            self._views.append((name, weakref.ref(t)))
        return t

    def _strided(self, offset: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The view as one ``as_strided`` call on the buffer viewed as ``dtype`` (a few µs instead of a
        slice and two views: a 30B MoE refit slices ~19,000 tensors per GPU); None when not aligned."""
        itemsize = dtype.itemsize
        numel, strides = _contiguous(shape)
        if offset % itemsize or numel * itemsize != nbytes:
            return None
        if dtype not in self._typed:
            assert self.tensor is not None
            base = self.tensor
            aligned = base.numel() % itemsize == 0 and base.storage_offset() % itemsize == 0
            self._typed[dtype] = base.view(dtype) if aligned else None
        typed = self._typed[dtype]
        if typed is None:
            return None
        return typed.as_strided(shape, strides, typed.storage_offset() + offset // itemsize)

    def live_views(self) -> list[str]:
        """Names of views handed out by ``view`` that are still referenced somewhere."""
        return [n for n, ref in self._views if ref() is not None]

    def check_no_live_views(self, who: str) -> None:
        live = self.live_views()
        if live:
            shown = ", ".join(repr(n) for n in live[:8]) + (f" ... ({len(live)} in all)" if len(live) > 8 else "")
            raise RefitLeakError(
                f"{who}: views of refit buffer {self.label} are still referenced after use: {shown}. The "
                "buffer is overwritten by the next bucket and released after the refit, so load_weights must "
                "copy the data (param.copy_(w)), not keep the tensor"
            )
        self._views = []

    def close(self) -> None:
        raise NotImplementedError


class BufferBackend(ABC):
    """Allocates (producer) / opens (consumer) refit buffers on one device."""

    name: str = ""
    device_key: str = ""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def free_memory(self) -> int: ...

    @abstractmethod
    def allocate(self, nbytes: int, label: str) -> tuple[Buffer, bytes]:
        """A new buffer and its opaque handle payload for the consumer."""

    @abstractmethod
    def open(self, ref: BufferRef, payload: bytes, label: str) -> Buffer:
        """Open a producer's buffer from its handle (on this same device)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until this process's queued copies on the device are complete."""

    def share(self, tensor: torch.Tensor) -> tuple[int, bytes]:
        """Export the whole storage ``tensor`` lives in for the consumer to map: ``(bytes, handle payload)``."""
        raise RefitProtocolError(f"the {self.name} refit backend cannot share a trainer storage")

    def open_shared(self, ref: StorageRef, payload: bytes, label: str) -> Buffer:
        """Map a storage the producer shared (on this same device); views are sliced out of it by byte offset."""
        raise RefitProtocolError(f"the {self.name} refit backend cannot map a trainer storage")

    def export_events(self, count: int) -> tuple[list[Any], list[str]]:
        """``count`` events this process records and its peer waits on, with their handles (hex strings).

        Backends whose copies are device-ordered return events, so neither end waits for the device
        at every bucket; backends whose copies are synchronous (shared memory) return none, and the
        protocol falls back to a device wait per bucket."""
        return [], []

    def open_events(self, handles: Sequence[str]) -> list[Any]:
        """The peer's events from their handles (none on backends without device-ordered copies)."""
        return []

    def record_event(self, event: Any) -> None:
        """Mark the copies queued so far on this process's stream (the peer waits on the mark)."""

    def wait_event(self, event: Any) -> None:
        """Make copies queued from now on wait, on the device, for the peer's last mark of ``event``."""

    def collect(self) -> None:
        """Release memory freed by closed buffers (producer side, end of refit)."""

    def release_cached(self) -> None:
        """Return cached free memory to the device (so the generation engine can use it)."""


# --------------------------------------------------------------------------- shared memory


class _ShmBuffer(Buffer):
    """A shared-memory segment: created (and unlinked) by the producer, mapped by the consumer.

    The mapping is never unmapped explicitly: ``torch.frombuffer`` does not pin the mmap, so an
    explicit close would leave live views dangling. Dropping the last reference unmaps it; a view
    that is still alive at ``close`` keeps the mapping valid and is reported as a leak.
    """

    def __init__(self, mm: mmap.mmap, nbytes: int, label: str, unlink_name: str | None) -> None:
        tensor = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        super().__init__(tensor, nbytes, label)
        self.mm: mmap.mmap | None = mm
        self.unlink_name = unlink_name

    def close(self) -> None:
        live = self.live_views()
        self.tensor = None
        self._typed = {}
        self.mm = None
        if self.unlink_name is not None:
            name, self.unlink_name = self.unlink_name, None
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except FileNotFoundError:
                pass
            resource_tracker.unregister("/" + name, "shared_memory")
        if live:
            raise RefitLeakError(
                f"shared-memory refit buffer {self.label} closed while views are still referenced "
                f"({', '.join(map(repr, live[:8]))}); load_weights must copy, not keep"
            )


#: Segments this process allocated, by the address of their mapping: ``share`` finds a tensor's segment here.
_OWN_SEGMENTS: "weakref.WeakValueDictionary[int, _ShmBuffer]" = weakref.WeakValueDictionary()


class ShmBackend(BufferBackend):
    """CPU shared-memory buffers; ``device_key`` pairs a producer with its consumer (like a GPU UUID)."""

    name = "shm"

    def __init__(self, device_key: str, free_bytes: int | None = None) -> None:
        self.device_key = device_key
        self._free_bytes = free_bytes

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def free_memory(self) -> int:
        return self._free_bytes if self._free_bytes is not None else free_shm_memory()

    def allocate(self, nbytes: int, label: str) -> tuple[Buffer, bytes]:
        name = f"rlc-refit-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        # The resource tracker unlinks the segment if this process dies before close().
        resource_tracker.register("/" + name, "shared_memory")
        buf = _ShmBuffer(mm, nbytes, label, unlink_name=name)
        if buf.tensor is not None and nbytes:
            _OWN_SEGMENTS[buf.tensor.untyped_storage().data_ptr()] = buf
        return buf, name.encode("utf-8")

    def open(self, ref: BufferRef, payload: bytes, label: str) -> Buffer:
        if ref.device_key != self.device_key:
            raise RefitProtocolError(
                f"buffer {label} belongs to device {ref.device_key!r}, this consumer is on {self.device_key!r}"
            )
        return self._map(payload, ref.nbytes, label)

    @staticmethod
    def _map(payload: bytes, nbytes: int, label: str) -> Buffer:
        # Mapped directly, not through SharedMemory: attaching would register the segment with the
        # (shared) resource tracker a second time. The producer owns and unlinks it.
        name = payload.decode("utf-8")
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
        try:
            mm = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        return _ShmBuffer(mm, nbytes, label, unlink_name=None)

    def share(self, tensor: torch.Tensor) -> tuple[int, bytes]:
        segment = _OWN_SEGMENTS.get(tensor.untyped_storage().data_ptr())
        if segment is None or segment.unlink_name is None:
            raise RefitProtocolError(
                "the shm refit backend shares only segments this process allocated with ShmBackend.allocate; the "
                "tensor lives elsewhere")
        return segment.nbytes, segment.unlink_name.encode("utf-8")

    def open_shared(self, ref: StorageRef, payload: bytes, label: str) -> Buffer:
        if ref.device_key != self.device_key:
            raise RefitProtocolError(
                f"storage {label} belongs to device {ref.device_key!r}, this consumer is on {self.device_key!r}")
        return self._map(payload, ref.nbytes, label)

    def synchronize(self) -> None:
        """CPU copies are synchronous."""


# --------------------------------------------------------------------------- CUDA IPC

_REBUILD_DEVICE_ARG = 6  # index of storage_device in reduce_tensor's rebuild_cuda_tensor args


class _CudaBuffer(Buffer):
    def close(self) -> None:
        self.tensor = None
        self._typed = {}


class CudaIpcBackend(BufferBackend):
    """CUDA IPC buffers on one GPU, keyed by the GPU's UUID."""

    name = "cuda_ipc"

    def __init__(self, device: int | str | torch.device | None = None, free_bytes: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("refit.transport=cuda_ipc needs a CUDA device; use 'shm' on CPU")
        self.index = cuda_index(device)
        self.device_key = cuda_device_uuid(self.index)
        self._free_bytes = free_bytes

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def free_memory(self) -> int:
        return self._free_bytes if self._free_bytes is not None else free_device_memory(self.index)

    def allocate(self, nbytes: int, label: str) -> tuple[Buffer, bytes]:
        from torch.multiprocessing.reductions import reduce_tensor

        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        func, args = reduce_tensor(t)
        return _CudaBuffer(t, nbytes, label), pickle.dumps((func, args))

    def open(self, ref: BufferRef, payload: bytes, label: str) -> Buffer:
        return self._rebuild(ref.device_key, ref.nbytes, payload, label)

    def share(self, tensor: torch.Tensor) -> tuple[int, bytes]:
        """The whole storage as one uint8 tensor through torch's own IPC export; the consumer's mapping keeps the
        storage's memory from being reused until it is closed (torch's IPC reference counting)."""
        from torch.multiprocessing.reductions import reduce_tensor

        if tensor.device != self.device:
            raise RefitProtocolError(f"a tensor on {tensor.device} cannot be shared from the refit backend on {self.device}")
        whole = whole_storage(tensor)
        func, args = reduce_tensor(whole)
        return int(whole.numel()), pickle.dumps((func, args))

    def open_shared(self, ref: StorageRef, payload: bytes, label: str) -> Buffer:
        return self._rebuild(ref.device_key, ref.nbytes, payload, label)

    def _rebuild(self, device_key: str, nbytes: int, payload: bytes, label: str) -> Buffer:
        if device_key != self.device_key:
            raise RefitProtocolError(
                f"buffer {label} was allocated on GPU {device_key}, this consumer is on GPU {self.device_key}; "
                "producer and consumer must be colocated on the same GPU"
            )
        func, args = pickle.loads(payload)  # same-job, same-node peer; torch's own IPC format
        args = list(args)
        if getattr(func, "__name__", "") != "rebuild_cuda_tensor" or len(args) <= _REBUILD_DEVICE_ARG:
            raise RefitProtocolError(
                f"unexpected CUDA IPC handle layout from reduce_tensor ({getattr(func, '__name__', func)}, "
                f"{len(args)} args): producer and consumer torch versions differ?"
            )
        args[_REBUILD_DEVICE_ARG] = self.index
        t = func(*args)
        return _CudaBuffer(t, nbytes, label)

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def export_events(self, count: int) -> tuple[list[Any], list[str]]:
        """Interprocess events; none where the platform cannot share them (the buckets are then ordered by a
        device wait per bucket, as on a synchronous backend)."""
        try:
            events = [torch.cuda.Event(interprocess=True) for _ in range(count)]
            with torch.cuda.device(self.index):
                handles = [e.ipc_handle().hex() for e in events]
        except RuntimeError:
            return [], []
        return events, handles

    def open_events(self, handles: Sequence[str]) -> list[Any]:
        """The peer's events; none where they cannot be opened here (the pair then waits for the device per
        bucket)."""
        try:
            return [torch.cuda.Event.from_ipc_handle(self.device, bytes.fromhex(h)) for h in handles]
        except (ValueError, RuntimeError):
            return []

    def record_event(self, event: Any) -> None:
        event.record(torch.cuda.current_stream(self.device))

    def wait_event(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def collect(self) -> None:
        torch.cuda.ipc_collect()

    def release_cached(self) -> None:
        torch.cuda.empty_cache()


def make_backend(transport: str, *, device_key: str | None = None, device: Any = None, free_bytes: int | None = None) -> BufferBackend:
    """Backend for ``refit.transport``: ``"cuda_ipc"`` (device = GPU index) or ``"shm"`` (device_key required)."""
    if transport == "cuda_ipc":
        return CudaIpcBackend(device, free_bytes=free_bytes)
    if transport == "shm":
        if not device_key:
            raise ValueError("the shm refit backend needs an explicit device_key (pairs producer and consumer)")
        return ShmBackend(device_key, free_bytes=free_bytes)
    raise ValueError(f"refit.transport={transport!r}: expected 'cuda_ipc' or 'shm'")
