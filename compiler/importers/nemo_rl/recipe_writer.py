"""Write the imported recipe: rlc keys in section order, each commented with the NeMo-RL key (and
file:line) it came from; every key that was not mapped listed as comments at the end."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import yaml

from rlc.compiler.diagnostics import PathPart, format_path
from rlc.compiler.importers.nemo_rl.config_loader import NemoRlConfig
from rlc.compiler.importers.nemo_rl.mapping import Mapping, MissingKey, Unmapped
from rlc.compiler.yaml_writer import dump_yaml

SECTIONS = ("version", "name", "description", "model", "cluster", "parallelism", "colocated", "refit",
            "generation", "training", "grpo", "loss", "data", "reward", "checkpointing", "logging")
SET_ORIGIN = "--set"


def recipe_name(config_path: str) -> str:
    """A run name (schema pattern ``^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$``) from the config's file name."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(config_path).stem).strip("-._") or "imported"
    return stem[:64]


def build_tree(mapping: Mapping, config_path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The recipe as nested dicts (section order) and ``dotted key -> comment``."""
    flat: dict[str, Any] = {"version": 1, "name": recipe_name(config_path),
                            "description": f"Imported from the NeMo-RL config {Path(config_path).name}."}
    notes: dict[str, str] = {}
    for v in mapping.values:
        flat[v.target] = v.value
    tree: dict[str, Any] = {}
    rank = {s: i for i, s in enumerate(SECTIONS)}
    for key in sorted(flat, key=lambda k: rank.get(k.split(".")[0], len(rank))):
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = flat[key]
    return tree, notes


def comment_for(mapping: Mapping, cfg: NemoRlConfig) -> dict[str, str]:
    """``rlc key -> "from <NeMo-RL key> = <as written> (file:line); note"``."""
    out: dict[str, str] = {}
    for v in mapping.values:
        parts = []
        for source in v.sources:
            raw = cfg.raw_text(source)
            written = f" = {raw}" if isinstance(raw, str) and "${" in raw else ""
            where = cfg.origins.get(source)
            parts.append(f"{source}{written}" + (f" ({where})" if where else ""))
        text = "from " + "; ".join(parts) if parts else ""
        out[v.target] = text + (f"; {v.note}" if v.note else "")
    return out


def _short(value: Any, limit: int = 70) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()
    text = text[:-4].strip() if text.endswith("...") else text
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def unmapped_lines(items: Sequence[Unmapped], cfg: NemoRlConfig, *, prefix: str) -> list[str]:
    lines = []
    for u in items:
        where = cfg.origins.get(u.key)
        lines.append(f"{prefix}{u.key}: {_short(u.value)}  ({u.reason}" + (f"; {where})" if where else ")"))
    return lines


def _examples(keys: Sequence[str], n: int = 4) -> str:
    shown = ", ".join(keys[:n])
    return shown + (", ..." if len(keys) > n else "")


def _components(items: Sequence[Unmapped]) -> str:
    """The NeMo-RL sections the inactive keys belong to (first two key parts)."""
    return ", ".join(dict.fromkeys(".".join(u.key.split(".")[:2]) for u in items))


def unmapped_report(mapping: Mapping, cfg: NemoRlConfig, *, prefix: str, where: str = "") -> list[str]:
    """What the recipe does not carry, by effect: dropped settings (changes), settings with no effect on what is
    trained (listed), NeMo-RL defaults and components the config turns off (one line each, counted)."""
    lines: list[str] = []
    active = [u for u in mapping.unmapped if not u.inactive]
    dropped = [u for u in active if u.effect == "changes"]
    listed = [u for u in active if u.effect == "none"]
    defaults = [u for u in active if u.effect == "default"]
    inactive = [u for u in mapping.unmapped if u.inactive]
    lead = prefix.rstrip() + " " if prefix.strip() else ""
    item = prefix + "  "
    if dropped:
        lines.append(f"{lead}Dropped (--accept-loss): {len(dropped)} NeMo-RL setting(s) that change the experiment, "
                     f"with no rlc equivalent{where}:")
        lines.extend(unmapped_lines(dropped, cfg, prefix=item))
    if listed:
        lines.append(f"{lead}Not mapped: {len(listed)} NeMo-RL key(s) that do not change what is trained{where}:")
        lines.extend(unmapped_lines(listed, cfg, prefix=item))
    if defaults:
        lines.append(f"{lead}{len(defaults)} more NeMo-RL key(s) keep NeMo-RL's defaults (or are unset) and have no "
                     f"rlc setting: {_examples([u.key for u in defaults])}")
    if inactive:
        lines.append(f"{lead}Ignored: {len(inactive)} key(s) of NeMo-RL components this config turns off "
                     f"({_components(inactive)})")
    return lines


def render_recipe(tree: dict[str, Any], comments: dict[str, str], *, cfg: NemoRlConfig, config_path: str,
                  overrides: Sequence[str], sets: Sequence[str], mapping: Mapping,
                  still_missing: Sequence[MissingKey]) -> str:
    """The recipe file text."""
    def comment(path: tuple[PathPart, ...]) -> str | None:
        return comments.get(format_path(path))

    head = [f"# Imported by `rlc import nemo-rl` from {config_path}.",
            f"# NeMo-RL defaults chain (merged in this order): {' -> '.join(cfg.files)}"]
    if overrides:
        head.append(f"# NeMo-RL overrides: {' '.join(overrides)}")
    if sets:
        head.append(f"# --set: {' '.join(sets)}")
    head.append("# Each comment names the NeMo-RL key (file:line) a value came from; keys rlc has no place for are "
                "listed at the end.")
    for note in mapping.notes:
        head.append(f"# Note: {note}")
    if still_missing:
        head.append("# Still to set (NeMo-RL does not say; rlc validate or compile fails until they are):")
        head.extend(f"#   {m.key}: {m.why}; e.g. --set {m.example}" for m in still_missing)
    body = dump_yaml(tree, comment)
    tail = unmapped_report(mapping, cfg, prefix="# ", where=" (value, reason, origin)")
    return "\n".join(head) + "\n" + body + ("\n" + "\n".join(tail) + "\n" if tail else "")
