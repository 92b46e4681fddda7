"""Shutdown never hangs behind a worker still blocked in a call (a vLLM engine waiting in refit prepare
for a trainer rank that already failed used to keep the job alive until its 600 s timeout)."""
from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from rlc.runtime.workers import WorkerGroup, stop_groups  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Worker:
    def __init__(self):
        self.stopped = False

    def block(self, seconds: float) -> None:
        time.sleep(seconds)

    def shutdown(self) -> bool:
        self.stopped = True
        return True

    def ping(self) -> str:
        return "ok"


def test_a_blocked_worker_is_killed_after_the_grace_period(local_ray):
    busy, idle = Worker.remote(), Worker.remote()
    ray.get([busy.ping.remote(), idle.ping.remote()])
    busy.block.remote(3600)  # like a consumer waiting for its producer
    t0 = time.monotonic()
    late = stop_groups([WorkerGroup("generation", [busy]), None, WorkerGroup("policy", [idle])], graceful_timeout_s=2)
    assert time.monotonic() - t0 < 30
    assert late == ["generation 0"]
    for actor in (busy, idle):  # both gone: the idle one after a clean shutdown, the busy one killed
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=30)
