"""Container bind mounts: parse ``cluster.container.mounts`` and check them.

Each entry is ``src:dst`` or ``src:dst:ro|rw``. Checks (errors name the entry's key):
absolute paths made only of characters that survive Pyxis/enroot and Apptainer mount lists
(see :func:`rlc.compiler.shell.quote`, context ``mount``), no duplicate destinations, nothing
mounted over ``/``, ``/proc``, ``/sys``, ``/dev`` (or inside ``/proc`` and ``/sys``), nor over the
folders the bundle mounts itself (its own copy of rlc and the log folder). A source outside
``cluster.shared_fs_roots`` (when that list is given) only warns: other nodes may not see it.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass

from rlc.compiler.bundle.errors import BundleError, Problems
from rlc.compiler.shell import UnsafeValue, quote

#: Where the bundle folder (runtime.yaml, env.sh, node.sh, rlc_pkg/) appears inside the container.
BUNDLE_MOUNT = "/opt/rlc-bundle"
_FORBIDDEN_EXACT = ("/", "/proc", "/sys", "/dev")
_FORBIDDEN_TREES = ("/proc", "/sys")


@dataclass(frozen=True)
class Mount:
    """One bind mount. ``mode`` is ``"ro"``, ``"rw"`` or ``None`` (runtime default: read-write)."""

    src: str
    dst: str
    mode: str | None = None

    @property
    def spec(self) -> str:
        """``src:dst[:mode]``, the form Pyxis and Apptainer both read."""
        return f"{self.src}:{self.dst}" + (f":{self.mode}" if self.mode else "")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _path(text: str, key: str, what: str) -> str:
    if not text:
        raise BundleError(f"{key}: the {what} path is empty; write `src:dst` or `src:dst:ro`", key)
    try:
        quote(text, key, "mount")
    except UnsafeValue as exc:
        raise BundleError(f"{key}: {what} {exc.problem}; {exc.fix}", key) from None
    return posixpath.normpath(text) if text != "/" else "/"


def parse_mount(text: str, key: str) -> Mount:
    """Parse one ``src:dst[:ro|rw]`` entry; raise :class:`BundleError` naming ``key``."""
    if not isinstance(text, str):
        raise BundleError(f"{key}: expected a string `src:dst[:ro|rw]`", key)
    if "," in text:
        raise BundleError(f"{key}: {text!r} contains ','; write one mount per list entry "
                          "(paths cannot contain ',')", key)
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise BundleError(
            f"{key}: {text!r} is not `src:dst` or `src:dst:ro|rw` (paths cannot contain ':')", key)
    mode = parts[2] if len(parts) == 3 else None
    if mode is not None and mode not in ("ro", "rw"):
        raise BundleError(f"{key}: mount option {mode!r} is not supported; use `ro` or `rw`", key)
    return Mount(_path(parts[0], key, "source"), _path(parts[1], key, "destination"), mode)


def check_mounts(entries: list[str], shared_fs_roots: list[str], reserved: dict[str, str],
                 key: str = "cluster.container.mounts",
                 problems: Problems | None = None) -> tuple[list[Mount], list[str]]:
    """Parse and check the user's mounts. ``reserved`` maps destinations the bundle mounts itself
    to a description. Returns the good mounts and warnings; each bad entry is added to
    ``problems`` (every entry is checked), or raised as a :class:`BundleError` when it is ``None``."""
    found = Problems() if problems is None else problems
    mounts: list[Mount] = []
    warnings: list[str] = []
    seen: dict[str, str] = {}
    for i, entry in enumerate(entries):
        k = f"{key}[{i}]"
        m = found.attempt(_checked_mount, entry, k, reserved, seen)
        if m is None:
            continue
        seen[m.dst] = k
        if shared_fs_roots and not any(_inside(m.src, posixpath.normpath(r)) for r in shared_fs_roots):
            warnings.append(f"{k}: source {m.src} is outside cluster.shared_fs_roots "
                            f"({', '.join(shared_fs_roots)}); other nodes may not see it")
        mounts.append(m)
    if problems is None:
        found.raise_first()
    return mounts, warnings


def _checked_mount(entry: str, k: str, reserved: dict[str, str], seen: dict[str, str]) -> Mount:
    m = parse_mount(entry, k)
    if m.dst in _FORBIDDEN_EXACT or any(_inside(m.dst, t) for t in _FORBIDDEN_TREES):
        raise BundleError(f"{k}: mounting over {m.dst} would break the container; "
                          "choose another destination", k)
    for dst, what in reserved.items():
        if _inside(m.dst, dst):
            raise BundleError(f"{k}: {m.dst} is where the bundle mounts {what}; "
                              "choose another destination", k)
    if m.dst in seen:
        raise BundleError(f"{k}: destination {m.dst} is already mounted by {seen[m.dst]}; "
                          "each destination may be mounted once", k)
    return m
