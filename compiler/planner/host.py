"""Host (CPU) memory per node: what sleep level 1 and the optimizer offloads put there.

vLLM's sleep level 1 copies each GPU's weight shard into pinned host memory, each allocation in a block
rounded up to a power of two (``pinned_copy.py``; level 2 discards it);
``offload_optimizer_for_refit`` moves gradients (counted at the GPU buffers' bytes per parameter:
fp32 with ``training.grad_reduce_in_fp32``, ``parts.grad_bytes_per_param``) and Adam moments (and the
fp32 master weights when they are optimizer state: precision-aware optimizer) to the host for the refit;
``optimizer_cpu_offload`` keeps a share of the optimizer state there all the time;
``training.offload_reference_policy`` keeps the KL penalty's reference policy there (in pinned blocks whose
sizes are powers of two, as the runtime allocates them: ``rlc.contract.host_blocks``);
``refit.offload_params_for_generation`` puts the trainer's bf16 parameters there while vLLM generates. Per node that
is the per-GPU block × ``cluster.gpus_per_node``, plus a per-process baseline, against the fraction
of host memory at which Ray's memory monitor starts killing workers (vime #191: GLM-4.5-Air on
GB200 reached 95 % of host memory at level 1 and died; level 2 peaked at 59 %).

The node's memory: ``cluster.host_memory_gib``, else a size in ``cluster.mem_per_node``, else the
typical node of the GPU type (``host_memory.yaml``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from rlc.contract.host_blocks import pinned_bytes
from rlc.compiler.planner.plan import GIB, Item, gib
from rlc.compiler.planner.residency import PhaseResidency
from rlc.compiler.recipe_types import Recipe
from rlc.compiler.tables import parse_table

HOST_FILE = Path(__file__).with_name("host_memory.yaml")
_SLURM_UNITS = {"K": 1 / (1 << 20), "M": 1 / 1024, "G": 1.0, "T": 1024.0, "": 1 / 1024}  # -> GiB (SLURM: MiB default)


@dataclass(frozen=True)
class HostTable:
    """``host_memory.yaml``: Ray's kill threshold, the per-process baseline and each GPU type's typical node."""

    threshold: float
    threshold_source: str
    baseline_gib_per_gpu: float
    baseline_source: str
    nodes: dict[str, tuple[float, str]]  # gpu -> (GiB, source)


@lru_cache(maxsize=1)
def host_table() -> HostTable:
    raw = parse_table(HOST_FILE.read_text(encoding="utf-8"))
    if not isinstance(raw, dict) or raw.get("format") != 1:
        raise ValueError("host_memory.yaml must have format: 1")
    return HostTable(
        threshold=float(raw["threshold"]["value"]), threshold_source=str(raw["threshold"]["source"]),
        baseline_gib_per_gpu=float(raw["process_baseline_gib_per_gpu"]["value"]),
        baseline_source=str(raw["process_baseline_gib_per_gpu"]["source"]),
        nodes={k: (float(v["gib"]), str(v["source"])) for k, v in raw["nodes"].items()},
    )


@dataclass(frozen=True)
class HostPlan:
    """Host memory of one node at its peak phase."""

    node_gib: Optional[float]
    node_source: str
    limit_gib: Optional[float]  # node × Ray's kill threshold
    phase: str  # the phase with the most host memory
    items: tuple[Item, ...]  # per node

    @property
    def used_gib(self) -> float:
        return sum(i.gib or 0.0 for i in self.items)

    @property
    def ok(self) -> Optional[bool]:
        return None if self.limit_gib is None else self.used_gib <= self.limit_gib

    def item_gib(self, label: str) -> float:
        return sum(i.gib or 0.0 for i in self.items if i.label == label)


def node_memory(recipe: Recipe, gpu_name: str) -> tuple[Optional[float], str]:
    """(host GiB per node, where the figure comes from)."""
    cluster = recipe.cluster
    if cluster.host_memory_gib is not None:
        return float(cluster.host_memory_gib), "cluster.host_memory_gib"
    mem = cluster.mem_per_node or ""
    m = re.fullmatch(r"([0-9]+)([KMGT]?)", mem)
    if m and int(m.group(1)) > 0:
        return int(m.group(1)) * _SLURM_UNITS[m.group(2)], f"cluster.mem_per_node {mem}"
    node = host_table().nodes.get(gpu_name)
    if node is None:
        return None, f"no typical node memory for {gpu_name}; set cluster.host_memory_gib"
    return node[0], f"typical {gpu_name} node: {node[1]}"


def host_plan(recipe: Recipe, figs: Sequence[Mapping[str, Any]], vllm_weights: Optional[int],
              vllm_copy: Optional[int], table: Mapping[str, PhaseResidency], gpu: Any,
              extra: Optional[Mapping[str, Sequence[Item]]] = None) -> HostPlan:
    """The host memory of one node in its worst phase (train, refit or generate).

    ``vllm_weights``: vLLM's weight bytes on its worst GPU; ``vllm_copy``: the host bytes of their
    level-1 copy there (pinned blocks, ``pinned_copy.py``); ``extra``: more per-node items by phase name
    (the rollout batch's routes with routing replay)."""
    per_node = recipe.cluster.gpus_per_node
    ht = host_table()
    node_gib, node_source = node_memory(recipe, gpu.name)
    limit = None if node_gib is None else node_gib * ht.threshold
    def offloaded(f: Mapping[str, Any]) -> float:
        """The stage's bytes the offloads can put in host memory at once (the worst stage has most)."""
        moved = max((p.host.reference + p.host.params for p in table.values()), default=0.0)
        return 2 * f["master_bytes"] + f["grads_bytes"] + f["moments_bytes"] + f["params_bytes"] * moved

    worst_fig = max(figs, key=offloaded) if figs else None

    def items_for(phase: PhaseResidency) -> list[Item]:
        h = phase.host
        out = [Item("trainer + vLLM processes (baseline)", ht.baseline_gib_per_gpu * per_node, "host",
                    "host_memory:process_baseline_gib_per_gpu",
                    f"{ht.baseline_gib_per_gpu:g} GiB per GPU × {per_node} GPUs")]
        if h.vllm_weights and vllm_weights is not None:
            copy = vllm_copy if vllm_copy is not None else vllm_weights
            out.append(Item("vLLM weight copy (sleep level 1)", copy * h.vllm_weights * per_node / GIB,
                            "vllm", "params", f"{gib(copy):.2f} GiB per GPU in pinned blocks (a power of two "
                            f"each) for {gib(vllm_weights):.2f} GiB of weights × {per_node} GPUs"))
        if worst_fig is not None:
            for key, label in (("grads", "Megatron grads (offloaded)"), ("master", "optimizer fp32 master (offloaded)"),
                               ("moments", "optimizer Adam moments (offloaded)")):
                share = getattr(h, key)
                if share:
                    out.append(Item(label, worst_fig[f"{key}_bytes"] * share * per_node / GIB, "megatron", "params",
                                    f"× {per_node} GPUs"))
            if h.cpu_optimizer_grads:
                out.append(
                    Item(
                        "CPU optimizer's fp32 gradients",
                        worst_fig["master_bytes"] * h.cpu_optimizer_grads * per_node / GIB,
                        "megatron",
                        "params",
                        f"HybridDeviceOptimizer's host copy of each offloaded shard's gradient × {per_node} GPUs",
                    )
                )
            if h.params:
                out.append(Item("Megatron params (offloaded for generation)", worst_fig["params_bytes"] * h.params
                                * per_node / GIB, "megatron", "params", f"× {per_node} GPUs"))
            if h.reference:
                ref = worst_fig["params_bytes"]
                copy = pinned_bytes(ref)
                out.append(Item("reference policy params (offloaded)", copy * h.reference * per_node / GIB,
                                "megatron", "params", f"{gib(copy):.3f} GiB per GPU in pinned blocks (powers of two) "
                                f"for {gib(ref):.3f} GiB of parameters × {per_node} GPUs"))
        return out

    phases = {name: items_for(p) for name, p in table.items()}
    for name, items in (extra or {}).items():
        if name in phases:
            phases[name] += list(items)
    worst = max(phases, key=lambda n: sum(i.gib or 0.0 for i in phases[n]))
    return HostPlan(node_gib=node_gib, node_source=node_source, limit_gib=limit, phase=worst,
                    items=tuple(phases[worst]))


__all__ = ["HostPlan", "host_plan", "host_table", "node_memory"]
