"""The model catalog: real HF configs shipped in ``models/`` (copied with their provenance from the
project's research notes; ``models/SOURCES.md`` says where each came from and how sure it is).

A catalog file is named after the HF id with ``/`` written as ``__``
(``Qwen__Qwen3.5-397B-A17B.json`` is ``Qwen/Qwen3.5-397B-A17B``). A recipe names a model by that
id (any case) or by the part after the ``/``; ``model.config`` points at a local ``config.json``
instead and overrides the catalog.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional

from rlc.compiler.catalog.errors import CatalogError
from rlc.compiler.catalog.hf_config import MTP_COUNT_KEYS, ConfigFormatError, facts_from_config
from rlc.compiler.files import read_text_capped
from rlc.compiler.model import ModelFacts

MODELS_DIR = Path(__file__).with_name("models")


@lru_cache(maxsize=1)
def _files() -> dict[str, Path]:
    return {p.stem.replace("__", "/"): p for p in sorted(MODELS_DIR.glob("*.json"))}


def model_ids() -> list[str]:
    """Every HF id in the shipped catalog."""
    return sorted(_files())


#: Checkpoint variants that share their base model's architecture: instruction-tuned, base and
#: FP8-quantized releases (``Qwen/Qwen3-30B-A3B-Instruct-2507``, ``...-Base``, ``...-FP8``).
_VARIANT_SUFFIX = re.compile(r"(?:-(?:instruct|base|chat|thinking|fp8|bf16|\d{4}))+$", re.IGNORECASE)


def _exact(model_id: str) -> str | None:
    files = _files()
    if model_id in files:
        return model_id
    lowered = {k.lower(): k for k in files}
    if model_id.lower() in lowered:
        return lowered[model_id.lower()]
    short = {k.split("/", 1)[-1].lower(): k for k in files}
    return short.get(model_id.lower())


def _lookup(model_id: str) -> str | None:
    """The catalog id for ``model_id``: exact (any case, with or without the org), else its base
    entry when ``model_id`` is an Instruct / Base / FP8 / dated variant of a catalogued model."""
    found = _exact(model_id)
    if found is not None:
        return found
    base = _VARIANT_SUFFIX.sub("", model_id)
    return _exact(base) if base and base != model_id else None


def resolve_id(model_id: str) -> tuple[str | None, bool]:
    """``(catalog id, is_variant)`` for a recipe's ``model.id`` (``None`` when not in the catalog)."""
    found = _exact(model_id)
    if found is not None:
        return found, False
    key = _lookup(model_id)
    return key, key is not None


def close_ids(model_id: str, n: int = 3) -> list[str]:
    """Catalog ids that look like ``model_id`` (compared on the whole id and on the name part)."""
    by_short = {i.split("/", 1)[-1].lower(): i for i in model_ids()}
    found = difflib.get_close_matches(model_id.lower(), [i.lower() for i in model_ids()], n=n, cutoff=0.4)
    found = [next(i for i in model_ids() if i.lower() == f) for f in found]
    for short in difflib.get_close_matches(model_id.split("/")[-1].lower(), list(by_short), n=n, cutoff=0.4):
        if by_short[short] not in found:
            found.append(by_short[short])
    return found[:n]


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(read_text_capped(path))
    except UnicodeDecodeError:
        raise CatalogError(f"{what} {path} is not UTF-8 text") from None
    except OSError as exc:
        raise CatalogError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CatalogError(f"{what} {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise CatalogError(f"{what} {path} must hold a JSON object")
    return data


def catalog_config(model_id: str) -> dict[str, Any]:
    """The shipped config (with its ``_provenance``) for a catalog id; :class:`CatalogError` if unknown."""
    key = _lookup(model_id)
    if key is None:
        close = close_ids(model_id)
        hint = f"; close catalog ids: {', '.join(close)}" if close else ""
        raise CatalogError(
            f"model {model_id!r} is not in the shipped catalog{hint}. Set model.config to a local "
            f"config.json to plan a model outside the catalog ({len(model_ids())} catalog models: "
            "rlc/compiler/catalog/models/SOURCES.md)"
        )
    return _read_json(_files()[key], "catalog file")


def _provenance(cfg: Mapping[str, Any]) -> str:
    prov = cfg.get("_provenance")
    if isinstance(prov, dict) and prov.get("type"):
        return str(prov["type"])
    return "no provenance recorded"


def _with_overrides(cfg: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` with ``model.overrides`` applied (to ``text_config`` too when the config nests one)."""
    if not overrides:
        return cfg
    out = dict(cfg)
    out.update(overrides)
    if isinstance(cfg.get("text_config"), dict):
        out["text_config"] = {**cfg["text_config"], **overrides}
    absent = [a for a in (cfg.get("_absent") or []) if a not in overrides]
    if "_absent" in cfg:
        out["_absent"] = absent
    return out


def model_facts(model_id: str, recipe_dir: Path, config: Optional[str] = None,
                overrides: Optional[Mapping[str, Any]] = None) -> ModelFacts:
    """Architecture facts of a recipe's model (``model.id``, ``model.config``, ``model.overrides``).

    ``config`` (relative to ``recipe_dir`` or absolute) wins over the catalog; otherwise
    ``model_id`` must be a catalog id, or an Instruct / Base / FP8 variant of one (its base entry
    is used and a note says so). ``overrides`` are applied on top of either. Raises
    :class:`CatalogError` with close ids for unknown ones.
    """
    local = config
    overrides = dict(overrides or {})
    # vLLM's MTP drafter loads the checkpoint's MTP blocks even when an override builds the trainer without them
    checkpoint_overrides = {k: v for k, v in overrides.items() if k not in MTP_COUNT_KEYS}
    mtp_overridden = len(checkpoint_overrides) < len(overrides)
    notes: list[str] = []
    if overrides:
        notes.append("model.overrides: " + ", ".join(f"{k}={v!r}" for k, v in overrides.items()))
    try:
        if local:
            path = Path(local)
            if not path.is_absolute():
                path = Path(recipe_dir) / path
            raw = _read_json(path, "model.config")
            facts_id, source = model_id, f"local config {path}"
        else:
            raw = catalog_config(model_id)
            key, variant = resolve_id(model_id)
            assert key is not None  # catalog_config found the entry
            if variant:
                notes.append(f"{model_id} is a checkpoint variant of {key}: planned with its catalog entry "
                             "(same architecture)")
            facts_id, source = key, f"catalog {_files()[key].name} ({_provenance(raw)})"
        facts = facts_from_config(_with_overrides(raw, overrides), facts_id, source)
        if mtp_overridden:
            checkpoint = facts_from_config(_with_overrides(raw, checkpoint_overrides), facts_id, source)
            facts = dataclasses.replace(facts, checkpoint_mtp_num_layers=checkpoint.mtp_num_layers)
    except ConfigFormatError as exc:
        where = "model.config" if local else f"catalog entry {model_id}"
        raise CatalogError(f"{where}: {exc}") from None
    if notes:
        facts = dataclasses.replace(facts, notes=tuple(notes) + facts.notes)
    return facts
