"""``python -m rlc`` is the ``rlc`` command."""
from rlc.compiler.cli import run

run()
