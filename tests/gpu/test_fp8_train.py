"""GPU check: FP8 training through Megatron / Transformer Engine (``training.fp8``, blockwise by default).

1. ``smoke``: the tiny GRPO run from a compiled bundle (``rlc/recipes/tiny-qwen3-1gpu.yaml --set
   training.fp8.enabled=true``) for ``--steps`` steps: every step trains in FP8 and refits (the exporter hands
   bf16 to the refit), the run exits 0. ``--param-gather`` adds ``training.fp8.param_gather`` (FP8 primary
   weights; Megatron-Bridge's export dequantizes them).
2. ``step``: a real-shape train step (``--model``, default Qwen3-0.6B from the model catalog, random weights
   built from its ``config.json``) with the runtime's own policy worker (distributed optimizer, fp32 gradient
   buffers as the recipe resolves them), one logprob pass and one GRPO train step on random tokens, FP8 and
   then bf16; the GPU memory after the step (parameters, gradients, optimizer state) and its peak are reported
   next to the planner's train-phase figures for the same recipe.

Passes when the smoke run exits 0 with a refit every step and both train steps finish with a finite loss and
gradient norm. Writes ``<out>/fp8_train.json`` (command, machine, the smoke summary, both steps' memory and the
plan's).

    python tests/gpu/test_fp8_train.py [--recipe blockwise] [--steps 8] [--model Qwen/Qwen3-0.6B] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from rlc.compiler.planner.parts import FP8_WEIGHTS_LABEL
from tests.gpu.common import Timer, dump, gpu_available

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

RECIPE = REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml"
PLAN_ITEMS = ("Megatron params", "Megatron grads", "optimizer fp32 master", "optimizer Adam moments", FP8_WEIGHTS_LABEL)
SEQ, MICRO, GLOBAL = 1024, 4, 8


# ------------------------------------------------------------------ 1. the tiny GRPO smoke run


def smoke(root: Path, out: str | None, recipe: str, steps: int, param_gather: bool, timeout_s: int) -> dict:
    from tests.gpu.test_fp8_grpo import compile_bundle, run_bundle, workspace  # noqa: PLC0415
    from tests.gpu.test_grpo_learning import summarize  # noqa: PLC0415

    shutil.rmtree(root, ignore_errors=True)
    ws = workspace(root / "ws", "tensor")
    sets = ["training.fp8.enabled=true", f"training.fp8.recipe={recipe}", f"grpo.max_steps={steps}",
            "grpo.max_gen_kl=0.5"]
    if param_gather:
        sets.append("training.fp8.param_gather=true")
    bundle, used = compile_bundle(root, ws, sets)
    got = run_bundle(bundle, timeout_s)
    s = summarize(got["metrics"], steps)
    reasons = []
    if got["rc"] != 0:
        reasons.append(f"driver exit {got['rc']}")
    if s["steps_logged"] != steps or s["refits_logged"] != steps:
        reasons.append(f"{s['steps_logged']} steps and {s['refits_logged']} refits logged of {steps}")
    fp8_log = [line for line in got["log_tail"] if "fp8" in line.lower()][:5]
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        src = Path(got["logs"]) / "metrics.jsonl"
        if src.exists():
            shutil.copy(src, Path(out) / "fp8_train_smoke_metrics.jsonl")
    return {"sets": used, "rc": got["rc"], "seconds": got["seconds"], "summary": s, "passed": not reasons,
            "reasons": reasons, "log_tail": got["log_tail"] if reasons else got["log_tail"][-5:], "fp8_lines": fp8_log}


# ------------------------------------------------------------------ 2. a real-shape train step


def probe_recipe(model_id: str, checkpoint: str, fp8: bool, recipe: str, root: Path) -> tuple[dict, dict]:
    """The runtime config and the plan's train-phase items of a one-GPU recipe training ``model_id``."""
    import yaml  # noqa: PLC0415

    from rlc.compiler import api  # noqa: PLC0415
    from rlc.compiler.resolve import to_runtime_config  # noqa: PLC0415

    r = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    r["name"] = "fp8-train-probe"
    r["model"] = {"id": model_id, "checkpoint": checkpoint, "dtype": "bfloat16"}
    r["training"].update(micro_batch_size=MICRO, global_batch_size=GLOBAL, max_sequence_length=SEQ,
                         fp8={"enabled": fp8, "recipe": recipe})
    r["grpo"].update(prompts_per_step=1, generations_per_prompt=GLOBAL, max_steps=1)
    r["generation"]["max_model_len"] = SEQ
    r["generation"]["sampling"]["max_tokens"] = SEQ // 2
    r["data"].update(max_prompt_length=SEQ // 2, train=str(root / "train.jsonl"))
    for key in ("log_dir",):
        r["cluster"][key] = str(root / "logs")
    r["logging"]["dir"] = str(root / "logs")
    r["checkpointing"]["dir"] = str(root / "ckpt")
    path = root / f"probe-{'fp8' if fp8 else 'bf16'}.yaml"
    path.write_text(yaml.safe_dump(r), encoding="utf-8")
    result = api.check(str(path), [])
    if not result.ok:
        raise RuntimeError(f"probe recipe: {[(d.rule, d.message) for d in result.errors]}")
    items = {i.label: i.gib for i in result.plan.phases["train"].items if i.label in PLAN_ITEMS}
    return to_runtime_config(result), {"items_gib": items, "megatron_gib": sum(v or 0.0 for v in items.values()),
                                       "train_used_gib": result.plan.phases["train"].used_gib}


def _probe_class() -> Any:
    from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker  # noqa: PLC0415

    class Fp8TrainProbe(MegatronPolicyWorker):
        """The runtime's policy worker with random weights from a bare ``config.json`` (no checkpoint)."""

        def __init__(self, cfg_dict: dict, model_dir: str) -> None:
            super().__init__(cfg_dict, 0, 1, 0)
            self.model_dir = model_dir

        def setup_random(self, master: tuple[str, int]) -> dict:
            import torch  # noqa: PLC0415
            from megatron.bridge import AutoBridge  # noqa: PLC0415
            from megatron.core import parallel_state as ps  # noqa: PLC0415
            from transformers import AutoConfig  # noqa: PLC0415

            from benchmarks import refit_at_scale as R  # noqa: PLC0415

            from rlc.runtime.policy.megatron_setup import build_policy, init_distributed, init_model_parallel  # noqa: PLC0415

            t0 = time.perf_counter()
            init_distributed(0, 1, master[0], master[1])
            init_model_parallel(self.cfg.train_parallel, self.cfg.training.seed)
            torch.manual_seed(self.cfg.training.seed)
            bridge = AutoBridge.from_hf_config(AutoConfig.from_pretrained(self.model_dir))
            R._plan_tasks_from_config(bridge)
            self._pm = build_policy(self.cfg, bridge=bridge)
            self.coords = {"rank": 0, "dp_rank": ps.get_data_parallel_rank(), "dp_size": 1, "tp_rank": 0,
                           "pp_rank": 0, "is_last_stage": True, "is_output": True}
            torch.cuda.synchronize()
            return {
                "setup_s": time.perf_counter() - t0,
                "allocated_gib": torch.cuda.memory_allocated() / 2**30,
                "fp8": getattr(self._pm.provider, "fp8", None),
                "fp8_recipe": getattr(self._pm.provider, "fp8_recipe", None),
            }

        def step_random(self, vocab: int) -> dict:
            import torch  # noqa: PLC0415

            from rlc.runtime.policy.batches import pack_rollouts  # noqa: PLC0415

            g = torch.Generator().manual_seed(0)
            n, prompt = GLOBAL, SEQ // 2
            prompts = [torch.randint(100, vocab - 100, (prompt,), generator=g).tolist() for _ in range(n)]
            responses = [torch.randint(100, vocab - 100, (SEQ - prompt,), generator=g).tolist() for _ in range(n)]
            batch = pack_rollouts(prompts, responses, [[-1.0] * len(r) for r in responses],
                                  [float(x) for x in torch.randn(n, generator=g)], pad_id=0, max_length=SEQ)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            old = self.compute_logprobs(batch)
            batch = dataclasses.replace(batch, old_logprobs=old, gen_logprobs=old.clone())
            out = self.train_step(batch, 1)
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            return {"seconds": time.perf_counter() - t0, "tokens": int(batch.tokens.numel()),
                    "loss": dict(out.loss_sums) if out is not None else {},
                    "grad_norm": out.grad_norm if out is not None else None,
                    "allocated_after_gib": torch.cuda.memory_allocated() / 2**30,
                    "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "reserved_gib": torch.cuda.memory_reserved() / 2**30,
                    "device_used_gib": (total - free) / 2**30}

    return Fp8TrainProbe


def train_step(model_id: str, recipe: str, root: Path) -> dict:
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group, remove_placement_group  # noqa: PLC0415

    from rlc.compiler.catalog.models import catalog_config  # noqa: PLC0415
    from rlc.contract.runtime_config import runtime_config_from_dict  # noqa: PLC0415
    from rlc.runtime.workers import spawn, worker_env  # noqa: PLC0415

    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / model_id.replace("/", "__")
    model_dir.mkdir(parents=True, exist_ok=True)
    hf = {k: v for k, v in catalog_config(model_id).items() if not k.startswith("_")}
    (model_dir / "config.json").write_text(json.dumps(hf, indent=1), encoding="utf-8")
    (root / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n', encoding="utf-8")
    out: dict[str, Any] = {"model": model_id, "seq": SEQ, "micro_batch": MICRO, "global_batch": GLOBAL}
    for mode in ("fp8", "bf16"):
        cfg_dict, plan = probe_recipe(model_id, str(model_dir), mode == "fp8", recipe, root)
        env = worker_env(runtime_config_from_dict(cfg_dict))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        got: dict[str, Any] = {"plan": plan, "training_fp8": cfg_dict["training"]["fp8"]}
        out[mode] = got
        ray.init(address="local", num_gpus=1, runtime_env={"env_vars": env}, include_dashboard=False)
        pg = placement_group([{"GPU": 1.0, "CPU": 4.0}], strategy="PACK")
        actor = None
        try:
            ray.get(pg.ready(), timeout=300)
            actor = spawn(_probe_class(), pg=pg, bundle=0, num_gpus=1.0, env=env, name=f"fp8-probe-{mode}",
                          args=(cfg_dict, str(model_dir)))
            master = ray.get(actor.master_address.remote(), timeout=60)
            got["setup"] = ray.get(actor.setup_random.remote(tuple(master)), timeout=400)
            got["step"] = ray.get(actor.step_random.remote(int(hf["vocab_size"])), timeout=400)
            step = got["step"]
            got["measured_over_plan"] = (
                step["allocated_after_gib"] / plan["megatron_gib"] if plan["megatron_gib"] else None
            )
        except Exception as exc:  # noqa: BLE001 - the record says what broke
            got["error"] = f"{type(exc).__name__}: {str(exc)[-3000:]}"
        finally:
            if actor is not None:
                ray.kill(actor)
            remove_placement_group(pg)
            ray.shutdown()
    reasons = []
    for mode in ("fp8", "bf16"):
        step = out[mode].get("step") or {}
        finite = step and all(math.isfinite(float(v)) for v in step.get("loss", {}).values()) and \
            step.get("grad_norm") is not None and math.isfinite(float(step["grad_norm"]))
        if "error" in out[mode] or not finite:
            reasons.append(f"{mode} train step: {out[mode].get('error', step)}"[:600])
    out["passed"], out["reasons"] = not reasons, reasons
    return out


# ------------------------------------------------------------------ the check


def run(out: str | None, recipe: str, steps: int, model: str, param_gather: bool, only: list[str], root: str,
        timeout_s: int) -> dict:
    clock = Timer()
    from tests.gpu.test_fp8_grpo import machine  # noqa: PLC0415

    res: dict[str, Any] = {"check": f"FP8 training ({recipe}) through Megatron / Transformer Engine",
                           "command": " ".join(["python", "tests/gpu/test_fp8_train.py", *sys.argv[1:]]),
                           "machine": machine(), "recipe": recipe}
    rootp = Path(root)
    passed = True
    if "smoke" in only:
        try:
            res["smoke"] = smoke(rootp / "smoke", out, recipe, steps, param_gather, timeout_s)
        except Exception:  # noqa: BLE001
            res["smoke"] = {"passed": False, "error": traceback.format_exc()[-3000:]}
        passed &= bool(res["smoke"].get("passed"))
        dump(res, out, "fp8_train")
    if "step" in only:
        try:
            res["step"] = train_step(model, recipe, rootp / "step")
        except Exception:  # noqa: BLE001
            res["step"] = {"passed": False, "error": traceback.format_exc()[-3000:]}
        passed &= bool(res["step"].get("passed"))
    res["passed"] = passed
    res["seconds"] = clock()
    dump(res, out, "fp8_train")
    return res


@pytest.mark.gpu
def test_fp8_training_runs_the_tiny_grpo_smoke_and_a_real_shape_step(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    res = run(None, "blockwise", 6, "Qwen/Qwen3-0.6B", False, ["smoke", "step"], str(tmp_path), 300)
    assert res["passed"], res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("blockwise", "tensorwise", "delayed"), default="blockwise")
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps of the smoke run")
    ap.add_argument("--model", default="Qwen/Qwen3-0.6B", help="catalog model of the real-shape train step")
    ap.add_argument("--param-gather", action="store_true", help="training.fp8.param_gather in the smoke run")
    ap.add_argument("--only", default="smoke,step")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "rlc-fp8-train"))
    ap.add_argument("--timeout", type=int, default=240, help="seconds for the smoke run's driver")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    r = run(a.out, a.recipe, a.steps, a.model, a.param_gather, a.only.split(","), a.root, a.timeout)
    print("fp8_train:", "passed" if r["passed"] else "FAILED", flush=True)
    sys.exit(0 if r["passed"] else 1)
