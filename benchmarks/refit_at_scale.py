"""Refit at model scale: Qwen3-30B-A3B on two GPUs and Qwen3-8B on one, random weights, colocated.

    python benchmarks/refit_at_scale.py --out DIR [--cases engine,dense-8b,moe-ep2,moe-tp2]
                                        [--tiny-metrics metrics.jsonl] [--refits 10] [--check]
                                        [--fused-transfer] [--keep-buffers-gb GIB]
    python benchmarks/refit_at_scale.py --dry-run      # CPU: the plan (memory budget, spot checks)
    python benchmarks/refit_at_scale.py --docs-rows DIR/refit_at_scale.json   # rows for docs/refit.md
    python benchmarks/refit_at_scale.py --report DIR/refit_at_scale.json      # the report again

Nothing is downloaded. Each model is built from its HF ``config.json`` (``benchmarks/models/``):
the trainer by Megatron-Bridge (``AutoBridge.from_hf_config`` + ``to_megatron_provider(load_weights
=False)``: random initialisation, bf16, no optimizer, no gradient buffers), vLLM with
``load_format="dummy"``. Both run as Ray actors sharing every GPU, the way the runtime colocates
them, and every refit goes through the runtime's own pieces: ``RefitSource`` (Bridge export ->
``RefitProducer``) on each trainer rank and the vLLM worker extension's ``RefitConsumer``.

``--step-gap-s S`` waits S seconds between a refit's sleep and the next refit (the rest of a GRPO step); by
default refits run back to back, which wakes vLLM's KV cache right after it slept.

Cases:
  engine    ``refit_bandwidth.py --backend cuda_ipc --gib 2``: the engine alone vs a same-run
            device-to-device copy (goal: ratio >= 0.4).
  engine-zero-copy
            the same with ``--zero-copy``: the consumer reads every tensor in place (one copy; no goal).
  dense-8b  Qwen3-8B, one GPU, trainer TP=1, vLLM TP=1.
  moe-1gpu  Qwen3-30B-A3B, one GPU, trainer TP=1, vLLM TP=1 (all 61 GB through one producer/consumer).
  dense-8b-awake, moe-1gpu-awake
            the same with ``refit.keep_weights_awake``: only vLLM's KV cache sleeps, the weights stay
            mapped and the refit writes into them (no ``wake_up(["weights"])``).
  dense-8b-direct, moe-1gpu-direct
            the awake cases with ``refit.direct_export`` (the trainer's parameters exported as views or one row
            gather where Bridge's conversion only renames, slices or reorders rows) and ``refit.replay_load``
            (vLLM's first load recorded as copies, replayed at every later refit); a full ``verify_every``
            comparison after the spot checks. ``dense-8b-export`` / ``dense-8b-replay``: one of the two.
  dense-8b-zero-copy, moe-1gpu-zero-copy
            the ``-direct`` cases with ``refit.zero_copy_views`` (vLLM reads the direct export's views where the
            trainer holds them: one copy instead of two, no one-off buffers), then the same full comparison.
  dense-8b-overlap
            ``dense-8b-zero-copy`` with ``refit.wake_kv_during_transfer`` (vLLM maps its KV cache back while the
            weights arrive: the wake-up row is then inside the transfer).
  moe-1gpu-zero-copy-experts
            ``moe-1gpu-zero-copy`` with ``refit.zero_copy_experts``: the stacked experts read in place too, expert
            by expert (one copy of their bytes instead of two).
  dense-8b-resident, moe-1gpu-resident
            the ``-zero-copy`` cases with ``refit.keep_kv_cache_awake``: vLLM never sleeps (no KV wake-up or
            sleep; the KV cache holds its memory through the refit, which the memory budget counts).
  moe-ep2   Qwen3-30B-A3B, two GPUs, trainer EP=2, vLLM TP=2.
  moe-tp2   the same vLLM engine, trainer TP=2 (experts ETP=2).
  tiny      refit + sleep as a fraction of the step of a GRPO run (``--tiny-metrics``; goal <= 15 %).

Goals (``--check``): every 30B-A3B case median total refit <= 0.5 s and slowest <= 1.0 s, dense-8b median
<= 0.05 s, engine >= 0.4 of the copy. ``--fused-transfer`` runs the GPU cases with ``refit.fused_transfer``
(each MoE layer's experts as two stacked tensors, copied straight into vLLM's fused parameters) and, after the
spot checks, a full ``refit.verify_every`` comparison of every vLLM parameter with vLLM's own load of the
per-expert export.

Each measured cycle: negate the trainer's weights (so every refit moves new values) ->
``wake_up(["weights"])`` -> refit (all trainer ranks and the vLLM workers at once) ->
``wake_up(["kv_cache"])`` -> reset the prefix cache -> ``sleep(level=2)`` (``*-awake``: ``sleep_kv_cache()``,
and no weight wake-up; ``*-resident``: nothing sleeps); the total refit is the wake-ups, the transfer and the reset;
one warm-up and ``--refits`` measured cycles.
After the last refit, a few exported HF tensors (experts on both EP ranks, router, attention, norms,
embedding, LM head) are reloaded through vLLM's own ``load_weights`` on each GPU and the parameters
they land in are compared bit for bit with their values after the refit.

Output: a table on stdout and ``refit_at_scale.json`` / ``refit_at_scale.txt`` in ``--out`` (the
JSON is rewritten after every case, so a timeout keeps what finished). ``--check`` exits 1 when a
case failed, a measured goal is missed, or nothing was measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))  # the checkout's rlc/ and this folder's package, installed or not

from benchmarks import refit_scale_plan as P  # noqa: E402

from rlc.runtime.gc_heap import freeze_heap  # noqa: E402
from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402

TINY_RUNTIME_YAML = REPO / "tests" / "gpu" / "tiny_runtime.yaml"
GPU_CASES = ("dense-8b", "dense-8b-awake", "dense-8b-direct", "dense-8b-export", "dense-8b-replay",
             "dense-8b-zero-copy", "dense-8b-overlap", "dense-8b-resident", "moe-1gpu", "moe-1gpu-awake",
             "moe-1gpu-direct", "moe-1gpu-zero-copy", "moe-1gpu-zero-copy-experts", "moe-1gpu-resident", "moe-ep2",
             "moe-tp2")
ALL_CASES = ("engine", "engine-zero-copy", *GPU_CASES, "tiny")
DEFAULT_CASES = "engine,dense-8b,moe-ep2,moe-tp2"
H200_GIB = 139.8  # torch's total for an H200 141 GB, used when nvidia-smi cannot be asked
ENGINE_OVERRIDES = {"load_format": "dummy", "skip_tokenizer_init": True}


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "refit_at_scale_out",
                    help="folder for refit_at_scale.json / .txt (default: $OUT, else ./refit_at_scale_out)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma list of {', '.join(ALL_CASES)}")
    ap.add_argument("--refits", type=int, default=10, help="measured refits per case (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--buffer-gb", type=float, default=2.0, help="refit.buffer_gb: both ping-pong halves, GiB")
    ap.add_argument("--fused-transfer", action="store_true",
                    help="refit.fused_transfer: on (stacked experts, direct copies into vLLM's fused parameters)")
    ap.add_argument("--keep-buffers-gb", type=float, default=None,
                    help="refit.keep_buffers_gb (default: --buffer-gb, so the halves are kept across refits)")
    ap.add_argument("--moe-vllm-util", type=float, default=0.4, help="vLLM gpu_memory_utilization, 30B-A3B")
    ap.add_argument("--moe-1gpu-vllm-util", type=float, default=0.48,
                    help="vLLM gpu_memory_utilization, 30B-A3B on one GPU")
    ap.add_argument("--dense-vllm-util", type=float, default=0.3, help="vLLM gpu_memory_utilization, 8B")
    ap.add_argument("--step-gap-s", type=float, default=0.0,
                    help="seconds between a refit's sleep and the next refit, standing for the logprob pass and the "
                         "train step of a GRPO step (0: refits back to back, the KV cache woken right after it slept)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--engine-gib", type=float, default=2.0, help="size of the engine-only case")
    ap.add_argument("--tiny-metrics", default=None, help="metrics.jsonl of a tiny GRPO run (adds the tiny case)")
    ap.add_argument(
        "--gpu-memory-gib", type=float, default=None, help="GPU memory for the budget (default: nvidia-smi)"
    )
    ap.add_argument("--timeout-s", type=float, default=180.0, help="refit protocol timeout (dead peer -> error)")
    ap.add_argument("--root", default="/tmp/rlc-refit-scale", help="scratch folder (model configs, logs)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every measured goal is met")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (budgets, spot checks) and stop")
    ap.add_argument("--docs-rows", metavar="JSON", default=None,
                    help="print docs/refit.md's result rows from a run's refit_at_scale.json and stop")
    ap.add_argument("--report", metavar="JSON", default=None,
                    help="print the report of a run's refit_at_scale.json again (this version's rendering) and stop")
    a = ap.parse_args(argv)
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in ALL_CASES]
    if unknown:
        ap.error(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(ALL_CASES)}")
    if a.tiny_metrics and "tiny" not in cases:
        cases.append("tiny")
    if "tiny" in cases and not a.tiny_metrics:
        ap.error("--cases tiny needs --tiny-metrics PATH (the metrics.jsonl of a GRPO run)")
    if a.refits < 1 or a.warmup < 0:
        ap.error(f"--refits must be >= 1 and --warmup >= 0 (got {a.refits}, {a.warmup})")
    if a.engine_gib <= 0 or a.buffer_gb <= 0:
        ap.error("--engine-gib and --buffer-gb must be > 0")
    if a.keep_buffers_gb is None:
        a.keep_buffers_gb = a.buffer_gb
    if a.keep_buffers_gb < 0:
        ap.error("--keep-buffers-gb must be >= 0")
    a.case_list = cases
    return a


def layouts_for(a: argparse.Namespace) -> list[P.Layout]:
    """The GPU cases asked for, in run order (the dense case first: one GPU, quickest to fail)."""
    all_layouts = P.default_layouts(moe_util=a.moe_vllm_util, dense_util=a.dense_vllm_util, buffer_gb=a.buffer_gb,
                                     moe_one_gpu_util=a.moe_1gpu_vllm_util)
    return [all_layouts[n] for n in GPU_CASES if n in a.case_list]


def gpu_memory_bytes(a: argparse.Namespace) -> int:
    if a.gpu_memory_gib:
        return int(a.gpu_memory_gib * P.GIB)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        mib = float(out.split()[0])
        return int(mib * (1 << 20) * 0.994)  # the driver reserves ~0.6 %: torch's total is a bit lower
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return int(H200_GIB * P.GIB)


def plan(a: argparse.Namespace) -> dict[str, Any]:
    """Budgets and spot checks of every GPU case (pure; printed by --dry-run and before a run)."""
    gpu = gpu_memory_bytes(a)
    plans = {}
    for lay in layouts_for(a):
        cfg = P.load_hf_config(lay.model)
        mb = P.model_bytes(cfg)
        budget = P.memory_budget(mb, lay, gpu)
        checks, notes = P.spot_checks(cfg)
        plans[lay.name] = {"layout": lay, "model_bytes": mb, "budget": budget, "checks": checks, "notes": notes}
    return plans


def plan_to_json(plans: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {
            "layout": vars(p["layout"]) | {"describe": p["layout"].describe()},
            "model_bytes": p["model_bytes"].to_dict(),
            "budget": p["budget"].to_dict(),
            "spot_checks": [vars(c) for c in p["checks"]],
            "notes": p["notes"],
        }
        for name, p in plans.items()
    }


# --------------------------------------------------------------------------- the GPU side (Ray actors)


def _plan_tasks_from_config(bridge: Any) -> None:
    """Let a bridge built from a bare HF config plan its conversion tasks.

    ``AutoBridge.get_conversion_tasks`` wants a checkpoint path when the bridge holds only a config
    (it reads the checkpoint's key order), but the model bridge underneath plans from a config alone
    (Megatron-Bridge 0.6: ``build_conversion_tasks`` accepts a ``PretrainedConfig``). The benchmark has no
    checkpoint, so the bridge plans from its config: the task list is the one a checkpoint of the same
    architecture gives, in the model's own parameter order.
    """
    import types  # noqa: PLC0415

    def get_conversion_tasks(self: Any, megatron_model: Any, hf_path: Any = None) -> Any:
        models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
        return self._model_bridge.build_conversion_tasks(self.hf_pretrained, models)

    bridge.get_conversion_tasks = types.MethodType(get_conversion_tasks, bridge)


class RandomInitTrainer(MegatronPolicyWorker):
    """A Megatron policy rank built from an HF config with random weights; no optimizer, no DDP."""

    def __init__(self, cfg_dict: dict, rank: int, world_size: int, bundle: int, model_dir: str) -> None:
        super().__init__(cfg_dict, rank, world_size, bundle)
        self.model_dir = model_dir

    def setup(self, master: tuple[str, int], total_opt_steps: int = 1) -> dict:
        import torch  # noqa: PLC0415
        from megatron.bridge import AutoBridge  # noqa: PLC0415
        from megatron.core import parallel_state as ps  # noqa: PLC0415
        from transformers import AutoConfig  # noqa: PLC0415

        from rlc.runtime.policy.megatron_setup import (  # noqa: PLC0415
            PolicyModel,
            init_distributed,
            init_model_parallel,
            make_provider,
        )

        t0 = time.perf_counter()
        init_distributed(self.rank, self.world_size, master[0], master[1])
        init_model_parallel(self.cfg.train_parallel, self.cfg.training.seed)
        torch.manual_seed(self.cfg.training.seed)
        bridge = AutoBridge.from_hf_config(AutoConfig.from_pretrained(self.model_dir))
        _plan_tasks_from_config(bridge)
        provider = make_provider(bridge, self.cfg, load_weights=False)
        model = provider.provide_distributed_model(wrap_with_ddp=False, bf16=True, fp16=False)
        for chunk in model:
            chunk.eval()
        self._pm = PolicyModel(bridge=bridge, provider=provider, model=model, optimizer=None, ddp_config=None)
        torch.cuda.synchronize()
        params = [p for m in model for p in m.parameters()]
        frozen = freeze_heap()  # as the runtime's policy worker does once it is set up
        return {
            "rank": self.rank,
            "dp_rank": ps.get_data_parallel_rank(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "params_local": int(sum(p.numel() for p in params)),
            "bytes_local": int(sum(p.numel() * p.element_size() for p in params)),
            "setup_s": time.perf_counter() - t0,
            "memory": self.memory().as_dict(),
            "gpu_uuid": self.info().gpu_uuid,
            "gc_frozen_objects": frozen,
        }


def _negate_weights(worker: Any) -> float:
    """Flip the sign of every trainer weight (exact in bf16): each refit then moves new values."""
    import torch  # noqa: PLC0415

    t0 = time.perf_counter()
    with torch.no_grad():
        for chunk in worker.pm.model:
            for p in chunk.parameters():
                p.neg_()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _drain(stream: Any) -> tuple[int, int]:
    """Consume an export stream: (tensors, bytes). Fused transfer yields stacked parts the producer would stack
    into its buffer; they are counted, not stacked."""
    n = nbytes = 0
    for _name, tensor in stream:
        n += 1
        nbytes += tensor.shape.numel() * tensor.dtype.itemsize
        del tensor
    return n, nbytes


def top_calls(profile: Any, limit: int = 20) -> list[dict]:
    """The ``limit`` functions of a ``cProfile.Profile`` with the most cumulative time, as JSON rows."""
    import pstats  # noqa: PLC0415

    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][3], reverse=True)[:limit]
    return [{"function": f"{os.path.basename(file)}:{line}({func})", "calls": calls, "own_s": round(own, 6),
             "cumulative_s": round(cum, 6)} for (file, line, func), (_prim, calls, own, cum, _callers) in rows]


def _export_alone(worker: Any) -> dict:
    """One Bridge export pass with nothing else (every rank at once: the export gathers), then one pass of what a
    refit sends (``RefitSource.stream``: with fused transfer, the non-expert tensors and the stacked experts),
    timed and then profiled, so that one GPU run says where the exporter's time goes."""
    import cProfile  # noqa: PLC0415

    import torch  # noqa: PLC0415

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n, nbytes = _drain(worker.source.export())
    torch.cuda.synchronize()
    out: dict[str, Any] = {"seconds": time.perf_counter() - t0, "tensors": n, "bytes": nbytes}
    t0 = time.perf_counter()
    n, nbytes = _drain(worker.source.stream())
    torch.cuda.synchronize()
    out["stream"] = {"seconds": time.perf_counter() - t0, "tensors": n, "bytes": nbytes}
    profile = cProfile.Profile()
    profile.enable()
    _drain(worker.source.stream())
    torch.cuda.synchronize()
    profile.disable()
    out["stream"]["profile_top"] = top_calls(profile)
    return out


def _vllm_uuids(gen: Any) -> list[str]:
    return gen.llm.collective_rpc("rlc_device_uuid")


def _use_layout_config(gen: Any, cfg_dict: dict) -> None:
    """The shared vLLM engine takes the layout's runtime config: its refit switches (replayed load, KV cache woken
    during the transfer) are read when the refit pairs and at every refit, not when the engine starts."""
    from rlc.contract.runtime_config import runtime_config_from_dict  # noqa: PLC0415

    gen.cfg = runtime_config_from_dict(cfg_dict)


def _wait(refs: list, what: str) -> list:
    import ray  # noqa: PLC0415

    try:
        return ray.get(refs)
    except Exception as exc:  # a Ray error wraps the worker's traceback; keep the last lines
        raise RuntimeError(f"{what} failed: {str(exc)[-3000:]}") from exc


def write_model_dir(root: Path, model: str) -> Path:
    """``root/<model>/config.json``: the HF config without provenance keys (what both engines read)."""
    d = root / model
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(P.load_hf_config(model), indent=1), encoding="utf-8")
    return d


def runtime_cfg_dict(lay: P.Layout, model_dir: Path, a: argparse.Namespace, root: Path) -> dict:
    """A runtime.yaml for the case (the tiny proof's file with the case's model, layout and refit)."""
    import yaml  # noqa: PLC0415

    d = yaml.safe_load(TINY_RUNTIME_YAML.read_text(encoding="utf-8"))
    hf = P.load_hf_config(lay.model)
    d["name"] = f"refit-scale-{lay.name}"
    d["model"].update(name=lay.model, checkpoint=str(model_dir), tokenizer=str(model_dir), dtype="bfloat16",
                      num_layers=int(hf["num_hidden_layers"]), num_experts=int(hf.get("num_experts") or 0))
    d["cluster"].update(gpus_per_node=lay.gpus, world_size=lay.gpus, log_dir=str(root / "logs"))
    d["train_parallel"].update(tp=lay.train_tp, ep=lay.train_ep, etp=lay.train_etp, dp=lay.train_dp,
                               expert_dp=lay.expert_dp)
    d["generation_parallel"].update(tp=lay.gen_tp, pp=1, ep=1, dp=lay.gpus // lay.gen_tp)
    d["generation"].update(gpu_memory_utilization=lay.vllm_util, max_model_len=a.max_model_len, enforce_eager=True)
    d["refit"].update(buffer_gb=lay.buffer_gb, buffer_memory_ratio=None, sleep_level=2,
                      offload_optimizer_for_refit=False, sync_params_before_refit=False, dedupe_mtp_embedding=False,
                      fused_transfer=bool(a.fused_transfer), keep_buffers_gb=float(a.keep_buffers_gb),
                      direct_export=lay.direct_export, replay_load=lay.replay_load,
                      zero_copy_views=lay.zero_copy_views, wake_kv_during_transfer=lay.wake_kv_during_transfer,
                      keep_weights_awake=lay.weights_awake, keep_kv_cache_awake=lay.kv_cache_awake,
                      zero_copy_experts=lay.zero_copy_experts)
    d["data"]["train_path"] = str(root / "data" / "train.jsonl")
    d["checkpointing"]["dir"] = str(root / "ckpt")
    d["logging"]["dir"] = str(root / "logs")
    return d


class GpuSession:
    """Ray, placement groups and actors of the GPU cases (one vLLM engine per model, reused by layouts)."""

    def __init__(self, a: argparse.Namespace, results: dict, save: Any) -> None:
        self.a = a
        self.results = results
        self.save = save
        self.root = Path(a.root)

    def env(self, cfg_dict: dict) -> dict:
        from rlc.contract.runtime_config import runtime_config_from_dict  # noqa: PLC0415
        from rlc.runtime.workers import worker_env  # noqa: PLC0415

        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded; fail fast instead of waiting
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        env = worker_env(runtime_config_from_dict(cfg_dict))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        return env

    def run(self, layouts: list[P.Layout], plans: dict[str, Any]) -> None:
        import ray  # noqa: PLC0415

        groups: dict[tuple, list[P.Layout]] = {}
        for lay in layouts:  # layouts of one model share its vLLM engine
            groups.setdefault((lay.model, lay.gpus, lay.gen_tp, lay.vllm_util), []).append(lay)
        try:
            for group in groups.values():
                self.run_group(group, plans)
        finally:
            if ray.is_initialized():
                ray.shutdown()

    def run_group(self, group: list[P.Layout], plans: dict[str, Any]) -> None:
        import ray  # noqa: PLC0415
        from ray.util.placement_group import placement_group, remove_placement_group  # noqa: PLC0415

        from rlc.runtime.generation.vllm_worker import VllmGenerationWorker  # noqa: PLC0415
        from rlc.runtime.workers import spawn  # noqa: PLC0415

        first = group[0]
        self.results.setdefault("gpu_release", []).append({"before " + first.model: wait_for_idle_gpus()})
        model_dir = write_model_dir(self.root, first.model)
        cfg_dict = runtime_cfg_dict(first, model_dir, self.a, self.root)
        env = self.env(cfg_dict)
        if not ray.is_initialized():
            ray.init(address="local", runtime_env={"env_vars": env}, include_dashboard=False)
        pg = placement_group([{"GPU": 1.0, "CPU": 4.0}] * first.gpus, strategy="PACK")
        ray.get(pg.ready(), timeout=300)
        gen = None
        try:
            t0 = time.perf_counter()
            gen = spawn(VllmGenerationWorker, pg=pg, bundle=0, num_gpus=0.5 if first.gen_tp == 1 else 0.0, env=env,
                        name=f"scale-gen-{first.name}-{os.getpid()}", args=(cfg_dict, 0, list(range(first.gpus))))
            started = _wait([gen.start.remote(ENGINE_OVERRIDES)], "vLLM start")[0]
            engine = {"start_s": time.perf_counter() - t0, "memory": started.memory.as_dict()}
            engine["sleep_first"] = dataclasses.asdict(_wait([gen.sleep.remote(2)], "vLLM sleep")[0])
            engine["uuids"] = _wait([gen.call.remote(_vllm_uuids)], "vLLM device uuids")[0]
            for lay in group:
                t1 = time.perf_counter()
                case: dict[str, Any] = {"describe": lay.describe(), "engine": engine}
                self.results["cases"][lay.name] = case
                try:
                    self.run_layout(lay, plans[lay.name], gen, pg, env, model_dir, case)
                except Exception as exc:
                    case["error"] = f"{type(exc).__name__}: {exc}"
                    case["traceback"] = traceback.format_exc()[-4000:]
                    self.results["errors"].append(f"{lay.name}: {case['error'][:300]}")
                    print(f"== {lay.name} FAILED: {case['error'][:2000]}", flush=True)
                case["elapsed_s"] = time.perf_counter() - t1
                self.save()
        except Exception as exc:
            for lay in group:
                case = self.results["cases"].setdefault(lay.name, {"describe": lay.describe()})
                if "summary" not in case and "error" not in case:
                    case["error"] = f"{type(exc).__name__}: {exc}"
                    case["traceback"] = traceback.format_exc()[-4000:]
                    self.results["errors"].append(f"{lay.name}: {case['error'][:300]}")
            print(f"== {first.model} engine FAILED: {exc}", flush=True)
            self.save()
        finally:
            if gen is not None:
                try:
                    ray.get(gen.shutdown.remote(), timeout=60)
                except Exception:
                    pass
                ray.kill(gen)
            remove_placement_group(pg)
            self.results.setdefault("gpu_release", []).append({first.model: wait_for_idle_gpus()})

    def run_layout(self, lay: P.Layout, plan_: dict, gen: Any, pg: Any, env: dict, model_dir: Path,
                   case: dict) -> None:
        import ray  # noqa: PLC0415

        from rlc.runtime.workers import spawn  # noqa: PLC0415

        a = self.a
        cfg_dict = runtime_cfg_dict(lay, model_dir, a, self.root)
        n = lay.gpus
        trainer_env = {**env, "CUDA_DEVICE_MAX_CONNECTIONS": env.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")}
        trainers = [spawn(RandomInitTrainer, pg=pg, bundle=r, num_gpus=0.5, env=trainer_env,
                          name=f"scale-{lay.name}-{r}-{os.getpid()}", args=(cfg_dict, r, n, r, str(model_dir)))
                    for r in range(n)]
        session = f"scale-{lay.name}-{uuid.uuid4().hex[:6]}"
        try:
            master = _wait([trainers[0].master_address.remote()], "master address")[0]
            case["setup"] = _wait([t.setup.remote(tuple(master)) for t in trainers], "trainer setup")
            if not self.results.get("versions"):
                self.results["versions"] = _wait([trainers[0].versions.remote()], "versions")[0]
            _wait([gen.call.remote(_use_layout_config, cfg_dict)], "the layout's refit config")
            prep = _wait([t.refit_prepare.remote(session, r, n, a.timeout_s) for r, t in enumerate(trainers)]
                         + [gen.refit_prepare.remote(session, a.timeout_s)], "refit prepare")
            case["prepare"] = {"producers": prep[:n], "consumers": prep[n]}
            print(f"== {lay.name}: {lay.describe()}; {prep[0]['num_tensors']} tensors, "
                  f"{prep[0]['bytes'] / 1e9:.2f} GB per trainer rank", flush=True)
            case["export_alone"] = _wait([t.call.remote(_export_alone) for t in trainers], "export alone")
            records: list[dict] = []
            case["refits"] = records  # kept if a later refit fails
            total = a.warmup + a.refits
            awake = lay.weights_awake
            if awake:  # the engine sleeps at level 2 between cases: its weights wake once, then stay
                _wait([gen.wake_up.remote(["weights"])], "wake_up(weights)")
            if lay.kv_cache_awake:  # and its KV cache, which then never sleeps
                _wait([gen.wake_up.remote(["kv_cache"])], "wake_up(kv_cache)")
            for i in range(total):
                negate = _wait([t.call.remote(_negate_weights) for t in trainers], "negate weights")
                woke_s = 0.0
                if not awake:
                    woke_s = _wait([gen.wake_up.remote(["weights"])], "wake_up(weights)")[0].seconds
                t0 = time.perf_counter()
                sent = _wait([t.refit_send.remote() for t in trainers] + [gen.refit_receive.remote()], "refit")
                transfer = time.perf_counter() - t0
                kv = _wait([gen.wake_up.remote(["kv_cache"])], "wake_up(kv_cache)")[0]  # a no-op when never asleep
                t1 = time.perf_counter()
                _wait([gen.reset_prefix_cache.remote()], "reset prefix cache")
                reset_s = time.perf_counter() - t1
                if i == total - 1:
                    case["spot_checks"] = self.spot_check(plan_, trainers, gen, case)
                    if not case["spot_checks"]["passed"]:
                        problems = "; ".join(case["spot_checks"]["problems"][:3])
                        self.results["errors"].append(f"{lay.name}: bit-exact spot checks failed: {problems}")
                    if a.fused_transfer or lay.direct_export or lay.replay_load:
                        case["verify"] = self.full_verify(lay, trainers, gen, case)
                        if not case["verify"].get("bit_exact"):
                            self.results["errors"].append(f"{lay.name}: full verify_every pass not bit-exact: "
                                                          f"{str(case['verify'])[:300]}")
                if lay.kv_cache_awake:
                    slept = _wait([gen.stay_awake.remote()], "stay_awake")[0]
                elif awake:
                    slept = _wait([gen.sleep_kv_cache.remote()], "sleep_kv_cache")[0]
                else:
                    slept = _wait([gen.sleep.remote(2)], "sleep(2)")[0]
                if a.step_gap_s > 0:  # the rest of a GRPO step before the next refit
                    time.sleep(a.step_gap_s)
                records.append({
                    "index": i, "warmup": i < a.warmup, "negate_s": max(negate), "transfer_s": transfer,
                    "wake_weights_s": woke_s, "wake_kv_s": kv.seconds, "reset_prefix_cache_s": reset_s,
                    "sleep_s": slept.seconds,
                    "free_after_wake_gib": kv.memory.free_gib, "producers": [s.raw for s in sent[:n]],
                    "consumers": sent[n],
                })
                r = P.refit_row(records[-1])
                print(f"   refit {i}{' (warm-up)' if i < a.warmup else ''}: total {r['total_refit_s']:.3f} s "
                      f"(transfer {r['transfer_s']:.3f}, export {r['export_s']:.3f}, load {r['load_weights_s']:.3f}), "
                      f"sleep {r['sleep_s']:.3f} s", flush=True)
            case["summary"] = P.summarize_refits(records, a.warmup)
        finally:
            try:
                ray.get([t.refit_close.remote() for t in trainers] + [gen.refit_close.remote()], timeout=120)
            except Exception:
                pass
            for t in trainers:
                ray.kill(t)
            if lay.weights_awake:  # back to level 2 for the next case
                try:
                    _wait([gen.wake_up.remote(["kv_cache"])], "wake_up(kv_cache)")
                    _wait([gen.sleep.remote(2)], "sleep(2)")
                except Exception:
                    pass

    def full_verify(self, lay: P.Layout, trainers: list, gen: Any, case: dict) -> dict:
        """``refit.verify_every``'s check after the last refit, as the runtime runs it: every trainer rank writes its
        export in shards while every vLLM worker compares the parameters of each shard's layers with vLLM's own
        load of it (``rlc.runtime.refit.verify_stream``): every parameter, a shard at a time in host memory."""
        export_dir = str(self.root / f"verify-{uuid.uuid4().hex[:6]}")
        t0 = time.perf_counter()
        try:
            answers = _wait([t.refit_dump_export.remote(export_dir) for t in trainers]
                            + [gen.refit_verify.remote(export_dir)], "verify: streamed export and reference load")
        except Exception as exc:
            return {"bit_exact": False, "error": str(exc)[-1500:]}
        written, reports = answers[:-1], answers[-1]
        keys = ("params_compared", "bytes_compared", "bit_exact", "mismatches", "not_loaded", "unchecked", "shards",
                "exported_tensors", "peak_host_bytes")
        slim = [{k: r[k] for k in keys if k in r} for r in reports]
        for r in slim:
            for k in ("mismatches", "not_loaded", "unchecked"):
                r[k] = r.get(k, [])[:6]
        return {"bit_exact": bool(reports) and all(r.get("bit_exact") for r in reports), "scope": "every parameter",
                "seconds": time.perf_counter() - t0, "written": [dataclasses.asdict(w) for w in written],
                "workers": slim}

    def spot_check(self, plan_: dict, trainers: list, gen: Any, case: dict) -> dict:
        """Each vLLM worker reloads the plan's HF tensors, exported by the trainer rank on its GPU, through
        its own ``load_weights`` and compares the touched parameters with their values after the refit."""
        checks: list[P.SpotCheck] = plan_["checks"]
        hf_names = sorted({c.hf_name for c in checks})
        try:
            exported = _wait([t.export_named.remote(hf_names) for t in trainers], "spot-check export")
            by_device = {s["gpu_uuid"]: exported[r] for r, s in enumerate(case["setup"])}
            reports = _wait([gen.refit_verify_tensors.remote(by_device, sorted({c.vllm_name for c in checks}))],
                            "spot-check reload in vLLM")[0]
        except Exception as exc:  # the timings stand; the check reports why it could not run
            verdict = P.spot_check_verdict(checks, [])
            return {**verdict, "problems": [f"could not run: {str(exc)[-1500:]}"], "notes": plan_["notes"]}
        verdict = P.spot_check_verdict(checks, reports)
        return {**verdict, "notes": plan_["notes"], "reports": reports}


# --------------------------------------------------------------------------- engine-only case


def run_engine(a: argparse.Namespace, out: Path, zero_copy: bool = False) -> dict:
    """``refit_bandwidth.py --backend cuda_ipc`` in a subprocess (before Ray takes the GPUs); with ``zero_copy`` the
    consumer reads every tensor in place (``--zero-copy``)."""
    path = out / ("engine_bandwidth_zero_copy.json" if zero_copy else "engine_bandwidth.json")
    cmd = [sys.executable, str(BENCH_DIR / "refit_bandwidth.py"), "--backend", "cuda_ipc", "--gib", f"{a.engine_gib:g}",
           "--json", str(path), *(["--zero-copy"] if zero_copy else [])]
    print(f"== engine{' (zero-copy)' if zero_copy else ''}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"refit_bandwidth.py exited {proc.returncode}: {proc.stderr[-3000:]}")
    data = json.loads(path.read_text(encoding="utf-8"))
    keep = ("device", "bytes", "tensors", "buckets", "half_bytes", "copy_seconds", "copy_gbps", "refit_seconds",
            "refit_gbps", "ratio")
    return {"command": " ".join(cmd[1:]), **{k: data[k] for k in keep}, "table": proc.stdout}


# --------------------------------------------------------------------------- main


def gpu_memory_used_mib() -> list[float] | None:
    """Used memory of every GPU (nvidia-smi), or None when it cannot be asked."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return [float(x) for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def wait_for_idle_gpus(timeout_s: float = 120.0, idle_mib: float = 3072.0) -> dict:
    """After a case's actors are killed, wait until their processes have given the GPUs back (vLLM
    refuses to start when less than its share is free)."""
    t0 = time.monotonic()
    used = gpu_memory_used_mib()
    while used is not None and max(used) > idle_mib and time.monotonic() - t0 < timeout_s:
        time.sleep(1.0)
        used = gpu_memory_used_mib()
    return {"waited_s": round(time.monotonic() - t0, 1), "used_mib": used}


def machine_info() -> dict:
    info: dict[str, Any] = {"hostname": socket.gethostname(), "python": sys.version.split()[0]}
    try:
        info["gpus"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    return info


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.docs_rows:
        results = json.loads(Path(a.docs_rows).read_text(encoding="utf-8"))
        print(f"<!-- {results.get('command', '')}; {results.get('machine', {}).get('hostname', '?')}; "
              f"{results.get('started_utc', '')} -->")
        print(P.docs_rows(results, P.evaluate_goals(results)))
        return 0
    if a.report:
        results = json.loads(Path(a.report).read_text(encoding="utf-8"))
        print(P.render_report(results, P.evaluate_goals(results)))
        return 0
    try:
        plans = plan(a)
    except P.BenchmarkInputError as exc:
        print(f"refit_at_scale: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out)
    results: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/refit_at_scale.py", *(sys.argv[1:] if argv is None else argv)]),
        "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": {},
        "options": {k: v for k, v in vars(a).items() if k != "case_list"} | {"cases": a.case_list},
        "plan": plan_to_json(plans),
        "cases": {},
        "errors": [],
    }
    print(P.render_plan(plans), flush=True)
    unfit = [f"{n}: {'; '.join(p['budget'].problems)}" for n, p in plans.items() if not p["budget"].fits]
    if unfit:
        print("refit_at_scale: memory budget does not fit:\n  " + "\n  ".join(unfit), file=sys.stderr)
        return 2
    if a.dry_run:
        return 0
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        results["goals"] = [g.to_dict() for g in P.evaluate_goals(results)]
        (out / "refit_at_scale.json").write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")

    if "tiny" in a.case_list:
        try:
            results["tiny"] = P.tiny_step_overhead(a.tiny_metrics)
        except P.BenchmarkInputError as exc:
            results["errors"].append(f"tiny: {exc}")
    for name, key, zero_copy in (("engine", "engine", False), ("engine-zero-copy", "engine_zero_copy", True)):
        if name in a.case_list:
            try:
                results[key] = run_engine(a, out, zero_copy=zero_copy)
            except Exception as exc:
                results["errors"].append(f"{name}: {str(exc)[:500]}")
                print(f"== {name} FAILED: {exc}", flush=True)
            save()
    layouts = layouts_for(a)
    if layouts:
        GpuSession(a, results, save).run(layouts, plans)
    results["finished_utc"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    save()
    goals = P.evaluate_goals(results)
    report = P.render_report(results, goals)
    print(report, flush=True)
    (out / "refit_at_scale.txt").write_text(report + "\n", encoding="utf-8")
    code, verdict = P.check_exit_code(goals, results["errors"])
    print(f"verdict: {verdict}", flush=True)
    return code if a.check else 0


if __name__ == "__main__":
    sys.exit(main())
