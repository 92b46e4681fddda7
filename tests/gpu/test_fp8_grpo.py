"""GPU check: the dense tiny GRPO run with FP8 rollouts, from a compiled bundle, learns the toy task.

``rlc compile rlc/recipes/tiny-qwen3-1gpu.yaml --set generation.precision=fp8`` (plus the workspace's paths),
then the bundle's runtime for ``--steps`` GRPO steps with a bit-exact refit check every ``--verify-every``
refits (vLLM's FP8 parameters against vLLM's own quantization of the trainer's bf16 export).

``--scales tensor`` (default) runs the shipped tiny model: its k/v projections are 64 rows, so block scales
are refused at compile time (RLC330) and vLLM quantizes per tensor as it loads. ``--scales block`` runs the same
model with ``head_dim: 64`` (k/v projections one block tall; the recipe's ``model.config`` points at that
config), so the trainer quantizes 128x128 blocks before each refit.

FP8 rollouts sample from a slightly different policy than the bf16 trainer scores: ``grpo.max_gen_kl`` is raised
to ``--max-gen-kl`` (a broken refit still stops the run) and ``loss.importance_sampling_correction`` is on unless
``--no-tis``. The gen-vs-train mismatch (gen-KL, largest logprob difference) is reported next to the bf16 run
recorded in ``docs/results/tiny-qwen3-h200-grpo/learning.json`` (or a bf16 run in this call with ``--bf16``).

Passes when the driver exits 0 with a refit every step, every verified refit is bit exact, and (``--scales
tensor``, the shipped model) the 10-step mean reward reaches 0.8 within the steps. Writes
``<out>/fp8_grpo_<scales>.json`` (command, machine, bundle, summary, bf16 comparison) and the metrics.

    python tests/gpu/test_fp8_grpo.py [--scales tensor|block] [--steps 150] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from tests.gpu.common import Timer, dump, gpu_available

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

RECIPE = REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml"
BF16_RESULT = REPO / "docs" / "results" / "tiny-qwen3-h200-grpo" / "learning.json"
GOAL_REWARD = 0.8


def machine() -> dict:
    info: dict = {"hostname": os.uname().nodename, "python": sys.version.split()[0]}
    try:
        info["gpus"] = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                                       "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
                                      check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    return info


def aligned_config(root: Path) -> Path:
    """The shipped tiny Qwen3 with ``head_dim: 64``: q 256 rows, k and v 128 (block scales need 128-aligned)."""
    fields = json.loads(
        (REPO / "rlc" / "recipes" / "models" / "tiny-qwen3" / "config.json").read_text(encoding="utf-8")
    )
    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    fields["head_dim"] = 64
    path = root / "tiny-qwen3-head64.json"
    path.write_text(json.dumps(fields, indent=1), encoding="utf-8")
    return path


def workspace(root: Path, scales: str) -> dict:
    from rlc.runtime.toy_model import build_toy_workspace  # noqa: PLC0415

    root.mkdir(parents=True, exist_ok=True)
    config = aligned_config(root) if scales == "block" else None
    paths = build_toy_workspace(str(root), config=str(config) if config else None)
    return {
        "checkpoint": str(paths["checkpoint"]),
        "train": str(paths["train"]),
        "config": str(config) if config else None,
    }


def compile_bundle(root: Path, ws: dict, sets: list[str]) -> tuple[Path, list[str]]:
    from tests.gpu.test_four_gpu_grpo import _env  # noqa: PLC0415

    bundle = root / "bundle"
    run = [f"model.checkpoint={ws['checkpoint']}", f"model.tokenizer={ws['checkpoint']}", f"data.train={ws['train']}",
           f"cluster.log_dir={root}/logs", f"logging.dir={root}/logs", f"checkpointing.dir={root}/ckpt", *sets]
    if ws.get("config"):
        run.append(f"model.config={ws['config']}")
    cmd = [sys.executable, "-m", "rlc", "compile", str(RECIPE), "-o", str(bundle), "--force",
           *[w for s in run for w in ("--set", s)]]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=_env(REPO), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"rlc compile failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return bundle, run


def run_bundle(bundle: Path, timeout_s: int) -> dict:
    from tests.gpu.test_four_gpu_grpo import _env, read_jsonl, run_driver  # noqa: PLC0415

    from rlc.contract.runtime_config import load_runtime_config  # noqa: PLC0415

    env = _env(bundle / "rlc_pkg")
    env.pop("RAY_ADDRESS", None)  # a private local Ray cluster for this run
    log = bundle.parent / "driver.log"
    t = Timer()
    rc = run_driver(bundle, env, log, timeout_s)
    logs = Path(load_runtime_config(bundle / "runtime.yaml").logging.dir)
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    return {"rc": rc, "seconds": t(), "log_tail": [line[:300] for line in text.splitlines()[-30:]],
            "metrics": read_jsonl(logs / "metrics.jsonl"), "verify": read_jsonl(logs / "refit_verify.jsonl"),
            "logs": str(logs)}


def keep_log_tail(src: Path, dst: Path, limit: int = 4 << 20) -> None:
    """The driver's whole log (its last ``limit`` bytes), timestamps and all, next to the result: a run that stalls
    says where only there."""
    if src.exists():
        with open(src, "rb") as f:
            f.seek(max(0, src.stat().st_size - limit))
            dst.write_bytes(f.read())


def bf16_reference() -> dict | None:
    if not BF16_RESULT.exists():
        return None
    s = json.loads(BF16_RESULT.read_text(encoding="utf-8"))["summary"]
    keys = ("step_10mean_reached_goal", "reward_last10_mean", "gen_kl_max", "gen_kl_mean", "gen_logprob_abs_diff_max",
            "generate_tokens_per_s_mean")
    return {"source": str(BF16_RESULT.relative_to(REPO)), **{k: s.get(k) for k in keys},
            "step_s": s.get("timing_mean_s", {}).get("step_s"), "refit_s": s.get("timing_mean_s", {}).get("refit_s")}


def verdict(got: dict, steps: int, verify_every: int, need_learning: bool) -> tuple[bool, list[str]]:
    s = got["summary"]
    reasons = []
    if got["rc"] != 0:
        reasons.append(f"driver exit {got['rc']}")
    if s["steps_logged"] != steps or s["refits_logged"] != steps:
        reasons.append(f"{s['steps_logged']} steps and {s['refits_logged']} refits logged of {steps}")
    verified = got["verify"]
    want = 1 + steps // verify_every if verify_every else 0
    bad = [
        (r.get("step"), [m["name"] for m in r.get("mismatches", [])][:3]) for r in verified if not r.get("bit_exact")
    ]
    if len({r.get("step") for r in verified}) < want or bad:
        reasons.append(f"verified refits: {len({r.get('step') for r in verified})} of {want}, not bit exact: {bad[:3]}")
    if need_learning and s["step_10mean_reached_goal"] is None:
        reasons.append(f"10-step mean reward never reached {GOAL_REWARD} (last 10: {s['reward_last10_mean']})")
    return not reasons, reasons


def run(root: str, out: str | None, scales: str, steps: int, verify_every: int, max_gen_kl: float, tis: bool,
        bf16: bool, timeout_s: int) -> dict:
    from tests.gpu.test_grpo_learning import summarize  # noqa: PLC0415

    clock = Timer()
    rootp = Path(root)
    for sub in ("bundle", "logs", "ckpt", "bf16"):
        shutil.rmtree(rootp / sub, ignore_errors=True)
    res: dict = {"check": f"tiny GRPO with FP8 rollouts ({scales} scales) from a compiled bundle",
                 "command": " ".join(["python", "tests/gpu/test_fp8_grpo.py", *sys.argv[1:]]), "machine": machine(),
                 "recipe": str(RECIPE.relative_to(REPO)), "goal": {"reward_10mean": GOAL_REWARD, "steps": steps}}
    try:
        ws = workspace(rootp / "ws", scales)
        sets = ["generation.precision=fp8", f"generation.fp8.scales={scales}", f"grpo.max_steps={steps}",
                f"grpo.max_gen_kl={max_gen_kl}", f"refit.verify_every={verify_every}",
                f"loss.importance_sampling_correction={'true' if tis else 'false'}"]
        bundle, res["sets"] = compile_bundle(rootp, ws, sets)
        import yaml  # noqa: PLC0415

        compiled = yaml.safe_load((bundle / "runtime.yaml").read_text(encoding="utf-8"))
        res["compiled"] = {
            "precision": compiled["generation"]["precision"],
            "fp8": compiled["generation"]["fp8"],
            "max_gen_kl": compiled["grpo"]["max_gen_kl"],
            "verify_every": compiled["refit"]["verify_every"],
        }
        got = run_bundle(bundle, timeout_s)
        got["summary"] = summarize(got["metrics"], steps)
        res["fp8"] = {k: v for k, v in got.items() if k not in ("metrics", "verify")}
        res["fp8"]["verified_refits"] = sorted({r.get("step") for r in got["verify"]})
        res["fp8"]["verify_params"] = sorted({r.get("params_compared") for r in got["verify"]})
        res["fp8"]["reference_quantizer"] = sorted({str(r.get("reference_quantizer")) for r in got["verify"]})
        res["passed"], res["reasons"] = verdict(got, steps, verify_every, need_learning=scales == "tensor")
        res["learning_reached"] = got["summary"]["step_10mean_reached_goal"]
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "refit_verify.jsonl", "calibration.jsonl"):
                src = Path(got["logs"]) / name
                if src.exists():
                    shutil.copy(src, Path(out) / f"fp8_grpo_{scales}_{name}")
            keep_log_tail(bundle.parent / "driver.log", Path(out) / f"fp8_grpo_{scales}_driver.log")
        res["bf16"] = bf16_reference()
        if bf16:  # the same bundle with bf16 rollouts, now
            bbundle, _ = compile_bundle(rootp / "bf16", ws, [f"grpo.max_steps={steps}"])
            b = run_bundle(bbundle, timeout_s)
            res["bf16_now"] = {"rc": b["rc"], "summary": summarize(b["metrics"], steps)}
        fp8s = got["summary"]
        res["mismatch"] = {
            "gen_kl_mean": {"fp8": fp8s["gen_kl_mean"], "bf16": (res["bf16"] or {}).get("gen_kl_mean")},
            "gen_kl_max": {"fp8": fp8s["gen_kl_max"], "bf16": (res["bf16"] or {}).get("gen_kl_max")},
            "gen_logprob_abs_diff_max": {"fp8": fp8s["gen_logprob_abs_diff_max"],
                                         "bf16": (res["bf16"] or {}).get("gen_logprob_abs_diff_max")},
        }
    except Exception:  # noqa: BLE001 - the record says what broke
        res["error"] = traceback.format_exc()[-3000:]
        res["passed"] = False
    res["seconds"] = clock()
    dump(res, out, f"fp8_grpo_{scales}")
    return res


@pytest.mark.gpu
def test_fp8_rollouts_learn_the_toy_task(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    res = run(str(tmp_path), None, "tensor", 150, 50, 0.5, True, False, 480)
    assert res["passed"], res.get("reasons") or res.get("error")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/rlc-fp8-grpo")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--scales", choices=("tensor", "block"), default="tensor")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--verify-every", type=int, default=50)
    ap.add_argument("--max-gen-kl", type=float, default=0.5)
    ap.add_argument("--no-tis", action="store_true", help="loss.importance_sampling_correction off")
    ap.add_argument("--bf16", action="store_true", help="also run the bf16 bundle now (about twice the time)")
    ap.add_argument("--timeout", type=int, default=420, help="seconds for the driver")
    a = ap.parse_args()
    r = run(a.root, a.out, a.scales, a.steps, a.verify_every, a.max_gen_kl, not a.no_tis, a.bf16, a.timeout)
    print(
        "fp8_grpo:",
        "passed" if r["passed"] else "FAILED: " + "; ".join(r.get("reasons") or [r.get("error", "")[-500:]]),
        "| mismatch:",
        r.get("mismatch"),
        flush=True,
    )
    sys.exit(0 if r["passed"] else 1)
