"""``python -m rlc`` is the ``rlc`` command."""
from rlc.compiler import collect_rarely

collect_rarely()  # before the command's imports, which allocate most of what the process keeps

from rlc.compiler.cli import run  # noqa: E402

run()
