"""rlc: a declarative recipe compiler (``rlc.compiler``) and its bundled runtime (``rlc.runtime``)."""

__version__ = "0.1.0"
#: Version of the recipe format (``version:`` in a recipe) this release reads.
RECIPE_VERSION = 1
#: Version of the resolved ``runtime.yaml`` contract between compiler and runtime.
RUNTIME_CONFIG_VERSION = 1
