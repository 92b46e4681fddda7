"""GPU checks of the Megatron generation backend (``generation.backend: megatron``) on one GPU, from compiled bundles.

cases (``--case``; each writes ``<out>/mcore_<case>.json`` with the command, the machine and a verdict):

- ``shared``     the dense tiny Qwen3 toy task (``tiny-qwen3-1gpu-megatron``), shared mode: the 10-step mean reward
                 reaches ``REWARD_GOAL`` within ``--steps``; every step refits (``mg_sync``); the gen-vs-train logprob
                 mismatch (gen-KL) is reported; measured memory per phase next to the plan's.
- ``moe``        the same on a tiny GLM-4.5-style MoE (``tiny-glm-moe-1gpu-megatron``: fp32 router bias, one MTP
                 layer; the tiny DeepSeek-V3's multi-latent attention needs latent caching in megatron-core 0.19).
- ``dedicated``  the tiny MoE in dedicated mode: a second model refit by ``swap_model_weights`` every step; after every
                 swap (``refit.verify_every=1``) each inference tensor equals the trainer's bit for bit, the fp32 router
                 biases included, over at least ``MIN_SWAPS`` refits; swap time and memory next to the plan's.
- ``compare``    the dense recipe with each backend for ``--compare-steps`` steps: step, generation and refit times and
                 memory per phase side by side (vLLM: ``tiny-qwen3-1gpu``, Megatron: ``tiny-qwen3-1gpu-megatron``).

Every case starts with a preflight (CUDA, and a FlashAttention that megatron-core's dynamic batching accepts) and
stops in seconds, saying what is missing, when the stack cannot run the engine. Runs are bounded by ``--timeout``;
a run cut by it still passes the learning check when the goal was reached before (the verdict says so).

    python tests/gpu/test_mcore_generation.py --case shared [--steps 150] [--root /tmp/rlc-mcore] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.common import Timer, dump, gpu_available

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "rlc" / "recipes"
DENSE_MG, MOE_MG, DENSE_VLLM = "tiny-qwen3-1gpu-megatron", "tiny-glm-moe-1gpu-megatron", "tiny-qwen3-1gpu"
MOE_CONFIG = RECIPES / "models" / "tiny-glm-moe-mtp" / "config.json"

# Thresholds of the verdicts (stated once, here).
REWARD_GOAL = 0.8  # 10-step mean reward
WINDOW = 10
GEN_KL_GOAL = 0.01  # reported against; the run's own guard is raised to GEN_KL_STOP so a mismatch is measured
GEN_KL_STOP = 0.5  # a wrong weight path gives gen-KL far above this and stops the run (exit 3)
MIN_SWAPS = 20
ROUTER_BIAS = "expert_bias"
PHASES = ("generate", "after_sleep", "logprobs", "train", "refit_offload", "after_wake")
TIMINGS = ("step_s", "generate_s", "vllm_generate_s", "megatron_generate_s", "sleep_s", "logprobs_s", "train_s",
           "refit_s", "refit_transfer_s", "wake_weights_s", "wake_kv_s")


# ------------------------------------------------------------------ verdicts and summaries (pure; CPU-tested)


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 6) if xs else None


def rewards_of(metrics: list[dict]) -> tuple[list[int], list[float]]:
    rows = sorted((r for r in metrics if "reward/mean" in r), key=lambda r: r["step"])
    return [int(r["step"]) for r in rows], [float(r["reward/mean"]) for r in rows]


def goal_step(steps: list[int], rewards: list[float]) -> int | None:
    """The first step whose trailing ``WINDOW``-step mean reward reaches ``REWARD_GOAL``."""
    for i in range(WINDOW - 1, len(rewards)):
        if sum(rewards[i - WINDOW + 1:i + 1]) / WINDOW >= REWARD_GOAL:
            return steps[i]
    return None


def verdict_learning(run: dict, max_steps: int) -> dict:
    """Learned the toy task with the Megatron engine: the goal reached, every step logged and refit in order, the
    engines were Megatron's (no vLLM engine started). A run cut by the timeout, or stopped at its goal by the
    harness, passes once the goal was reached."""
    steps, rewards = rewards_of(run["metrics"])
    kls = [float(r["gen_kl"]) for r in run["metrics"] if "gen_kl" in r]
    refits = sorted({int(r["step"]) for r in run["ranks"]})
    reached = goal_step(steps, rewards)
    # every logged step refit after it (and the initial refit); a run cut by the timeout may have refit once more
    in_order = (steps == list(range(1, len(steps) + 1)) and set(range(0, len(steps) + 1)) <= set(refits)
                and max(refits, default=-1) <= len(steps) + 1)
    megatron = "Megatron inference engines up" in run["log"] and "vLLM engines up" not in run["log"]
    finished = run["rc"] == 0 and len(steps) == max_steps
    # cut by the timeout, or stopped by the harness (Lab.start_driver), once the goal was reached
    cut = (run["rc"] == 124 or run.get("stopped_at_goal") is not None) and reached is not None
    res = {"rc": run["rc"], "steps": len(steps), "step_10mean_reached_goal": reached, "goal": REWARD_GOAL,
           "first10_mean": _mean(rewards[:WINDOW]), "last10_mean": _mean(rewards[-WINDOW:]),
           "refits": len(refits), "refits_in_order": in_order, "megatron_engines": megatron,
           "cut_by_timeout_after_goal": cut,
           "gen_kl": {"max": max(kls) if kls else None, "mean": _mean(kls), "goal": GEN_KL_GOAL,
                      "within_goal": bool(kls) and max(kls) <= GEN_KL_GOAL, "run_stops_above": GEN_KL_STOP},
           "gen_logprob_abs_diff_max": max((float(r.get("gen_logprob_abs_diff_max", 0.0)) for r in run["metrics"]),
                                           default=None),
           "reward_curve": [round(x, 4) for x in rewards]}
    res["passed"] = bool((finished or cut) and reached is not None and in_order and megatron)
    return res


def verdict_swaps(run: dict, min_swaps: int, min_fp32: int) -> dict:
    """Every verified swap bit-exact on every rank, at least ``min_swaps`` of them, each comparing at least
    ``min_fp32`` fp32 router biases (the dtype is compared too: a bias left in bf16 is a mismatch)."""
    records = run["verify"]
    steps = sorted({int(r["step"]) for r in records})
    bad = [(r["step"], r["worker"], [m["name"] for m in r["mismatches"]][:3]) for r in records if not r["bit_exact"]]
    biases = [sum(1 for n in r["fp32_params"] if ROUTER_BIAS in n) for r in records]
    res = {"rc": run["rc"], "verified_swaps": len(steps), "first_steps": steps[:3], "not_exact": bad[:5],
           "tensors_per_rank": sorted({r["params_compared"] for r in records}),
           "bytes_per_rank": sorted({r["bytes_compared"] for r in records}),
           "fp32_router_biases_min": min(biases) if biases else 0, "fp32_router_biases_needed": min_fp32,
           "fp32_names": sorted({n for r in records[:1] for n in r["fp32_params"]})[:8]}
    res["passed"] = bool(run["rc"] == 0 and len(steps) >= min_swaps and not bad and biases
                         and min(biases) >= min_fp32)
    return res


#: Plan phase -> the measured phases it must cover: the plan's phase is the peak of what those moments hold
#: (``refit``: the swap's peak, after ``refit_offload``; ``logprob``: the engine suspended and the trainer as the
#: refit left it, so ``after_sleep`` and ``refit_offload`` too (shared mode plans no refit phase); ``generate``: the
#: engine awake, ``after_wake`` too).
COVERS = {"generate": ("generate", "after_wake"), "train": ("train",), "refit": ("refit_offload",),
          "logprob": ("logprobs", "after_sleep", "refit_offload")}


def memory_vs_plan(metrics: list[dict], plan: dict) -> dict:
    """GPU 0's measured used memory per phase (mean and max over steps) next to the plan's phase totals, and the
    plan phases a measured maximum exceeds (``under_planned``: the plan must never be below a measurement)."""
    measured = {}
    for phase in PHASES:
        values = [float(r[f"memory/{phase}/used_gib"]) for r in metrics if f"memory/{phase}/used_gib" in r]
        if values:
            measured[phase] = {"mean": _mean(values), "max": round(max(values), 4)}
    planned = {name: round(p["used_gib"], 4) for name, p in plan.get("phases", {}).items()
               if p.get("used_gib") is not None}
    side = {}
    for plan_phase, moments in COVERS.items():
        seen = [m for m in moments if m in measured]
        if plan_phase in planned and seen:
            worst = max(seen, key=lambda m: measured[m]["max"])
            side[plan_phase] = {"planned_gib": planned[plan_phase], "measured_max_gib": measured[worst]["max"],
                                "measured_as": worst,
                                "measured_minus_planned_gib": round(measured[worst]["max"] - planned[plan_phase], 4)}
    under = sorted(p for p, v in side.items() if v["measured_minus_planned_gib"] > 0)
    return {"measured": measured, "planned": planned, "side_by_side": side, "under_planned": under,
            "kv_pool": plan.get("megatron", {}).get("kv_pool")}


def timings(metrics: list[dict], skip_first: int = 1) -> dict:
    """Mean seconds per step of each phase, the first ``skip_first`` steps left out (warm-up)."""
    rows = [r for r in metrics if "reward/mean" in r and int(r["step"]) > skip_first]
    out = {}
    for key in TIMINGS:
        values = [float(r[f"timing/{key}"]) for r in rows if f"timing/{key}" in r]
        if values:
            out[key] = _mean(values)
    out["refit_bytes"] = _mean([float(r["refit/bytes"]) for r in rows if "refit/bytes" in r])
    out["steps_averaged"] = len(rows)
    return out


# ------------------------------------------------------------------ the machine, the preflight, the runs


def machine() -> dict:
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version()}
    try:
        info["gpus"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                       "--format=csv,noheader"], capture_output=True, text=True, timeout=30
                                      ).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        info["gpus"] = f"nvidia-smi failed: {exc}"
    from rlc.runtime.workers import library_versions  # noqa: PLC0415

    info["versions"] = library_versions()
    return info


def preflight(env: dict) -> dict:
    """CUDA and the FlashAttention megatron-core's dynamic batching needs, checked in a fresh interpreter."""
    code = ("import torch, json\n"
            "from rlc.runtime.generation.megatron_engine import flash_attention\n"
            "print(json.dumps({'cuda': torch.cuda.is_available(), 'flash_attention': flash_attention()}))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": (proc.stdout + proc.stderr)[-3000:]}
    from rlc.runtime.generation.megatron_engine import FLASH_ATTENTION_MISSING  # noqa: PLC0415 (no torch import)

    found["ok"] = bool(found["cuda"] and found["flash_attention"])
    if not found["flash_attention"]:
        found["error"] = FLASH_ATTENTION_MISSING
    return found


def compile_recipe(recipe: str, run_dir: Path, checkpoint: Path | str, data: Path | str,
                   extra: tuple[str, ...] | list[str] = ()) -> Path:
    """``rlc compile`` of the shipped ``recipe`` into ``run_dir/bundle`` (a fresh ``run_dir``) with the workspace's
    checkpoint, tokenizer and data, logs under ``run_dir``, no checkpointing, and the ``extra`` settings."""
    from tests.gpu.test_four_gpu_grpo import _env  # noqa: PLC0415

    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [f"model.checkpoint={checkpoint}", f"model.tokenizer={checkpoint}", f"data.train={data}",
            f"cluster.log_dir={run_dir}/logs", f"logging.dir={run_dir}/logs", "checkpointing.enabled=false", *extra]
    cmd = [sys.executable, "-m", "rlc", "compile", str(RECIPES / f"{recipe}.yaml"), "-o", str(run_dir / "bundle"),
           "--force", *[w for s in sets for w in ("--set", s)]]
    proc = subprocess.run(cmd, env=_env(REPO), capture_output=True, text=True, check=False, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"rlc compile {recipe} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return run_dir / "bundle"


class Workspace:
    """Checkpoints, data and one Ray head for every run of a case (the two-GPU proofs' ``Lab``, one GPU)."""

    def __init__(self, root: str) -> None:
        from tests.gpu import test_moe_two_gpu as moe  # noqa: PLC0415

        self.lab = moe.Lab(root, gpus=1)
        self.root = Path(root)

    def build(self, dense: bool, moe: bool) -> dict:
        """The dense tiny Qwen3 and/or the tiny GLM-4.5-style MoE (with its MTP layer and fp32 router bias)."""
        from rlc.runtime import toy  # noqa: PLC0415
        from rlc.runtime.toy_model import build_toy_model, build_toy_workspace  # noqa: PLC0415
        from tests.gpu.test_four_gpu_grpo import add_mtp_layers  # noqa: PLC0415

        info: dict = {}
        if dense and not (self.root / "dense" / "qwen3" / "config.json").exists():
            info["dense"] = {k: str(v) for k, v in build_toy_workspace(str(self.root / "dense")).items()}
        ckpt = self.root / "moe" / "glm4_moe"
        if moe and not (ckpt / "config.json").exists():
            build_toy_model(ckpt, config=MOE_CONFIG)
            info["moe"] = {"checkpoint": str(ckpt), **add_mtp_layers(ckpt)}
            toy.write_dataset(self.root / "moe" / "data" / "train.jsonl", 4096, 0)
        return info

    def compile(self, recipe: str, run: str, extra: tuple[str, ...] = ()) -> Path:
        dense = recipe in (DENSE_MG, DENSE_VLLM)
        ws = self.root / ("dense" if dense else "moe")
        ckpt = ws / ("qwen3" if dense else "glm4_moe")
        return compile_recipe(recipe, self.root / "runs" / run, ckpt, ws / "data" / "train.jsonl", extra)

    def run(self, bundle: Path, overrides: list[str], timeout_s: int, stop_at_goal_after: int | None = None) -> dict:
        got = self.lab.start_driver(bundle, overrides, "driver.log", timeout_s, stop_at_goal_after)
        got["plan"] = json.loads((bundle / "plan.json").read_text(encoding="utf-8"))
        return got

    def close(self) -> None:
        self.lab.close()


def _tail(text: str, n: int) -> list[str]:
    return [line[:300] for line in text.splitlines()[-n:]]


def _router_biases() -> int:
    cfg = json.loads(MOE_CONFIG.read_text(encoding="utf-8"))
    return (
        cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    )  # the decoder's MoE layers (the MTP layer's too, if any)


def case_learn(ws: Workspace, recipe: str, steps: int, timeout_s: int, sets: tuple[str, ...] = ()) -> dict:
    bundle = ws.compile(recipe, f"learn_{recipe}", (f"grpo.max_steps={steps}", *sets))
    got = ws.run(bundle, [f"grpo.max_gen_kl={GEN_KL_STOP}"], timeout_s, stop_at_goal_after=1)
    res = {"recipe": recipe, "sets": list(sets), "learning": verdict_learning(got, steps),
           "memory": memory_vs_plan(got["metrics"], got["plan"]), "timing_mean_s": timings(got["metrics"]),
           "calibration": got["calibration"][:6], "seconds": got["seconds"]}
    res["passed"] = res["learning"]["passed"]
    res["log_tail"] = _tail(got["log"], 10 if res["passed"] else 60)
    return res


def case_dedicated(ws: Workspace, steps: int, timeout_s: int) -> dict:
    bundle = ws.compile(MOE_MG, "dedicated", (f"grpo.max_steps={steps}", "generation.megatron.mode=dedicated"))
    got = ws.run(bundle, ["refit.verify_every=1", f"grpo.max_gen_kl={GEN_KL_STOP}"], timeout_s)
    steps_logged, rewards = rewards_of(got["metrics"])
    res = {"recipe": MOE_MG, "mode": "dedicated", "swaps": verdict_swaps(got, MIN_SWAPS, _router_biases()),
           "steps": len(steps_logged), "reward_first5": _mean(rewards[:5]), "reward_last5": _mean(rewards[-5:]),
           "built_dedicated": "built the dedicated inference model" in got["log"],
           "gen_kl_max": max((float(r["gen_kl"]) for r in got["metrics"] if "gen_kl" in r), default=None),
           "memory": memory_vs_plan(got["metrics"], got["plan"]), "timing_mean_s": timings(got["metrics"]),
           "seconds": got["seconds"]}
    res["passed"] = bool(res["swaps"]["passed"] and res["built_dedicated"])
    res["log_tail"] = _tail(got["log"], 10 if res["passed"] else 60)
    return res


def case_compare(ws: Workspace, steps: int, timeout_s: int) -> dict:
    res: dict = {"steps": steps, "backends": {}}
    for backend, recipe in (("vllm", DENSE_VLLM), ("megatron", DENSE_MG)):
        bundle = ws.compile(recipe, f"compare_{backend}", (f"grpo.max_steps={steps}",))
        got = ws.run(bundle, [f"grpo.max_gen_kl={GEN_KL_STOP}"], timeout_s)
        logged, rewards = rewards_of(got["metrics"])
        res["backends"][backend] = {
            "recipe": recipe, "rc": got["rc"], "steps": len(logged), "reward_last5": _mean(rewards[-5:]),
            "gen_kl_max": max((float(r["gen_kl"]) for r in got["metrics"] if "gen_kl" in r), default=None),
            "timing_mean_s": timings(got["metrics"]), "memory": memory_vs_plan(got["metrics"], got["plan"]),
            "seconds": got["seconds"], "log_tail": _tail(got["log"], 8 if got["rc"] == 0 else 50)}
    b = res["backends"]
    gen = {k: b[k]["timing_mean_s"].get(f"{k}_generate_s") for k in b}
    res["side_by_side_s"] = {
        "step": {k: b[k]["timing_mean_s"].get("step_s") for k in b}, "generate": gen,
        "release (vLLM sleep / engine suspend)": {k: b[k]["timing_mean_s"].get("sleep_s") for k in b},
        "refit": {k: b[k]["timing_mean_s"].get("refit_s") for k in b}}
    res["passed"] = all(v["rc"] == 0 and v["steps"] == steps for v in b.values())
    return res


CASES = ("shared", "moe", "dedicated", "compare")


def run(case: str, root: str, out: str | None, steps: int, timeout_s: int, compare_steps: int,
        sets: tuple[str, ...] = ()) -> dict:
    from tests.gpu.test_four_gpu_grpo import _env  # noqa: PLC0415

    clock = Timer()
    res: dict = {"check": f"Megatron generation backend: {case}", "case": case,
                 "command": " ".join([sys.executable, *sys.argv]), "machine": machine()}
    ws = None
    try:
        res["preflight"] = preflight(_env(REPO))
        if not res["preflight"]["ok"]:
            res["passed"] = False
            res["error"] = res["preflight"].get("error", "CUDA is not available")
            return res
        ws = Workspace(root)
        res["workspace"] = ws.build(dense=case in ("shared", "compare"), moe=case in ("moe", "dedicated"))
        if case == "shared":
            res.update(case_learn(ws, DENSE_MG, steps, timeout_s, sets))
        elif case == "moe":
            res.update(case_learn(ws, MOE_MG, steps, timeout_s, sets))
        elif case == "dedicated":
            res.update(case_dedicated(ws, steps, timeout_s))
        elif case == "compare":
            res.update(case_compare(ws, compare_steps, timeout_s))
        else:
            raise ValueError(f"unknown case {case}; known: {', '.join(CASES)}")
    except Exception:  # noqa: BLE001 - the record says what broke
        res["error"] = traceback.format_exc()[-4000:]
        res["passed"] = False
    finally:
        if ws is not None:
            ws.close()
        res["elapsed_s"] = clock()
        dump(res, out, f"mcore_{case}")
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_mcore_generation(case, tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    steps = {"shared": 150, "moe": 150, "dedicated": 25, "compare": 20}[case]
    assert run(case, str(tmp_path), None, steps, 560, 20)["passed"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--root", default="/tmp/rlc-mcore")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--timeout", type=int, default=470, help="seconds for each driver run")
    ap.add_argument("--compare-steps", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                    help="extra `rlc compile --set` for the shared and moe cases (recorded in the result)")
    a = ap.parse_args()
    r = run(a.case, a.root, a.out, a.steps, a.timeout, a.compare_steps, tuple(a.sets))
    print(f"mcore_{a.case}:", "passed" if r.get("passed") else f"FAILED ({str(r.get('error', ''))[:300]})", flush=True)
    sys.exit(0 if r.get("passed") else 1)
