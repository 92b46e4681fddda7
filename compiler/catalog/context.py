"""The longest sequence a model's config allows, computed the way vLLM does before it refuses a
``max_model_len`` (vLLM 0.22 ``vllm/config/model.py`` ``_get_and_verify_max_len`` with
``ModelArchConfigConvertor.derive_max_model_len_and_key``):

* the smallest of the length keys the config states (``max_position_embeddings``, ``n_positions``,
  ``max_seq_len``, ``seq_length``, ``model_max_length``, ``max_target_positions``,
  ``max_sequence_length``, ``max_seq_length``, ``seq_len``), ``model_max_length`` winning when set;
* times the RoPE scaling ``factor`` of every rope type but ``llama3``, ``longrope`` (``su``) and
  the default; for ``yarn`` the base is ``original_max_position_embeddings`` (so the limit is
  factor × original length); Gemma-3 configs state the scaled length already;
* no length key at all: vLLM takes any ``max_model_len`` it is given, so there is nothing to check.
"""
from __future__ import annotations

from typing import Any, Optional

LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
_UNSCALED = ("su", "longrope", "llama3")


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _rope_layers(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The config's RoPE parameters, one dict per layer type (``rope_parameters``, or the older ``rope_scaling``)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not isinstance(rope, dict) or not rope:
        return []
    if all(isinstance(v, dict) for v in rope.values()):
        return [v for v in rope.values() if v]
    return [rope]


def context_length(cfg: dict[str, Any]) -> tuple[Optional[int], str]:
    """``(tokens, how)`` for a language-model config (the text config of VL checkpoints); ``(None, why)``
    when the config states no length."""
    derived: Optional[float] = None
    key = ""
    for name in LENGTH_KEYS:
        value = _number(cfg.get(name))
        if value is not None and (derived is None or value < derived):
            derived, key = value, name
    model_max = _number(cfg.get("model_max_length"))
    if model_max:
        derived, key = model_max, "model_max_length"
    if derived is None:
        return None, "the config states no maximum length (max_position_embeddings)"
    how = f"{key} {int(derived)}"
    layers = _rope_layers(cfg)
    if layers and "gemma3" not in str(cfg.get("model_type", "")):
        factor: Optional[float] = 1.0
        yarn = False
        for rp in layers:
            rope_type = str(rp.get("rope_type", rp.get("type", "default")))
            if rope_type in _UNSCALED:
                continue
            factor = _number(rp.get("factor", factor)) if rp.get("factor", factor) is not None else None
            if rope_type == "yarn":
                yarn = True
                original = _number(cfg.get("original_max_position_embeddings")) or \
                    _number(rp.get("original_max_position_embeddings")) or _number(cfg.get("max_position_embeddings"))
                if original is not None:
                    derived, how = original, f"original_max_position_embeddings {int(original)}"
        if factor is None:  # vLLM falls back to 1.0 for a null factor
            factor = 1.0
        if factor != 1.0:
            derived *= factor
            how = f"{'YaRN ' if yarn else ''}rope factor {factor:g} × {how}"
    return int(derived), how
