"""Host memory of ``refit.verify_every``'s check, per node, in the refit phase (vLLM backend).

The trainer rank writes its export in shards that the vLLM worker on the same GPU checks as they arrive
(``rlc.contract.verify_check``): with bf16 rollouts a GPU's check holds a few shards; with FP8 rollouts the vLLM
worker gathers the whole export and two copies of its weights, which for a large model is more host memory than a
node has. The bytes come from the model's parameter counts: the export in ``model.dtype``, a shard's largest uncut
piece (a decoder layer, an MTP block, or the final norm with the LM head).
"""
from __future__ import annotations

from typing import Optional

from rlc.compiler.model import ModelFacts
from rlc.compiler.planner.plan import GIB, Item, gib
from rlc.compiler.recipe_types import Recipe
from rlc.contract.verify_check import gathered_check_host_bytes, shard_bound, streamed_check_host_bytes

LABEL = "refit.verify_every check"


def largest_uncut_params(facts: ModelFacts) -> Optional[int]:
    """Parameters of the largest run of the export the shard writer keeps together (None: a fact is unknown)."""
    if facts.layer_kinds is None or facts.hidden is None:
        return None
    sizes = [facts.layer_split(kind) for kind in set(facts.layer_kinds)]
    if any(s is None for s in sizes):
        return None
    pieces = [s.total for s in sizes if s is not None]
    vocab = facts.vocab_matrix_params()
    if vocab is not None:
        pieces.append(vocab + facts.hidden)  # the LM head (or the embedding) with the final norm
    if facts.mtp_num_layers:
        block = facts.mtp_block_split()
        if block is not None:
            pieces.append(block.total)
    return max(pieces)


def verify_check_items(recipe: Recipe, facts: ModelFacts, vllm_weights: Optional[int],
                       bytes_per_param: int) -> list[Item]:
    """The check's host memory per node (nothing when the check is off or a needed fact is unknown)."""
    if not recipe.refit.verify_every:
        return []
    unit = largest_uncut_params(facts)
    total = facts.param_counts().get("total")
    if unit is None or total is None:
        return []
    per_node = recipe.cluster.gpus_per_node
    unit_bytes = unit * bytes_per_param
    export = total * bytes_per_param
    if recipe.generation.precision == "fp8":
        if vllm_weights is None:
            return []
        per_gpu = gathered_check_host_bytes(export, vllm_weights, unit_bytes)
        note = (f"FP8 rollouts: the vLLM worker gathers the whole export ({gib(export):.1f} GiB) and two CPU copies "
                f"of its {gib(vllm_weights):.1f} GiB of weights, per GPU × {per_node} GPUs")
    else:
        share = 1.0 if vllm_weights is None else vllm_weights / export
        per_gpu = streamed_check_host_bytes(unit_bytes, export, share)
        note = (f"two shards of at most {gib(shard_bound(unit_bytes, export)):.2f} GiB per GPU (the writer's and the "
                f"reader's) and the reader's snapshot and reference of vLLM's share ({min(share, 1.0):.2f}) of one "
                f"× {per_node} GPUs")
    return [Item(LABEL, per_gpu * per_node / GIB, "refit", "recipe:refit.verify_every", note)]


__all__ = ["LABEL", "largest_uncut_params", "verify_check_items"]
