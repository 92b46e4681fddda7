"""FP8 rollouts in the compiler: how much of the model ``generation.fp8.keep_bf16`` keeps in the model dtype.

The fragments name checkpoint modules (NeMo-RL ``quantization_ignored_layer_kws``); the planner counts parameters
by layer component (attention, linear attention, Mamba, MLA, dense MLP, routed and shared experts, latent
projections). A component counts as kept, whole, when a fragment occurs in the name of any of its modules as
Hugging Face checkpoints name them (:data:`COMPONENT_MODULES`): never fewer bytes than vLLM holds, more when a
fragment names one part of a component (``o_proj`` keeps the whole attention here). A fragment that names no
decoder-layer module (``visual``: the vision tower, which the plan does not count) keeps nothing here. Block
scales' alignment conditions skip only the components a fragment list keeps whole
(:func:`component_fully_kept`).
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from rlc.contract.fp8 import kept

if TYPE_CHECKING:
    from rlc.compiler.model import ModelFacts
    from rlc.compiler.recipe_types import Recipe

#: Checkpoint module names (under ``model.layers.N.``) of each layer component, one tuple per naming family
#: (Llama / Qwen / DeepSeek / GLM / Mixtral / Qwen3-Next / Qwen3.5 / Nemotron-H).
COMPONENT_MODULES: dict[str, tuple[tuple[str, ...], ...]] = {
    "attention": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
                  ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.o_proj")),
    "mla": (("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
             "self_attn.o_proj"),
            ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj")),
    "linear_attention": (("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.conv1d",
                          "linear_attn.out_proj"),
                         ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a",
                          "linear_attn.in_proj_b", "linear_attn.conv1d", "linear_attn.out_proj")),
    "mamba": (("mixer.in_proj", "mixer.conv1d", "mixer.out_proj"),),
    "dense_mlp": (("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"), ("mixer.up_proj", "mixer.down_proj")),
    "routed_experts": (("mlp.experts.0.gate_proj", "mlp.experts.0.up_proj", "mlp.experts.0.down_proj"),
                       ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
                       ("block_sparse_moe.experts.0.w1", "block_sparse_moe.experts.0.w2",
                        "block_sparse_moe.experts.0.w3"),
                       ("mixer.experts.0.up_proj", "mixer.experts.0.down_proj")),
    "shared_experts": (("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"),
                       ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                        "mlp.shared_experts.down_proj"),
                       ("mixer.shared_experts.up_proj", "mixer.shared_experts.down_proj")),
    "latent_projections": (("mixer.fc1_latent_proj", "mixer.fc2_latent_proj"),
                           ("mlp.fc1_latent_proj", "mlp.fc2_latent_proj")),
}
#: Components the FP8 engine never quantizes (kept or not, they are not FP8 weights).
NOT_QUANTIZED = ("norms", "moe_router")


#: A layer index no fragment names: what a fragment matches in every layer.
ANY_LAYER = "#"


def _named(module: str, keep: tuple[str, ...], layer: str) -> bool:
    return kept(f"model.layers.{layer}.{module}.weight", keep)


def component_kept(component: str, keep: tuple[str, ...]) -> bool:
    """Whether a fragment of ``keep`` names any module of ``component`` in any layer (memory: the component counts
    as kept in every layer, so a fragment naming one layer, e.g. ``layers.0.``, counts for all)."""
    return any(_named(m, keep, layer) for family in COMPONENT_MODULES.get(component, ()) for m in family
               for layer in (ANY_LAYER, "0"))


def component_fully_kept(component: str, keep: tuple[str, ...]) -> bool:
    """Whether ``keep`` names every module of ``component`` in one naming family, in every layer (its shapes then
    do not matter to block scales: nothing of it is quantized)."""
    return any(all(_named(m, keep, ANY_LAYER) for m in family) for family in COMPONENT_MODULES.get(component, ()))


def kept_share(recipe: "Recipe", facts: "ModelFacts") -> float:
    """The share of the decoder layers' linear weights the FP8 engine keeps in the model dtype (0 without FP8
    rollouts or fragments; 1 when the layer facts are unknown)."""
    keep = tuple(recipe.generation.fp8.keep_bf16)
    if recipe.generation.precision != "fp8" or not keep:
        return 0.0
    if facts.layer_kinds is None:
        return 1.0
    kept_params = total = 0
    for kind, count in Counter(facts.layer_kinds).items():
        comps = facts.layer_components(kind)
        if comps is None:
            return 1.0
        for component, split in comps.items():
            if component in NOT_QUANTIZED:
                continue
            total += split.total * count
            kept_params += split.total * count if component_kept(component, keep) else 0
    return kept_params / total if total else 0.0


__all__ = ["COMPONENT_MODULES", "component_fully_kept", "component_kept", "kept_share"]
