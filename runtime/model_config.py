"""The HF config the job builds its models from: the checkpoint's ``config.json`` with ``model.overrides``.

The trainer (and its reference policy, and the Megatron generation backend, which share its Megatron-Bridge
config) and vLLM read one config, as if the checkpoint's ``config.json`` stated the overrides
(:mod:`rlc.contract.model_overrides` says how they apply; the planner reads them the same way). The config is
rebuilt from the file's own text rather than patched attribute by attribute: Transformers keeps some keys in
derived forms (``rope_theta`` and ``rope_scaling`` live in ``rope_parameters``), which a later assignment would
not update, while reading a ``config.json`` derives them as the model's own loader does.

vLLM gets the config through ``hf_overrides`` as :class:`EngineConfig`, a picklable callable (vLLM's engine
process rebuilds its configuration from it), without the MTP block counts: its MTP drafter loads the checkpoint's.
:func:`parameter_names` lists the parameters of the model that config describes, as the checkpoint names them
(the FP8 engine's ``ignored_layers`` for ``generation.fp8.keep_bf16``).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping

from rlc.contract.model_overrides import apply_overrides, engine_overrides


def checkpoint_config_json(checkpoint: str) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as written: in its folder, or (a Hub id) in the local Hugging Face cache."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        from transformers.utils import cached_file  # noqa: PLC0415

        resolved = cached_file(checkpoint, "config.json")
        if resolved is None:
            raise FileNotFoundError(f"model.checkpoint {checkpoint!r}: no config.json in the folder or the Hugging "
                                    "Face cache; model.overrides applies to it")
        path = Path(resolved)
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config.json is not a JSON object")
    return config


def overridden_config(loaded: Any, checkpoint: str, overrides: Mapping[str, Any]) -> Any:
    """A config of ``loaded``'s class (a Transformers ``PretrainedConfig``) read from the checkpoint's
    ``config.json`` with ``overrides`` applied; ``loaded`` itself when there are none."""
    if not overrides:
        return loaded
    return type(loaded).from_dict(apply_overrides(checkpoint_config_json(checkpoint), overrides))


class EngineConfig:
    """vLLM ``hf_overrides``: whatever config vLLM read, the checkpoint's ``config.json`` with the engine's
    overrides, read by the class vLLM chose. ``extra``: ``hf_overrides`` mappings set on it afterwards as vLLM
    sets a mapping of them (the FP8 engine's quantization config, ``generation.vllm_kwargs.hf_overrides``): a
    nested config is updated key by key, any other value replaced."""

    def __init__(self, checkpoint: str, overrides: Mapping[str, Any], extra: Mapping[str, Any] | None = None):
        self.config = apply_overrides(checkpoint_config_json(checkpoint), engine_overrides(overrides))
        self.extra = dict(extra or {})

    def __call__(self, config: Any) -> Any:
        # a copy each call: vLLM calls it more than once, and a config's reader may take nested mappings apart
        out = type(config).from_dict(copy.deepcopy(self.config))
        _set_as_vllm_does(out, self.extra, top=True)
        return out

    def __repr__(self) -> str:  # vLLM logs its engine arguments
        return f"EngineConfig(keys={sorted(self.config)}, extra={sorted(self.extra)})"


def _set_as_vllm_does(target: Any, updates: Mapping[str, Any], *, top: bool = False) -> None:
    """vLLM's reading of an ``hf_overrides`` mapping (``ModelConfig._apply_dict_overrides`` / ``_update_nested``):
    at the top a mapping updates a nested config in place and replaces anything else; below, mappings merge."""
    for key, value in updates.items():
        current = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
        nested = current is not None and (hasattr(current, "to_dict") if top else
                                          isinstance(current, dict) or hasattr(current, "__dict__"))
        if isinstance(value, Mapping) and nested:
            _set_as_vllm_does(current, value)
        elif isinstance(target, dict):
            target[key] = value
        else:
            setattr(target, key, value)


def checkpoint_config(checkpoint: str, overrides: Mapping[str, Any], *, trust_remote_code: bool = False) -> Any:
    """The Transformers config the rollout engine reads: the checkpoint's, with the engine's overrides."""
    from transformers import AutoConfig  # noqa: PLC0415

    loaded = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    return overridden_config(loaded, checkpoint, engine_overrides(overrides))


def parameter_names(config: Any, *, trust_remote_code: bool = False) -> list[str]:
    """The parameter names of the model ``config`` describes, as its checkpoint names them: the model class of its
    ``architectures`` built on the meta device (no memory, no weights)."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        if cls is not None:
            model = cls._from_config(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return [name for name, _ in model.named_parameters()]


__all__ = ["EngineConfig", "checkpoint_config", "checkpoint_config_json", "overridden_config", "parameter_names"]
