"""``model.overrides``: how HF ``config.json`` keys are added to or replaced in a model's config (pure Python).

One reading for the planner (the model's facts) and the runtime (the config the trainer's Megatron-Bridge model
and the rollout engine are built from), so the plan describes the model the job builds:

* a key replaces (or adds) the config's value, as if ``config.json`` said it;
* a mapping for a key whose value is a mapping (a nested config such as ``text_config``, or ``rope_scaling``) is
  merged into it key by key, recursively: ``rope_scaling: {rope_type: yarn, factor: 4.0}`` keeps the other
  fields the checkpoint states, and ``text_config: {router_aux_loss_coef: 0.0}`` changes one key of the language
  model's config;
* a config that nests its language model's config (``text_config``: vision-language checkpoints such as
  Qwen3.5) gets every other key in ``text_config`` too, where the language model reads it;
* ``rope_theta`` and a ``rope_scaling`` mapping go into ``rope_parameters`` where the config keeps its RoPE
  settings there (Transformers 5 writes them so, and would read ``rope_parameters`` and ignore the older keys).

The keys that count a checkpoint's MTP blocks build the trainer only: vLLM's MTP drafter (speculative
decoding) loads every block the checkpoint has (:func:`engine_overrides`).
"""
from __future__ import annotations

from typing import Any, Mapping

TEXT_CONFIG = "text_config"
#: Where Transformers 5 keeps a config's RoPE settings, and the older keys it folds into it.
ROPE_PARAMETERS = "rope_parameters"
LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling")

#: The config keys that state how many MTP blocks a checkpoint has. Recipes set one to 0 in ``model.overrides``
#: to build the trainer without MTP (NeMo-RL ``mtp_num_layers: 0``).
NEXTN_KEY = "num_nextn_predict_layers"  # DeepSeek-V3, GLM-4.5, Nemotron-H
MTP_HIDDEN_KEY = "mtp_num_hidden_layers"  # Qwen3.5, Qwen3-Next
MTP_COUNT_KEYS = (NEXTN_KEY, MTP_HIDDEN_KEY)


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides``: a mapping over a mapping merges recursively, anything else replaces."""
    out = dict(base)
    for key, value in overrides.items():
        current = out.get(key)
        if isinstance(value, Mapping) and isinstance(current, Mapping):
            out[key] = merged(current, value)
        else:
            out[key] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    """``value`` as plain dicts and lists (a recipe's mappings may be read-only views)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _with_rope(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`merged`, with ``rope_theta`` / ``rope_scaling`` folded into the config's ``rope_parameters`` when it
    states them there (Transformers 5 writes them so, and reads a ``rope_parameters`` before the older keys)."""
    rope = config.get(ROPE_PARAMETERS)
    if not isinstance(rope, Mapping) or not any(k in overrides for k in LEGACY_ROPE_KEYS):
        return merged(config, overrides)
    rest = {k: v for k, v in overrides.items() if k not in LEGACY_ROPE_KEYS}
    folded: dict[str, Any] = {}
    if isinstance(overrides.get("rope_scaling"), Mapping):
        folded.update(overrides["rope_scaling"])
    if "rope_theta" in overrides:
        folded["rope_theta"] = overrides["rope_theta"]
    if isinstance(rest.get(ROPE_PARAMETERS), Mapping):
        folded = merged(folded, rest[ROPE_PARAMETERS])
    if rope and all(isinstance(v, Mapping) for v in rope.values()):  # one set per layer type (e.g. sliding windows)
        folded = {kind: folded for kind in rope}
    rest[ROPE_PARAMETERS] = folded
    return merged(config, rest)


def apply_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json`` as a dict) with ``model.overrides`` applied (see the module docstring)."""
    out = _with_rope(config, overrides)
    text = config.get(TEXT_CONFIG)
    if isinstance(text, Mapping):
        flat = {k: v for k, v in overrides.items() if k != TEXT_CONFIG}
        out[TEXT_CONFIG] = _with_rope(out[TEXT_CONFIG], flat)
    return out


def engine_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The overrides the rollout engine's config gets: all but the MTP block counts, at the top level and in
    ``text_config`` (the drafter loads the checkpoint's blocks; the planner counts them so)."""
    out = {k: v for k, v in overrides.items() if k not in MTP_COUNT_KEYS}
    text = out.get(TEXT_CONFIG)
    if isinstance(text, Mapping):
        out[TEXT_CONFIG] = {k: v for k, v in text.items() if k not in MTP_COUNT_KEYS}
        if not out[TEXT_CONFIG]:
            del out[TEXT_CONFIG]
    return out


__all__ = ["LEGACY_ROPE_KEYS", "MTP_COUNT_KEYS", "MTP_HIDDEN_KEY", "NEXTN_KEY", "ROPE_PARAMETERS", "TEXT_CONFIG",
           "apply_overrides", "engine_overrides", "merged"]
