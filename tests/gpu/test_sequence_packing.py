"""GPU check: sequence packing (``training.sequence_packing``) against the padded passes, and its speed.

Every run starts from a bundle compiled from the shipped ``tiny-qwen3-1gpu`` recipe (the tiny dense Qwen3,
its checkpoint made with ``max_position_embeddings`` 1024; packing on, train and logprob budgets 4096
tokens, micro batch 8), the Megatron policy worker in a process of its own per GPU, weights perturbed
(seeded, bf16-representable) so the logits are O(1):

(a) correctness, on 64 sequences of 8..300 tokens (random tokens, 4-token prompts, advantages mostly
    positive): the logprobs (response tokens), the GRPO loss and every parameter's gradient of the packed
    passes against the padded passes, and both against the same padded passes in fp32 (a bundle compiled
    with ``model.dtype=float32``: the same weights, exact up to fp32). Tolerance (``verdicts.py``): twice the
    padded bf16 pass's own error against fp32, never below one bf16 rounding; a negative control (the
    packed rows with their sequence boundaries removed, so attention leaks across sequences) must miss it
    by 5x. Reported too: the padded pass against itself run again and with other shapes (96 tokens wider,
    micro batch 3).
(b) speed, on 512 sequences of 8..512 tokens: train-pass tokens/s packed (4096-token budget) against padded
    (micro batch 8, i.e. 8 × 512 tokens: the same budget), one warm-up and three timed steps each, with
    the logprob pass's time, the number of micro batches and the peak memory of each.

With ``--cp 2`` (two GPUs) the packed passes run under context parallelism 2 as well (a bundle with
``cluster.gpus_per_node=2 parallelism.train.cp=2``, without the distributed optimizer so every rank holds
the whole reduced gradient) and are held to the same tolerances against the one-GPU padded and fp32 passes.

    python tests/gpu/test_sequence_packing.py [--root /tmp/rlc-packing] [--out DIR] [--cp 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.gpu.common import Timer, dump, gpu_available
from tests.gpu.verdicts import PACKING_LEAK_MIN, packing_tolerances, packing_verdict

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml"
MAX_LEN = 1024
BUDGET = 4096
MBS = 8
PROMPT = 4
CORRECT = {"n": 64, "lengths": (8, 300), "seed": 0}
SPEED = {"n": 512, "lengths": (8, 512), "seed": 1, "steps": 3}
WIDE_EXTRA, WIDE_MBS = 96, 3
PERTURB_SCALE, PERTURB_SEED = 0.05, 1
WORKER_TIMEOUT_S = 240
COMPARE_MODES = ("padded", "padded_rerun", "padded_wide", "packed", "packed_leak")


# --------------------------------------------------------------------------- workspace, bundles, batches


def workspace(root: Path) -> Path:
    from rlc.runtime.toy_model import build_toy_workspace  # noqa: PLC0415

    dense = root / "dense"
    if not (dense / "qwen3" / "config.json").exists():
        build_toy_workspace(str(dense), config={"max_position_embeddings": MAX_LEN})
    return dense


def compile_bundle(root: Path, ws: Path, name: str, extra: tuple[str, ...] = ()) -> Path:
    """``rlc compile`` the shipped tiny recipe with this check's folders, lengths and packing budgets."""
    out = root / name
    ckpt = ws / "qwen3"
    sets = [f"model.checkpoint={ckpt}", f"model.tokenizer={ckpt}", f"model.config={ckpt}/config.json",
            f"data.train={ws}/data/train.jsonl", f"cluster.log_dir={root}/logs", f"logging.dir={root}/logs/{name}",
            f"checkpointing.dir={root}/ckpt/{name}", f"generation.max_model_len={MAX_LEN}",
            f"training.max_sequence_length={MAX_LEN}", f"training.micro_batch_size={MBS}",
            "training.sequence_packing.enabled=true", f"training.sequence_packing.train_mb_tokens={BUDGET}",
            f"training.sequence_packing.logprob_mb_tokens={BUDGET}", *extra]
    cmd = [sys.executable, "-m", "rlc", "compile", str(RECIPE), "-o", str(out), "--force",
           *[w for s in sets for w in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"rlc compile failed ({' '.join(extra)}):\n{proc.stdout}\n{proc.stderr}")
    return out


def make_batch(n: int, lengths: tuple[int, int], seed: int) -> Any:
    """``n`` sequences of random tokens with ``lengths`` tokens (uniform), 4-token prompts, advantages of
    either sign (three in four positive, so the loss stays away from 0)."""
    from rlc.runtime import toy  # noqa: PLC0415
    from rlc.runtime.policy.batches import pack_rollouts  # noqa: PLC0415

    rng = random.Random(seed)
    vocab = toy.vocab_size()
    seqs = [[rng.randrange(4, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]
    adv = [rng.uniform(0.2, 1.2) * (1.0 if rng.random() < 0.75 else -1.0) for _ in range(n)]
    return pack_rollouts([s[:PROMPT] for s in seqs], [s[PROMPT:] for s in seqs],
                         [[0.0] * (len(s) - PROMPT) for s in seqs], adv, pad_id=0, pad_to_multiple=16)


def widen(batch: Any, extra: int) -> Any:
    """The same rows padded ``extra`` tokens wider (the padded pass's shapes change, not its math)."""
    import torch  # noqa: PLC0415

    pad = torch.nn.functional.pad
    return dataclasses.replace(batch, tokens=pad(batch.tokens, (0, extra), value=0),
                               mask=pad(batch.mask, (0, extra), value=0.0),
                               gen_logprobs=pad(batch.gen_logprobs, (0, extra), value=0.0))


def _env(**extra: str) -> dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH`` (the GPU stack's entries kept)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO), **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(job: dict, world: int, root: Path, name: str) -> list[dict]:
    """Run ``job`` in ``world`` worker processes (one GPU each, ``CUDA_VISIBLE_DEVICES`` = rank); their results."""
    import torch  # noqa: PLC0415

    folder = root / "jobs" / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job_path = folder / "job.pt"
    torch.save(job, job_path)
    port = _free_port()
    procs = []
    for rank in range(world):
        env = _env(CUDA_VISIBLE_DEVICES=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1")
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            str(job_path),
            "--rank",
            str(rank),
            "--world",
            str(world),
            "--port",
            str(port),
            "--result",
            str(folder / f"result{rank}.pt"),
        ]
        log = open(folder / f"rank{rank}.log", "w")  # noqa: SIM115 - closed when the rank's process ends
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(124)
        log.close()
    if any(codes):
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
        tails = {r: (folder / f"rank{r}.log").read_text(errors="replace").splitlines()[-40:] for r in range(world)}
        raise RuntimeError(f"{name}: worker exit codes {codes}; log tails:\n" +
                           "\n".join(f"--- rank {r}\n" + "\n".join(t) for r, t in tails.items()))
    return [torch.load(folder / f"result{r}.pt", weights_only=False) for r in range(world)]


# --------------------------------------------------------------------------- inside a worker process


def _perturb(worker: Any, scale: float, seed: int) -> None:
    """Seeded noise on every parameter, the result rounded to bf16 in every dtype (fp32 runs get the same
    weights), identical on every rank that holds a parameter."""
    import torch  # noqa: PLC0415

    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for chunk in worker.pm.model:
            for p in chunk.parameters():
                noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * scale
                p.copy_((p.detach().to(torch.bfloat16) + noise.to(torch.bfloat16)).to(p.dtype))


def _set_mode(worker: Any, packing: bool, mbs: int) -> None:
    import dataclasses  # noqa: PLC0415

    t = worker.cfg.training
    t = dataclasses.replace(t, micro_batch_size=mbs,
                            sequence_packing=dataclasses.replace(t.sequence_packing, enabled=packing))
    worker.cfg = dataclasses.replace(worker.cfg, training=t)


def _unwrapped(name: str) -> str:
    """A parameter's name inside Megatron's wrappers (DDP, Float16Module): ``module.module.x`` -> ``x``."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


@contextmanager
def _gradients_instead_of_a_step(worker: Any) -> Iterator[dict]:
    """``train_step`` runs up to the optimizer step; the step itself records every parameter's reduced
    gradient (``main_grad``) instead of changing the weights."""
    import torch  # noqa: PLC0415

    opt, store = worker.pm.optimizer, {}

    def step():
        torch.cuda.synchronize()
        grads = {}
        for i, chunk in enumerate(worker.pm.model):
            for name, p in chunk.named_parameters():
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is not None:  # named without the wrappers (bf16 adds Float16Module, fp32 does not)
                    grads[f"{i}.{_unwrapped(name)}"] = g.detach().float().cpu().clone()
        store["grads"] = grads
        return True, math.sqrt(sum(float(x.double().pow(2).sum()) for x in grads.values())), None

    opt.step = step
    try:
        yield store
    finally:
        del opt.step


@contextmanager
def _boundaries_removed(worker: Any) -> Iterator[None]:
    """The negative control: each packed row as one sequence (attention and positions run across the
    sequences of a micro batch; the labels stay per sequence)."""
    import torch  # noqa: PLC0415

    original = worker._packed_microbatches

    def leaky(*args, **kwargs):
        mbs = original(*args, **kwargs)
        for mb in mbs:
            total = int(mb["seq_length"])
            mb["cu_seqlens"] = torch.tensor([0, total], dtype=torch.int32)
            mb["max_seqlen"] = total
        return mbs

    worker._packed_microbatches = leaky
    try:
        yield
    finally:
        del worker._packed_microbatches


@contextmanager
def _counting_microbatches(worker: Any) -> Iterator[list]:
    original, counts = worker._run, []

    def run(model, mbs, *args, **kwargs):
        counts.append(len(mbs))
        return original(model, mbs, *args, **kwargs)

    worker._run = run
    try:
        yield counts
    finally:
        del worker._run


def _with_old(batch: Any, old: Any) -> Any:
    import torch  # noqa: PLC0415

    width = batch.mask.shape[1]
    if old.shape[1] < width:
        old = torch.nn.functional.pad(old, (0, width - old.shape[1]), value=0.0)
    return dataclasses.replace(batch, old_logprobs=old[:, :width].contiguous())


def _compare_mode(worker: Any, job: dict, mode: str, old: Any) -> dict:
    packing = mode.startswith("packed")
    wide = mode == "padded_wide"
    _set_mode(worker, packing, WIDE_MBS if wide else MBS)
    batch = job["wide"] if wide else job["batch"]
    leak = _boundaries_removed(worker) if mode == "packed_leak" else _noop()
    with leak, _counting_microbatches(worker) as counts:
        lp = worker.compute_logprobs(batch)
        logprobs_old = old if old is not None else lp
        with _gradients_instead_of_a_step(worker) as store:
            train = worker.train_step(_with_old(batch, logprobs_old), 1)
    return {"logprobs": lp, "train": train, "grads": store.get("grads") if worker.rank == 0 else None,
            "microbatches": counts, "old_from_this_mode": old is None}


@contextmanager
def _noop() -> Iterator[None]:
    yield


def _speed(worker: Any, job: dict) -> dict:
    import torch  # noqa: PLC0415

    batch = job["speed"]
    tokens = int(batch.lengths.sum())
    out = {"sequences": int(batch.lengths.numel()), "tokens": tokens,
           "response_tokens": int(batch.mask.sum()), "padded_width": int(batch.tokens.shape[1])}
    for mode, packing in (("padded", False), ("packed", True)):
        _set_mode(worker, packing, MBS)
        with _counting_microbatches(worker) as counts:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            old = worker.compute_logprobs(batch)
            torch.cuda.synchronize()
            logprob_s = time.perf_counter() - t0
            b = _with_old(batch, old)
            worker.train_step(b, 1)  # warm-up
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(job["speed_steps"]):
                worker.train_step(b, 1)
            torch.cuda.synchronize()
            train_s = (time.perf_counter() - t0) / job["speed_steps"]
        out[mode] = {"train_s_per_step": round(train_s, 4), "train_tokens_per_s": round(tokens / train_s, 1),
                     "logprob_s": round(logprob_s, 4), "logprob_tokens_per_s": round(tokens / logprob_s, 1),
                     "train_microbatches": counts[-1], "logprob_microbatches": counts[0],
                     "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 4)}
    out["train_speedup"] = round(out["padded"]["train_s_per_step"] / out["packed"]["train_s_per_step"], 3)
    return out


def worker_main(job_path: str, rank: int, world: int, port: int, result_path: str) -> None:
    import torch  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker  # noqa: PLC0415
    from rlc.runtime.workers import BASE_WORKER_ENV  # noqa: PLC0415

    os.environ.update(BASE_WORKER_ENV)
    job = torch.load(job_path, weights_only=False)
    cfg = yaml.safe_load((Path(job["bundle"]) / "runtime.yaml").read_text(encoding="utf-8"))
    worker = MegatronPolicyWorker(cfg, rank, world)
    setup = worker.setup(("127.0.0.1", port), 1000)
    _perturb(worker, PERTURB_SCALE, PERTURB_SEED)
    out: dict = {"rank": rank, "coords": dict(worker.coords), "dtype": cfg["model"]["dtype"],
                 "setup_s": setup.setup_s, "device": torch.cuda.get_device_name(0)}
    old = job.get("old")
    for mode in job["modes"]:
        t0 = time.perf_counter()
        out[mode] = _compare_mode(worker, job, mode, old)
        out[mode]["seconds"] = round(time.perf_counter() - t0, 3)
        if old is None and mode == "padded":
            old = out[mode]["logprobs"]  # every later mode's loss uses the padded logprobs as "old"
    if job.get("speed") is not None:
        out["speed"] = _speed(worker, job)
    torch.save(out, result_path)
    worker.shutdown()


# --------------------------------------------------------------------------- comparisons (driver side)


def difference(ref: dict, other: dict, mask: Any) -> dict:
    """``other`` against ``ref``: logprobs on the response tokens, the loss, every gradient."""
    import torch  # noqa: PLC0415

    width = ref["logprobs"].shape[1]
    keep = mask[:, :width] > 0
    d = (other["logprobs"][:, :width].double() - ref["logprobs"].double()).abs()[keep]
    loss_r = float(ref["train"].loss_sums["loss/total"])
    loss_o = float(other["train"].loss_sums["loss/total"])
    num = den = 0.0
    for name, g in ref["grads"].items():
        num += float((other["grads"][name].double() - g.double()).pow(2).sum())
        den += float(g.double().pow(2).sum())
    return {"logprob_max_abs": float(d.max()), "logprob_mean_abs": float(d.mean()), "tokens": int(d.numel()),
            "loss_rel": abs(loss_o - loss_r) / max(abs(loss_r), 1e-12), "loss": loss_o, "loss_ref": loss_r,
            "grad_rel_l2": math.sqrt(num / den) if den > 0 else float("nan"),
            "grad_norm": math.sqrt(sum(float(g.double().pow(2).sum()) for g in other["grads"].values())),
            "finite": bool(torch.isfinite(other["logprobs"]).all())}


def _machine() -> dict:
    import torch  # noqa: PLC0415

    return {
        "host": socket.gethostname(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
    }


def run(root: str, out: str | None, cp: int = 1) -> dict:
    import torch  # noqa: PLC0415

    clock = Timer()
    root_p = Path(root)
    res: dict = {"check": "sequence packing: packed vs padded logprobs, loss, gradients; train tokens/s",
                 "command": "python tests/gpu/test_sequence_packing.py" + (f" --cp {cp}" if cp > 1 else ""),
                 "recipe": str(RECIPE.relative_to(REPO)), "budget_tokens": BUDGET, "micro_batch_size": MBS,
                 "correctness_batch": CORRECT, "speed_batch": SPEED, "perturbation": PERTURB_SCALE}
    try:
        res["machine"] = _machine()
        ws = workspace(root_p)
        bf16 = compile_bundle(root_p, ws, "bundle_bf16")
        fp32 = compile_bundle(root_p, ws, "bundle_fp32", ("model.dtype=float32",))
        batch = make_batch(CORRECT["n"], CORRECT["lengths"], CORRECT["seed"])
        wide = widen(batch, WIDE_EXTRA)
        speed = make_batch(SPEED["n"], SPEED["lengths"], SPEED["seed"]) if cp == 1 else None
        (b,) = launch({"bundle": str(bf16), "modes": COMPARE_MODES, "batch": batch, "wide": wide, "speed": speed,
                       "speed_steps": SPEED["steps"]}, 1, root_p, "bf16")
        mask, old = batch.mask, b["padded"]["logprobs"]
        figures = res["figures"] = {  # recorded before the fp32 run, which the verdict needs
            "padded_rerun_vs_padded": difference(b["padded"], b["padded_rerun"], mask),
            "padded_wide_vs_padded": difference(b["padded"], b["padded_wide"], mask),
            "packed_vs_padded": difference(b["padded"], b["packed"], mask),
            "leak_vs_padded": difference(b["padded"], b["packed_leak"], mask),
        }
        res["microbatches"] = {m: b[m]["microbatches"] for m in COMPARE_MODES}
        if speed is not None:
            res["speed"] = b["speed"]
        (f,) = launch({"bundle": str(fp32), "modes": ("padded",), "batch": batch, "old": old}, 1, root_p, "fp32")
        padded_error = figures["padded_error_vs_fp32"] = difference(f["padded"], b["padded"], mask)
        figures["packed_error_vs_fp32"] = difference(f["padded"], b["packed"], mask)
        res["setup_s"] = {"bf16": b["setup_s"], "fp32": f["setup_s"]}
        res["tolerances"] = packing_tolerances(padded_error)
        ok, why = packing_verdict(padded_error, figures["packed_vs_padded"], figures["packed_error_vs_fp32"],
                                  figures["leak_vs_padded"])
        res["correct"] = {"passed": ok, "reasons": why, "leak_factor_needed": PACKING_LEAK_MIN}
        if cp > 1:
            if torch.cuda.device_count() < cp:
                raise RuntimeError(f"--cp {cp} needs {cp} GPUs, this machine has {torch.cuda.device_count()}")
            bundle_cp = compile_bundle(root_p, ws, f"bundle_cp{cp}", (f"cluster.gpus_per_node={cp}",
                                       f"parallelism.train.cp={cp}", "training.use_distributed_optimizer=false"))
            ranks = launch({"bundle": str(bundle_cp), "modes": ("packed",), "batch": batch, "old": old}, cp, root_p,
                           f"cp{cp}")
            r0 = ranks[0]
            res["cp_coords"] = [r["coords"] for r in ranks]
            cp_figs = {"packed_cp_vs_padded": difference(b["padded"], r0["packed"], mask),
                       "packed_cp_error_vs_fp32": difference(f["padded"], r0["packed"], mask)}
            res["figures"].update(cp_figs)
            ok_cp, why_cp = packing_verdict(padded_error, cp_figs["packed_cp_vs_padded"],
                                            cp_figs["packed_cp_error_vs_fp32"])
            res["cp"] = {"size": cp, "passed": ok_cp, "reasons": why_cp, "microbatches": r0["packed"]["microbatches"]}
        res["passed"] = bool(res["correct"]["passed"] and (cp == 1 or res["cp"]["passed"]))
    except Exception:  # noqa: BLE001 - the record says what broke
        res["error"] = traceback.format_exc()[-4000:]
        res["passed"] = False
    res["seconds"] = clock()
    dump(res, out, "sequence_packing" + (f"_cp{cp}" if cp > 1 else ""))
    return res


@pytest.mark.gpu
def test_packed_passes_match_padded_within_the_bf16_tolerance(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    res = run(str(tmp_path), None)
    assert res["passed"], res.get("error") or res["correct"]["reasons"]


@pytest.mark.gpu
def test_packed_passes_under_context_parallelism_match_padded(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (GPU host only)")
    res = run(str(tmp_path), None, cp=2)
    assert res["passed"], res.get("error") or res["cp"]["reasons"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/rlc-packing")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker_main(a.worker, a.rank, a.world, a.port, a.result)
        sys.exit(0)
    r = run(a.root, a.out, a.cp)
    verdict = "passed" if r["passed"] else "FAILED: " + (r.get("error", "").strip().splitlines()[-1:] or [""])[0]
    if not r["passed"] and "correct" in r:
        verdict += " " + "; ".join(r["correct"]["reasons"] + r.get("cp", {}).get("reasons", []))
    print(f"sequence packing: {verdict}", flush=True)
    if "speed" in r:
        s = r["speed"]
        print(f"train tokens/s: padded {s['padded']['train_tokens_per_s']}, packed {s['packed']['train_tokens_per_s']} "
              f"(x{s['train_speedup']})", flush=True)
    sys.exit(0 if r["passed"] else 1)
