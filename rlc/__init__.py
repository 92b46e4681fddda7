"""rlc: a declarative recipe compiler (``rlc.compiler``) and its bundled runtime (``rlc.runtime``)."""

import os as _os

__version__ = "0.1.0"
#: Version of the recipe format (``version:`` in a recipe) this release reads.
RECIPE_VERSION = 1
#: Version of the resolved ``runtime.yaml`` contract between compiler and runtime.
RUNTIME_CONFIG_VERSION = 1

# In a source checkout the subpackages are the top-level folders (compiler/, runtime/, ...), which
# an install maps into ``rlc``. Run from the checkout's root without installing (or with the
# checkout shadowing an editable install: ``python -m rlc.runtime`` puts the cwd first), the
# folder ``rlc/`` alone would be found; adding the checkout to ``__path__`` lets
# ``rlc.compiler`` resolve to ``compiler/`` there too. An installed wheel has ``rlc/compiler``
# and never takes this branch.
_here = _os.path.dirname(_os.path.abspath(__file__))
_checkout = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "compiler")) and _os.path.isfile(_os.path.join(_checkout, "setup.py")):
    __path__.append(_checkout)  # noqa: F821 (``__path__`` exists in a package's __init__)
del _here, _checkout
