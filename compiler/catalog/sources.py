"""Where a model's ``config.json`` comes from: the checkpoint itself, before the shipped catalog.

In order, :func:`find_config` looks at

1. the checkpoint folder ``model.checkpoint`` names, when it is a path: on this machine as written,
   relative to the recipe, or, for a path inside the container, under the host folder a
   ``cluster.container.mounts`` entry binds there;
2. the local Hugging Face cache for the checkpoint's Hub id (and ``model.id``), offline, laid out as
   ``huggingface_hub`` writes it (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
   ``~/.cache/huggingface/hub``; ``models--ORG--NAME/snapshots/REV/config.json``, the revision
   ``refs/main`` names first), read without importing ``huggingface_hub``;
3. the Hub (:func:`fetch_from_hub`), only when the caller asks: the catalog answers first, and a
   network request is made only for a model the catalog does not have, or lacks facts of. It is
   bounded by :data:`HUB_TIMEOUT_S` and skipped when ``HF_HUB_OFFLINE`` is set (Hugging Face's own
   switch; CI and compute nodes usually have no network, login nodes usually do). ``HF_ENDPOINT``
   and ``HF_TOKEN`` are honoured as ``huggingface_hub`` does.

Every place looked at is recorded with what it gave (or why it gave nothing), so an error about a
missing fact can say where rlc looked.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from rlc.compiler.files import JsonError, parse_json, read_text_capped

#: Longest a Hub request for ``config.json`` may take (connect + read), in seconds.
HUB_TIMEOUT_S = 10.0
#: Largest ``config.json`` read from the Hub, in bytes.
HUB_CONFIG_BYTES = 4 << 20
DEFAULT_ENDPOINT = "https://huggingface.co"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class FoundConfig:
    """A ``config.json`` found for the model, or ``None`` with the places looked at."""

    config: Optional[dict[str, Any]]
    source: str = ""  # where ``config`` came from, e.g. "checkpoint folder /models/x/config.json"
    looked: tuple[str, ...] = field(default_factory=tuple)  # each place tried and its outcome


def is_hub_id(text: str) -> bool:
    """``org/name`` (or ``name``) as the Hub spells model ids, not a file-system path."""
    return bool(_HUB_ID.match(text)) and not text.startswith((".", "~")) and not text.endswith(".json")


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", "./", "../", "~")) or not is_hub_id(text)


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` asks for no network (as ``huggingface_hub`` reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder, as ``huggingface_hub`` resolves it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _read_config(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ``ValueError`` / ``OSError`` with the reason otherwise."""
    data = parse_json(read_text_capped(path))  # a JsonError is a ValueError
    if not isinstance(data, dict):
        raise ValueError("it does not hold a JSON object")
    return data


def _mount_pairs(mounts: Sequence[str]) -> list[tuple[str, str]]:
    """``(host source, container destination)`` of each ``src:dst[:mode]`` entry."""
    pairs = []
    for entry in mounts:
        parts = entry.split(":")
        if len(parts) >= 2 and parts[0].startswith("/") and parts[1].startswith("/"):
            pairs.append((parts[0].rstrip("/") or "/", parts[1].rstrip("/") or "/"))
    return pairs


def _host_paths(path: str, recipe_dir: Path, mounts: Sequence[str]) -> list[Path]:
    """Where a checkpoint path may be on this machine: as written (relative to the recipe), then
    through each mount whose container side holds it (the longest destination first)."""
    expanded = Path(path).expanduser()
    out = [expanded if expanded.is_absolute() else recipe_dir / expanded]
    if path.startswith("/"):
        for src, dst in sorted(_mount_pairs(mounts), key=lambda p: -len(p[1])):
            if path == dst or path.startswith(dst.rstrip("/") + "/"):
                rest = path[len(dst):].lstrip("/")
                out.append(Path(src) / rest if rest else Path(src))
    return list(dict.fromkeys(out))


def _from_folder(path: str, recipe_dir: Path, mounts: Sequence[str], looked: list[str]) -> Optional[FoundConfig]:
    for folder in _host_paths(path, recipe_dir, mounts):
        config = folder / "config.json"
        shown = str(folder) if str(folder) == path else f"{folder} (for {path})"
        if not folder.is_dir():
            looked.append(f"checkpoint folder {shown}: not on this machine")
            continue
        if not config.is_file():
            looked.append(f"checkpoint folder {shown}: has no config.json")
            continue
        try:
            return FoundConfig(_read_config(config), f"checkpoint folder {config}", tuple(looked))
        except (OSError, ValueError) as exc:
            looked.append(f"{config}: unreadable ({getattr(exc, 'strerror', None) or exc})")
    return None


def _snapshot_config(repo: Path) -> Optional[Path]:
    """``snapshots/REV/config.json`` of a cached repo: ``refs/main``'s revision, else the newest."""
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    try:
        rev = read_text_capped(ref, 4096).strip() if ref.is_file() else ""
    except (OSError, UnicodeDecodeError):
        rev = ""
    if rev and (snapshots / rev / "config.json").is_file():
        return snapshots / rev / "config.json"
    try:
        found = [p / "config.json" for p in snapshots.iterdir() if (p / "config.json").is_file()]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _from_cache(hub_id: str, looked: list[str]) -> Optional[FoundConfig]:
    cache = hub_cache_dir()
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    config = _snapshot_config(repo) if repo.is_dir() else None
    if config is None:
        looked.append(f"Hugging Face cache {cache}: no config.json for {hub_id}")
        return None
    try:
        return FoundConfig(_read_config(config), f"Hugging Face cache {config}", tuple(looked))
    except (OSError, ValueError) as exc:
        looked.append(f"{config}: unreadable ({getattr(exc, 'strerror', None) or exc})")
        return None


def hub_ids(checkpoint: Optional[str], model_id: str) -> list[str]:
    """The Hub ids a recipe's model may be cached or published under: the checkpoint's, then ``model.id``."""
    ids = [c for c in (checkpoint, model_id) if c and not _looks_like_path(c)]
    return list(dict.fromkeys(ids))


def find_local_config(model_id: str, checkpoint: Optional[str], recipe_dir: Path,
                      mounts: Sequence[str] = ()) -> FoundConfig:
    """The model's ``config.json`` from its checkpoint folder or the local Hugging Face cache (no network)."""
    looked: list[str] = []
    if checkpoint and _looks_like_path(checkpoint):
        found = _from_folder(checkpoint, recipe_dir, mounts, looked)
        if found is not None:
            return found
    for hub_id in hub_ids(checkpoint, model_id):
        found = _from_cache(hub_id, looked)
        if found is not None:
            return found
    return FoundConfig(None, "", tuple(looked))


def fetch_from_hub(hub_id: str, timeout: float = HUB_TIMEOUT_S) -> tuple[Optional[dict[str, Any]], str]:
    """``(config, where)`` from the Hub's ``resolve/main/config.json``, or ``(None, why not)``.

    Never raises for network trouble: no network, a gated or missing repo, a slow server (at most
    ``timeout`` seconds per step) all come back as the reason.
    """
    import urllib.error  # noqa: PLC0415 - only a model nothing local describes needs the network
    import urllib.request  # noqa: PLC0415

    endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
    url = f"{endpoint}/{hub_id}/resolve/main/config.json"
    if hub_offline():
        return None, f"the Hub ({url}): not asked, HF_HUB_OFFLINE is set"
    request = urllib.request.Request(url, headers={"User-Agent": "rlc"})  # noqa: S310
    token = os.environ.get("HF_TOKEN")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - https or HF_ENDPOINT
            body = response.read(HUB_CONFIG_BYTES + 1)
    except urllib.error.HTTPError as exc:
        hint = " (a gated model: set HF_TOKEN)" if exc.code in (401, 403) else ""
        return None, f"the Hub ({url}): HTTP {exc.code}{hint}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return None, f"the Hub ({url}): unreachable ({reason})"
    if len(body) > HUB_CONFIG_BYTES:
        return None, f"the Hub ({url}): config.json larger than {HUB_CONFIG_BYTES} bytes"
    try:
        data = parse_json(body.decode("utf-8"))
    except (UnicodeDecodeError, JsonError):
        return None, f"the Hub ({url}): not a JSON config.json"
    if not isinstance(data, dict):
        return None, f"the Hub ({url}): config.json holds no JSON object"
    return data, f"the Hub {url}"
