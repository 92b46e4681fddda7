"""Where a benchmark result comes from: the checkout's commit and the machine, recorded in every
results file (``"commit"``, ``"machine"``) so a number can be traced and compared like for like."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def git_commit(root: Path) -> str:
    """The short commit of the checkout at ``root``, ``+dirty`` when tracked files differ from it;
    ``unknown`` outside a git checkout."""
    proc = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (proc.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def machine(**versions: str) -> dict[str, Any]:
    """The host, its CPU model and usable CPUs, the 1-minute load average (how busy it was), the
    Python version, ``versions`` (e.g. ``torch=torch.__version__``) and the platform."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cpus": len(os.sched_getaffinity(0)),
            "load_average_1m": round(os.getloadavg()[0], 2), "python": platform.python_version(),
            **versions, "platform": platform.platform()}
