"""Launch bundles: ``rlc compile`` writes a folder that ``sbatch DIR/launch.sbatch`` runs.

Public interface: :func:`build_bundle`, :class:`BundleResult`, :class:`BundleError`.
Modules, one job each: ``context`` (recipe -> quoted template values), ``mounts``, ``env``,
``render`` (jinja2), ``pkgcopy`` (the bundle's own rlc), ``planfiles``, ``lock``, ``writer``
(atomic folder replacement), ``build`` (the whole sequence), ``checks`` (the bundle-stage checks
every command runs).

The builder (and jinja2 with it) is imported on first use, so ``rlc validate`` and ``rlc lint``, which
run only ``checks``, do not pay for the renderer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlc.compiler.bundle.errors import BundleError

if TYPE_CHECKING:
    from rlc.compiler.bundle.build import BUNDLE_FILES, BundleResult, build_bundle

__all__ = ["BUNDLE_FILES", "BundleError", "BundleResult", "build_bundle"]


def __getattr__(name: str) -> Any:
    if name in ("BUNDLE_FILES", "BundleResult", "build_bundle"):
        from rlc.compiler.bundle import build  # noqa: PLC0415

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
