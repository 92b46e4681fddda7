"""GPU check: GRPO with the settings production configurations use, from compiled bundles, on one GPU.

A KL penalty > 0 with the reference policy in host memory (``training.offload_reference_policy``) and
sequence packing (``training.sequence_packing.enabled``), on the dense tiny Qwen3
(``tiny-qwen3-1gpu``) or the tiny DeepSeek-V3 MoE compiled for one GPU (``tiny-moe-mtp-2gpu-ep2`` with
trainer EP 1, one vLLM engine); ``--set`` adds more (e.g. routing replay). Every run starts from
``rlc compile`` of the shipped recipe and runs the bundle's ``runtime.yaml`` with the bundled runtime.

Passes when the 10-step mean reward reaches the toy task's goal within ``--steps``, gen-KL stays under
its goal on every step, every step refits, the KL term is logged on every step and every verified refit is
bit exact. The run stops once the goal is reached and at least ``--verify-every`` steps ran (two verified
refits), unless ``--run-all-steps``; the driver gets what is left of ``--budget`` seconds, so the result file
is written (with the steps logged so far) even when the run is cut. The result (``production_<model>.json``)
carries the reward curve, the gen-vs-train logprob mismatch, the per-phase memory and timings, and the
command that made it.

    python tests/gpu/test_production_settings.py --model dense|moe [--steps 150] [--set KEY=VALUE ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import platform
import sys
import traceback

import pytest

from tests.gpu.common import Timer, dump, gpu_available
from tests.gpu import test_moe_two_gpu as moe

PRODUCTION = ("loss.kl_penalty=0.01", "training.offload_reference_policy=true",
              "training.sequence_packing.enabled=true")
MOE_ONE_GPU = ("cluster.gpus_per_node=1", "parallelism.train.ep=1", "parallelism.generation.ep=1",
               "refit.sleep_level=1")
MODELS = {"dense": (moe.DENSE, ()), "moe": (moe.EP2, MOE_ONE_GPU)}
PHASES = ("generate", "after_sleep", "logprobs", "train", "refit_offload", "after_wake")


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if key in r]
    return round(sum(vals) / len(vals), 6) if vals else None


def run_summary(metrics: list[dict]) -> dict:
    """What the issue reports next to the verdict: mismatch, KL term, memory and time per phase (pure)."""
    rows = [r for r in metrics if "reward/mean" in r]
    keys = sorted({k for r in rows for k in r})
    return {
        "gen_kl_mean": _mean(rows, "gen_kl"),
        "gen_logprob_abs_diff_max": max((float(r["gen_logprob_abs_diff_max"]) for r in rows
                                         if "gen_logprob_abs_diff_max" in r), default=None),
        "kl_term_steps": sum(1 for r in rows if any(k.startswith("loss/kl") for k in r)),
        "memory_used_gib_mean": {p: _mean(rows, f"memory/{p}/used_gib") for p in PHASES},
        "timing_mean_s": {k[len("timing/"):]: _mean(rows, k) for k in keys if k.startswith("timing/")},
        "train_tokens_per_s_mean": _mean(rows, "throughput/train_tokens_per_s"),
        "router_replay_keys": [k for k in keys if "replay" in k],
    }


#: Seconds kept, of the check's budget, for the verdict and the result file after the driver stops.
DUMP_RESERVE_S = 25


def run(model: str, root: str, out: str | None, steps: int, verify_every: int, extra: list[str],
        budget_s: float = 560, stop_at_goal: bool = True) -> dict:
    recipe, base = MODELS[model]
    sets = (*base, *PRODUCTION, *extra, f"grpo.max_steps={steps}")
    clock, lab = Timer(), moe.Lab(root, gpus=1)
    res: dict = {"check": f"GRPO with production settings on the tiny {model} model, one GPU",
                 "command": " ".join(["python tests/gpu/test_production_settings.py", "--model", model,
                                      "--steps", str(steps), *[f"--set {s}" for s in extra],
                                      *([] if stop_at_goal else ["--run-all-steps"])]),
                 "machine": f"{platform.node()} ({_gpu_name()})", "recipe": recipe, "sets": list(sets)}
    try:
        lab.workspace()
        bundle = lab.compile(recipe, f"production_{model}", sets)
        # the driver gets what is left of the check's budget, so the verdict is written even when it is cut
        driver_s = max(60, int(budget_s - clock() - DUMP_RESERVE_S))
        got = lab.start_driver(bundle, [f"refit.verify_every={verify_every}"], "driver.log", driver_s,
                               stop_at_goal_after=verify_every if stop_at_goal else None)
        ran = got["stopped_at_goal"] or steps
        res["learning"] = moe.verdict_learning(got, steps, moe._switches(bundle))
        # refits 0, verify_every, ... up to the last full step (a stopped run may end before that step's refit)
        verified = 1 + (ran - 1) // verify_every if got["stopped_at_goal"] else 1 + steps // verify_every
        res["bit_exact"] = moe.verdict_bit_exact(got, refits=verified,
                                                 min_fp32=moe._router_biases_per_worker() if model == "moe" else 0)
        res["summary"] = run_summary(got["metrics"])
        res["calibration"] = got["calibration"]
        res["passed"] = bool(res["learning"]["passed"] and res["bit_exact"]["passed"]
                             and res["summary"]["kl_term_steps"] >= ran)
        res["log_tail"] = moe._tail(got["log"], 8 if res["passed"] else 60)
        res["driver_log"] = got["log_path"]
    except Exception:  # noqa: BLE001 - the record says what broke
        res["error"] = traceback.format_exc()[-3000:]
        res["passed"] = False
    finally:
        lab.close()
    res["seconds"] = clock()
    dump(res, out, f"production_{model}")
    return res


def _gpu_name() -> str:
    try:
        import torch  # noqa: PLC0415

        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        return "no GPU"


@pytest.mark.gpu
def test_production_settings_dense(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    res = run("dense", str(tmp_path), None, steps=150, verify_every=50, extra=[])
    assert res["passed"], res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--root", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--verify-every", type=int, default=50)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--budget", type=float, default=560, help="seconds for the whole check, result file included")
    ap.add_argument("--run-all-steps", action="store_true", help="do not stop once the goal is reached")
    a = ap.parse_args()
    r = run(a.model, a.root or f"/tmp/rlc-production-{a.model}", a.out, a.steps, a.verify_every, a.set,
            budget_s=a.budget, stop_at_goal=not a.run_all_steps)
    print({k: v for k, v in r.items() if k not in ("calibration",)}, flush=True)
    sys.exit(0 if r["passed"] else 1)
