"""Per-refit metrics (pure Python): one producer-side record per refit, JSONL-ready via ``to_dict``.

``RefitMetrics`` answers the questions the field reports (NeMo-RL #2471, SkyRL #1816) had to reconstruct from logs by hand: how
many bytes and buckets, how long, how fast, how much memory was free before/after and at the
tightest point, how big the halves were and which knob sized them, and which seed fixes were
active for this refit.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


def fixes_active(refit_cfg: Any, metadata_source_rank: int, producer_rank: int) -> dict[str, Any]:
    """Which seed fixes are on for this refit (from ``RefitConfig``, duck-typed)."""
    return {
        "per_rank_ipc_metadata": metadata_source_rank == producer_rank,  # SkyRL #1816
        "metadata_source_rank": metadata_source_rank,
        "fp32_params": list(refit_cfg.fp32_params),  # SkyRL #1816
        "sleep_level": refit_cfg.sleep_level,  # NeMo-RL #2471 failure 3
        "offload_optimizer_for_refit": refit_cfg.offload_optimizer_for_refit,  # NeMo-RL #3490
        "sync_params_before_refit": refit_cfg.sync_params_before_refit,  # NeMo-RL #4086
        "dedupe_mtp_embedding": refit_cfg.dedupe_mtp_embedding,  # NeMo-RL #2471 failure 1
    }


@dataclass
class ConsumerMetrics:
    """What the consumer saw in one refit (sent back to the producer in ``Done``)."""

    refit_id: int
    producer_rank: int
    device_key: str
    device_ordered: bool = False  # buckets ordered by interprocess events, not a device wait per bucket
    num_buckets: int = 0
    num_tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    load_seconds: float = 0.0  # inside load_weights (+ a device wait per bucket where buckets are not device-ordered)
    sync_seconds: float = 0.0  # the device wait before Done (the loads still queued on the device)
    wait_seconds: float = 0.0  # waiting for the next bucket
    open_seconds: float = 0.0  # opening / closing the producer's buffers (CUDA IPC map/unmap)
    buffers_opened: int = 0  # buffer handles opened in this refit (CUDA IPC: cudaIpcOpenMemHandle)
    buffers_kept: int = 0  # mappings kept open for the next refit (the producer keeps those halves)
    storages_opened: int = 0  # trainer storages mapped in this refit (refit.zero_copy_views)
    storages_kept: int = 0  # trainer storage mappings kept open for the next refit
    zero_copy_tensors: int = 0  # tensors read in place from the trainer's storages

    def to_dict(self) -> dict[str, Any]:
        """Plain data (every field is a number, a string or a bool: no deep copy needed; sent in ``Done``)."""
        return dict(vars(self))


@dataclass
class RefitMetrics:
    """One refit, seen from the producer (with the consumer's view attached)."""

    refit_id: int
    producer_rank: int
    device_key: str
    transport: str
    num_tensors: int = 0
    num_buckets: int = 0
    num_oneoff_buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    gbps: float = 0.0  # bytes / seconds / 1e9
    free_before_bytes: int = 0  # free device memory at refit time, counting the halves kept from the last refit,
    # less what the consumer maps during the refit (refit.wake_kv_during_transfer)
    free_after_bytes: int = 0
    min_free_bytes: int = 0  # tightest free memory observed during the refit
    half_bytes: int = 0
    device_ordered: bool = False  # buckets ordered by interprocess events, not a device wait per bucket
    peak_buffer_bytes: int = 0  # refit buffers alive at once (halves in use + largest one-off)
    buffer_source: str = ""
    pack_seconds: float = 0.0  # copying exported tensors into the buffers (+ a device wait per bucket where not device-ordered)
    alloc_seconds: float = 0.0  # allocating / exporting / freeing the buffers
    wait_ack_seconds: float = 0.0  # blocked on the consumer (ping-pong stall)
    done_wait_seconds: float = 0.0  # waiting for the consumer's verdict: its last loads on the device, its manifest check
    export_seconds: float = 0.0  # waiting on the exporter's iterator
    buffers_allocated: int = 0  # buffers allocated (and handles exported) in this refit, one-offs included
    buffers_kept: int = 0  # ping-pong halves kept allocated for the next refit
    zero_copy_tensors: int = 0  # tensors the consumer read in place from the trainer's storages (refit.zero_copy_views)
    zero_copy_bytes: int = 0
    zero_copy_seconds: float = 0.0  # describing them (and the event that orders the consumer's reads)
    storages_shared: int = 0  # trainer storages shared with the consumer in this refit (a new IPC handle each)
    fp32_tensors: int = 0
    precision_lost: list[str] = field(default_factory=list)  # fp32 on the wire but exported in 16 bit
    fixes: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    consumer: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the JSONL logger; keys are stable."""
        return asdict(self)
