"""Megatron settings from ``runtime.yaml`` that the policy worker applies to the Bridge's model provider
and optimizer config: FP8, the MoE dispatcher, routing replay, fused RoPE for sequence packing, and the
``training.megatron_kwargs`` pass-through.

FP8 training (megatron-core 0.19 ``TransformerConfig``): ``fp8`` is the format (``e4m3`` / ``hybrid``),
``fp8_recipe`` the scaling recipe (``tensorwise``, ``delayed``, ``blockwise``, ``mxfp8``; Transformer Engine's
``Float8CurrentScaling``, ``DelayedScaling``, ``Float8BlockScaling``, ``MXFP8BlockScaling``), ``fp8_param`` keeps
the weights themselves in FP8 (Transformer Engine FP8 parameters), and the distributed optimizer then
all-gathers them in FP8 (``DistributedDataParallelConfig.fp8_param_gather``): Megatron-LM's
``--fp8-param-gather`` sets both, and so does ``training.fp8.param_gather``. Which recipes the cluster's GPUs
run is checked at compile time (RLC331).

Pure Python (no torch / megatron imports) so the mapping is tested on CPU; ``megatron_setup`` applies it.
"""
from __future__ import annotations

import logging
from typing import Any

from rlc.contract.runtime_config import RuntimeConfig
from rlc.contract.engine_options import MEGATRON_OWNED

log = logging.getLogger(__name__)


def typed_provider_settings(cfg: RuntimeConfig) -> dict[str, Any]:
    """Provider attributes from ``training.fp8`` and ``training.moe`` (only what the recipe turns on)."""
    t = cfg.training
    out: dict[str, Any] = {}
    if t.fp8.enabled:
        out.update(fp8=t.fp8.format, fp8_recipe=t.fp8.recipe, fp8_param=t.fp8.param_gather)
    if cfg.model.num_experts:
        out["moe_token_dispatcher_type"] = t.moe.token_dispatcher
        out["moe_enable_deepep"] = bool(t.moe.deepep)
        if t.moe.router_dtype != "auto":
            out["moe_router_dtype"] = t.moe.router_dtype
        if t.router_replay.enabled:
            # every TopKRouter gets a RouterReplay the policy worker arms with vLLM's routes
            out["moe_enable_routing_replay"] = True
    elif t.router_replay.enabled:
        raise ValueError("training.router_replay.enabled: the model has no routed experts (model.num_experts is 0); "
                         "recompile with training.router_replay.enabled: false")
    if cfg.model.mtp_num_layers:
        # Megatron adds the MTP block's next-next-token loss to every forward that trains (0.1 by
        # default); in RL that is a cross-entropy on the model's own rollouts mixed into the policy
        # gradient, so it is the recipe's choice (training.mtp_loss_scale, 0 by default).
        out["mtp_loss_scaling_factor"] = float(t.mtp_loss_scale)
    return out


def packed_rope_fusion(provider: Any, cfg: RuntimeConfig, *, mla_kernels: bool | None = None) -> bool:
    """Whether to turn on fused RoPE (``apply_rope_fusion``) for sequence packing.

    Unfused, megatron-core 0.19 applies RoPE to a packed (``thd``) row one sequence at a time: about a dozen small
    kernels per sequence, in every attention layer, for the queries and the keys, and again backward, so a micro
    batch of many short sequences spends its time launching them. Fused, one kernel takes the whole row (and
    computes in fp32); NeMo-RL's Megatron configurations turn it on too. Standard attention gets Transformer
    Engine's kernel; multi-latent attention (MLA) gets megatron-core's own Triton kernels
    (``fused_apply_mla_rope_for_q`` / ``_kv``), which it uses for its YaRN rotary embedding (the MLA providers'
    ``rope_type``, which is plain RoPE at scaling factor 1) and never while generating, so not with the Megatron
    generation backend. ``mla_kernels``: whether those kernels can load (Triton installed); found out here when
    not given.

    It is left alone when the recipe sets ``training.megatron_kwargs.apply_rope_fusion`` (that value is applied),
    and for RoPE the fused packed kernels do not cover: other position embeddings, YaRN scaling outside MLA,
    multimodal RoPE sections, MLA with plain ``rope`` or with cached latents.
    """
    if not cfg.training.sequence_packing.enabled or "apply_rope_fusion" in cfg.training.megatron_kwargs:
        return False
    if getattr(provider, "apply_rope_fusion", False) or getattr(provider, "position_embedding_type", None) != "rope":
        return False
    if getattr(provider, "multi_latent_attention", False):
        return _mla_rope_fusion(provider, cfg, mla_kernels)
    # the fused thd kernel takes no YaRN concentration factor; multimodal sections have a RoPE path of their own
    return (getattr(provider, "yarn_rotary_scaling_factor", None) is None
            and getattr(provider, "mrope_section", None) is None)


def _mla_rope_fusion(provider: Any, cfg: RuntimeConfig, kernels: bool | None) -> bool:
    if getattr(provider, "rope_type", None) != "yarn" or getattr(provider, "cache_mla_latents", False):
        return False
    if cfg.generation.backend != "vllm":
        return False  # megatron-core asserts that inference never runs MLA with fused RoPE
    if kernels is None:
        import importlib.util  # noqa: PLC0415

        kernels = importlib.util.find_spec("triton") is not None
    if not kernels:
        log.warning("sequence packing on multi-latent attention without Triton: megatron-core applies RoPE one "
                    "packed sequence at a time, which can dominate the step time on short rollouts")
    return kernels


def apply_provider_settings(provider: Any, cfg: RuntimeConfig) -> dict[str, Any]:
    """Set the typed settings, then ``training.megatron_kwargs`` unchanged; returns what was set.

    A pass-through key the runtime sets itself, or one the provider does not have (a typo would
    otherwise become a silently ignored attribute), raises ``ValueError`` naming the key.
    """
    applied = typed_provider_settings(cfg)
    if packed_rope_fusion(provider, cfg):
        applied["apply_rope_fusion"] = True
    for key, value in applied.items():
        setattr(provider, key, value)
    for key, value in cfg.training.megatron_kwargs.items():
        if key in MEGATRON_OWNED:
            raise ValueError(f"training.megatron_kwargs.{key}: set by the runtime from a typed recipe key; "
                             "recompile the bundle without it")
        if not hasattr(provider, key):
            raise ValueError(f"training.megatron_kwargs.{key}: the Megatron model provider "
                             f"({type(provider).__name__}) has no such option")
        setattr(provider, key, value)
        applied[key] = value
    return applied


def ddp_settings(cfg: RuntimeConfig) -> dict[str, Any]:
    """Extra ``megatron.core.distributed.DistributedDataParallelConfig`` arguments from ``runtime.yaml``."""
    fp8 = cfg.training.fp8
    return {"fp8_param_gather": bool(fp8.enabled and fp8.param_gather)}


def optimizer_settings(cfg: RuntimeConfig) -> dict[str, Any]:
    """Extra ``megatron.core.optimizer.OptimizerConfig`` arguments from ``runtime.yaml``."""
    return {"use_precision_aware_optimizer": bool(cfg.training.use_precision_aware_optimizer)}
