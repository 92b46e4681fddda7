"""Driver-state checkpoints: one folder per step, complete only once its marker is written.

Layout::

    <checkpointing.dir>/
      step_000010/
        driver_state.json   # the driver's state (step, data cursor, RNG seeds, ...): JSON
        model/ optimizer/   # shards written by the training workers (not this module's business)
        COMPLETE            # written last; a folder without it is an interrupted checkpoint

Order of a save: ``begin(root, step)`` makes the step folder (clearing an interrupted one of the
same step) and returns it for the workers to write their shards into; then ``save(root, step, state)``
writes ``driver_state.json`` (tmp file + fsync + rename) and then the ``COMPLETE`` marker the same
way, and prunes to the last ``checkpointing.keep_last``. ``latest`` / ``load`` / ``list_complete``
only ever see complete checkpoints, so a crash at any point leaves the previous one as the latest.

Experiments never share state: each save records the run's :func:`experiment` (the resolved
settings that define what is being trained: model and tokenizer, data, reward, loss, optimizer,
sampling and context length, fp8 training and rollouts, routing replay, GRPO but ``max_steps``,
``extensions``), and a resume
from a checkpoint whose experiment differs is refused, naming the keys, unless
``checkpointing.resume_changed_recipe`` says it is on purpose. Two recipes that share a parent and
its ``name`` (so its checkpoint folder) and differ only in ``lr`` can no longer resume from each
other's checkpoints. What may change between restarts (``max_steps``, the cluster, parallel layout,
memory and refit settings, logging, checkpoint cadence) is listed, with why, in
:data:`RESTART_KEYS`. Both lists come from the keys' declarations (each declares its policy), so every
key of ``runtime.yaml`` is in one of the two.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlc.contract.declare import Policy, leaves
from rlc.contract.files import CONFIG_BYTES, JsonError, parse_json, read_text_capped
from rlc.contract.ranges import declared_default
from rlc.contract.runtime_types import RuntimeConfig

log = logging.getLogger("rlc.runtime.checkpoint")

DRIVER_STATE = "driver_state.json"
COMPLETE_MARKER = "COMPLETE"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk."""

    step: int
    path: Path  # the step folder (workers' shards live here too)
    state: dict[str, Any]


def step_dir(root: str | Path, step: int) -> Path:
    """``<root>/step_000010`` for step 10."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return Path(root) / f"step_{step:06d}"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file() and (Path(path) / DRIVER_STATE).is_file()


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def list_complete(root: str | Path) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    return [step for step, path in _step_folders(Path(root)) if is_complete(path)]


def list_incomplete(root: str | Path) -> list[int]:
    """Steps whose folder lacks the marker (interrupted saves, or one being written now)."""
    return [step for step, path in _step_folders(Path(root)) if not is_complete(path)]


def latest(root: str | Path) -> int | None:
    """The newest complete checkpoint's step, or None."""
    steps = list_complete(root)
    return steps[-1] if steps else None


def _find_unserialisable(value: Any, path: str) -> str | None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{path}[{k!r}] (key must be a string)"
            bad = _find_unserialisable(v, f"{path}.{k}" if path else k)
            if bad:
                return bad
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            bad = _find_unserialisable(v, f"{path}[{i}]")
            if bad:
                return bad
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path or '<state>'} (non-finite float {value!r})"
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    return f"{path or '<state>'} ({type(value).__name__})"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def begin(root: str | Path, step: int) -> Path:
    """Create (or clear an interrupted) step folder for the workers' shards; returns it.

    Raises ``CheckpointError`` if a *complete* checkpoint of that step exists (it is never overwritten).
    """
    d = step_dir(root, step)
    if is_complete(d):
        raise CheckpointError(f"checkpoint {d} is already complete; refusing to overwrite it")
    if d.exists():
        log.warning("checkpoint: removing interrupted checkpoint %s before saving step %d again", d, step)
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def save(root: str | Path, step: int, state: dict[str, Any], *, keep_last: int = 0) -> Path:
    """Write ``driver_state.json`` then the ``COMPLETE`` marker into the step folder; prune.

    ``state`` must be JSON-serialisable (the error names the offending key). Workers' shards must
    already be in the folder (``begin``); the folder is created if ``begin`` was not called.
    ``keep_last > 0`` keeps that many newest complete checkpoints.
    """
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state must be a dict, got {type(state).__name__}")
    bad = _find_unserialisable(state, "")
    if bad:
        raise CheckpointError(f"checkpoint state is not JSON-serialisable at {bad}; store plain data there")
    d = step_dir(root, step)
    if is_complete(d):
        raise CheckpointError(f"checkpoint {d} is already complete; refusing to overwrite it")
    d.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT_VERSION, "step": step, "saved_at": time.time(), "state": state}
    _atomic_write(d / DRIVER_STATE, json.dumps(payload, indent=1, allow_nan=False))
    _atomic_write(d / COMPLETE_MARKER, f"step {step}\n")
    if keep_last > 0:
        prune(root, keep_last)
    return d


def load(root: str | Path, step: int | None = None) -> Checkpoint:
    """Read a complete checkpoint (the latest when ``step`` is None)."""
    if step is None:
        step = latest(root)
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {root}")
    d = step_dir(root, step)
    if not is_complete(d):
        raise CheckpointError(f"checkpoint {d} is missing or incomplete (no {COMPLETE_MARKER} marker)")
    try:
        payload = parse_json(read_text_capped(d / DRIVER_STATE, CONFIG_BYTES))
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{d / DRIVER_STATE}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    except JsonError as exc:
        raise CheckpointError(f"{d / DRIVER_STATE}: corrupt JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{d / DRIVER_STATE}: corrupt (not a JSON object)")
    if payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{d / DRIVER_STATE}: format {payload.get('format')!r}, this runtime reads {FORMAT_VERSION}"
        )
    if payload.get("step") != step:
        raise CheckpointError(f"{d / DRIVER_STATE}: records step {payload.get('step')!r} but lives in {d.name}")
    return Checkpoint(step=step, path=d, state=payload["state"])


def _remove(path: Path) -> None:
    marker = path / COMPLETE_MARKER
    if marker.exists():
        marker.unlink()  # first, so a half-deleted folder never counts as complete
    shutil.rmtree(path, ignore_errors=True)


def prune(root: str | Path, keep_last: int) -> list[int]:
    """Keep the ``keep_last`` newest complete checkpoints; also drop interrupted folders older than
    the newest complete one (a newer incomplete one may be in progress and is left alone).
    Returns the removed steps."""
    if keep_last <= 0:
        return []
    folders = _step_folders(Path(root))
    complete = [s for s, p in folders if is_complete(p)]
    if not complete:
        return []
    keep = set(complete[-keep_last:])
    newest = complete[-1]
    removed = []
    for step, path in folders:
        if step in keep:
            continue
        if not is_complete(path) and step > newest:
            continue
        _remove(path)
        removed.append(step)
    return removed


def should_save(every_steps: int, step: int, max_steps: int) -> bool:
    """Save at every ``checkpointing.every_steps``-th step and at the last step."""
    return (every_steps > 0 and step % every_steps == 0) or step == max_steps


def _policies() -> dict[str, Policy]:
    return {path: meta["runtime"] for path, _, meta in leaves(RuntimeConfig)}


#: The ``runtime.yaml`` keys that define an experiment (see the module docstring): those declared
#: ``runtime=EXPERIMENT`` (:mod:`rlc.compiler.recipe_types`, ``DERIVED`` of :mod:`rlc.compiler.declarations`).
#: Every key is either here or in :data:`RESTART_KEYS`: the generator refuses a key without a policy.
EXPERIMENT_KEYS: tuple[str, ...] = tuple(k for k, p in _policies().items() if p.experiment)
#: The ``runtime.yaml`` keys that may change between restarts of one experiment, each with why.
RESTART_KEYS: dict[str, str] = {k: p.why for k, p in _policies().items() if not p.experiment}
EXPERIMENT_STATE_KEY = "experiment"


def experiment(config: Any) -> dict[str, Any]:
    """The values of :data:`EXPERIMENT_KEYS` in ``config`` (a ``RuntimeConfig`` or its mapping),
    flattened to dotted keys, plus their ``sha256``: what a checkpoint records."""
    tree = dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else config
    values: dict[str, Any] = {}

    def flatten(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value):
                flatten(f"{prefix}.{k}", value[k])
        else:
            values[prefix] = value

    for key in EXPERIMENT_KEYS:
        node: Any = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        flatten(key, node)
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()
    return {"sha256": digest, "values": values}


def experiment_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: recorded -> current`` for each experiment key that differs (empty when they match).

    A key the checkpoint does not record (an rlc that had no such key wrote it) at its declared default
    is no change: a key joins rlc with the default that keeps what rlc did before it existed."""
    if recorded.get("sha256") == current["sha256"]:
        return []
    old, new = recorded.get("values") or {}, current["values"]
    differ = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if not differ:
        return ["(the recorded fingerprint differs)"]
    added = [k for k in differ if k not in old and k in new and declared_default(k) == (True, new[k])]
    return [f"{k}: {old.get(k, '(not recorded)')!r} -> {new.get(k, '(not set)')!r}" for k in differ if k not in added]


def resume_from_latest(cfg: Any, *, warn: Callable[[str], None] | None = None,
                       current: dict[str, Any] | None = None) -> Checkpoint | None:
    """The checkpoint to resume from for a ``CheckpointConfig``, or None to start fresh.

    None when checkpointing or ``resume`` is off or no complete checkpoint exists. Interrupted
    folders are reported through ``warn`` (default: the module logger) and ignored. With
    ``current`` (this run's :func:`experiment`), a checkpoint another experiment wrote raises
    :class:`CheckpointError` naming the differing keys, unless ``cfg.resume_changed_recipe``.
    """
    if not (cfg.enabled and cfg.resume):
        return None
    say = warn or log.warning
    incomplete = list_incomplete(cfg.dir)
    ckpt_step = latest(cfg.dir)
    if incomplete:
        say(
            f"checkpoint: ignoring incomplete checkpoint(s) {', '.join(step_dir(cfg.dir, s).name for s in incomplete)} "
            f"in {cfg.dir} (no {COMPLETE_MARKER} marker: the save was interrupted)"
        )
    if ckpt_step is None:
        return None
    found = load(cfg.dir, ckpt_step)
    if current is not None:
        recorded = found.state.get(EXPERIMENT_STATE_KEY)
        changes = (experiment_changes(recorded, current) if isinstance(recorded, dict)
                   else ["(the checkpoint records no experiment: written by an older rlc)"])
        if changes and getattr(cfg, "resume_changed_recipe", False):
            say(f"checkpoint: resuming from {found.path}, written under a different recipe "
                f"(checkpointing.resume_changed_recipe is on): " + "; ".join(changes))
        elif changes:
            raise CheckpointError(
                f"{found.path} was written by a different experiment, refusing to resume from it: "
                + "; ".join(changes) + ". A different experiment needs its own folder: give the recipe its own "
                "`name` (or checkpointing.dir). To continue this run with the changed settings on purpose, "
                "set checkpointing.resume_changed_recipe: true; to start over, checkpointing.resume: false.")
    return found
