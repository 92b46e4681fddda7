"""The model catalog: real HF configs shipped in ``models/`` (copied with their provenance from the
project's research notes; ``models/SOURCES.md`` says where each came from and how sure it is).

A catalog file is named after the HF id with ``/`` written as ``__``
(``Qwen__Qwen3.5-397B-A17B.json`` is ``Qwen/Qwen3.5-397B-A17B``). A recipe names a model by that
id (any case) or by the part after the ``/``; ``model.config`` points at a local ``config.json``
instead and overrides the catalog. The checkpoint's own ``config.json`` (its folder, or the local
Hugging Face cache, :mod:`rlc.compiler.catalog.sources`) comes before the catalog, which then only
states what that config does not.
"""
from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from rlc.compiler.catalog.errors import CatalogError
from rlc.compiler.catalog.hf_config import ConfigFormatError, facts_from_config
from rlc.contract.model_overrides import apply_overrides, engine_overrides
from rlc.compiler.catalog.sources import fetch_from_hub, find_local_config, hub_ids
from rlc.compiler.files import JsonError, parse_json, read_text_capped
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
    import difflib  # noqa: PLC0415 - only for a did-you-mean (a recipe without typos never loads it)

    by_short = {i.split("/", 1)[-1].lower(): i for i in model_ids()}
    found = difflib.get_close_matches(model_id.lower(), [i.lower() for i in model_ids()], n=n, cutoff=0.4)
    found = [next(i for i in model_ids() if i.lower() == f) for f in found]
    for short in difflib.get_close_matches(model_id.split("/")[-1].lower(), list(by_short), n=n, cutoff=0.4):
        if by_short[short] not in found:
            found.append(by_short[short])
    return found[:n]


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = parse_json(read_text_capped(path))
    except UnicodeDecodeError:
        raise CatalogError(f"{what} {path} is not UTF-8 text") from None
    except OSError as exc:
        raise CatalogError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except JsonError as exc:
        raise CatalogError(f"{what} {path}: {exc}") from None
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
    """``cfg`` with ``model.overrides`` applied (:func:`rlc.contract.model_overrides.apply_overrides`, the
    runtime's reading too); a key an override states is no longer absent."""
    if not overrides:
        return cfg
    out = apply_overrides(cfg, overrides)
    if "_absent" in cfg:
        out["_absent"] = [a for a in (cfg.get("_absent") or []) if a not in overrides]
    return out


def _fill_from_catalog(cfg: dict[str, Any], entry: Optional[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """``cfg`` with the keys it lacks taken from the catalog ``entry`` (``text_config`` key by key), and
    the names of the keys taken: the catalog states what a config does not."""
    if not entry:
        return cfg, []
    out = dict(cfg)
    taken = [k for k in entry if k not in cfg and not k.startswith("_")]
    for key in taken:
        out[key] = entry[key]
    if isinstance(cfg.get("text_config"), dict) and isinstance(entry.get("text_config"), dict):
        text = dict(cfg["text_config"])
        for key, value in entry["text_config"].items():
            if key not in text and key not in cfg:
                text[key] = value
                taken.append(f"text_config.{key}")
        out["text_config"] = text
    return out, taken


def _facts(raw: dict[str, Any], overrides: dict[str, Any], facts_id: str, source: str) -> ModelFacts:
    """Facts of ``raw`` with ``model.overrides`` applied; the MTP count vLLM's drafter loads stays the
    checkpoint's when an override builds the trainer without MTP."""
    # vLLM's MTP drafter loads the checkpoint's MTP blocks even when an override builds the trainer without them
    checkpoint_overrides = engine_overrides(overrides)
    facts = facts_from_config(_with_overrides(raw, overrides), facts_id, source)
    if checkpoint_overrides != dict(overrides):
        checkpoint = facts_from_config(_with_overrides(raw, checkpoint_overrides), facts_id, source)
        facts = dataclasses.replace(facts, checkpoint_mtp_num_layers=checkpoint.mtp_num_layers)
    return facts


def model_facts(model_id: str, recipe_dir: Path, config: Optional[str] = None,
                overrides: Optional[Mapping[str, Any]] = None, *, checkpoint: Optional[str] = None,
                mounts: Sequence[str] = (), hub: bool = True) -> ModelFacts:
    """Architecture facts of a recipe's model (``model.id``, ``model.config``, ``model.overrides``,
    ``model.checkpoint``).

    ``config`` (relative to ``recipe_dir`` or absolute) wins. Otherwise the checkpoint's own
    ``config.json`` (its folder, or the local Hugging Face cache: :mod:`.sources`), with the catalog
    filling what it does not state; then the catalog entry of ``model_id`` (or of the Instruct /
    Base / FP8 release it is a variant of); then, with ``hub`` and only for a model the catalog
    lacks or lacks facts of, the Hub. ``overrides`` are applied on top. ``ModelFacts.searched`` lists
    every place looked at. Raises :class:`CatalogError` (close ids, where rlc looked) when nothing
    describes the model.
    """
    overrides = dict(overrides or {})
    notes: list[str] = []
    if overrides:
        notes.append("model.overrides: " + ", ".join(f"{k}={v!r}" for k, v in overrides.items()))
    looked: list[str] = []
    try:
        if config:
            path = Path(config)
            if not path.is_absolute():
                path = Path(recipe_dir) / path
            raw = _read_json(path, "model.config")
            facts = _facts(raw, overrides, model_id, f"local config {path}")
        else:
            facts = _searched_facts(model_id, Path(recipe_dir), overrides, checkpoint, mounts, hub, looked, notes)
    except ConfigFormatError as exc:
        where = "model.config" if config else f"the config of {model_id}"
        raise CatalogError(f"{where}: {exc}") from None
    if notes:
        facts = dataclasses.replace(facts, notes=tuple(notes) + facts.notes)
    return dataclasses.replace(facts, searched=tuple(looked))


def _searched_facts(model_id: str, recipe_dir: Path, overrides: dict[str, Any], checkpoint: Optional[str],
                    mounts: Sequence[str], hub: bool, looked: list[str], notes: list[str]) -> ModelFacts:
    """Facts from the checkpoint's config (folder, cache), the catalog, then the Hub; ``looked`` and
    ``notes`` gain what was tried and what was taken from where."""
    key, variant = resolve_id(model_id)
    entry = _read_json(_files()[key], "catalog file") if key is not None else None
    found = find_local_config(model_id, checkpoint, recipe_dir, mounts)
    looked.extend(found.looked)
    if found.config is not None:
        return _from_config(found.config, found.source, entry, key, model_id, overrides, notes, looked)
    facts = None
    if entry is not None and key is not None:
        looked.append(f"catalog {_files()[key].name} ({_provenance(entry)})")
        if variant:
            notes.append(f"{model_id} is a checkpoint variant of {key}: planned with its catalog entry "
                         "(same architecture)")
        facts = _facts(entry, overrides, key, f"catalog {_files()[key].name} ({_provenance(entry)})")
        if not facts.unknown or not hub:
            return facts
    else:
        looked.append(f"catalog: no entry for {model_id}")
    if hub:
        for hub_id in hub_ids(checkpoint, model_id):
            fetched, where = fetch_from_hub(hub_id)
            if fetched is not None:
                return _from_config(fetched, where, entry, key, model_id, overrides, notes, looked)
            looked.append(where)
    if facts is not None:
        return facts
    close = close_ids(model_id)
    hint = f"; close catalog ids: {', '.join(close)}" if close else ""
    raise CatalogError(
        f"no config.json describes model {model_id!r}{hint}. rlc looked in: {'; '.join(looked)}. Put the "
        "checkpoint's config.json where rlc finds it (model.checkpoint: a folder holding it on this machine, or "
        "the Hugging Face cache: `huggingface-cli download MODEL config.json`), or set model.config to a local "
        f"config.json ({len(model_ids())} catalog models: rlc/compiler/catalog/models/SOURCES.md)"
    )


def _from_config(cfg: dict[str, Any], source: str, entry: Optional[dict[str, Any]], key: Optional[str],
                 model_id: str, overrides: dict[str, Any], notes: list[str], looked: list[str]) -> ModelFacts:
    raw, taken = _fill_from_catalog(cfg, entry)
    if taken and key is not None:
        notes.append(f"catalog {_files()[key].name} states what the config does not: {', '.join(taken)}")
    looked.append(f"{source}: used")
    return _facts(raw, overrides, model_id, source)
