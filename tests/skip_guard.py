"""CI fails when a test that must run on the CI machine skipped.

The CI machine (``.ci/run``: Debian, no GPU, test extras installed, the SLURM harness started) runs
everything but the GPU-host proofs. A skip there means a dependency went missing or a fixture
stopped being found, and the test silently stopped testing. With ``RLC_STRICT_SKIPS=1`` (set by
``.ci/run``) every skip must match ``ALLOWED_SKIPS``; any other fails the session, listed by name.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import pytest

#: (node id prefix, words in the skip reason, why it may skip on the CI machine)
ALLOWED_SKIPS: tuple[tuple[str, str, str], ...] = (
    ("tests/gpu/", "GPU host only", "GPU proofs run on a GPU host (tests/gpu/host_run.sh)"),
    ("tests/gpu/", "needs two GPUs", "GPU proofs run on a GPU host"),
    ("tests/gpu/", "needs four GPUs", "GPU proofs run on a GPU host"),
    ("tests/bundle/test_bundle_golden.py", "is a negative fixture", "recipes that must fail have no bundle"),
    ("tests/bundle/test_bundle_golden.py", "takes its model facts from its checkpoint's config.json",
     "Nemotron-3-Ultra's geometry is only in its checkpoint's config.json: offline it refuses to compile (RLC216)"),
    ("tests/planner/test_ratio_window.py", "no refit math for this recipe (facts unknown)",
     "a recipe whose architecture is not public (Nemotron-3-Ultra) has no refit window to compare"),
)

ENV = "RLC_STRICT_SKIPS"


def disallowed(skips: Iterable[tuple[str, str]], allowed: Sequence[tuple[str, str, str]] = ALLOWED_SKIPS
               ) -> list[tuple[str, str]]:
    """The (node id, reason) skips that no ``allowed`` entry covers."""
    return [(node, reason) for node, reason in skips
            if not any(node.startswith(prefix) and words in reason for prefix, words, _ in allowed)]


def skip_reason(longrepr: object) -> str:
    """The reason of a skipped test report (pytest stores ``(path, line, "Skipped: reason")``)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


_SKIPS: list[tuple[str, str]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPS.append((report.nodeid, skip_reason(report.longrepr)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(ENV) != "1":
        return
    bad = disallowed(_SKIPS)
    if bad:
        lines = "\n".join(f"  {node}: {reason}" for node, reason in bad)
        print(f"\n{ENV}=1: {len(bad)} test(s) skipped that must run on this machine "
              f"(allowed skips: tests/skip_guard.py ALLOWED_SKIPS):\n{lines}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
