"""``refit.verify_every``'s shards and host memory: one definition, read by the runtime's check
(``rlc.runtime.refit.verify_stream``) and the compiler's host-memory plan (pure Python, no torch).

The trainer rank writes its export in shards of at least :data:`SHARD_BYTES`, cut only where the decoder layer
changes, so a shard stays below ``SHARD_BYTES`` plus the largest piece the writer does not cut (a decoder layer, or
the embedding, final norm and LM head together). At most :data:`MAX_PENDING` shards wait on disk.
"""
from __future__ import annotations

import re

#: A shard is cut at the first layer change once it holds this many bytes.
SHARD_BYTES = 1 << 30
#: Shards written and not yet read; the writer waits above this.
MAX_PENDING = 2

#: A decoder layer's index in an HF or vLLM parameter name (``model.layers.7.mlp...``, ``backbone.layers.7...``).
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a parameter belongs to (None: embedding, final norm, LM head and the like)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def shard_bound(largest_unit_bytes: int, export_bytes: int) -> int:
    """The most bytes one shard can hold: ``SHARD_BYTES`` less one byte, then the largest uncut piece (and never more
    than the whole export)."""
    return min(SHARD_BYTES + largest_unit_bytes, export_bytes)


def streamed_check_host_bytes(largest_unit_bytes: int, export_bytes: int, vllm_share: float = 1.0) -> int:
    """Host memory of one GPU's check with bf16 rollouts: the writer's shard being built, the reader's shard, and the
    reader's snapshot and reference of the shard's layers, which are vLLM's share of them (``vllm_share``: vLLM's
    weight bytes on the GPU over the export's bytes, at most 1)."""
    share = min(max(vllm_share, 0.0), 1.0)
    return int((2 + 2 * share) * shard_bound(largest_unit_bytes, export_bytes))


def gathered_check_host_bytes(export_bytes: int, vllm_weight_bytes: int, largest_unit_bytes: int) -> int:
    """Host memory of one GPU's check with FP8 rollouts: the reader gathers the whole export (vLLM's layerwise
    reload processes a layer once all its tensors are in) and takes two CPU copies of vLLM's weights (before and
    after the reference load), while the writer holds its last shard."""
    return export_bytes + 2 * vllm_weight_bytes + shard_bound(largest_unit_bytes, export_bytes)
