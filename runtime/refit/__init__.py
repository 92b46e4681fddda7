"""Refit engine: move updated trainer weights into the colocated generation engine every step.

Pure-Python parts (no torch; usable by the compiler and CI): ``specs``, ``bucket_planner``,
``manifest``, ``protocol``, ``metrics``, ``errors``. Runtime parts (torch + pyzmq): ``buffers``,
``channel``, ``producer``, ``consumer``; they are imported lazily from this package so that
``import rlc.runtime.refit.bucket_planner`` never pulls in torch.

Public API::

    RefitProducer(refit_cfg, session=, rank=, world_size=, export_dtype=, ...).prepare(specs) / .send(it)
    RefitConsumer(session=, transport=, ...).prepare() / .receive(load_weights)
    plan_refit(specs, free_bytes, buffer_memory_ratio=, buffer_gb=, alignment_bytes=, reserve_bytes=)
    TensorSpec, specs_from_named_tensors(it), wire_specs, ManifestTracker, RefitMetrics,
    free_device_memory(device), errors
"""
from __future__ import annotations

import importlib
from typing import Any

from rlc.runtime.refit.bucket_planner import (
    SLOT_ONEOFF,
    Bucket,
    BucketPacker,
    BufferSizing,
    RefitPlan,
    plan_from_config,
    plan_refit,
    size_buffers,
)
from rlc.runtime.refit.errors import (
    RefitError,
    RefitLeakError,
    RefitManifestError,
    RefitPlanError,
    RefitProtocolError,
    RefitRemoteError,
    RefitTimeoutError,
)
from rlc.runtime.refit.manifest import ManifestReport, ManifestTracker
from rlc.runtime.refit.metrics import ConsumerMetrics, RefitMetrics, fixes_active
from rlc.runtime.refit.specs import TensorSpec, specs_from_named_tensors, wire_dtype, wire_specs

_LAZY = {
    "RefitProducer": "rlc.runtime.refit.producer",
    "RefitConsumer": "rlc.runtime.refit.consumer",
    "ShmBackend": "rlc.runtime.refit.buffers",
    "CudaIpcBackend": "rlc.runtime.refit.buffers",
    "make_backend": "rlc.runtime.refit.buffers",
    "free_device_memory": "rlc.runtime.refit.buffers",
    "free_shm_memory": "rlc.runtime.refit.buffers",
    "cuda_device_uuid": "rlc.runtime.refit.buffers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rlc.runtime.refit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "SLOT_ONEOFF",
    "Bucket",
    "BucketPacker",
    "BufferSizing",
    "ConsumerMetrics",
    "ManifestReport",
    "ManifestTracker",
    "RefitError",
    "RefitLeakError",
    "RefitManifestError",
    "RefitMetrics",
    "RefitPlan",
    "RefitPlanError",
    "RefitProtocolError",
    "RefitRemoteError",
    "RefitTimeoutError",
    "TensorSpec",
    "fixes_active",
    "plan_from_config",
    "plan_refit",
    "size_buffers",
    "specs_from_named_tensors",
    "wire_dtype",
    "wire_specs",
    *_LAZY,
]
