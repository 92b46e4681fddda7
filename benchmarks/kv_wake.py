"""How long vLLM's sleep mode takes to release and re-map a KV-cache-sized pool of GPU memory.

    python benchmarks/kv_wake.py --pool-gib 40 --allocations 1,36,288 --gaps 0,0.5 --repeats 10 --json OUT.json
    python benchmarks/kv_wake.py --dry-run      # CPU: the configurations and allocation sizes, nothing measured

When vLLM sleeps it unmaps and releases the physical memory behind its KV cache, and when it wakes it
creates and maps new memory at the same addresses. Waking a 24.8 GiB KV cache (Qwen3-8B on one H200, one
allocation per layer) was seen to take 0.015-0.077 s, longer the sooner it followed the previous sleep.
This benchmark asks why: is the cost per allocation (so fewer, larger allocations would help), or per
byte (the driver clearing the physical memory it hands back, which no layout can avoid)?

It uses vLLM's own allocator (``vllm.device_allocator.cumem.CuMemAllocator``), not a copy of it. For
each configuration (number of allocations x gap), a fresh process allocates the pool as that many
int8 tensors (sizes in 2 MiB steps, summing to the pool) inside ``use_memory_pool(tag="kv_cache")``,
then runs one warm-up and ``--repeats`` measured cycles of:

    sleep(offload_tags=())  -- timed: unmap + release every allocation, nothing copied to the host
                               (vLLM's sleep also runs gc.collect() and torch.cuda.empty_cache())
    time.sleep(gap)         -- the rest of the training step
    wake_up(["kv_cache"])   -- timed: create + map every allocation again

each timed phase between two ``torch.cuda.synchronize()`` calls. Outside the timing, every cycle
writes a byte pattern into the first and last 2 MiB of the pool before the sleep, reads them after
the wake (``zero``: the memory came back cleared; ``kept``: the pattern survived; ``other``), and
writes and reads back a new pattern to check that the memory is usable. ``--fill-all`` also writes
the whole pool after every wake, as generation would write the KV cache.

Output: a table (median, min and max seconds, wake GB/s = pool bytes / median wake) and, with
``--json``, the command line, the machine, every raw timing and the summary.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this folder's package, run as a script or imported

from benchmarks._provenance import git_commit, machine  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
ALIGN = 2 * MIB  # the driver's allocation granularity on NVIDIA GPUs; vLLM's allocator rounds up to it
#: PyTorch's caching allocator packs requests under 10 MiB into shared 20 MiB segments, so below this size the
#: number of tensors would not be the number of driver allocations.
MIN_ALLOCATION = 10 * MIB
CHECK_BYTES = 2 * MIB  # the pattern written before each sleep and read after each wake, at each end of the pool
TAG = "kv_cache"


# --------------------------------------------------------------------------- arguments and plan (pure)


def pool_bytes(gib: float) -> int:
    """``gib`` GiB rounded down to a whole number of 2 MiB steps."""
    return int(gib * GIB) // ALIGN * ALIGN


def allocation_sizes(pool: int, n: int) -> list[int]:
    """``pool`` bytes split into ``n`` sizes, each a multiple of 2 MiB, differing by at most 2 MiB, summing to
    ``pool``. ``ValueError`` when ``pool`` is not a multiple of 2 MiB or has fewer 2 MiB steps than ``n``."""
    if n < 1:
        raise ValueError(f"need at least 1 allocation, got {n}")
    if pool <= 0 or pool % ALIGN:
        raise ValueError(f"the pool ({pool} bytes) must be a positive multiple of 2 MiB")
    units = pool // ALIGN
    if n > units:
        raise ValueError(f"{n} allocations need at least {n * 2} MiB; the pool has {pool // MIB} MiB")
    base, extra = divmod(units, n)
    return [(base + (i < extra)) * ALIGN for i in range(n)]


def _number_list(ap: argparse.ArgumentParser, flag: str, text: str, kind: type) -> list[Any]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        ap.error(f"{flag}: give a comma list of numbers (got {text!r})")
    try:
        return [kind(s) for s in items]
    except ValueError:
        ap.error(f"{flag}: {text!r} is not a comma list of {'whole numbers' if kind is int else 'numbers'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: a wrong value exits with the flag named (``SystemExit`` 2), not a traceback.
    Adds ``pool_bytes``, ``allocation_list``, ``gap_list``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-gib", type=float, default=40.0, help="size of the pool in GiB (default 40)")
    ap.add_argument("--allocations", default="1,36,288", help="comma list: how many allocations the pool is split into")
    ap.add_argument("--gaps", default="0,0.5", help="comma list: seconds between the release and the re-map")
    ap.add_argument("--repeats", type=int, default=10, help="measured cycles per configuration, after one warm-up")
    ap.add_argument("--fill-all", action="store_true", help="write the whole pool after every wake (untimed)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="limit for one configuration's process")
    ap.add_argument("--json", type=Path, default=None, help="write the raw timings and the summary here")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and stop (no GPU, no torch, no vLLM)")
    a = ap.parse_args(argv)
    if not (math.isfinite(a.pool_gib) and a.pool_gib > 0):
        ap.error(f"--pool-gib must be > 0 (got {a.pool_gib})")
    a.pool_bytes = pool_bytes(a.pool_gib)
    if a.pool_bytes < ALIGN:
        ap.error(f"--pool-gib {a.pool_gib} is under 2 MiB")
    a.allocation_list = _number_list(ap, "--allocations", a.allocations, int)
    for n in a.allocation_list:
        if n < 1:
            ap.error(f"--allocations: each count must be >= 1 (got {n})")
        smallest = a.pool_bytes // n // ALIGN * ALIGN
        if smallest < MIN_ALLOCATION:
            ap.error(f"--allocations {n} splits the {a.pool_bytes / GIB:g} GiB pool (--pool-gib) into pieces of "
                     f"{smallest / MIB:g} MiB; below {MIN_ALLOCATION // MIB} MiB PyTorch packs several into one "
                     "segment, so give a smaller count or a larger pool")
    a.gap_list = _number_list(ap, "--gaps", a.gaps, float)
    for g in a.gap_list:
        if not (math.isfinite(g) and g >= 0):
            ap.error(f"--gaps: each gap must be a number of seconds >= 0 (got {g})")
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1 (got {a.repeats})")
    if not a.timeout_s > 0:
        ap.error(f"--timeout-s must be > 0 (got {a.timeout_s})")
    return a


def configurations(a: argparse.Namespace) -> list[dict[str, Any]]:
    """One entry per (allocations, gap), in run order: what a measuring process needs."""
    return [{"allocations": n, "gap_s": g, "pool_bytes": a.pool_bytes,
             "sizes": allocation_sizes(a.pool_bytes, n), "repeats": a.repeats, "fill_all": a.fill_all}
            for n in a.allocation_list for g in a.gap_list]


def plan_text(a: argparse.Namespace) -> str:
    lines = [f"pool: {a.pool_bytes / GIB:g} GiB ({a.pool_bytes} bytes), tag {TAG!r}; per configuration one "
             f"process, 1 warm-up + {a.repeats} measured sleep/wake cycles"
             + (", whole pool written after every wake" if a.fill_all else "")]
    for c in configurations(a):
        lo, hi = min(c["sizes"]), max(c["sizes"])
        each = f"{lo / MIB:g} MiB" if lo == hi else f"{lo / MIB:g}-{hi / MIB:g} MiB"
        lines.append(f"  allocations {c['allocations']:>5}  gap {c['gap_s']:>5g} s  each {each}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- summary and table (pure)


def summarise(values: list[float]) -> dict[str, float]:
    """Median, min, max and count of ``values`` (not empty)."""
    if not values:
        raise ValueError("no timings to summarise")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise_result(r: dict[str, Any]) -> dict[str, Any]:
    """The summary of one configuration's raw timings: sleep and wake statistics, wake GB/s (pool bytes / median
    wake, 1 GB = 1e9 bytes), and how many wakes gave back cleared / unchanged memory."""
    wake, sleep = summarise(r["wake_s"]), summarise(r["sleep_s"])
    states = r.get("after_wake", [])
    return {"wake_s": wake, "sleep_s": sleep,
            "wake_gb_per_s": r["pool_bytes"] / wake["median"] / 1e9 if wake["median"] > 0 else math.inf,
            "after_wake": {s: states.count(s) for s in dict.fromkeys(states)}}


def _stat(s: dict[str, float]) -> str:
    return f"{s['median']:.4f} ({s['min']:.4f}-{s['max']:.4f})"


def table_text(results: list[dict[str, Any]]) -> str:
    """One row per configuration; a failed one shows its error's last line."""
    head = (f"{'allocations':>11}  {'gap_s':>6}  {'MiB each':>9}  {'wake s: median (min-max)':<26}  "
            f"{'sleep s: median (min-max)':<26}  {'wake GB/s':>9}  after wake")
    rows = [head, "-" * len(head)]
    for r in results:
        lead = f"{r['allocations']:>11}  {r['gap_s']:>6g}  {r['pool_bytes'] / r['allocations'] / MIB:>9.1f}"
        if r.get("error"):
            rows.append(f"{lead}  FAILED: {r['error'].strip().splitlines()[-1]}")
            continue
        s = r.get("summary") or summarise_result(r)
        seen = ", ".join(f"{k} {v}/{s['wake_s']['n']}" for k, v in s["after_wake"].items())
        note = "" if r.get("driver_allocations", r["allocations"]) == r["allocations"] else \
            f"  ({r['driver_allocations']} driver allocations)"
        rows.append(f"{lead}  {_stat(s['wake_s']):<26}  {_stat(s['sleep_s']):<26}  {s['wake_gb_per_s']:>9.0f}  "
                    f"{seen}{note}")
    return "\n".join(rows)


# --------------------------------------------------------------------------- the measuring process (GPU)


def _gpu_info(torch: Any) -> dict[str, str]:
    import vllm  # noqa: PLC0415 - GPU stack, only in the measuring process

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    props = torch.cuda.get_device_properties(0)
    return {"torch": torch.__version__, "vllm": vllm.__version__, "cuda": str(torch.version.cuda),
            "gpu": props.name, "gpu_memory_gib": f"{props.total_memory / GIB:.1f}", "driver": driver}


def measure(cfg: dict[str, Any]) -> dict[str, Any]:
    """Allocate the pool through vLLM's allocator and time its sleep/wake cycles (see the module docstring)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every sleep at INFO
    import torch  # noqa: PLC0415 - GPU stack, only in the measuring process
    from vllm.device_allocator.cumem import CuMemAllocator  # noqa: PLC0415 - loads the cumem extension

    torch.cuda.set_device(0)
    free, _ = torch.cuda.mem_get_info()
    if free < cfg["pool_bytes"] + GIB:
        raise RuntimeError(f"the GPU has {free / GIB:.1f} GiB free; the pool needs {cfg['pool_bytes'] / GIB:g} GiB "
                           "+ 1 GiB headroom (lower --pool-gib)")
    allocator = CuMemAllocator.get_instance()
    t0 = time.perf_counter()
    with allocator.use_memory_pool(tag=TAG):
        tensors = [torch.empty(size, dtype=torch.int8, device="cuda") for size in cfg["sizes"]]
    torch.cuda.synchronize()
    allocate_s = time.perf_counter() - t0
    handles = [d.handle for d in allocator.pointer_to_data.values() if d.tag == TAG]
    ends = [tensors[0][:CHECK_BYTES], tensors[-1][-CHECK_BYTES:]]

    def mark(value: int) -> None:  # write the pattern and read it back: the memory is usable
        for x in ends:
            x.fill_(value)
        got = [int(x.sum()) for x in ends]  # int8 sums in int64
        if got != [value * CHECK_BYTES] * len(ends):
            raise RuntimeError(f"pattern {value} read back as sums {got}, expected {value * CHECK_BYTES}")

    def observe(value: int) -> str:
        if all(int(x.count_nonzero()) == 0 for x in ends):
            return "zero"
        return "kept" if all(bool((x == value).all()) for x in ends) else "other"

    def cycle(value: int, probe: bool = False) -> dict[str, Any]:
        """One sleep/gap/wake; ``value`` is the pattern the ends hold before it, ``next`` the one after it."""
        free_before = torch.cuda.mem_get_info()[0] if probe else 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        allocator.sleep(offload_tags=())
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out: dict[str, Any] = {}
        if probe:  # inside the gap, outside the timing: did the sleep give the memory back to the driver?
            out["freed_on_sleep_bytes"] = torch.cuda.mem_get_info()[0] - free_before
        if cfg["gap_s"] > 0:
            time.sleep(cfg["gap_s"])
        t2 = time.perf_counter()
        allocator.wake_up(tags=[TAG])
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        out |= {"sleep_s": t1 - t0, "wake_s": t3 - t2, "after_wake": observe(value), "next": value % 100 + 1}
        if cfg["fill_all"]:
            for x in tensors:
                x.fill_(value)
        mark(out["next"])
        torch.cuda.synchronize()
        return out

    mark(1)
    warm = cycle(1, probe=True)  # the warm-up, not among the measured cycles
    value = warm.pop("next")
    cycles: list[dict[str, Any]] = []
    for _ in range(cfg["repeats"]):
        cycles.append(cycle(value))
        value = cycles[-1]["next"]
    return {"allocations": cfg["allocations"], "gap_s": cfg["gap_s"], "pool_bytes": cfg["pool_bytes"],
            "fill_all": cfg["fill_all"], "driver_allocations": len(handles),
            "mapped_bytes": sum(h[1] for h in handles), "allocate_s": allocate_s, "warmup": warm,
            **{k: [c[k] for c in cycles] for k in ("sleep_s", "wake_s", "after_wake")},
            "versions": _gpu_info(torch)}


def _child(cfg: dict[str, Any], conn: Any) -> None:
    """The spawned process: measure, send the result (or the traceback), exit without tearing the pool down (the
    driver frees a process's memory when it ends; freeing it through the allocator at exit buys nothing)."""
    try:
        conn.send({"result": measure(cfg)})
    except BaseException:  # noqa: BLE001 - whatever fails goes back to the parent as text, and the next config runs
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_configuration(cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``measure(cfg)`` in a fresh spawned process, so each configuration starts from a clean GPU; a failure or a
    timeout becomes the result's ``error``."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(cfg, send))
    proc.start()
    send.close()
    base = {k: cfg[k] for k in ("allocations", "gap_s", "pool_bytes", "fill_all")}
    try:
        if not recv.poll(timeout_s):
            proc.terminate()
            return base | {"error": f"no result within {timeout_s:g} s (--timeout-s)"}
        msg = recv.recv()
    except EOFError:
        proc.join(30)
        return base | {"error": f"the measuring process exited with code {proc.exitcode} before reporting"}
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(30)
        recv.close()
    if "error" in msg:
        return base | {"error": msg["error"]}
    r = msg["result"]
    return r | {"summary": summarise_result(r)}


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    print(plan_text(a), flush=True)
    if a.dry_run:
        return 0
    record: dict[str, Any] = {
        "benchmark": "kv_wake",
        "command": " ".join(["python", "benchmarks/kv_wake.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": git_commit(REPO), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "configurations": []}
    for cfg in configurations(a):
        print(f"allocations {cfg['allocations']}, gap {cfg['gap_s']:g} s ...", flush=True)
        r = run_configuration(cfg, a.timeout_s)
        if r.get("error"):
            print(r["error"], file=sys.stderr, flush=True)
        elif "versions" in r and "torch" not in record["machine"]:
            record["machine"] = machine(**r["versions"])
        record["configurations"].append(r)
        record["summary"] = [{k: c[k] for k in ("allocations", "gap_s", "pool_bytes")} | c["summary"]
                             for c in record["configurations"] if "summary" in c]
        record["table"] = table_text(record["configurations"])
        if a.json:  # rewritten after every configuration: a timeout keeps what finished
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(record, indent=2) + "\n")
    print(record["table"])
    return 1 if any(r.get("error") for r in record["configurations"]) else 0


if __name__ == "__main__":
    sys.exit(main())
