"""Host (CPU) cost of sequence packing per GRPO step: the work before and after the model's forward passes.

For each batch shape it times, on CPU, the same calls the runtime makes in one step with
``training.sequence_packing.enabled`` (the model forward itself is left out):

* ``driver: batch``: the driver's per-sample lists from the rollout groups and ``pack_rollouts`` (with
  routing replay, the routes too);
* ``old logprobs`` / ``ref logprobs``: the policy worker's ``_packed_microbatches`` for the logprob pass
  (planning every data-parallel shard's bins, packing this rank's), the routes of each micro batch as
  the forward step lays them out, and putting the per-bin logprobs back into the ``[N, L-1]`` result;
* ``train``: the same for every optimizer step's rows with the train budget;
* ``driver: gen-KL``: the gen-KL metrics on the returned logprobs.

Cases: ``tiny`` (the tiny recipe's step: 2,048 sequences of 5..15 tokens, one DP rank), ``mid`` (the GPU
packing check: 512 of 8..512 tokens, 4,096-token budget), ``prod`` (8,192 of 100..4,000 tokens, DP 8,
16,384-token budget, two optimizer steps; rank 0's view) and ``routes`` (1,024 of 50..1,000 tokens with
routing replay routes [8 MoE layers x 8 experts], DP 2, CP 2).

Each measurement runs in a fresh process with ``PYTHONPATH`` set to the checkout measured, so
``--baseline DIR`` (another rlc checkout, e.g. ``git worktree add /tmp/before main``) gives before/after
numbers from one run. Every repeat is a new step (nothing planned in an earlier repeat is reused).
Torch runs on one thread, as in the runtime's Ray actors (Ray sets ``OMP_NUM_THREADS`` to the actor's
one CPU); ``--threads`` changes it. Not a test: timings depend on the machine.

Usage: ``python benchmarks/packing_host_cost.py [--cases tiny,mid,prod,routes] [--repeats 5]
[--baseline DIR] [--json FILE]``
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__:
    from benchmarks._provenance import git_commit
    from benchmarks._provenance import machine as _machine
else:  # run as a script (python benchmarks/packing_host_cost.py): this folder is first on the path
    from _provenance import git_commit  # type: ignore[no-redef]
    from _provenance import machine as _machine  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
PHASES = ("driver: batch", "old logprobs", "ref logprobs", "train", "driver: gen-KL")

CASES: dict[str, dict[str, Any]] = {
    "tiny": {"n": 2048, "lengths": (5, 15), "budget": 131072, "dp": 1, "cp": 1, "max_len": 64, "opt_steps": 1,
             "group": 16},
    "mid": {"n": 512, "lengths": (8, 512), "budget": 4096, "dp": 1, "cp": 1, "max_len": 1024, "opt_steps": 1,
            "group": 16},
    "prod": {"n": 8192, "lengths": (100, 4000), "budget": 16384, "dp": 8, "cp": 1, "max_len": 4096,
             "opt_steps": 2, "group": 16},
    "routes": {"n": 1024, "lengths": (50, 1000), "budget": 8192, "dp": 2, "cp": 2, "max_len": 1024, "opt_steps": 1,
               "group": 16, "routes": {"layers": 8, "topk": 8, "experts": 64}},
}


# --------------------------------------------------------------------------- one measurement (child process)


def _groups(case: dict[str, Any], seed: int = 0) -> list[dict[str, Any]]:
    """Rollout groups as the driver holds them: a prompt and ``group`` generations (token ids, logprobs,
    routes with routing replay)."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(seed)
    n, (lo, hi), size = case["n"], case["lengths"], case["group"]
    totals = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    ids = torch.randint(3, 150_000, (sum(totals),), generator=g).tolist()
    lps = (-torch.rand(sum(totals), generator=g) * 5).tolist()
    routes = case.get("routes")
    groups, start = [], 0
    for first in range(0, n, size):
        prompt_len = max(1, min(totals[first:first + size]) // 4)
        prompt = ids[start:start + prompt_len]
        gens = []
        for total in totals[first:first + size]:
            resp = ids[start + prompt_len:start + total]
            gen: dict[str, Any] = {"token_ids": resp, "logprobs": lps[start + prompt_len:start + total]}
            if routes:
                rng = np.random.default_rng(start)
                shape = (total - 1, routes["layers"], routes["topk"])
                gen["routed_experts"] = rng.integers(0, routes["experts"], shape, dtype=np.uint8)
            gens.append(gen)
            start += total
        groups.append({"prompt_ids": prompt, "generations": gens, "advantages": [0.5] * len(gens)})
    return groups


def _worker(case: dict[str, Any], checkout: Path) -> Any:
    import yaml  # noqa: PLC0415

    from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker  # noqa: PLC0415

    cfg = yaml.safe_load((checkout / "tests" / "gpu" / "tiny_runtime.yaml").read_text(encoding="utf-8"))
    t = cfg["training"]
    t["sequence_packing"].update(enabled=True, train_mb_tokens=case["budget"], logprob_mb_tokens=case["budget"])
    t["max_sequence_length"] = case["max_len"]
    t["global_batch_size"] = case["n"] // case["opt_steps"]
    cfg["train_parallel"].update(dp=case["dp"], cp=case["cp"])
    cfg["cluster"]["world_size"] = case["dp"] * case["cp"]
    w = MegatronPolicyWorker(cfg, rank=0, world_size=case["dp"] * case["cp"])  # no GPU work before setup()
    w.coords = {"dp_size": case["dp"], "dp_rank": 0, "cp_rank": 0}
    return w


def measure_case(name: str, repeats: int, checkout: Path) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from rlc.runtime.grpo.loss import gen_kl_metrics  # noqa: PLC0415
    from rlc.runtime.policy import batches as B  # noqa: PLC0415
    from rlc.runtime.policy import packing as P  # noqa: PLC0415
    from rlc.runtime.policy.routes import micro_batch_routes  # noqa: PLC0415

    case = CASES[name]
    groups = _groups(case)
    w = _worker(case, checkout)
    routes_cfg = case.get("routes")
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    info: dict[str, Any] = {}

    def packed_pass(batch: dict, rows: tuple[int, int] | None, key: str) -> list[dict]:
        mbs = w._packed_microbatches(batch, rows, case["budget"], key)
        if routes_cfg:
            for mb in mbs:
                micro_batch_routes(mb, num_experts=routes_cfg["experts"], cp_size=case["cp"], cp_rank=0)
        return mbs

    for _ in range(repeats):
        cache = getattr(P, "_plan_bins", None)
        if cache is not None:
            cache.cache_clear()  # a new step: nothing planned before
        gc.collect()
        t0 = time.perf_counter()
        prompt_ids, resp_ids, gen_lps, advantages, routes = [], [], [], [], []
        for grp in groups:  # as the driver's trainer_logprobs flattens the groups
            for gen, a in zip(grp["generations"], grp["advantages"]):
                prompt_ids.append(grp["prompt_ids"])
                resp_ids.append(gen["token_ids"])
                gen_lps.append(gen["logprobs"])
                advantages.append(a)
                if routes_cfg:
                    routes.append(gen.get("routed_experts"))
        batch = B.pack_rollouts(prompt_ids, resp_ids, gen_lps, advantages, pad_id=0, pad_to_multiple=16 * case["cp"],
                                max_length=case["max_len"], routes=routes if routes_cfg else None,
                                num_experts=routes_cfg["experts"] if routes_cfg else 0).tensors()
        times["driver: batch"].append(time.perf_counter() - t0)
        n_local = case["n"] // case["dp"]
        width = int(batch["tokens"].shape[1]) - 1

        for phase in ("old logprobs", "ref logprobs"):
            gc.collect()
            t0 = time.perf_counter()
            mbs = packed_pass(batch, None, "training.sequence_packing.logprob_mb_tokens")
            result = torch.zeros((n_local, width), dtype=torch.float32)
            for mb in mbs:  # the output rank puts each bin's rows back (the logprobs come from the GPU)
                n = mb["num_real"]
                result[mb["rows"][:n]] = torch.zeros((n, width), dtype=torch.float32)
            times[phase].append(time.perf_counter() - t0)
            info[f"{phase} micro batches"] = len(mbs)
            batch["old_logprobs" if phase == "old logprobs" else "ref_logprobs"] = torch.zeros(
                (case["n"], width), dtype=torch.float32)

        gc.collect()
        t0 = time.perf_counter()
        count = 0
        for lo, hi in B.optimizer_step_slices(case["n"], case["n"] // case["opt_steps"], case["dp"]):
            count += len(packed_pass(batch, (lo, hi), "training.sequence_packing.train_mb_tokens"))
        times["train"].append(time.perf_counter() - t0)
        info["train micro batches"] = count

        t0 = time.perf_counter()
        gen_kl_metrics(batch["gen_logprobs"], batch["gen_logprobs"] - 0.01, batch["mask"])
        times["driver: gen-KL"].append(time.perf_counter() - t0)
        info["tokens"] = int(batch["lengths"].sum())
        info["padded shape"] = list(batch["tokens"].shape)
        del batch
    return {"times": times, "info": info}


# --------------------------------------------------------------------------- the parent: run, table, JSON


def machine() -> dict[str, Any]:
    import torch  # noqa: PLC0415

    return _machine(torch=torch.__version__)


def run_child(checkout: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--repeats", str(args.repeats),
           "--threads", str(args.threads), "--checkout", str(checkout)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{shlex.join(cmd)} (PYTHONPATH={checkout}) exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(runs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def fmt(s: dict[str, Any]) -> str:
    return f"{s['median']:.4f} ({s['min']:.4f}–{s['max']:.4f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="tiny,mid,prod,routes", help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--repeats", type=int, default=5, help="steps timed per case (min, max, median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the runtime's actors use 1)")
    parser.add_argument("--baseline", type=Path, help="another rlc checkout to measure in the same run (before)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--checkout", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        import torch  # noqa: PLC0415

        torch.set_num_threads(args.threads)
        print(json.dumps(measure_case(args.child, args.repeats, args.checkout)))
        return 0

    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    checkouts = {"after": REPO}
    if args.baseline:
        checkouts = {"before": args.baseline.resolve(), "after": REPO}
    results: dict[str, Any] = {}
    for name in names:
        results[name] = {"params": CASES[name], "checkouts": {}}
        for label, checkout in checkouts.items():
            out = run_child(checkout, name, args)
            results[name]["checkouts"][label] = {
                "source": str(checkout), "commit": git_commit(checkout), "info": out["info"],
                "phases": {p: summary(t) for p, t in out["times"].items()}}

    info = machine()
    print(f"Sequence packing: host seconds per step phase, median (min–max) of {args.repeats} steps; "
          f"torch threads {args.threads}")
    head = f"{'case':7} {'phase':15} " + " ".join(f"{label + ' s':>26}" for label in checkouts)
    if "before" in checkouts:
        head += f" {'speed-up':>9}"
    print(head)
    for name in names:
        res = results[name]["checkouts"]
        for phase in PHASES:
            line = f"{name:7} {phase:15} " + " ".join(f"{fmt(res[label]['phases'][phase]):>26}" for label in checkouts)
            if "before" in checkouts:
                before, after = res["before"]["phases"][phase]["median"], res["after"]["phases"][phase]["median"]
                line += f" {before / max(after, 1e-9):8.1f}x"
            print(line)
        inf = res["after"]["info"]
        print(f"{'':7} ({CASES[name]['n']} sequences, {inf['tokens']} tokens, padded {inf['padded shape']}; "
              f"micro batches: logprob {inf['old logprobs micro batches']}, train {inf['train micro batches']})")
    sources = ", ".join(f"{label}: {c.name} @ {git_commit(c)}" for label, c in checkouts.items())
    print(f"({info['cpus']} CPUs {info['cpu']}, load average {info['load_average_1m']}; python {info['python']}, "
          f"torch {info['torch']}; {sources})")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "packing_host_cost", "command": shlex.join([sys.executable, *sys.argv]),
            "machine": info, "torch_threads": args.threads, "repeats": args.repeats,
            "checkouts": {k: {"source": str(c), "commit": git_commit(c)} for k, c in checkouts.items()},
            "cases": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
