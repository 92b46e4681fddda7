"""Refit bandwidth: the full refit protocol between two processes on one device vs a plain copy.

    python benchmarks/refit_bandwidth.py --backend cuda_ipc --gib 2     # GPU: two processes, one GPU
    python benchmarks/refit_bandwidth.py --backend shm --mib 64         # CPU: shared memory (CI)
    python benchmarks/refit_bandwidth.py --backend cuda_ipc --gib 2 --zero-copy   # read in place
    python benchmarks/refit_bandwidth.py --backend cuda_ipc --gib 2 --timeline    # when each step happens

The producer (this process) holds ``--gib`` of bf16 "exported" tensors; the consumer (a spawned
process on the same device) holds same-shaped destination tensors and its ``load_weights`` copies
into them, one tensor at a time as vLLM's ``load_weights`` does (``--batched-load``: a bucket at a time, as the
replayed load does). Each refit is the real ``RefitProducer.send`` /
``RefitConsumer.receive`` (planning, ping-pong buffers, ZMQ control, manifest check). Next to it,
in the same run, a single-process copy of the same bytes (device-to-device for cuda_ipc, memcpy
for shm) gives the reference bandwidth. Prints a table and ``ratio = refit / copy`` (goal >= 0.5).

Both processes freeze their start-up heap out of the garbage collector's walks, as the runtime's policy worker
and vLLM's engine do (``rlc.runtime.gc_heap``).

``--timeline`` records every protocol event of both processes (the refit engine's event hooks) on the host's
monotonic clock and prints, per event, its median time after the producer's ``send`` began (min-max over the
measured refits): where a refit's time goes between the two processes when the copies themselves take a millisecond.

Note: a refit moves every byte twice (pack into the IPC buffer, then load into the parameter),
so 0.5 is the two-copy bound unless the two copies overlap on the device. With ``--zero-copy``
(``refit.zero_copy_views``) the consumer reads the producer's tensors where they are (it maps their
storage once): one copy, so the bound is 1.0; with shm the tensors then live in a shared segment.
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's rlc/, installed or not

import torch

from tests.refit.harness import refit_config, shm_segment
from rlc.runtime.gc_heap import freeze_heap
from rlc.runtime.refit.buffers import CudaIpcBackend, ShmBackend
from rlc.runtime.refit.consumer import RefitConsumer
from rlc.runtime.refit.copy_tables import copy_all
from rlc.runtime.refit.producer import RefitProducer
from rlc.runtime.refit.specs import TensorSpec, format_bytes

ROW = 4096  # hidden size of the synthetic weights


#: A refit copies every byte twice (pack into the buffer, load out of it): half a plain copy's
#: bandwidth is the bound unless pack and load overlap. The goal is that bound.
GOAL_RATIO = 0.5


def make_specs(total_bytes: int, tensor_bytes: int) -> list[TensorSpec]:
    n = max(1, total_bytes // tensor_bytes)
    rows = max(1, tensor_bytes // (2 * ROW))
    return [TensorSpec(f"model.layers.{i}.mlp.experts.w", (rows, ROW), "bfloat16") for i in range(n)]


def make_backend(kind: str):
    if kind == "cuda_ipc":
        torch.cuda.set_device(0)
        return CudaIpcBackend(0)
    return ShmBackend("bench-shm")


def device_of(kind: str) -> torch.device:
    return torch.device("cuda", 0) if kind == "cuda_ipc" else torch.device("cpu")


def sync(kind: str) -> None:
    if kind == "cuda_ipc":
        torch.cuda.synchronize(0)


#: One protocol event on the host's monotonic clock: (refit number, event, bucket index, nanoseconds).
Event = tuple[int, str, int, int]


class EventLog:
    """A process's protocol events (``--timeline``), numbered by the refit they belong to: ``call`` and ``return``
    mark the benchmark's own ``send`` / ``receive`` calls, every other event comes from the engine's hook."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.refit = -1

    def call(self) -> None:
        self.refit += 1
        self.hook("call", -1)

    def hook(self, event: str, index: int) -> None:
        self.events.append((self.refit, event, index, time.perf_counter_ns()))


def timeline_rows(producer: list[Event], consumer: list[Event], warmup: int) -> list[dict]:
    """Per event of either side (``P``/``C``, name, bucket index), its time after the producer's ``call`` of the
    same refit, in µs: median, min and max over the refits after ``warmup``; ordered by median."""
    starts = {r: t for r, e, _, t in producer if e == "call"}
    offsets: dict[tuple[str, str, int], list[float]] = {}
    for side, events in (("P", producer), ("C", consumer)):
        for r, event, index, t in events:
            if r < warmup or r not in starts or (side, event) == ("C", "call"):
                continue  # the consumer's call waits for the producer: it has no place on the refit's clock
            offsets.setdefault((side, event, index), []).append((t - starts[r]) / 1e3)
    rows = [{"side": side, "event": event, "bucket": index, "median_us": statistics.median(v), "min_us": min(v),
             "max_us": max(v), "refits": len(v)} for (side, event, index), v in offsets.items()]
    return sorted(rows, key=lambda row: row["median_us"])


def print_timeline(rows: list[dict]) -> None:
    print("timeline: µs after the producer's send began (P: producer, C: consumer), median (min-max)")
    for row in rows:
        where = "" if row["bucket"] < 0 else f" #{row['bucket']}"
        print(f"  {row['side']} {row['event'] + where:<18} {row['median_us']:9.1f} "
              f"({row['min_us']:.1f}-{row['max_us']:.1f})")


def consumer_proc(args: dict, out: mp.Queue) -> None:
    """Consumer side: same-shaped destination tensors; load_weights copies into them."""
    torch.set_num_threads(1)
    log = EventLog()
    try:
        kind = args["backend"]
        backend = make_backend(kind)
        dev = device_of(kind)
        dst = {
            s.name: torch.empty(s.shape, dtype=torch.bfloat16, device=dev)
            for s in make_specs(args["total"], args["tensor"])
        }
        if args.get("host_wait"):
            wait_on_host(backend)
        consumer = RefitConsumer(session=args["session"], backend=backend, timeout_s=120,
                                 event_hook=log.hook if args.get("timeline") else None)
        consumer.prepare()
        freeze_heap()  # as vLLM's engine freezes its start-up heap

        def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
            if args.get("batched_load"):  # as the replayed load issues a bucket's copies (refit.replay_load)
                copy_all([dst[name] for name, _ in weights], [w for _, w in weights])
                return
            for name, w in weights:
                dst[name].copy_(w)

        metrics = []
        for _ in range(args["runs"]):
            log.call()
            metrics.append(consumer.receive(load_weights).to_dict())
            log.hook("return", -1)
        sync(kind)
        checksum = float(sum(t.double().sum().item() for t in dst.values()))
        consumer.close()
        out.put({"ok": True, "metrics": metrics, "checksum": checksum, "events": log.events})
    except BaseException as e:  # reported by the parent
        out.put({"ok": False, "error": f"{type(e).__name__}: {e}"})


def wait_on_host(backend: CudaIpcBackend | ShmBackend) -> None:
    """``--host-wait``: this process waits for the other process's events on the host (``event.synchronize()``)
    before it queues the copies that depend on them, instead of queuing them behind a device-side wait: an
    experiment on how the two processes' contexts share the GPU, not a mode of the engine."""
    if isinstance(backend, CudaIpcBackend):
        backend.wait_event = lambda event: event.synchronize()  # type: ignore[method-assign]


def copy_baseline(kind: str, src: list[torch.Tensor], runs: int) -> list[float]:
    """Seconds of one single-process copy pass over the same tensors (same bytes, same count)."""
    dst = [torch.empty_like(t) for t in src]
    times = []
    for _ in range(runs):
        sync(kind)
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        sync(kind)
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> dict:
    threads = torch.get_num_threads()
    frozen_before = gc.get_freeze_count()
    torch.set_num_threads(1)  # CPU copies: same single thread in both processes (the child's default below)
    try:
        return _main(argv)
    finally:
        torch.set_num_threads(threads)
        if not frozen_before:  # called in-process (tests): the caller's heap goes back to the collector
            gc.unfreeze()


def _main(argv: list[str] | None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["cuda_ipc", "shm"], default="cuda_ipc")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--gib", type=float, help="weights to refit, GiB (default 2 for cuda_ipc)")
    size.add_argument("--mib", type=float, help="weights to refit, MiB (default 64 for shm)")
    ap.add_argument(
        "--tensor-mib", type=float, default=None, help="size of each weight tensor, MiB (default: min(64, total/32))"
    )
    ap.add_argument(
        "--buffer-gb", type=float, default=None, help="refit.buffer_gb (both halves); default 1/2 of the weights"
    )
    ap.add_argument("--zero-copy", action="store_true",
                    help="the consumer reads the tensors in place (refit.zero_copy_views): one copy, not two")
    ap.add_argument("--host-wait", action="store_true",
                    help="experiment: each process waits for the other's events on the host before queuing the "
                         "copies that depend on them (instead of a device-side wait)")
    ap.add_argument("--keep-gb", type=float, default=2.0,
                    help="refit.keep_buffers_gb: both halves stay allocated across refits while they fit (default 2)")
    ap.add_argument("--zero-copy-bucket-mib", type=float, default=None,
                    help="with --zero-copy: bytes of views a zero-copy bucket reads before it goes out (default: the "
                         "engine's own, RefitProducer.zero_copy_bucket_bytes); fewer buckets, fewer messages")
    ap.add_argument("--batched-load", action="store_true",
                    help="the consumer copies each bucket in one torch._foreach_copy_ call, as refit.replay_load's "
                         "replayed copies do (default: one copy_ per tensor, as vLLM's load_weights)")
    ap.add_argument("--timeline", action="store_true",
                    help="also print when each protocol event of both processes happens within a refit")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results as JSON to this path")
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 when ratio refit/copy is below the goal ({GOAL_RATIO})")
    a = ap.parse_args(argv)
    if a.gib is not None:
        total = int(a.gib * (1 << 30))
    elif a.mib is not None:
        total = int(a.mib * (1 << 20))
    else:
        total = 2 << 30 if a.backend == "cuda_ipc" else 64 << 20
    tensor = int(a.tensor_mib * (1 << 20)) if a.tensor_mib else min(64 << 20, total // 32)
    tensor = max(2 * ROW, min(tensor, total))
    specs = make_specs(total, tensor)
    total = sum(s.nbytes for s in specs)
    buffer_gb = a.buffer_gb if a.buffer_gb is not None else total / 2 / (1 << 30)
    runs = a.warmup + a.repeats

    if a.keep_gb < 0 or (a.zero_copy_bucket_mib is not None and a.zero_copy_bucket_mib <= 0):
        ap.error("--keep-gb must be >= 0 and --zero-copy-bucket-mib > 0")
    cfg = refit_config(buffer_gb=buffer_gb, fp32_params=[], transport=a.backend, keep_buffers_gb=a.keep_gb)
    backend = make_backend(a.backend)
    if a.host_wait:
        wait_on_host(backend)
    dev = device_of(a.backend)
    gen = torch.Generator(device=dev).manual_seed(0)
    src = [torch.randn(s.shape, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16) for s in specs]
    segment = None
    if a.zero_copy and a.backend == "shm":  # the shm backend shares only segments it allocated
        segment, views = shm_segment(specs, "bench source")
        for view, t in zip(views, src):
            view.copy_(t)
        src = views
    sync(a.backend)
    checksum = float(sum(t.double().sum().item() for t in src))

    session = "bench" + uuid.uuid4().hex[:8]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(
        target=consumer_proc,
        args=({"backend": a.backend, "session": session, "total": total, "tensor": tensor, "runs": runs,
               "host_wait": a.host_wait, "timeline": a.timeline, "batched_load": a.batched_load}, out),
    )
    child.start()
    log = EventLog()
    producer = RefitProducer(
        cfg, session=session, rank=0, world_size=1, export_dtype="bfloat16", backend=backend, timeout_s=120,
        event_hook=log.hook if a.timeline else None,
    )
    if a.zero_copy_bucket_mib is not None:
        producer.zero_copy_bucket_bytes = int(a.zero_copy_bucket_mib * (1 << 20))
    refits = []
    try:
        producer.prepare(specs, zero_copy=[s.name for s in specs] if a.zero_copy else ())
        freeze_heap()  # as the runtime's policy worker freezes its heap once set up
        for _ in range(runs):
            log.call()
            refits.append(producer.send(zip([s.name for s in specs], src)))
            log.hook("return", -1)
    finally:
        producer.close()
    result = out.get(timeout=300)
    child.join(60)
    if not result["ok"]:
        raise SystemExit(f"consumer failed: {result['error']}")
    if abs(result["checksum"] - checksum) > 1e-6 * max(1.0, abs(checksum)):
        raise SystemExit(f"consumer weights differ from the producer's: checksum {result['checksum']} != {checksum}")

    copy_times = copy_baseline(a.backend, src, runs)[a.warmup :]
    if segment is not None:
        src = []
        segment.close()
    measured = refits[a.warmup :]
    refit_s = statistics.median(m.seconds for m in measured)
    copy_s = statistics.median(copy_times)
    refit_gbps, copy_gbps = total / refit_s / 1e9, total / copy_s / 1e9
    ratio = refit_gbps / copy_gbps
    m0 = measured[0]
    consumer_load = statistics.median(
        c["load_seconds"] + c.get("sync_seconds", 0.0) for c in result["metrics"][a.warmup :]
    )
    device = torch.cuda.get_device_name(0) if a.backend == "cuda_ipc" else "CPU"
    copy_label = "device-to-device copy, same bytes" if a.backend == "cuda_ipc" else "memcpy (torch copy_), same bytes"
    buffers = ("every tensor read in place, no buffer" if a.zero_copy else
               f"halves {format_bytes(m0.half_bytes)} ({m0.buffer_source})")
    print(
        f"refit bandwidth on {device}: backend={a.backend}, {format_bytes(total)} in {len(specs)} bf16 tensors of "
        f"{format_bytes(specs[0].nbytes)}; {buffers}, {m0.num_buckets} buckets/refit; median of {a.repeats} "
        f"(+{a.warmup} warmup)"
    )
    med = statistics.median
    cons = result["metrics"][a.warmup :]
    copies = 1 if a.zero_copy else 2
    rows = [
        (copy_label, copy_s, copy_gbps),
        ("two-copy bound (copy time x 2: pack + load)", 2 * copy_s, copy_gbps / 2) if copies == 2 else
        ("one-copy bound (zero-copy: load only)", copy_s, copy_gbps),
        (f"refit {a.backend}{' zero-copy' if a.zero_copy else ''} (pack + ZMQ + load + manifest)", refit_s,
         refit_gbps),
        ("  producer: pack (queue the copies, mark each bucket)", med(m.pack_seconds for m in measured), None),
        ("  producer: allocate / free buffers", med(m.alloc_seconds for m in measured), None),
        ("  producer: blocked on acks", med(m.wait_ack_seconds for m in measured), None),
        ("  consumer: load_weights + the device wait before done", consumer_load, None),
        ("  consumer: open / close buffers (IPC map)", med(c["open_seconds"] for c in cons), None),
        ("  consumer: waiting for buckets", med(c["wait_seconds"] for c in cons), None),
    ]
    print(f"| {'measurement':<52} | {'seconds':>9} | {'GB/s':>9} |")
    print(f"|{'-' * 54}|{'-' * 11}|{'-' * 11}|")
    for label, secs, gbps in rows:
        rate = f"{gbps:>9.1f}" if gbps is not None else " " * 9
        print(f"| {label:<52} | {secs:>9.4f} | {rate} |")
    allocated = [m.buffers_allocated for m in refits]
    opened = [c["buffers_opened"] for c in result["metrics"]]
    print(f"buffers allocated per refit (warm-up first): {allocated}; handles opened by the consumer: {opened}")
    timeline = timeline_rows(log.events, result["events"], a.warmup) if a.timeline else []
    if timeline:
        print_timeline(timeline)
    verdict = "meets" if meets_goal(ratio) else "BELOW"
    bound = ("a refit copies every byte twice, so 0.5 is the bound unless pack and load overlap on the device"
             if copies == 2 else "zero-copy: every byte is copied once, so 1.0 is the bound")
    print(f"ratio refit/copy = {ratio:.3f} ({verdict} the goal >= {GOAL_RATIO}; {bound})")
    summary = {
        "backend": a.backend,
        "zero_copy": bool(a.zero_copy),
        "host_wait": bool(a.host_wait),
        "device": device,
        "bytes": total,
        "tensors": len(specs),
        "copy_seconds": copy_s,
        "copy_gbps": copy_gbps,
        "refit_seconds": refit_s,
        "refit_gbps": refit_gbps,
        "ratio": ratio,
        "goal_ratio": GOAL_RATIO,
        "meets_goal": meets_goal(ratio),
        "buckets": m0.num_buckets,
        "half_bytes": m0.half_bytes,
        "buffers_allocated": allocated,
        "handles_opened": opened,
        "zero_copy_tensors": [m.zero_copy_tensors for m in refits],
        "batched_load": bool(a.batched_load),
        "keep_buffers_gb": a.keep_gb,
        "zero_copy_bucket_bytes": producer.zero_copy_bucket_bytes,
        "refit_metrics": [m.to_dict() for m in measured],
        "timeline": timeline,
    }
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    if a.check and not summary["meets_goal"]:
        raise SystemExit(f"--check: ratio refit/copy {ratio:.3f} is below the goal {GOAL_RATIO}")
    return summary


def meets_goal(ratio: float) -> bool:
    """The benchmark's verdict: refit bandwidth at least ``GOAL_RATIO`` of a plain copy (NaN fails)."""
    return ratio >= GOAL_RATIO


if __name__ == "__main__":
    main()
