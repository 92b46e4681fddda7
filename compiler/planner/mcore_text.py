"""The parts of ``plan.txt`` that differ with ``generation.backend: megatron`` (the layout line and the refit)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from rlc.contract.refit_buffer import GIB

if TYPE_CHECKING:  # the plan renders itself through this module
    from rlc.compiler.planner.plan import MemoryPlan


def mcore_layout_lines(plan: MemoryPlan, stages: str) -> list[str]:
    t = plan.layout["train"]
    moe = plan.layout.get("moe", True)
    m = plan.mcore or {}
    return [
        f"  train:      TP{t['tp']} PP{t['pp']} CP{t['cp']}" + (f" EP{t['ep']} ETP{t['etp']}" if moe else "")
        + (f" VPP{t['vpp']}" if t["vpp"] > 1 else "")
        + f" (DP {t['dp']}" + (f", expert DP {t['expert_dp']}" if moe else "") + f"; layers per stage {stages})",
        f"  generation: Megatron inference in each trainer process, {m.get('mode')} mode "
        f"({m.get('transformer_impl')}; one engine per GPU; KV pool {m.get('kv_cache')} while training)",
    ]


def mcore_refit_lines(plan: MemoryPlan) -> list[str]:
    m = plan.mcore or {}
    lines = ["refit (Megatron inference)"]
    if m.get("mode") == "dedicated":
        lines.append("  swap_model_weights copies every parameter and persistent buffer of the trainer into the "
                     "inference model (fp32 router bias kept fp32)")
        inf = m.get("inference_model") or {}
        if inf.get("resharded"):
            lines.append(f"  resharded into {inf['layout']} (one inference replica per GPU): each slice goes from "
                         "the GPU whose trainer holds it to the GPUs whose inference model wants it (NCCL)")
    else:
        lines.append("  shared mode: no weights move; the engine generates with the trainer's parameters")
    pool = m.get("kv_pool")
    if pool is None:
        lines.append("  KV pool: unknown (generation.kv_cache_memory_bytes or a model fact missing)")
        return lines
    lines += [
        f"  KV pool            {pool['bytes'] / GIB:8.2f} GiB = {pool['blocks']} blocks of {pool['block_tokens']} "
        f"tokens ({pool['block_bytes']} bytes each, the dummy block included)",
        f"  one request        {pool['blocks_per_request']} blocks at max_model_len; the pool holds "
        f"{pool['full_requests']} full-length requests at once",
        f"  engine step        at most {pool['max_requests']} requests and {pool['max_tokens']} tokens",
    ]
    return lines


__all__ = ["mcore_layout_lines", "mcore_refit_lines"]
