"""Launch bundles: ``rlc compile`` writes a folder that ``sbatch DIR/launch.sbatch`` runs.

Public interface: :func:`build_bundle`, :class:`BundleResult`, :class:`BundleError`.
Modules, one job each: ``context`` (recipe -> quoted template values), ``mounts``, ``env``,
``render`` (jinja2), ``pkgcopy`` (the bundle's own rlc), ``planfiles``, ``lock``, ``writer``
(atomic folder replacement), ``build`` (the whole sequence).
"""
from rlc.compiler.bundle.build import BUNDLE_FILES, BundleResult, build_bundle
from rlc.compiler.bundle.errors import BundleError

__all__ = ["BUNDLE_FILES", "BundleError", "BundleResult", "build_bundle"]
