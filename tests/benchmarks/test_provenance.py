"""The provenance every benchmark result records: the checkout's commit and the machine."""
from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

from benchmarks import _provenance, bench_compiler, packing_host_cost

REPO = Path(__file__).resolve().parents[2]


def test_the_commit_is_the_checkouts_short_hash():
    commit = _provenance.git_commit(REPO)
    assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", commit), commit
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert head.startswith(commit.removesuffix("+dirty"))


def test_outside_a_checkout_the_commit_is_unknown(tmp_path):
    assert _provenance.git_commit(tmp_path) == "unknown"


def test_the_machine_record():
    info = _provenance.machine()
    assert list(info) == ["host", "cpu", "cpus", "load_average_1m", "python", "platform"]
    assert info["host"] == platform.node() and info["platform"] == platform.platform()
    assert info["python"] == platform.python_version()
    assert isinstance(info["cpu"], str) and info["cpus"] == len(os.sched_getaffinity(0)) >= 1
    assert isinstance(info["load_average_1m"], float) and info["load_average_1m"] >= 0
    # versions of what was measured go before the platform
    assert list(_provenance.machine(torch="2.13.0")) == ["host", "cpu", "cpus", "load_average_1m", "python",
                                                         "torch", "platform"]


def test_the_benchmarks_record_it_with_the_one_helper():
    assert bench_compiler.git_commit is packing_host_cost.git_commit is _provenance.git_commit
    assert bench_compiler.machine is _provenance.machine
