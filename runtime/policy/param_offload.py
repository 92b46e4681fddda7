"""The trainer's bf16 parameters to host memory while vLLM generates (``refit.offload_params_for_generation``).

After the refit the weights are in vLLM and the trainer does not read its parameters until the next
logprob pass. NeMo-RL (``offload_after_refit``), verl (``param_offload``), slime and SkyRL
(``colocate_all``) move them to host memory for that time so that vLLM's pool has the GPU. megatron-core
keeps every parameter of a DDP chunk as a view of one contiguous ``param_data`` buffer per bucket group
(``_ParamAndGradBuffer``) when the distributed optimizer is on; ``offload_to_cpu(move_params=True,
move_grads=False)`` copies it into pinned host memory and frees its storage, ``reload_from_cpu`` gives the
storage back and copies the values in, and every parameter view is valid again. The fp32 master shard
and the optimizer state are not moved here (``refit_source.offload`` moves the optimizer state for the
refit).

Without the distributed optimizer megatron-core allocates no ``param_data`` (each parameter is its own
tensor); the compiler refuses the switch then (RLC221) and :func:`param_buffers` says so if a runtime.yaml
asks for it anyway.
"""
from __future__ import annotations

from typing import Any

import torch


class ParamBuffersMissing(RuntimeError):
    """A DDP buffer has no contiguous parameter storage to offload (no distributed optimizer)."""


def param_buffers(model: list) -> list[Any]:
    """Every parameter-and-grad buffer of the model chunks (dense and expert-parallel), each with its
    ``param_data``; a buffer without one stops with :class:`ParamBuffersMissing`."""
    buffers = []
    for chunk in model:
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            if buffer.param_data is None:
                raise ParamBuffersMissing(
                    "refit.offload_params_for_generation: Megatron's DDP buffers hold no contiguous parameter "
                    "storage (param_data) without the distributed optimizer, so the parameters cannot be moved "
                    "to host memory; set training.use_distributed_optimizer: true or "
                    "refit.offload_params_for_generation: false and recompile")
            buffers.append(buffer)
    return buffers


def _resident_bytes(buffer: Any) -> int:
    data = buffer.param_data
    return int(data.numel() * data.element_size()) if data.untyped_storage().size() > 0 else 0


def offload_params(model: list) -> int:
    """The bf16 parameter buffers to pinned host memory; returns the bytes freed on the GPU."""
    buffers = param_buffers(model)
    torch.cuda.synchronize()  # the refit's last reads of the parameters are done
    moved = 0
    for buffer in buffers:
        moved += _resident_bytes(buffer)
        buffer.offload_to_cpu(move_params=True, move_grads=False)
    torch.cuda.synchronize()  # the device-to-host copies have landed before the storage goes back to the driver
    torch.cuda.empty_cache()
    return moved


def onload_params(model: list) -> int:
    """Inverse of :func:`offload_params`; returns the bytes brought back to the GPU."""
    buffers = param_buffers(model)
    restored = 0
    for buffer in buffers:
        before = _resident_bytes(buffer)
        buffer.reload_from_cpu(move_params=True, move_grads=False)
        restored += _resident_bytes(buffer) - before
    torch.cuda.synchronize()  # the host-to-device copies have landed before the next forward reads them
    return restored


__all__ = ["ParamBuffersMissing", "offload_params", "onload_params", "param_buffers"]
