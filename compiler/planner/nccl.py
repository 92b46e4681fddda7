"""NCCL's NVLink SHARP (NVLS) buffers: device memory every process keeps per NCCL communicator.

NCCL (2.21 and later, ``src/transport/nvls.cc``) sets up NVLS when a communicator is created, if the
GPUs support NVLink multicast (NVSwitch systems: HGX H100 / H200 / H20, B200, GB200) and the
communicator has more than two GPUs on the node (``ncclNvlsInit``: ``gpuCount <= 2`` returns). It
maps, on every GPU of the communicator and outside PyTorch's allocator (so neither ``empty_cache``
nor vLLM's sleep gives it back)::

    channels × 2 × NCCL_NVLS_CHUNKSIZE (128 KiB) × NCCL_STEPS (8) × heads

bytes (``ncclNvlsBufferSetup``), ``heads`` being the communicator's GPUs on the node and
``channels`` 16 on Hopper (``NVLS_NCHANNELS_SM90``), 24 on Blackwell within one node and 32 across
nodes: 256 MiB per communicator on eight H100s. ``NCCL_NVLS_ENABLE=0`` turns it off; NeMo-RL's
DeepSeek-V3 and Qwen3-235B performance scripts do, "to avoid OOM issue".

Which communicators a process creates is a fact of the frameworks, counted here per parallel
group (one NCCL communicator each):

* trainer (Megatron-core): the default process group (initialised with an all-reduce, and used for
  barriers), TP, CP, data parallel × CP (dense gradients), PP, for MoE models EP, expert TP and
  expert data parallel (PyTorch creates a group's communicator at its first collective, and a dense
  model runs none on the expert groups), and the group the optimizer reduces gradient statistics
  over (the whole allocation with the distributed optimizer, ``intra_dist_opt_instance``; TP × PP
  without it);
* vLLM: the TP, PP, EP and data-parallel groups of one engine (pynccl communicators, created and
  warmed up at start); its world group has no device communicator.

Ranks are placed as Megatron's rank generator places them (order ``tp-cp-ep-dp-pp``: TP innermost;
for experts ETP, then EP) and vLLM's engines are contiguous blocks of TP × PP ranks, TP innermost.
A group counts when the node holding its first rank has at least three of its members (the layouts
are regular, so every group of that kind looks the same). Multi-node NVLink domains (GB200 NVL72)
are planned as one node each.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Optional, Sequence, Union

from rlc.compiler.planner.layout import GenerationLayout, TrainLayout

#: NCCL's defaults (``nvls.cc``, ``device.h``).
NVLS_CHUNK_BYTES = 128 * 1024
NCCL_STEPS = 8
#: NVLS channels per architecture: (within one node, across nodes).
NVLS_CHANNELS = {"hopper": (16, 16), "blackwell": (24, 32)}
#: Fewer GPUs than this on a node: NCCL sets up no NVLS for the communicator.
MIN_LOCAL_RANKS = 3

EnvValue = Union[str, int, float, bool]


@dataclass(frozen=True)
class NvlsSettings:
    """NVLS as ``cluster.env`` sets it (NCCL's defaults where it says nothing)."""

    enabled: bool
    chunk_bytes: int
    channels: Optional[int]  # NCCL_NVLS_NCHANNELS (None: the architecture's default)
    why_off: str = ""


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator of a process: its group, size and where its members sit."""

    name: str
    size: int
    local_ranks: int  # members on the node of the group's first rank
    nodes: int  # nodes the group spans


@dataclass(frozen=True)
class NvlsMemory:
    """The NVLS buffers one GPU of a process holds."""

    bytes: int
    communicators: tuple[Communicator, ...]  # the ones with NVLS
    note: str


def _env_int(env: Mapping[str, EnvValue], key: str) -> Optional[int]:
    value = env.get(key)
    if value is None:
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def nvls_settings(env: Mapping[str, EnvValue]) -> NvlsSettings:
    """NVLS on or off, chunk and channels, from ``cluster.env`` (``NCCL_NVLS_*``)."""
    enable = _env_int(env, "NCCL_NVLS_ENABLE")
    chunk = _env_int(env, "NCCL_NVLS_CHUNKSIZE") or NVLS_CHUNK_BYTES
    channels = _env_int(env, "NCCL_NVLS_NCHANNELS")
    if enable == 0:
        return NvlsSettings(False, chunk, channels, "cluster.env NCCL_NVLS_ENABLE=0")
    return NvlsSettings(True, chunk, channels)


def _group(name: str, strides_sizes: Sequence[tuple[int, int]], gpus_per_node: int) -> Optional[Communicator]:
    """The group spanned by ``(stride, size)`` dimensions from rank 0, or None when it has one member."""
    size = 1
    for _, n in strides_sizes:
        size *= max(1, n)
    if size < 2:
        return None
    local, nodes = _placement(tuple(strides_sizes), gpus_per_node)
    return Communicator(name, size, local, nodes)


@lru_cache(maxsize=1024)
def _placement(strides_sizes: tuple[tuple[int, int], ...], gpus_per_node: int) -> tuple[int, int]:
    """(members on rank 0's node, nodes spanned) of the group spanned by ``strides_sizes`` from rank 0."""
    members = [0]
    for stride, size in strides_sizes:
        members = [m + k * stride for m in members for k in range(max(1, size))]
    return sum(1 for m in members if m < gpus_per_node), len({m // gpus_per_node for m in members})


@lru_cache(maxsize=256)
def trainer_communicators(tl: TrainLayout, gpus_per_node: int, distributed_optimizer: bool,
                          moe: bool = True) -> tuple[Communicator, ...]:
    """Megatron-core's communicators on one GPU of the trainer (see the module docstring)."""
    tp, cp, dp, pp = tl.tp, tl.cp, tl.dp, tl.pp
    etp, ep, edp = tl.etp, tl.ep, tl.expert_dp
    stride_pp = tp * cp * dp  # dense order tp-cp-dp-pp (EP is 1 for dense ranks)
    groups = [
        _group("world", [(1, tl.world)], gpus_per_node),
        _group(f"TP{tp}", [(1, tp)], gpus_per_node),
        _group(f"CP{cp}", [(tp, cp)], gpus_per_node),
        _group(f"DP×CP {dp * cp}", [(tp, cp * dp)], gpus_per_node),
        _group(f"PP{pp}", [(stride_pp, pp)], gpus_per_node),
        _group(f"EP{ep}", [(etp, ep)], gpus_per_node) if moe else None,  # expert order tp-ep-dp-pp
        _group(f"expert TP{etp}", [(1, etp)], gpus_per_node) if moe else None,
        _group(f"expert DP{edp}", [(etp * ep, edp)], gpus_per_node) if moe else None,
        (_group("optimizer statistics (all ranks)", [(1, tl.world)], gpus_per_node) if distributed_optimizer
         else _group(f"TP×PP {tp * pp}", [(1, tp), (stride_pp, pp)], gpus_per_node)),
    ]
    return tuple(g for g in groups if g is not None)


@lru_cache(maxsize=256)
def generation_communicators(gl: GenerationLayout, gpus_per_node: int) -> tuple[Communicator, ...]:
    """vLLM's communicators on one GPU of an engine (see the module docstring)."""
    groups = [
        _group(f"TP{gl.tp}", [(1, gl.tp)], gpus_per_node),
        _group(f"PP{gl.pp}", [(gl.tp, gl.pp)], gpus_per_node),
    ]
    if gl.ep > 1:
        dp = gl.attention_dp  # data-parallel ranks inside one expert-parallel group
        groups.append(_group(f"EP{gl.ep}", [(1, gl.tp), (gl.tp * gl.pp, dp)], gpus_per_node))
        groups.append(_group(f"DP{dp}", [(gl.tp * gl.pp, dp)], gpus_per_node))
    return tuple(g for g in groups if g is not None)


def nvls_memory(communicators: Sequence[Communicator], arch: str, multicast: bool,
                settings: NvlsSettings) -> NvlsMemory:
    """NVLS bytes on one GPU for ``communicators`` on a GPU of ``arch`` (0 with NVLS off, saying what it saves)."""
    if not multicast:
        return NvlsMemory(0, (), "no NVLink multicast on this GPU")
    with_nvls = tuple(c for c in communicators if c.local_ranks >= MIN_LOCAL_RANKS)
    if not with_nvls:
        return NvlsMemory(0, (), f"no communicator has {MIN_LOCAL_RANKS} or more GPUs on a node")
    single, multi = NVLS_CHANNELS.get(arch, NVLS_CHANNELS["hopper"])
    sizes = tuple((settings.channels or (single if c.nodes == 1 else multi)) * 2 * settings.chunk_bytes
                  * NCCL_STEPS * c.local_ranks for c in with_nvls)
    mib = sorted({s >> 20 for s in sizes})
    each = f"{mib[0]} MiB" if len(mib) == 1 else f"{mib[0]}–{mib[-1]} MiB"
    count = f"{len(with_nvls)} communicator" + ("s" if len(with_nvls) > 1 else "")
    what = f"{count} × {each} ({', '.join(c.name for c in with_nvls)})"
    if not settings.enabled:
        return NvlsMemory(0, with_nvls, f"off ({settings.why_off}); on, it would keep {what}")
    return NvlsMemory(sum(sizes), with_nvls, f"{what}; NCCL_NVLS_ENABLE=0 frees it")


__all__ = ["Communicator", "NvlsMemory", "NvlsSettings", "generation_communicators", "nvls_memory",
           "nvls_settings", "trainer_communicators"]
