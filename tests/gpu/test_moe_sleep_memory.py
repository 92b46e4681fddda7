"""GPU measurement: what vLLM keeps on the GPU after sleep level 1 and 2, eager on and off, on the tiny MoE.

The engine is the one the shipped recipe ``tiny-moe-mtp-2gpu-ep2`` compiles to (a tiny DeepSeek-V3: 8 routed
experts + 1 shared, fp32 router bias, one MTP layer; one vLLM engine per GPU), taken from the compiled
bundle's ``runtime.yaml`` and started alone on GPU 0 with the runtime's own ``VllmGenerationWorker`` — the
same method as the dense sleep-level table in ``docs/gpu-results.md``, so the two sit side by side. For
``enforce_eager`` true and false: start -> ``sleep(1)`` -> ``wake_up()`` -> ``sleep(2)`` -> ``wake_up()``.
Every snapshot is written as a calibration record (``rlc.contract.calibration_record``: phases
``vllm_started``, ``after_sleep``, ``after_wake``) to ``<out>/moe_sleep_calibration.jsonl``, which
``rlc calibrate`` reads; the table and the verdict go to ``<out>/moe_sleep_memory.json``.

Residue is "used after sleep" minus "used before the engine started" (device-wide, so it includes the
engine process's CUDA context). The verdict passes when all four settings were measured, every record
is valid, and each sleep gave back at least ``MIN_FREED_SHARE`` of what the engine held awake (a sleep
that frees almost nothing is a broken sleep mode, not a measurement).

    python tests/gpu/test_moe_sleep_memory.py [--root /tmp/rlc-moe-sleep] [--out DIR]   # one GPU is enough
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from pathlib import Path

import pytest

from tests.gpu.common import Timer, dump, gpu_available
from tests.gpu.test_four_gpu_grpo import _env
from tests.gpu.test_moe_two_gpu import EP2, RECIPES, Lab

REPO = Path(__file__).resolve().parents[2]
RECIPE = RECIPES / f"{EP2}.yaml"
GPU_TYPE = "h200-141gb"
MIN_FREED_SHARE = 0.5  # of (used awake - used before start) that a sleep must give back


def compile_runtime_config(root: Path) -> dict:
    """``rlc compile`` the shipped EP=2 recipe with this probe's folders (the two-GPU proofs' own
    workspace and compile step); the bundle's runtime.yaml as a dict."""
    import yaml  # noqa: PLC0415

    lab = Lab(str(root))
    lab.workspace()
    bundle = lab.compile(EP2, "moe-sleep")
    return yaml.safe_load((bundle / "runtime.yaml").read_text(encoding="utf-8"))


def _wait_idle(threshold_gib: float = 2.0, timeout_s: float = 120.0) -> float:
    """Device-wide used GiB once the previous engine's process has given its memory back."""
    import torch  # noqa: PLC0415

    t0 = time.monotonic()
    while True:
        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 2**30
        if used < threshold_gib or time.monotonic() - t0 > timeout_s:
            return used
        time.sleep(1.0)


def probe(cfg_dict: dict, enforce_eager: bool, pg, env: dict) -> list:
    """One engine: the calibration records of its start, both sleeps and both wake-ups."""
    import ray  # noqa: PLC0415

    from rlc.contract.calibration_record import CalibrationRecord  # noqa: PLC0415
    from rlc.runtime.generation.vllm_worker import VllmGenerationWorker  # noqa: PLC0415
    from rlc.runtime.workers import library_versions, spawn  # noqa: PLC0415

    cfg = copy.deepcopy(cfg_dict)
    cfg["generation"]["enforce_eager"] = enforce_eager
    versions = library_versions()
    gen = spawn(VllmGenerationWorker, pg=pg, bundle=0, num_gpus=0.5, env=env,
                name=f"moe-sleep-probe-{int(enforce_eager)}", args=(cfg, 0, [0]))
    records = []

    def record(phase: str, memory: dict, level: int, **extra) -> None:
        records.append(CalibrationRecord.from_memory(
            phase, memory, step=0, sleep_level=level, enforce_eager=enforce_eager, gpu_type=GPU_TYPE,
            versions=versions, worker="generation-0", extra={"probe": "vllm-alone", **extra}))

    try:
        before = ray.get(gen.memory.remote())
        started = ray.get(gen.start.remote(), timeout=600)
        record("vllm_started", started.memory.as_dict(), 0, used_before_start_gib=round(before.used_gib, 4))
        for level in (1, 2):
            slept = ray.get(gen.sleep.remote(level), timeout=300)
            record("after_sleep", slept.memory.as_dict(), level, freed_gib=round(slept.freed_gib, 4),
                   sleep_s=round(slept.seconds, 4), used_before_start_gib=round(before.used_gib, 4))
            woke = ray.get(gen.wake_up.remote(None), timeout=300)
            record("after_wake", woke.memory.as_dict(), level, wake_s=round(woke.seconds, 4))
        ray.get(gen.shutdown.remote(), timeout=120)
    finally:
        ray.kill(gen)
    return records


def summarize(records: list) -> dict:
    """One row per (eager, level): used before start, awake, after sleep, freed, residue; and the verdict."""
    rows, problems = [], []
    for eager in (True, False):
        started = [r for r in records if r.enforce_eager is eager and r.phase == "vllm_started"]
        if not started:
            problems.append(f"enforce_eager={eager}: not measured")
            continue
        base = float(started[0].extra["used_before_start_gib"])
        awake = started[0].used_gib
        for level in (1, 2):
            slept = [r for r in records if r.enforce_eager is eager and r.phase == "after_sleep"
                     and r.sleep_level == level]
            if not slept:
                problems.append(f"enforce_eager={eager} level {level}: not measured")
                continue
            s = slept[0]
            row = {"enforce_eager": eager, "sleep_level": level, "used_before_start_gib": round(base, 3),
                   "used_awake_gib": round(awake, 3), "freed_gib": round(float(s.extra["freed_gib"]), 3),
                   "free_after_sleep_gib": round(s.free_gib, 3), "used_after_sleep_gib": round(s.used_gib, 3),
                   "residue_gib": round(s.used_gib - base, 3), "sleep_s": s.extra["sleep_s"]}
            rows.append(row)
            held = awake - base
            if held > 0 and row["freed_gib"] < MIN_FREED_SHARE * held:
                problems.append(f"enforce_eager={eager} level {level}: freed {row['freed_gib']} of {held:.2f} GiB held")
    return {"rows": rows, "problems": problems, "passed": not problems and len(rows) == 4}


def run(root: str, out: str | None) -> dict:
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group, remove_placement_group  # noqa: PLC0415

    from rlc.contract.runtime_config import runtime_config_from_dict  # noqa: PLC0415
    from rlc.runtime.workers import worker_env  # noqa: PLC0415

    t = Timer()
    res: dict = {"check": "MoE sleep-level memory (vLLM alone, tiny DeepSeek-V3 of tiny-moe-mtp-2gpu-ep2)",
                 "command": "python tests/gpu/test_moe_sleep_memory.py --out DIR", "recipe": RECIPE.name}
    records: list = []
    root_p = Path(root)
    root_p.mkdir(parents=True, exist_ok=True)
    try:
        cfg_dict = compile_runtime_config(root_p)
        env = worker_env(runtime_config_from_dict(cfg_dict))
        env["PYTHONPATH"] = _env(REPO)["PYTHONPATH"]
        ray.init(address="local", num_gpus=1, runtime_env={"env_vars": env}, include_dashboard=False)
        pg = placement_group([{"GPU": 1.0, "CPU": 4.0}], strategy="PACK")
        ray.get(pg.ready(), timeout=300)
        try:
            for eager in (True, False):
                res.setdefault("idle_used_gib", []).append(round(_wait_idle(), 3))
                try:
                    records += probe(cfg_dict, eager, pg, env)
                except Exception as exc:  # keep the other setting's numbers
                    res.setdefault("errors", []).append(f"enforce_eager={eager}: {type(exc).__name__}: {exc}"[:2000])
                    print(traceback.format_exc(), flush=True)
        finally:
            remove_placement_group(pg)
            ray.shutdown()
    except Exception as exc:
        res.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}"[:3000])
        print(traceback.format_exc(), flush=True)
    res.update(summarize(records))
    if res.get("errors"):
        res["passed"] = False
    res["records"] = [r.to_dict() for r in records]
    res["seconds"] = t()
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "moe_sleep_calibration.jsonl").write_text("".join(r.to_json() + "\n" for r in records),
                                                                  encoding="utf-8")
    dump(res, out, "moe_sleep_memory")
    print(f"{'eager':>6} {'level':>5} {'awake':>7} {'freed':>7} {'after':>7} {'residue':>8}")
    for row in res["rows"]:
        print(f"{str(row['enforce_eager']):>6} {row['sleep_level']:>5} {row['used_awake_gib']:>7} "
              f"{row['freed_gib']:>7} {row['used_after_sleep_gib']:>7} {row['residue_gib']:>8}")
    print("passed:", res["passed"], res.get("problems"), res.get("errors"), flush=True)
    return res


def test_moe_sleep_memory(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    assert run(str(tmp_path), str(tmp_path))["passed"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/rlc-moe-sleep")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.exit(0 if run(a.root, a.out)["passed"] else 1)
