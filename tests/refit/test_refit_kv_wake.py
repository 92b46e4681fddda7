"""The KV cache woken during the transfer (``refit.wake_kv_during_transfer``), as far as the CPU can show it: the
consumer's ``on_begin`` runs once per refit, after the producer's ``begin`` and before any bucket is loaded; the
producer plans its buffers without the bytes the consumer announced it maps during the refit; the thread that runs
the wake-up hands its error back to the refit.

The wake-up itself is vLLM's ``Worker.wake_up(tags=["kv_cache"])`` on the GPU (``tests/gpu/host_run.sh``).
"""
from __future__ import annotations

import threading
import uuid

import pytest

from rlc.runtime.generation.background import BackgroundCall
from tests.refit import harness as H

FREE = 1 << 20


def _run(pool, *, mapped: int, steps: int = 3):
    s = f"kv-{uuid.uuid4().hex[:8]}"
    fc = pool.submit(H.dense_consumer_main, {"session": s, "replay": False, "steps": steps, "on_begin": True,
                                             "mapped_during_refit": mapped})
    fp = pool.submit(H.model_producer_main, {"model": "dense", "session": s, "steps": steps, "free_bytes": FREE})
    return fp.result(timeout=90), fc.result(timeout=90)


def test_on_begin_runs_before_any_bucket_and_the_producer_plans_without_the_mapped_bytes(pool):
    p, c = map(H.ok, _run(pool, mapped=300_000))
    assert c["began"] == [0, 0, 0]  # once per refit, before a single tensor of it was loaded
    assert [m["free_before_bytes"] for m in p["metrics"]] == [FREE - 300_000] * 3
    quiet = H.ok(_run(pool, mapped=0)[0])
    assert [m["free_before_bytes"] for m in quiet["metrics"]] == [FREE] * 3


def test_a_consumer_that_maps_almost_everything_leaves_the_producer_no_room_for_its_buffers(pool):
    p, c = _run(pool, mapped=FREE - 8192, steps=1)  # the harness's halves need 16 KiB together
    assert not p["ok"] and p["error_type"] == "RefitPlanError"
    assert "refit.buffer_gb" in p["error"] and "free at refit time" in p["error"]
    assert not c["ok"]


def test_a_background_call_runs_beside_the_caller_and_hands_back_its_error():
    release = threading.Event()
    ran = []

    def work() -> None:
        release.wait(5)
        ran.append(threading.current_thread().name)

    call = BackgroundCall(work, "wake")
    assert call.join() == 0.0 and not call.started  # never started: nothing to wait for
    call.start()
    assert call.started and not ran  # the caller goes on while it waits
    release.set()
    call.join()
    assert ran == ["wake"] and call.seconds > 0
    with pytest.raises(RuntimeError, match="started twice"):
        call.start()

    def fails() -> None:
        raise OSError("cuMemCreate: out of memory")

    failing = BackgroundCall(fails, "KV cache wake-up")
    failing.start()
    with pytest.raises(RuntimeError, match="KV cache wake-up failed: cuMemCreate: out of memory"):
        failing.join()
    failing.join(raise_error=False)  # when the caller has its own error to report
