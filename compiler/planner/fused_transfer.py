"""Fused expert transfer in the compiler: whether a recipe's refits move each MoE layer's routed experts as two
stacked tensors (``refit.fused_transfer``, ``auto`` resolved here) and why. Read by the planner (the largest
tensor on the refit's wire) and the rules (RLC209, which records the decision), so both see the same answer."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlc.compiler.planner.layout import generation_layout, train_layout
from rlc.contract.refit_buffer import fused_transfer_applies

if TYPE_CHECKING:
    from rlc.compiler.recipe_types import Recipe

def _split_layout(recipe: "Recipe") -> str | None:
    """The parallelism that splits or spreads a layer's experts over GPUs on either side, or None."""
    tl, gl = train_layout(recipe), generation_layout(recipe)
    parts = [f"{side} {name.upper()}{size}" for side, name, size in
             (("trainer", "ep", tl.ep), ("trainer", "etp", tl.etp), ("trainer", "pp", tl.pp),
              ("vLLM", "tp", gl.tp), ("vLLM", "ep", gl.ep), ("vLLM", "pp", gl.pp)) if size > 1]
    return ", ".join(parts) or None


def fused_transfer(recipe: "Recipe", facts: Any) -> tuple[bool, str]:
    """``(on, reason)`` for ``refit.fused_transfer``.

    ``on`` / ``off`` are the recipe's (FP8 rollouts still move experts per expert, as the runtime does).
    ``auto`` turns it on for bf16 rollouts of a MoE model with gated, bias-free experts that Megatron-Bridge
    exports one tensor per expert, where every expert is whole on one GPU on both sides (trainer EP, ETP and PP
    1; vLLM TP, EP and PP 1): the layouts whose direct copies have been checked bit for bit on a GPU. Other
    layouts keep the per-expert path unless the recipe says ``on``.
    """
    value = recipe.refit.fused_transfer
    if recipe.generation.backend == "megatron":
        return False, "off: n/a with generation.backend megatron (no IPC stream into vLLM)"
    if value == "off":
        return False, "off: set in recipe"
    if value == "on":
        on, why = fused_transfer_applies(True, recipe.generation.precision)
        return on, why if not on else "on: set in recipe"
    if recipe.generation.precision == "fp8":
        return fused_transfer_applies(True, "fp8")
    if facts is None:
        return False, "off: the model's facts are unknown"
    if not facts.num_experts:
        return False, "off: the model has no routed experts"
    if not facts.gated_mlp or facts.expert_mlp_bias:
        return False, ("off: the experts " + ("have no gated linear unit" if not facts.gated_mlp else "carry biases")
                       + ", so they travel per expert")
    if facts.expert_export != "per_expert":
        return False, f"off: Megatron-Bridge exports this model's experts {facts.expert_export or 'in an unknown way'}"
    split = _split_layout(recipe)
    if split is not None:
        return False, (f"off: the experts are split or spread over GPUs ({split}); direct copies into that layout "
                       "are opt-in (refit.fused_transfer: on, checked by refit.verify_every)")
    return True, ("on: bf16 rollouts of a MoE model with every expert whole on one GPU: each layer's experts move "
                  "as two stacked tensors copied straight into vLLM's fused parameters")


__all__ = ["fused_transfer"]
