"""Package layout: the customer's top-level folders install as one namespace, ``rlc``.

``compiler/`` -> ``rlc.compiler``, ``runtime/`` -> ``rlc.runtime``, and the data folders
``templates/``, ``schemas/``, ``recipes/`` -> ``rlc.templates`` etc. (found at run time with
``importlib.resources``). setuptools cannot discover packages through a ``package-dir`` map,
so they are listed here by walking each folder.
"""
import os

from setuptools import setup

ROOTS = {
    "rlc": "rlc",
    "rlc.compiler": "compiler",
    "rlc.runtime": "runtime",
    "rlc.templates": "templates",
    "rlc.schemas": "schemas",
    "rlc.recipes": "recipes",
}
DATA = ["*.json", "*.yaml", "*.yml", "*.j2", "*.sh", "*.txt", "*.md", "*.jsonl"]


def _packages():
    found = []
    for package, folder in ROOTS.items():
        for dirpath, dirnames, _ in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
            rel = os.path.relpath(dirpath, folder)
            found.append(package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}")
    return found


PACKAGES = _packages()
setup(
    packages=PACKAGES,
    package_dir=ROOTS,
    package_data={p: DATA for p in PACKAGES},
)
