"""Every path the job reads or writes inside the container, checked against what the container has.

A path the job uses must be inside the container: in a mount (``cluster.container.mounts``, or
one the bundle adds itself: its own folder, read-only, and ``cluster.log_dir``), or, for what it
only reads, in a folder the image holds (``cluster.container.image_paths``). Otherwise Pyxis or
Apptainer start the job, after its wait in the queue, without the file: the job fails at start
("no such file"), or writes its checkpoints into the container, where they vanish at the end.

The paths (:func:`job_paths`), by the key that names them:

* ``data.train``, ``data.val``: files the driver reads;
* ``model.checkpoint``, ``model.tokenizer``: folders every node reads, when they are local paths
  (absolute, or ``./``, ``../``, ``~``); anything else is a Hugging Face Hub id, fetched by the job;
* ``checkpointing.dir`` (when checkpointing is on) and ``logging.dir``: folders the job writes,
  made absolute as the resolver does (by default inside ``cluster.log_dir``, which the bundle mounts);
* ``cluster.env.PYTHONPATH``: absolute folders the job imports from (a ``module:function`` reward
  lives in one of them, or in the image);
* ``reward.kwargs``: string values that are absolute paths (a file the reward function opens).

``data.prompt_template`` is the template text itself, never a file; ``reward.function`` names a
module (imported through ``PYTHONPATH``), never a file. With ``cluster.container.runtime: none``
the job sees the host's files and nothing is checked.

The bundle does not add mounts for these paths by itself (docs/bundle.md says why); each error
names the key, the path and the mount line that would cover it (source = destination: change the
source where the host keeps the files elsewhere).
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from rlc.compiler.bundle.errors import BundleError, Problems
from rlc.compiler.bundle.mounts import BUNDLE_MOUNT, Mount, parse_mount
from rlc.compiler.recipe_types import (
    CheckpointingSection,
    ClusterSection,
    DataSection,
    LoggingSection,
    ModelSection,
    RewardSection,
)
from rlc.compiler.shell import UnsafeValue, quote
from rlc.contract.job_paths import is_local, kwarg_paths
from rlc.compiler.run_dirs import output_dirs_of

MOUNTS_KEY = "cluster.container.mounts"
IMAGE_KEY = "cluster.container.image_paths"


@dataclass(frozen=True)
class JobPath:
    """One path the job uses inside the container, by the recipe key that names it."""

    key: str
    path: str
    writes: bool  # the job writes there (else: only reads)
    is_file: bool  # a file (the mount to suggest is its folder), else a folder


@dataclass(frozen=True)
class Cover:
    """Something that makes paths visible in the container: a mount, or a folder of the image."""

    root: str
    what: str  # how an error names it
    writable: bool
    image: bool = False


def job_paths(cluster: ClusterSection, data: DataSection, model: ModelSection, reward: RewardSection,
              checkpointing: CheckpointingSection, logging: LoggingSection, name: str) -> list[JobPath]:
    """The paths the job uses inside the container (see the module docstring), relative ones as written."""
    found = [JobPath("data.train", data.train, False, True)]
    if data.val is not None:
        found.append(JobPath("data.val", data.val, False, True))
    if is_local(model.checkpoint_path):
        found.append(JobPath("model.checkpoint" if model.checkpoint is not None else "model.id",
                             model.checkpoint_path, False, False))
    if model.tokenizer is not None and is_local(model.tokenizer):
        found.append(JobPath("model.tokenizer", model.tokenizer, False, False))
    ckpt, metrics = output_dirs_of(cluster.log_dir, name, checkpointing.dir, logging.dir)
    if checkpointing.enabled:
        found.append(JobPath("checkpointing.dir", ckpt, True, False))
    found.append(JobPath("logging.dir", metrics, True, False))
    pythonpath = cluster.env.get("PYTHONPATH")
    if isinstance(pythonpath, str):
        for entry in pythonpath.split(":"):
            if entry.startswith("/") and "$" not in entry:
                found.append(JobPath("cluster.env.PYTHONPATH", entry, False, False))
    for key, path in kwarg_paths(dict(reward.kwargs)):
        found.append(JobPath(key, path, False, True))
    return found


def covers(mounts: list[tuple[str, Mount]], image_paths: list[tuple[str, str]], log_dir: str) -> list[Cover]:
    """What the container holds: the recipe's mounts (``(key, mount)``), the bundle's own two, and
    the image's folders (``(key, path)``)."""
    found = [Cover(BUNDLE_MOUNT, f"the bundle's own mount at {BUNDLE_MOUNT} (read-only)", False),
             Cover(log_dir, f"cluster.log_dir ({log_dir}, which the bundle mounts)", True)]
    found += [Cover(m.dst, f"{key} (`{m.spec}`)", m.mode != "ro") for key, m in mounts]
    found += [Cover(posixpath.normpath(p), f"{key} ({p}, a folder of the image)", False, image=True)
              for key, p in image_paths]
    return found


def _inside(path: str, root: str) -> bool:
    return root == "/" or path == root or path.startswith(root.rstrip("/") + "/")


def covering(path: str, found: list[Cover]) -> Cover | None:
    """The cover the container shows at ``path``: the deepest mount or image folder holding it
    (a mount over an image folder hides it)."""
    best: Cover | None = None
    for cover in found:
        if _inside(path, cover.root) and (best is None or len(cover.root) > len(best.root)
                                          or (len(cover.root) == len(best.root) and best.image)):
            best = cover
    return best


def _mountable(folder: str) -> str | None:
    """``folder``, or the nearest folder above it, whose path a mount list can hold (None: only ``/``)."""
    while folder not in ("/", ""):
        try:
            quote(folder, MOUNTS_KEY, "mount")
            return folder
        except UnsafeValue:
            folder = posixpath.dirname(folder)
    return None


def _fix(jp: JobPath, path: str) -> str:
    folder = _mountable(posixpath.dirname(path) if jp.is_file else path)
    if folder is None:
        return ("no mount can name a folder holding it (its path has characters a mount list cannot hold); "
                "move it to a plainer path")
    line = f"{folder}:{folder}" + ("" if jp.writes else ":ro")
    fix = (f"add `{line}` to {MOUNTS_KEY} (its first part is the host's folder, which must exist on every node: "
           "change it if the host keeps the files elsewhere)")
    if not jp.writes:
        fix += f", or add {folder} to {IMAGE_KEY} if the image holds it"
    return fix


def parsed_mounts(entries: Any) -> list[tuple[str, Mount]]:
    """The well-formed entries of ``cluster.container.mounts`` with their keys (the bundle's mount
    checks report the others)."""
    found = []
    for i, entry in enumerate(entries):
        key = f"{MOUNTS_KEY}[{i}]"
        try:
            found.append((key, parse_mount(entry, key)))
        except BundleError:
            continue
    return found


def _check(jp: JobPath, found: list[Cover]) -> None:
    path = posixpath.normpath(jp.path)
    if not posixpath.isabs(jp.path):
        raise BundleError(
            f"{jp.key}: {jp.path!r} is a relative path, and in the container the job runs from the bundle's "
            "folder, not from where you compiled; write the absolute path the container sees (and mount it)",
            jp.key)
    cover = covering(path, found)
    verb = "writes" if jp.writes else "reads"
    if cover is None:
        lost = (", so what it writes would stay inside the container and be lost when the job ends" if jp.writes
                else ", so the job would not find it")
        raise BundleError(f"{jp.key}: the job {verb} {path}, which no mount puts in the container{lost}; "
                          f"{_fix(jp, path)}", jp.key)
    if jp.writes and cover.image:
        raise BundleError(f"{jp.key}: the job writes {path}, inside {cover.what}: what it writes there is lost when "
                          f"the container ends and other nodes never see it; mount a shared folder there: "
                          f"{_fix(jp, path)}", jp.key)
    if jp.writes and not cover.writable:
        raise BundleError(f"{jp.key}: the job writes {path}, inside {cover.what}, which is read-only; drop `:ro` "
                          f"from that mount, or mount a writable folder there: {_fix(jp, path)}", jp.key)


def _hidden_image_paths(mounts: list[tuple[str, Mount]], image_paths: list[tuple[str, str]],
                        problems: Problems) -> None:
    for key, m in mounts:
        for ikey, p in image_paths:
            if _inside(posixpath.normpath(p), m.dst):
                problems.append(BundleError(
                    f"{key}: `{m.spec}` mounts over {m.dst}, which hides the image's own {p} ({ikey}); mount it "
                    f"somewhere else, or remove {p} from {IMAGE_KEY} if it is not in the image", key))


def check_job_paths(paths: list[JobPath], mounts: list[tuple[str, Mount]], image_paths: list[str], log_dir: str,
                    problems: Problems | None = None) -> None:
    """Check that every path the job uses is in the container; each problem is added to
    ``problems`` (or, when that is ``None``, the first one is raised once all have run)."""
    found = Problems() if problems is None else problems
    images = [(f"{IMAGE_KEY}[{i}]", p) for i, p in enumerate(image_paths)]
    _hidden_image_paths(mounts, images, found)
    cover = covers(mounts, images, log_dir)
    for jp in paths:
        found.attempt(_check, jp, cover)
    if problems is None:
        found.raise_first()


__all__ = ["JobPath", "check_job_paths", "covering", "covers", "job_paths", "parsed_mounts"]
