"""Real gloo process groups for the CPU tests of code that runs on several ranks.

``run_ranks(worker, world, tmp_path, *args)`` forks ``world`` processes; each initialises a gloo group (a file
rendezvous under ``tmp_path``, so there is no free port to race for), calls ``worker(rank, world, *args)`` and sends
back what it returns. A rank that raises sends its traceback, which fails the test at once (not after the others
time out waiting for it)."""
from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path
from typing import Any, Callable


class RankFailed(AssertionError):
    """A rank raised; the message is its traceback."""


def _entry(worker: Callable[..., Any], rank: int, world: int, init: str, args: tuple[Any, ...], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        queue.put((rank, True, worker(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(worker: Callable[..., Any], world: int, tmp_path: Path, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Each rank's return value of ``worker(rank, world, *args)``, in rank order."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'gloo-rendezvous'}"
    procs = [ctx.Process(target=_entry, args=(worker, r, world, init, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        out: dict[int, Any] = {}
        for _ in procs:
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RankFailed(f"rank {rank} of {world} raised:\n{value}")
            out[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    return [out[r] for r in range(world)]
