"""GPU proof: ``python -m rlc.runtime runtime.yaml`` learns the toy task on one GPU.

A tiny random Qwen3 (``rlc.runtime.toy_model``) learns "a+b=" -> (a+b) mod 10 with GRPO: Megatron
trainer + colocated vLLM on one GPU via Ray, refit through the refit engine every step with the
configured sleep level. Goal: mean reward from chance to >= 0.8 within <= 150 steps, gen-KL <= 0.01.
Then the run is restarted with 3 more steps: it must resume from the last checkpoint (not from
chance). Writes the metrics, the calibration records, a summary and the reward-curve PNG to --out.

    python tests/gpu/test_grpo_learning.py [--steps 150] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.common import Timer, dump, gpu_available, tiny_cfg_dict, write_yaml
from tests.gpu.verdicts import resume_verdict

GOAL_REWARD, GOAL_GEN_KL = 0.8, 0.01
PARAM_OFFLOAD_KEY = "refit.offload_params_for_generation"
MEMORY_PHASES = ("params_offload", "generate", "after_sleep", "logprobs", "train", "refit_offload", "after_wake")


def _run_driver(yaml_path: Path, timeout_s: int) -> int:
    cmd = [sys.executable, "-m", "rlc.runtime", str(yaml_path)]
    print("$", " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        return 124


def summarize(records: list[dict], steps: int) -> dict:
    """Reward curve start/end, first step whose 10-step mean reaches the goal, gen-KL max, refits."""
    rows = [r for r in records if "reward/mean" in r and r.get("step", 0) <= steps]
    rewards = [float(r["reward/mean"]) for r in rows]
    kls = [float(r["gen_kl"]) for r in rows if "gen_kl" in r]
    reached = None
    for i in range(len(rewards)):
        window = rewards[max(0, i - 9) : i + 1]
        if len(window) == 10 and sum(window) / 10 >= GOAL_REWARD:
            reached = rows[i]["step"]
            break

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in rows if key in r]
        return round(sum(vals) / len(vals), 4) if vals else None

    return {
        "steps_logged": len(rows),
        "reward_first10_mean": round(sum(rewards[:10]) / max(1, len(rewards[:10])), 4),
        "reward_last10_mean": round(sum(rewards[-10:]) / max(1, len(rewards[-10:])), 4),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "step_10mean_reached_goal": reached,
        "gen_kl_max": max(kls) if kls else None,
        "gen_kl_mean": round(sum(kls) / len(kls), 6) if kls else None,
        "gen_logprob_abs_diff_max": max((float(r.get("gen_logprob_abs_diff_max", 0)) for r in rows), default=None),
        "gen_logprob_abs_diff_mean": mean("gen_logprob_abs_diff_mean"),
        "gen_truncation_miss_fraction_mean": mean("gen_truncation_miss_fraction"),
        "truncation_miss_fraction_mean": mean("truncation_miss_fraction"),
        "refits_logged": sum(1 for r in rows if float(r.get("refit/bytes", 0)) > 0),
        "refit_sleep_levels": sorted({int(r["refit/sleep_level"]) for r in rows if "refit/sleep_level" in r}),
        "timing_mean_s": {k: mean(f"timing/{k}") for k in ("step_s", "generate_s", "sleep_s", "logprobs_s", "train_s",
                                                         "refit_s", "wake_weights_s", "wake_kv_s")},
        "refit_gbps_mean": mean("refit/gbps"),
        "refit_free_before_gib_mean": mean("refit/free_before_gib"),
        "generate_tokens_per_s_mean": mean("throughput/generate_tokens_per_s"),
        # GPU 0's used memory at the end of each phase (mean over steps): with and without
        # refit.offload_params_for_generation the generate figure differs by the trainer's parameter shard
        "memory_used_gib_mean": {p: mean(f"memory/{p}/used_gib") for p in MEMORY_PHASES},
        "params_offload_freed_gib": [round(float(r["memory/params_offload_freed_gib"]), 6) for r in rows
                                     if "memory/params_offload_freed_gib" in r],
    }


def smoke_verdict(res: dict, steps: int, overrides: dict) -> tuple[bool, list[str]]:
    """The steps ran with a refit each; a restart (``--resume-steps``) exited 0 and went on after the last
    step; with the parameter offload on, every step moved the trainer's parameters off the GPU (a wrong
    restore would show as a gen-KL stop, exit 3, before this)."""
    s = res["summary"]
    reasons = []
    if res["rc"] != 0:
        reasons.append(f"driver exit {res['rc']}")
    if s["steps_logged"] != steps or s["refits_logged"] != steps:
        reasons.append(f"{s['steps_logged']} steps and {s['refits_logged']} refits logged of {steps}")
    if res.get("resume_rc") not in (None, 0):
        reasons.append(f"the resumed run exited {res['resume_rc']}")
    if "resume" in res:  # a few steps cannot lift the reward off chance: the step numbers show the resume
        after = res["resume"]["steps"]
        if not after or after[0] != steps + 1 or after != list(range(steps + 1, steps + 1 + len(after))):
            reasons.append(f"the restart logged steps {after}, expected {steps + 1}.. (resumed after step {steps})")
    freed = s["params_offload_freed_gib"]
    if overrides.get(PARAM_OFFLOAD_KEY):
        if len(freed) != steps or not all(f > 0 for f in freed):
            reasons.append(f"{PARAM_OFFLOAD_KEY}: freed GiB per step {freed}, expected {steps} figures > 0")
    elif freed:
        reasons.append(f"parameters were offloaded with {PARAM_OFFLOAD_KEY} off: {freed}")
    return not reasons, reasons


def _machine() -> str:
    import platform  # noqa: PLC0415

    try:
        import torch  # noqa: PLC0415 - torch

        return f"{platform.node()} ({torch.cuda.get_device_name(0)}, torch {torch.__version__})"
    except Exception:  # noqa: BLE001 - no GPU: the record still says where it ran
        return platform.node()


def run(root: str = "/tmp/rlc-tiny", out: str | None = None, steps: int = 150, resume_steps: int = 3,
        timeout_s: int = 420, overrides: dict | None = None) -> dict:
    from rlc.runtime.metrics import read_metrics  # noqa: PLC0415
    from rlc.runtime.toy_model import build_toy_workspace  # noqa: PLC0415

    clock = Timer()
    for sub in ("ckpt", "logs"):
        shutil.rmtree(Path(root) / sub, ignore_errors=True)
    build_toy_workspace(root)
    cfg = tiny_cfg_dict(root, **{"grpo.max_steps": steps, **(overrides or {})})
    yaml1 = write_yaml(cfg, Path(root) / "runtime.yaml")
    res: dict = {"command": " ".join(["python", *sys.argv]), "machine": _machine(),
                 "goal": {"reward": GOAL_REWARD, "gen_kl": GOAL_GEN_KL, "steps": steps}, "overrides": overrides or {}}
    res["rc"] = _run_driver(yaml1, timeout_s)
    res["train_wall_s"] = clock()
    metrics_path = Path(root) / "logs" / "metrics.jsonl"
    records = read_metrics(metrics_path) if metrics_path.exists() else []
    res["summary"] = summarize(records, steps)
    if resume_steps and res["rc"] == 0:
        cfg2 = tiny_cfg_dict(root, **{"grpo.max_steps": steps + resume_steps, **(overrides or {})})
        yaml2 = write_yaml(cfg2, Path(root) / "runtime_resume.yaml")
        t = Timer()
        res["resume_rc"] = _run_driver(yaml2, 150)
        res["resume_wall_s"] = t()
        records = read_metrics(metrics_path)
        after = [r for r in records if r.get("step", 0) > steps and "reward/mean" in r]
        res["resume"] = {"steps": [r["step"] for r in after],
                         "reward": [round(float(r["reward/mean"]), 4) for r in after]}
    s = res["summary"]
    res["passed"] = bool(
        res["rc"] == 0
        and s["step_10mean_reached_goal"] is not None
        and s["gen_kl_max"] is not None and s["gen_kl_max"] <= GOAL_GEN_KL
        and s["refits_logged"] == s["steps_logged"]
    )
    if resume_steps:  # the restart must resume: exit 0, the next steps, rewards of the trained policy
        resume = res.get("resume", {})
        res["resume_passed"], res["resume_reasons"] = resume_verdict(
            res.get("resume_rc"), resume.get("steps", []), resume.get("reward", []), steps=steps,
            resume_steps=resume_steps)
        res["passed"] = res["passed"] and res["resume_passed"]
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "calibration.jsonl"):
            src = Path(root) / "logs" / name
            if src.exists():
                shutil.copy(src, Path(out) / f"grpo_{name}")
        try:
            from tests.gpu.plot_rewards import plot  # noqa: PLC0415

            plot(
                metrics_path,
                Path(out) / "grpo_reward_curve.png",
                title=f"tiny Qwen3 GRPO, toy a+b mod 10 ({steps} steps)",
            )
        except Exception as exc:
            res["plot_error"] = repr(exc)[:300]
    res["elapsed_s"] = clock()
    dump(res, out, "grpo_learning")
    return res


@pytest.mark.gpu
def test_grpo_learns_toy_task(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    res = run(str(tmp_path / "tiny"), steps=150)
    s = res["summary"]
    assert res["rc"] == 0
    assert res["resume_passed"], res["resume_reasons"]
    assert s["step_10mean_reached_goal"] is not None, s
    assert s["gen_kl_max"] <= GOAL_GEN_KL, s


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/rlc-tiny")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--resume-steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=420)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted runtime.yaml override (YAML value), e.g. training.use_precision_aware_optimizer=true")
    ap.add_argument("--smoke", action="store_true",
                    help="pass when the steps ran with a refit each (no learning goal): for short option checks")
    a = ap.parse_args()
    import yaml  # noqa: PLC0415

    sets = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in a.set)}
    r = run(a.root, a.out, a.steps, a.resume_steps, a.timeout, overrides=sets)
    if a.smoke:  # the record says which verdict judged it
        ok, why = smoke_verdict(r, a.steps, sets)
        r.update(verdict="smoke", passed=ok, reasons=why)
        dump(r, a.out, "grpo_learning")
        print("smoke:", "passed" if ok else "; ".join(why), "| memory used (GiB, mean):",
              r["summary"]["memory_used_gib_mean"], flush=True)
        sys.exit(0 if ok else 1)
    sys.exit(0 if r.get("passed") else 1)
