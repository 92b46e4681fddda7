"""GPU checks of the Megatron generation backend resharding between different training and inference layouts, on
two GPUs (``nvidia-h200-x2``), from compiled bundles.

cases (``--case``; each writes ``<out>/mcore_reshard_<case>.json`` with the command, the machine and a verdict):

- ``tp``  ``tiny-qwen3-2gpu-megatron-tp2-tp1``: Megatron trains with TP 2; the dedicated inference model has TP 1
          (two replicas, one per GPU, each generating half of the prompts). GRPO with ``refit.verify_every=1``:
          after every swap each inference tensor equals its slice of the trainer's tensor gathered over the
          trainer's TP group, bit for bit and in dtype, on both GPUs, over at least ``MIN_SWAPS`` refits; the toy
          task is learned (10-step mean reward >= ``REWARD_GOAL`` within ``--steps``); measured memory per phase
          next to the plan's.
- ``ep``  ``tiny-glm-moe-2gpu-megatron-ep2-ep1``: Megatron trains with EP 2 (4 of the 8 experts per GPU); the
          inference model has EP 1 (all experts on each GPU). The same checks, the experts compared under their
          global index, and every MoE layer's router bias compared as fp32 on both GPUs.

Each case starts with a preflight (two CUDA GPUs and a FlashAttention megatron-core's dynamic batching accepts) and
stops in seconds, saying what is missing. It builds its own checkpoint, tokenizer and data under ``--root``, starts
its own Ray head and stops it (nothing left from an earlier stage is used). The driver run is bounded by
``--timeout``; a run cut by it still passes the learning check when the goal was reached before.

    python tests/gpu/test_mcore_reshard.py --case tp [--steps 200] [--root /tmp/rlc-mcore-reshard-tp] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from tests.gpu.common import Timer, dump, gpu_available
from tests.gpu.test_mcore_generation import (GEN_KL_STOP, MIN_SWAPS, REWARD_GOAL, ROUTER_BIAS, _tail,
                                             compile_recipe, machine, memory_vs_plan, preflight, timings,
                                             verdict_learning)

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "rlc" / "recipes"
DENSE_CONFIG = RECIPES / "models" / "tiny-qwen3-vocab32" / "config.json"
MOE_CONFIG = RECIPES / "models" / "tiny-glm-moe-mtp" / "config.json"
GPUS = 2


CASES = {
    "tp": {"recipe": "tiny-qwen3-2gpu-megatron-tp2-tp1", "model": "dense", "train": "TP2 EP1", "inference": "TP1 EP1"},
    "ep": {"recipe": "tiny-glm-moe-2gpu-megatron-ep2-ep1", "model": "moe", "train": "TP1 EP2", "inference": "TP1 EP1"},
}


def moe_router_biases() -> int:
    """Router biases every inference replica must hold in fp32 at least: one per MoE decoder layer (the MTP
    layer's, when it has one, comes on top; the report lists the count)."""
    cfg = json.loads(MOE_CONFIG.read_text(encoding="utf-8"))
    return cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]


# ------------------------------------------------------------------ verdicts (pure; CPU-tested)


def verdict_reshard_swaps(run: dict, min_swaps: int, workers: int, min_fp32_biases: int) -> dict:
    """Every verified swap bit-exact on each of ``workers`` ranks (a rank's report compares its inference tensors
    with their slices of the gathered trainer tensors), at least ``min_swaps`` refits, the same tensor count on
    every rank and refit, and at least ``min_fp32_biases`` fp32 router biases in each report (a bias that reached
    the inference model in bf16 is a mismatch)."""
    records = run["verify"]
    by_step: dict[int, set[int]] = {}
    for r in records:
        by_step.setdefault(int(r["step"]), set()).add(int(r["worker"]))
    steps = sorted(s for s, ws in by_step.items() if len(ws) == workers)
    partial = sorted(s for s, ws in by_step.items() if len(ws) != workers)
    bad = [(r["step"], r["worker"], [m["name"] for m in r["mismatches"]][:3]) for r in records if not r["bit_exact"]]
    counts = sorted({int(r["params_compared"]) for r in records})
    biases = [sum(1 for n in r["fp32_params"] if ROUTER_BIAS in n) for r in records]
    res = {"rc": run["rc"], "verified_swaps": len(steps), "min_swaps": min_swaps, "first_steps": steps[:3],
           "steps_missing_a_rank": partial[:5], "not_exact": bad[:5], "tensors_per_rank": counts,
           "bytes_per_rank": sorted({int(r["bytes_compared"]) for r in records}),
           "fp32_router_biases_min": min(biases) if biases else 0, "fp32_router_biases_needed": min_fp32_biases,
           "not_in_trainer": sorted({n for r in records for n in r.get("not_in_trainer", [])})[:5]}
    ok_rc = run["rc"] == 0 or (run["rc"] == 124 and len(steps) >= min_swaps)
    res["passed"] = bool(ok_rc and len(steps) >= min_swaps and not bad and not partial and len(counts) == 1
                         and counts[0] > 0 and (min_fp32_biases == 0 or (biases and min(biases) >= min_fp32_biases)))
    return res


def verdict_layout(log: str, train: str, inference: str, workers: int) -> dict:
    """Both ranks built the dedicated inference model in the inference layout, resharded from the trainer's."""
    line = f"resharding train {train} -> inference {inference} ({workers} replicas)"
    pattern = re.compile(r"\[megatron-inference\] rank (\d+): " + re.escape(line))
    ranks = sorted({int(m.group(1)) for m in pattern.finditer(log)})
    built = log.count("built the dedicated inference model")
    res = {"expected_line": line, "ranks_resharding": ranks, "dedicated_models_built": built,
           "megatron_engines": "Megatron inference engines up" in log and "vLLM engines up" not in log}
    res["passed"] = bool(ranks == list(range(workers)) and built >= workers and res["megatron_engines"])
    return res


# ------------------------------------------------------------------ the workspace and the run


def build_workspace(root: Path, model: str) -> dict:
    """The checkpoint (+ tokenizer) and toy data of ``model`` under ``root`` (made once per root)."""
    from rlc.runtime import toy  # noqa: PLC0415
    from rlc.runtime.toy_model import build_toy_model, build_toy_workspace  # noqa: PLC0415

    if model == "dense":
        ckpt = root / "dense" / "qwen3"
        if not (ckpt / "config.json").exists():  # the padded vocabulary of the recipe's model config
            vocab = json.loads(DENSE_CONFIG.read_text(encoding="utf-8"))["vocab_size"]
            build_toy_workspace(str(root / "dense"), config=DENSE_CONFIG, vocab_size=vocab)
        return {"checkpoint": ckpt, "data": root / "dense" / "data" / "train.jsonl"}
    from tests.gpu.test_four_gpu_grpo import add_mtp_layers  # noqa: PLC0415

    ckpt = root / "moe" / "glm4_moe"
    if not (ckpt / "config.json").exists():
        build_toy_model(ckpt, config=MOE_CONFIG)
        add_mtp_layers(ckpt)
        toy.write_dataset(root / "moe" / "data" / "train.jsonl", 4096, 0)
    return {"checkpoint": ckpt, "data": root / "moe" / "data" / "train.jsonl"}


def compile_bundle(root: Path, recipe: str, ws: dict, steps: int) -> Path:
    return compile_recipe(recipe, root / "runs" / recipe, ws["checkpoint"], ws["data"], [f"grpo.max_steps={steps}"])


def run_case(case: str, root: str, steps: int, timeout_s: int) -> dict:
    from tests.gpu.test_moe_two_gpu import Lab  # noqa: PLC0415

    spec = CASES[case]
    lab = Lab(root, gpus=GPUS)
    res: dict = {"recipe": spec["recipe"], "train_layout": spec["train"], "inference_layout": spec["inference"]}
    try:
        ws = build_workspace(Path(root), spec["model"])
        res["workspace"] = {k: str(v) for k, v in ws.items()}
        bundle = compile_bundle(Path(root), spec["recipe"], ws, steps)
        got = lab.start_driver(bundle, ["refit.verify_every=1", f"grpo.max_gen_kl={GEN_KL_STOP}"],
                               "driver.log", timeout_s)
    finally:
        lab.close()
    plan = json.loads((bundle / "plan.json").read_text(encoding="utf-8"))
    biases = moe_router_biases() if spec["model"] == "moe" else 0
    res["swaps"] = verdict_reshard_swaps(got, MIN_SWAPS, GPUS, biases)
    res["layout"] = verdict_layout(got["log"], spec["train"], spec["inference"], GPUS)
    res["learning"] = verdict_learning(got, steps)
    res["memory"] = memory_vs_plan(got["metrics"], plan)
    res["memory"]["inference_model_plan"] = plan.get("megatron", {}).get("inference_model")
    res["timing_mean_s"] = timings(got["metrics"])
    res["calibration"] = got["calibration"][:6]
    res["seconds"] = got["seconds"]
    res["passed"] = bool(res["swaps"]["passed"] and res["layout"]["passed"] and res["learning"]["passed"])
    res["log_tail"] = _tail(got["log"], 12 if res["passed"] else 80)
    return res


def two_gpu_preflight(env: dict) -> dict:
    found = preflight(env)
    code = "import torch; print(torch.cuda.device_count())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    try:
        found["gpus"] = int(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        found["gpus"] = 0
    if found["ok"] and found["gpus"] < GPUS:
        found["ok"] = False
        found["error"] = f"{found['gpus']} CUDA GPU(s) visible; this check needs {GPUS} (nvidia-h200-x2)"
    return found


def run(case: str, root: str, out: str | None, steps: int, timeout_s: int) -> dict:
    from tests.gpu.test_four_gpu_grpo import _env  # noqa: PLC0415

    clock = Timer()
    res: dict = {"check": f"Megatron generation backend, resharding {CASES[case]['train']} -> "
                          f"{CASES[case]['inference']} on {GPUS} GPUs", "case": case,
                 "command": " ".join([sys.executable, *sys.argv]), "machine": machine(),
                 "goals": {"min_verified_swaps": MIN_SWAPS, "reward_10step_mean": REWARD_GOAL, "max_steps": steps}}
    try:
        res["preflight"] = two_gpu_preflight(_env(REPO))
        if not res["preflight"]["ok"]:
            res["passed"] = False
            res["error"] = res["preflight"].get("error", "CUDA is not available")
            return res
        res.update(run_case(case, root, steps, timeout_s))
    except Exception:  # noqa: BLE001 - the record says what broke
        res["error"] = traceback.format_exc()[-4000:]
        res["passed"] = False
    finally:
        res["elapsed_s"] = clock()
        dump(res, out, f"mcore_reshard_{case}")
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_mcore_reshard(case, tmp_path):
    if not gpu_available():
        pytest.skip("needs two CUDA GPUs with Ray and Megatron-Bridge (GPU host only)")
    assert run(case, str(tmp_path), None, 200, 460)["passed"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), required=True)
    ap.add_argument("--root", default=None, help="workspace (default /tmp/rlc-mcore-reshard-CASE)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--timeout", type=int, default=460, help="seconds for the driver run")
    a = ap.parse_args()
    r = run(a.case, a.root or f"/tmp/rlc-mcore-reshard-{a.case}", a.out, a.steps, a.timeout)
    print(f"mcore_reshard_{a.case}:", "passed" if r.get("passed") else f"FAILED ({str(r.get('error', ''))[:300]})",
          flush=True)
    sys.exit(0 if r.get("passed") else 1)
