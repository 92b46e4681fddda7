"""rlc: a declarative recipe compiler (``rlc.compiler``) and its bundled runtime (``rlc.runtime``)."""

#: Version of the resolved ``runtime.yaml`` contract between compiler and runtime (the contract defines it).
from rlc.contract.version import RUNTIME_CONFIG_VERSION

__version__ = "0.1.0"
#: Version of the recipe format (``version:`` in a recipe) this release reads.
RECIPE_VERSION = 1

__all__ = ["RECIPE_VERSION", "RUNTIME_CONFIG_VERSION", "__version__"]
