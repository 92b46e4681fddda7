"""RLC320: Rollout Routing Replay (``training.router_replay``) needs a MoE model and a stack that records and replays
routes."""
from __future__ import annotations

from rlc.compiler.rules.engine import Context, rule

KEY = "training.router_replay.enabled"
#: The vLLM release whose routes layout the runtime reads: ``CompletionOutput.routed_experts``, one array per
#: completion of shape [prompt + response - 1, decoder layers, experts per token], prompt rows first.
ROUTES_VLLM = ("0", "22")
#: Model families whose vLLM MTP drafter numbers its layers after the decoder's (deepseek_mtp.py, glm4_moe_mtp.py:
#: ``mtp_start_layer_idx = num_hidden_layers``), so vLLM's routes recorder skips the drafter's routers. Other
#: drafters (qwen3_next_mtp.py, qwen3_5_mtp.py: ``mtp.layers.0``) share layer ids with the decoder's first layers
#: and would overwrite their recorded routes on every speculative step.
DRAFTER_AFTER_DECODER = ("deepseek_v2", "deepseek_v3", "glm4_moe")
#: Megatron options under which megatron-core 0.19.2 routes without consulting the replay.
FUSED_ROUTER = "moe_router_fusion"


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(str(version).split("+")[0].split(".")[:2])


@rule("RLC320", "routing replay needs a MoE model and a stack that records and replays routes",
      severities=("error", "warning"),
      rationale="Rollout Routing Replay (R3, arXiv 2510.11370) makes the trainer route every rollout token to the "
                "experts vLLM routed it to, so the trainer's logprobs come from the experts that sampled the token. "
                "A dense model has no routed experts. vLLM records the routes only without pipeline parallelism "
                "(it refuses enable_return_routed_experts with PP > 1), and the runtime reads the layout of vLLM "
                "0.22 (one array per completion, prompt rows first); other releases returned the routes in other "
                "layouts, which would pair tokens with another token's experts. megatron-core 0.19.2's fused top-k "
                "(moe_router_fusion) computes the routing without consulting RouterReplay. With MTP speculative "
                "decoding, vLLM records the drafter's routers under their layer ids: drafters that number their "
                "layers from 0 (Qwen3-Next, Qwen3.5) overwrite the routes of the decoder's first layers.",
      seed="vLLM PR #28284 (routed_experts_capturer.py; VllmConfig: 'incompatible with pipeline parallelism'); "
           "megatron-core transformer/moe/router_replay.py and moe_utils.topk_routing_with_score_function (the "
           "fused path returns before the replay); NeMo-RL PR #2590 (policy.router_replay.enabled).",
      fixes="Turn training.router_replay.enabled off (dense models, or a stack without it), or: "
            "parallelism.generation.pp: 1; generation.vllm_version 0.22; drop training.megatron_kwargs."
            "moe_router_fusion; speculative decoding off (or method ngram) for models whose MTP drafter numbers its "
            "layers from 0.")
def router_replay(ctx: Context) -> None:
    recipe, facts = ctx.recipe, ctx.facts
    if not recipe.training.router_replay.enabled:
        return
    off = f"{KEY}: false"
    if facts is not None:
        if facts.is_moe is False:
            ctx.error(f"routing replay on {facts.model_id}, a dense model: it has no routed experts to replay", KEY,
                      hint=off)
        elif facts.is_moe is None:
            ctx.warning(f"whether {facts.model_id} has routed experts is not known, so routing replay cannot be "
                        "checked against the model", KEY, hint="state the expert count in model.config")
    if recipe.parallelism.generation.pp > 1:
        ctx.error(f"routing replay with parallelism.generation.pp {recipe.parallelism.generation.pp}: vLLM records "
                  "the routed experts only without pipeline parallelism", "parallelism.generation.pp",
                  hint=f"parallelism.generation.pp: 1, or {off}")
    version = ctx.plan.vllm_version if ctx.plan is not None and ctx.plan.vllm_version else \
        recipe.generation.vllm_version
    if version and _major_minor(version) != ROUTES_VLLM:
        ctx.error(f"routing replay with vLLM {version}: the runtime reads vLLM {'.'.join(ROUTES_VLLM)}'s routes "
                  "layout (one array per completion, prompt rows first); other releases return them differently",
                  "generation.vllm_version", hint=f"generation.vllm_version: \"{'.'.join(ROUTES_VLLM)}\", or {off}")
    if recipe.training.megatron_kwargs.get(FUSED_ROUTER):
        ctx.error(f"routing replay with training.megatron_kwargs.{FUSED_ROUTER}: megatron-core's fused top-k "
                  "routes without consulting the replay", f"training.megatron_kwargs.{FUSED_ROUTER}",
                  hint=f"drop training.megatron_kwargs.{FUSED_ROUTER}")
    if recipe.generation.drafts_with_mtp and facts is not None and facts.family not in DRAFTER_AFTER_DECODER:
        ctx.error(f"routing replay with MTP speculative decoding on a {facts.family} model: vLLM's MTP drafter "
                  "for it numbers its layers from 0, so its routes overwrite those recorded for the decoder's "
                  "first layers", "generation.speculative_decoding.method",
                  hint=f"drop generation.speculative_decoding (or use method: ngram), or {off}")


__all__ = ["DRAFTER_AFTER_DECODER", "ROUTES_VLLM", "router_replay"]
