"""``python -m rlc`` is the ``rlc`` command."""
import gc

gc.set_threshold(50_000)  # before the imports: see rlc.compiler.cli.run

from rlc.compiler.cli import run  # noqa: E402

run()
