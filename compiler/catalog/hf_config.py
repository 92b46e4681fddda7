"""Turn an HF ``config.json`` (a plain dict) into :class:`rlc.compiler.model.ModelFacts`.

One small reader per model family; each takes only what the config states. A fact the config does
not give stays ``None`` and is named in ``ModelFacts.unknown``. A few facts are not in any
``config.json`` and come from the conversion code instead (which tensors Megatron-Bridge exports
stacked, which parameters are fp32); each such fact carries its source in ``notes``.

The shipped catalog files keep their provenance under keys starting with ``_`` (ignored here,
except ``_layer_counts`` and ``_absent``) and, for the partial Nemotron-3-Ultra entry, a few
``*_secondary`` / ``recipe_*`` keys whose weaker source is recorded in ``notes``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from rlc.compiler.catalog.context import context_length
from rlc.compiler.model import Fp32Param, LayerKind, ModelFacts
from rlc.contract.model_overrides import MTP_HIDDEN_KEY, NEXTN_KEY

ROUTER_BIAS = Fp32Param(
    pattern="*e_score_correction_bias*",
    example="model.layers.3.mlp.gate.e_score_correction_bias",
    why="aux-loss-free router bias; bf16 rounding at its magnitude (~25-57) erases per-expert offsets "
        "(std ~7e-4) and corrupts routing (SkyRL #1816)",
)
MEGATRON_EXPERT_BIAS = Fp32Param(
    pattern="*expert_bias*",
    example="decoder.layers.3.mlp.router.expert_bias",
    why="Megatron name of the same router bias (SkyRL #1816)",
)


_FACT_FIELDS = ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "tied_embeddings",
                "num_experts", "experts_per_tok", "moe_intermediate", "shared_expert_intermediate",
                "dense_intermediate", "layer_kinds", "mtp_num_layers", "mtp_shared_embedding")


class ConfigFormatError(ValueError):
    """The config is not a model config this reader understands."""


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language-model part: ``text_config`` for VL checkpoints (Qwen3.5), else the root."""
    text = cfg.get("text_config")
    if isinstance(text, dict):
        merged = {k: v for k, v in cfg.items() if k != "text_config"}
        merged.update(text)
        return merged
    return cfg


#: Routed-expert count of Qwen3-MoE / Qwen3.5 configs: checkpoints on the Hub say ``num_experts``;
#: transformers 5 writes ``num_local_experts`` when it saves one of these configs.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")

#: Largest architecture size (layers, widths, heads, experts, vocabulary) taken from a config.
MAX_FACT = 1 << 40
#: Most decoder (and MTP) layers a model may have: the planner lays out every layer, so a count of
#: 2**40 would exhaust memory (the largest public models have under 200; the recipe's per-stage
#: layer keys allow up to the same number).
MAX_LAYERS = 10_000


def _int(cfg: dict[str, Any], *keys: str) -> Optional[int]:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not 0 <= value <= MAX_FACT:
                raise ConfigFormatError(f"{key} is {value}, which is no architecture size "
                                        f"(expected 0 to {MAX_FACT}); fix the config or model.overrides")
            return value
    return None


def _bool(cfg: dict[str, Any], key: str) -> Optional[bool]:
    value = cfg.get(key)
    return value if isinstance(value, bool) else None


def _head_dim(cfg: dict[str, Any]) -> Optional[int]:
    hd = _int(cfg, "head_dim")
    if hd is not None:
        return hd
    h, nh = _int(cfg, "hidden_size"), _int(cfg, "num_attention_heads")
    return h // nh if h and nh else None


def _common(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_layers": _int(cfg, "num_hidden_layers"),
        "hidden": _int(cfg, "hidden_size"),
        "heads": _int(cfg, "num_attention_heads"),
        "kv_heads": _int(cfg, "num_key_value_heads"),
        "head_dim": _head_dim(cfg),
        "vocab": _int(cfg, "vocab_size"),
        "tied_embeddings": _bool(cfg, "tie_word_embeddings"),
    }


# --------------------------------------------------------------------------- families


def _dense(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama / Qwen2 / Qwen3 dense decoders."""
    out = _common(cfg)
    n = out["num_layers"]
    out.update(
        dense_intermediate=_int(cfg, "intermediate_size"),
        num_experts=0,
        layer_kinds=None if n is None else (("full_attention", "dense"),) * n,
        qk_norm=cfg.get("model_type") == "qwen3",
        # Qwen2's q/k/v projections always carry biases; its config has no attention_bias key
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
    )
    return out


def _qwen3_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _common(cfg)
    n = out["num_layers"]
    dense_layers = set(cfg.get("mlp_only_layers") or [])
    step = _int(cfg, "decoder_sparse_step") or 1
    kinds = None
    if n is not None:
        kinds = tuple(("full_attention", "dense" if (i in dense_layers or (i + 1) % step) else "moe")
                      for i in range(n))
    out.update(
        num_experts=_int(cfg, *EXPERT_COUNT_KEYS),
        experts_per_tok=_int(cfg, "num_experts_per_tok"),
        moe_intermediate=_int(cfg, "moe_intermediate_size"),
        shared_expert_intermediate=0,
        dense_intermediate=_int(cfg, "intermediate_size"),
        layer_kinds=kinds,
        qk_norm=True,
        expert_export="per_expert",
    )
    out["_notes"] = ["expert export per expert: HF Qwen3-MoE checkpoints store experts.{i}.gate_proj/up_proj/down_proj"]
    return out


def _qwen3_5_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE / Qwen3-Next: Gated DeltaNet + gated attention, shared expert, MTP."""
    out = _common(cfg)
    n = out["num_layers"]
    types = cfg.get("layer_types")
    kinds = None
    if isinstance(types, list) and n is not None and len(types) == n:
        kinds = tuple(("linear_attention" if t == "linear_attention" else "full_attention", "moe") for t in types)
    elif n is not None and (every := _int(cfg, "full_attention_interval")):
        kinds = tuple(("full_attention" if (i + 1) % every == 0 else "linear_attention", "moe") for i in range(n))
    mtp = _int(cfg, MTP_HIDDEN_KEY)
    dedicated = _bool(cfg, "mtp_use_dedicated_embeddings")
    out.update(
        num_experts=_int(cfg, *EXPERT_COUNT_KEYS),
        experts_per_tok=_int(cfg, "num_experts_per_tok"),
        moe_intermediate=_int(cfg, "moe_intermediate_size"),
        shared_expert_intermediate=_int(cfg, "shared_expert_intermediate_size"),
        shared_expert_gate=True,
        layer_kinds=kinds,
        attn_output_gate=bool(cfg.get("attn_output_gate", False)),
        qk_norm=True,
        linear_key_heads=_int(cfg, "linear_num_key_heads"),
        linear_value_heads=_int(cfg, "linear_num_value_heads"),
        linear_key_head_dim=_int(cfg, "linear_key_head_dim"),
        linear_value_head_dim=_int(cfg, "linear_value_head_dim"),
        linear_conv_kernel=_int(cfg, "linear_conv_kernel_dim"),
        mtp_num_layers=mtp if mtp is not None else 0,
        mtp_shared_embedding=None if dedicated is None else not dedicated,
        mtp_layer_kinds=(("full_attention", "moe"),),
        expert_export="stacked",
        hf_prefix="model.language_model",
    )
    out["_notes"] = [
        "expert export stacked: HF Qwen3.5 checkpoints hold fused experts.gate_up_proj [E, 2I, H]; "
        "Megatron-Bridge _accumulate_grouped_export torch.stack()s all E experts (NeMo-RL #2471 failure 2)",
    ]
    if mtp is None:
        out["_notes"].append("mtp_num_hidden_layers not stated: assumed 0")
    return out


def _qwen3_5_dense(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5 dense (``qwen3_5`` / ``qwen3_5_text``, e.g. Qwen3.5-9B): the MoE reader's Gated DeltaNet + gated
    attention layers with a dense SwiGLU MLP in every layer and in the MTP block."""
    out = _qwen3_5_moe(cfg)
    kinds = out["layer_kinds"]
    out.update(
        num_experts=0,
        experts_per_tok=None,
        moe_intermediate=None,
        shared_expert_intermediate=None,
        shared_expert_gate=False,
        dense_intermediate=_int(cfg, "intermediate_size"),
        layer_kinds=None if kinds is None else tuple((mixer, "dense") for mixer, _ in kinds),
        mtp_layer_kinds=(("full_attention", "dense"),),
        expert_export=None,
    )
    out["_notes"] = [n for n in out["_notes"] if not n.startswith("expert export")]
    return out


#: The note of readers whose MTP block reuses the model's word embedding in Megatron.
_MTP_SHARED_EMBEDDING_NOTE = (
    "MTP shares the main word embedding in Megatron (the HF MTP layer's embed_tokens is a copy)"
)


def _first_k_dense_moe(cfg: dict[str, Any], mixer: str, mtp: Optional[int]) -> dict[str, Any]:
    """The facts DeepSeek-V3-style MoE configs (DeepSeek, Kimi-K2, GLM-4.5) state the same way:
    ``first_k_dense_replace`` dense layers then MoE layers with ``mixer`` attention, ``n_routed_experts`` routed
    plus ``n_shared_experts`` shared experts of ``moe_intermediate_size``, experts exported one by one, and ``mtp``
    MTP blocks of the same kind sharing the word embedding (vLLM keeps their ``eh_proj`` whole)."""
    out = _common(cfg)
    n = out["num_layers"]
    first_k = _int(cfg, "first_k_dense_replace") or 0
    n_shared, moe_i = _int(cfg, "n_shared_experts"), _int(cfg, "moe_intermediate_size")
    out.update(
        num_experts=_int(cfg, "n_routed_experts"),
        experts_per_tok=_int(cfg, "num_experts_per_tok"),
        moe_intermediate=moe_i,
        shared_expert_intermediate=None if n_shared is None or moe_i is None else n_shared * moe_i,
        dense_intermediate=_int(cfg, "intermediate_size"),
        first_k_dense=first_k,
        layer_kinds=None if n is None else tuple((mixer, "dense" if i < first_k else "moe") for i in range(n)),
        mtp_num_layers=mtp,
        mtp_shared_embedding=True if mtp else None,
        mtp_layer_kinds=((mixer, "moe"),),
        vllm_mtp_eh_proj_replicated=True,
        expert_export="per_expert",
    )
    return out


def _deepseek(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2 / V3 / Kimi-K2: MLA (V2-Lite: full q_proj, no q LoRA), first-k dense layers, routed + shared
    experts (V2: softmax routing without expert bias, ``topk_method: greedy``), MTP (V3)."""
    notes = ["expert export per expert: HF DeepSeek-V3-style checkpoints store experts.{i}.* separately"]
    topk = cfg.get("topk_method")
    if topk is None:
        expert_bias = True
        notes.append("topk_method not stated: router e_score_correction_bias assumed (DeepSeek-V3 architecture)")
    else:
        expert_bias = topk == "noaux_tc"
    mtp = _int(cfg, NEXTN_KEY)
    if mtp is None and cfg.get("model_type") == "deepseek_v2":
        mtp = 0  # the DeepSeek-V2 architecture has no MTP module (its config.json has no such key)
    out = _first_k_dense_moe(cfg, "mla", mtp)
    out.update(
        kv_heads=out["kv_heads"] or out["heads"],
        q_lora_rank=_int(cfg, "q_lora_rank"),
        kv_lora_rank=_int(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim"),
        v_head_dim=_int(cfg, "v_head_dim"),
        expert_bias=expert_bias,
        router_groups=_int(cfg, "n_group"),
    )
    if mtp:
        notes.append(_MTP_SHARED_EMBEDDING_NOTE)
    out["_notes"] = notes
    return out


def _glm4_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5 / 4.6 / 4.5-Air: GQA attention with qkv bias, first-k dense layers, routed + shared experts, MTP."""
    mtp = _int(cfg, NEXTN_KEY)
    out = _first_k_dense_moe(cfg, "full_attention", mtp)
    out.update(
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        expert_bias=True,
        router_groups=_int(cfg, "n_group"),
    )
    out["_notes"] = ["expert export per expert: HF GLM-4.5 checkpoints store experts.{i}.gate_proj/up_proj/down_proj",
                     "router e_score_correction_bias (sigmoid, aux-loss-free routing)"]
    if mtp:
        out["_notes"].append(_MTP_SHARED_EMBEDDING_NOTE)
    return out


_PATTERN = {"M": ("mamba", None), "E": (None, "moe"), "*": ("full_attention", None), "-": (None, "dense")}


def _even_mix(counts: dict[str, int]) -> tuple[LayerKind, ...]:
    """A layer order with each kind spread evenly (used only when the real pattern is unknown)."""
    total = sum(counts.values())
    slots: list[tuple[float, int, str]] = []
    for order, (sym, cnt) in enumerate(sorted(counts.items())):
        for j in range(cnt):
            slots.append(((j + 0.5) * total / cnt, order, sym))
    slots.sort()
    return tuple(_PATTERN[sym] for _, _, sym in slots)


def _nemotron_h(cfg: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H: hybrid Mamba-2 / attention / (Latent)MoE layers, squared-ReLU experts."""
    out = _common(cfg)
    notes = ["expert export per expert: Megatron-Bridge nemotron_h_bridge maps experts.*.up_proj / down_proj"]
    pattern = cfg.get("hybrid_override_pattern")
    kinds, order_known = None, True
    if isinstance(pattern, str) and set(pattern) <= set(_PATTERN):
        kinds = tuple(_PATTERN[c] for c in pattern)
        if out["num_layers"] is None:
            out["num_layers"] = len(pattern)
    else:
        counts_raw = cfg.get("_layer_counts")
        if isinstance(counts_raw, dict):
            counts = {}
            for key, cnt in counts_raw.items():
                sym = key[0]
                if sym in _PATTERN and isinstance(cnt, int):
                    counts[sym] = cnt
            if counts and sum(counts.values()) == (out["num_layers"] or sum(counts.values())):
                kinds = _even_mix(counts)
                order_known = False
                notes.append("hybrid_override_pattern not known, only per-kind layer counts: "
                             "per-stage figures assume the kinds are evenly mixed")
    mtp = _int(cfg, NEXTN_KEY)
    mtp_source = None
    if mtp is None and _int(cfg, "recipe_mtp_num_layers") is not None:
        mtp = _int(cfg, "recipe_mtp_num_layers")
        mtp_source = "mtp_num_layers from the Megatron-Bridge training recipe (not from config.json)"
    mtp_pattern = cfg.get("mtp_hybrid_override_pattern")
    mtp_kinds = tuple(_PATTERN[c] for c in mtp_pattern) if isinstance(mtp_pattern, str) and \
        set(mtp_pattern) <= set(_PATTERN) else None
    n_shared, shared_i = _int(cfg, "n_shared_experts"), _int(cfg, "moe_shared_expert_intermediate_size")
    num_experts = _int(cfg, "n_routed_experts")
    topk = _int(cfg, "num_experts_per_tok")
    if num_experts is None and _int(cfg, "n_routed_experts_secondary") is not None:
        num_experts = _int(cfg, "n_routed_experts_secondary")
        notes.append(f"n_routed_experts={num_experts} from a secondary source (paper summary), not config.json")
    if topk is None and _int(cfg, "num_experts_per_tok_secondary") is not None:
        topk = _int(cfg, "num_experts_per_tok_secondary")
    if mtp_source:
        notes.append(mtp_source)
    if mtp:
        notes.append("MTP shares the main word embedding (Megatron-Bridge maps no MTP embedding for Nemotron-H)")
    shared = None
    if shared_i is not None:
        shared = shared_i * (n_shared if n_shared is not None else 1)
    out.update(
        num_experts=num_experts,
        experts_per_tok=topk,
        moe_intermediate=_int(cfg, "moe_intermediate_size"),
        shared_expert_intermediate=shared,
        dense_intermediate=_int(cfg, "intermediate_size"),
        gated_mlp=False,
        latent_size=_int(cfg, "moe_latent_size"),
        layer_kinds=kinds,
        layer_order_known=order_known,
        mamba_heads=_int(cfg, "mamba_num_heads"),
        mamba_head_dim=_int(cfg, "mamba_head_dim"),
        mamba_groups=_int(cfg, "n_groups"),
        mamba_state=_int(cfg, "ssm_state_size"),
        mamba_conv_kernel=_int(cfg, "conv_kernel"),
        expert_bias=True,
        mtp_num_layers=mtp if mtp is not None else 0,
        mtp_shared_embedding=True if mtp else None,
        mtp_layer_kinds=mtp_kinds,
        expert_export="per_expert",
        hf_prefix="backbone",
    )
    if mtp is None:
        notes.append("num_nextn_predict_layers not stated: assumed 0")
    out["_notes"] = notes
    return out


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    out = _common(cfg)
    n = out["num_layers"]
    out.update(
        num_experts=_int(cfg, "num_local_experts"),
        experts_per_tok=_int(cfg, "num_experts_per_tok", "experts_per_token"),
        moe_intermediate=_int(cfg, "intermediate_size"),
        shared_expert_intermediate=0,
        layer_kinds=None if n is None else (("full_attention", "moe"),) * n,
        attention_bias=bool(cfg.get("attention_bias", True)),
        expert_mlp_bias=True,
        expert_export="stacked",
    )
    out["_notes"] = ["expert export stacked: HF gpt-oss stores fused experts.gate_up_proj [E, H, 2I]; "
                     "sizes assume bf16 (the released experts are MXFP4)"]
    return out


_READERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": _dense, "qwen2": _dense, "qwen3": _dense, "mistral": _dense,
    "qwen3_moe": _qwen3_moe,
    "qwen3_5_moe": _qwen3_5_moe, "qwen3_5_moe_text": _qwen3_5_moe, "qwen3_next": _qwen3_5_moe,
    "qwen3_5": _qwen3_5_dense, "qwen3_5_text": _qwen3_5_dense,
    "deepseek_v2": _deepseek, "deepseek_v3": _deepseek, "kimi_k2": _deepseek,
    "nemotron_h": _nemotron_h,
    "gpt_oss": _gpt_oss,
    "glm4_moe": _glm4_moe,
}


_CANONICAL = {"qwen3_5_moe_text": "qwen3_5_moe", "qwen3_5_text": "qwen3_5", "kimi_k2": "deepseek_v3"}


def family_of(cfg: dict[str, Any]) -> str:
    """The reader key for a config: its ``model_type`` (first word), or a guess from ``architectures``."""
    text = _text_config(cfg)
    raw = str(text.get("model_type") or cfg.get("model_type") or "").strip()
    word = raw.split()[0] if raw else ""
    if word in _READERS:
        return _CANONICAL.get(word, word)
    archs = " ".join(cfg.get("architectures") or [])
    for key, arch in (("nemotron_h", "NemotronH"), ("qwen3_5_moe", "Qwen3_5Moe"), ("qwen3_5", "Qwen3_5"),
                      ("qwen3_moe", "Qwen3Moe"), ("deepseek_v3", "DeepseekV3"), ("deepseek_v2", "DeepseekV2"),
                      ("gpt_oss", "GptOss"), ("glm4_moe", "Glm4Moe"), ("qwen3", "Qwen3"), ("llama", "Llama")):
        if arch in archs:
            return key
    if "nemotron_h" in raw:
        return "nemotron_h"
    raise ConfigFormatError(
        f"model_type {raw or '(missing)'!r} is not one rlc can plan; known: {', '.join(sorted(_READERS))}"
    )


def _check_layer_counts(cfg: dict[str, Any]) -> None:
    """Layer counts and layer patterns of at most :data:`MAX_LAYERS` (checked before any reader
    builds a per-layer list from them)."""
    for key in ("num_hidden_layers", NEXTN_KEY, MTP_HIDDEN_KEY, "recipe_mtp_num_layers", "first_k_dense_replace"):
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_LAYERS < value <= MAX_FACT:
            raise ConfigFormatError(f"{key} is {value}, more layers than rlc plans (at most {MAX_LAYERS}); "
                                    "fix the config or model.overrides")
    for key in ("hybrid_override_pattern", "mtp_hybrid_override_pattern"):
        value = cfg.get(key)
        if isinstance(value, str) and len(value) > MAX_LAYERS:
            raise ConfigFormatError(f"{key} has {len(value)} layers, more than rlc plans (at most {MAX_LAYERS}); "
                                    "fix the config or model.overrides")
    counts = cfg.get("_layer_counts")
    if isinstance(counts, dict):
        total = sum(v for v in counts.values() if isinstance(v, int) and not isinstance(v, bool))
        if total > MAX_LAYERS:
            raise ConfigFormatError(f"_layer_counts add up to {total} layers, more than rlc plans (at most "
                                    f"{MAX_LAYERS})")


def facts_from_config(cfg: dict[str, Any], model_id: str, source: str) -> ModelFacts:
    """Read ``cfg`` (an HF ``config.json`` as a dict) into :class:`ModelFacts`."""
    if not isinstance(cfg, dict):
        raise ConfigFormatError("config.json must hold a JSON object")
    family = family_of(cfg)
    text = _text_config(cfg)
    _check_layer_counts(text)
    fields = _READERS[family](text)
    notes = list(fields.pop("_notes", []))
    if fields.get("tied_embeddings") is None and "_provenance" not in cfg:
        # a real config.json that does not state it loads with its config class's default, in transformers
        # (vLLM and Megatron-Bridge read the same config object); catalog entries state every fact themselves
        fields["tied_embeddings"] = False
        notes.append(f"tie_word_embeddings not stated: false, the default of the {family} config class "
                     "(transformers; what vLLM and Megatron-Bridge load)")
    if fields.get("expert_bias"):
        fields["fp32_params"] = (ROUTER_BIAS, MEGATRON_EXPERT_BIAS)
    absent = cfg.get("_absent") or []
    unknown = [name for name in _FACT_FIELDS if fields.get(name, 0) is None]
    if fields.get("num_experts") == 0:
        unknown = [u for u in unknown if u not in ("moe_intermediate", "shared_expert_intermediate",
                                                    "experts_per_tok")]
    elif not any(kind[1] == "dense" for kind in fields.get("layer_kinds") or ()):
        unknown = [u for u in unknown if u != "dense_intermediate"]
    if fields.get("mtp_num_layers") == 0:
        unknown = [u for u in unknown if u != "mtp_shared_embedding"]
    if fields.get("mtp_num_layers") and fields.get("mtp_layer_kinds") is None:
        unknown.append("mtp_layer_kinds")
    raw_type = str(text.get("model_type") or "")
    if raw_type and raw_type.split()[0] != raw_type:
        notes.append(f"model_type stated as {raw_type!r}")
    for item in absent:
        notes.append(f"not in any source: {item}")
    fields.setdefault("checkpoint_mtp_num_layers", fields.get("mtp_num_layers", 0))
    fields["context_length"], fields["context_length_source"] = context_length(text)
    total = cfg.get("total_params_hf_api")
    return ModelFacts(
        model_id=model_id,
        family=family,
        source=source,
        unknown=tuple(dict.fromkeys(unknown)),
        notes=tuple(notes),
        reference_total_params=total if isinstance(total, int) else None,
        **fields,
    )
