"""GPU check: a verified refit into FP8 vLLM parameters at real shapes, refit time and generation speed next to bf16.

A real-shape model with random weights, built as ``benchmarks/refit_at_scale.py`` builds it (Megatron-Bridge from the
HF ``config.json`` in ``benchmarks/models/``, vLLM with ``load_format: dummy``), one GPU, trainer and vLLM
colocated as the runtime colocates them. For each rollout precision, bf16 then FP8 (``generation.fp8.scales``,
default block), on a fresh engine: one warm-up and ``--refits`` measured refit cycles (negate every trainer
weight -> wake weights -> refit -> wake KV -> sleep level 2), then ``--prompts`` random prompts generating
``--max-tokens`` tokens each (``ignore_eos``) for tokens/s. After the last FP8 refit:

* every vLLM parameter is snapshot, then the trainer sends the same weights again in **bf16** and vLLM loads
  them with its own quantization: block scales quantized in the vLLM process by vLLM's
  ``per_block_cast_to_fp8``, one tensor at a time (the trainer groups experts and quantizes before the
  transfer), tensor scales by vLLM's online FP8 as it loads; both through the layerwise reload a refit uses.
  Every parameter (FP8 weights, their scales, the bf16 embedding / norms / routers) must equal its snapshot
  bit for bit;
* on a sample of exported weights rlc's plain-torch restatements (``rlc.runtime.refit.fp8``) are compared with
  vLLM's functions (``per_block_cast_to_fp8``, ``scaled_fp8_quant`` per tensor and per row): reported, not gating.

Passes when every refit ran, the FP8 engine's module check passed at prepare and the verification is bit
exact. Writes ``<out>/fp8_refit_<case>.json`` (command, machine, versions, every refit, tokens/s, the check).

    python tests/gpu/test_fp8_refit.py --case dense-8b [--scales block] [--refits 3] [--out DIR]
    python tests/gpu/test_fp8_refit.py --case moe-1gpu --fp8-util 0.40
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as _dt
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.common import Timer, dump, gpu_available

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

CASES = ("dense-8b", "moe-1gpu")
#: Prompts for the tokens/s measurement per case (30B-A3B on one GPU keeps a small KV cache in bf16).
PROMPTS = {"dense-8b": 256, "moe-1gpu": 64}
PROMPT_LEN = 64
SAMPLE_MIRROR = 12  # exported weights on which rlc's restatements are compared with vLLM's functions


# ------------------------------------------------------------------ functions run inside the actors


def _set_cfg(worker: Any, cfg_dict: dict) -> dict:
    """Trainer: close the producer and take ``cfg_dict`` (the next refit_prepare builds the source from it)."""
    from rlc.contract.runtime_config import runtime_config_from_dict  # noqa: PLC0415

    worker.refit_close()
    worker.cfg = runtime_config_from_dict(cfg_dict)
    return {"precision": worker.cfg.generation.precision, "scales": worker.cfg.generation.fp8.scales}


def _throughput(gen: Any, prompts: int, max_tokens: int, vocab: int, seed: int) -> dict:
    """vLLM worker actor: tokens/s of ``prompts`` random prompts x ``max_tokens`` tokens (no EOS stop)."""
    import random  # noqa: PLC0415

    from vllm import SamplingParams  # noqa: PLC0415

    rng = random.Random(seed)
    reqs = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)]} for _ in range(prompts)]
    # untimed, with every request: the prefill and decode batch sizes of the timed pass, so any kernel compiled on
    # first use (DeepGEMM's, when its start-up warm-up is skipped) is compiled before the clock starts
    warm = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, detokenize=False)
    gen.llm.generate(reqs, warm, use_tqdm=False)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=seed, detokenize=False)
    t0 = time.perf_counter()
    outs = gen.llm.generate(reqs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompts": prompts, "prompt_len": PROMPT_LEN, "max_tokens": max_tokens, "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds}


def _worker(wrapper: Any) -> Any:
    """The vLLM worker itself: a callable given to ``collective_rpc`` gets vLLM's worker wrapper, which forwards
    attribute reads to the worker but keeps attribute writes for itself."""
    return getattr(wrapper, "worker", wrapper)


def _snapshot(worker: Any) -> dict:
    """vLLM worker: every parameter to host memory, kept on the worker for :func:`_compare`."""
    import torch  # noqa: PLC0415

    worker = _worker(worker)
    params = dict(worker.model_runner.model.named_parameters())
    worker._fp8_check_snapshot = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
    torch.cuda.synchronize()
    by_dtype: dict[str, int] = {}
    for p in params.values():
        key = str(p.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + 1
    return {"params": len(params), "by_dtype": by_dtype,
            "bytes": sum(p.numel() * p.element_size() for p in params.values())}


def _reference_receive(worker: Any, scales: str, pow2: bool) -> dict:
    """vLLM worker: receive a bf16 refit and load it as vLLM itself would make FP8 of it (the runtime's
    reference path of ``refit.verify_every``: ``_rlc_reference`` inside ``_rlc_reload``)."""
    worker = _worker(worker)
    worker._rlc_fp8_scales, worker._rlc_fp8_pow2 = scales, pow2
    model = worker.model_runner.model
    with worker._rlc_reload():
        metrics = worker._rlc_consumer.receive(lambda ws: model.load_weights(weights=worker._rlc_reference(ws)),
                                               copy_buckets=True)
    return {**metrics.to_dict(), "reference_quantizer": getattr(worker, "_rlc_reference_quantizer", None)}


def _compare(worker: Any) -> dict:
    """vLLM worker: every parameter against the snapshot, bit for bit (``rlc.runtime.refit.verify``)."""
    import torch  # noqa: PLC0415

    from rlc.runtime.refit.verify import compare_parameters  # noqa: PLC0415

    worker = _worker(worker)
    snap = worker._fp8_check_snapshot
    now = {n: p.detach() for n, p in worker.model_runner.model.named_parameters()}
    report_parts = []
    fp8 = scales = 0
    for name in sorted(snap):  # one parameter at a time: no second host copy of the model
        cur = {name: now[name].to("cpu")} if name in now else {}
        report_parts.append(compare_parameters({name: snap[name]}, cur or {name: torch.empty(0)}))
        fp8 += int(snap[name].dtype == torch.float8_e4m3fn)
        scales += int("scale" in name)
    del worker._fp8_check_snapshot
    mismatches = [m for r in report_parts for m in r.mismatches]
    compared = sum(r.params_compared for r in report_parts)
    return {"params_compared": compared, "bytes_compared": sum(r.bytes_compared for r in report_parts),
            "fp8_params": fp8, "scale_params": scales, "bit_exact": not mismatches and compared > 0,
            "mismatches": [vars(m) for m in mismatches[:20]], "mismatch_count": len(mismatches),
            "missing_now": sorted(set(snap) - set(now))[:10]}


def _mirror_check(gen: Any, tensors: dict) -> dict:
    """vLLM worker actor: rlc's plain-torch restatements against vLLM's own functions on exported weights."""
    import torch  # noqa: PLC0415
    from vllm import _custom_ops as ops  # noqa: PLC0415
    from vllm.utils.deep_gemm import per_block_cast_to_fp8  # noqa: PLC0415

    from rlc.runtime.refit.fp8 import quantize_blocks, quantize_rows, quantize_tensor  # noqa: PLC0415

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.element_size() == 1:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return torch.equal(a, b)

    out = {"tensors": len(tensors), "block_equal": 0, "tensor_equal": 0, "row_equal": 0, "differing": []}
    for name, t in tensors.items():
        x = t.cuda()
        vq, vs = per_block_cast_to_fp8(x, block_size=[128, 128], use_ue8m0=False)
        rq, rs = quantize_blocks(x)
        ok_block = same(vq, rq) and same(vs.float(), rs)
        tq, ts = ops.scaled_fp8_quant(x, scale=None)
        mq, ms = quantize_tensor(x)
        ok_tensor = same(tq, mq) and same(ts.reshape(-1).float(), ms.reshape(-1))
        pq, ps = ops.scaled_fp8_quant(x, scale=None, use_per_token_if_dynamic=True)
        nq, ns = quantize_rows(x)
        ok_row = same(pq, nq) and same(ps.reshape(-1).float(), ns.reshape(-1))
        out["block_equal"] += int(ok_block)
        out["tensor_equal"] += int(ok_tensor)
        out["row_equal"] += int(ok_row)
        if not (ok_block and ok_tensor and ok_row):
            out["differing"].append({"name": name, "block": ok_block, "tensor": ok_tensor, "row": ok_row})
    out["differing"] = out["differing"][:10]
    return out


# ------------------------------------------------------------------ the driver


def runtime_configs(case: str, root: Path, scales: str, fp8_util: float | None,
                    cuda_graphs: bool) -> tuple[Path, dict[str, dict]]:
    """The case's model folder under ``root`` and the two runtime configs (``bf16``, ``fp8``) the check runs, as
    ``benchmarks/refit_at_scale.py`` builds them. No GPU needed (CPU-tested)."""
    from benchmarks import refit_at_scale as R  # noqa: PLC0415
    from benchmarks import refit_scale_plan as P  # noqa: PLC0415

    lay = P.default_layouts()[case]
    model_dir = R.write_model_dir(root, lay.model)
    # the runtime's transfer (stacked experts off, its default) with the buffers kept as the refit benchmark keeps them
    a = argparse.Namespace(max_model_len=1024, fused_transfer=False, keep_buffers_gb=lay.buffer_gb)
    bf16 = R.runtime_cfg_dict(lay, model_dir, a, root)
    # eager by default (the refit benchmark's engines); with CUDA graphs the per-layer Python of vLLM's FP8 linear
    # path (activation quantization, scale layout) is captured once instead of run every decode step
    bf16["generation"]["enforce_eager"] = not cuda_graphs
    fp8 = copy.deepcopy(bf16)
    fp8["generation"]["precision"] = "fp8"
    fp8["generation"]["fp8"].update(scales=scales, pow2_scales=False)
    if fp8_util is not None:
        fp8["generation"]["gpu_memory_utilization"] = fp8_util
    return model_dir, {"bf16": bf16, "fp8": fp8}


def run(case: str, out: str | None, scales: str, refits: int, warmup: int, max_tokens: int,
        fp8_util: float | None, root: str, deep_gemm_warmup: str = "skip", cuda_graphs: bool = False) -> dict:
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group, remove_placement_group  # noqa: PLC0415

    from benchmarks import refit_at_scale as R  # noqa: PLC0415
    from benchmarks import refit_scale_plan as P  # noqa: PLC0415

    from rlc.contract.fp8 import block_quantized  # noqa: PLC0415
    from rlc.contract.runtime_config import runtime_config_from_dict  # noqa: PLC0415
    from rlc.runtime.generation.vllm_worker import VllmGenerationWorker  # noqa: PLC0415
    from rlc.runtime.workers import spawn, worker_env  # noqa: PLC0415

    clock = Timer()
    res: dict[str, Any] = {
        "check": "verified refit into FP8 vLLM parameters at real shapes; refit time and tokens/s next to bf16",
        "command": " ".join(["python", "tests/gpu/test_fp8_refit.py", *sys.argv[1:]]),
        "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": R.machine_info(), "case": case, "scales": scales, "refits": refits, "warmup": warmup,
        "vllm_deep_gemm_warmup": deep_gemm_warmup, "cuda_graphs": cuda_graphs, "modes": {},
    }
    lay = P.default_layouts()[case]
    rootp = Path(root)
    model_dir, cfgs = runtime_configs(case, rootp, scales, fp8_util, cuda_graphs)
    hf = P.load_hf_config(lay.model)
    res["vllm_util"] = {m: c["generation"]["gpu_memory_utilization"] for m, c in cfgs.items()}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    env = worker_env(runtime_config_from_dict(cfgs["bf16"]))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["VLLM_DEEP_GEMM_WARMUP"] = deep_gemm_warmup
    ray.init(address="local", num_gpus=1, runtime_env={"env_vars": env}, include_dashboard=False)
    pg = placement_group([{"GPU": 1.0, "CPU": 4.0}], strategy="PACK")
    trainer = None
    try:
        ray.get(pg.ready(), timeout=300)
        trainer_env = {**env, "CUDA_DEVICE_MAX_CONNECTIONS": env.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")}
        trainer = spawn(R.RandomInitTrainer, pg=pg, bundle=0, num_gpus=0.5, env=trainer_env,
                        name=f"fp8-trainer-{os.getpid()}", args=(cfgs["bf16"], 0, 1, 0, str(model_dir)))
        master = R._wait([trainer.master_address.remote()], "master address")[0]
        res["setup"] = R._wait([trainer.setup.remote(tuple(master))], "trainer setup")[0]
        res["versions"] = R._wait([trainer.versions.remote()], "versions")[0]
        for mode in ("bf16", "fp8"):
            t_mode = Timer()
            got: dict[str, Any] = {}
            res["modes"][mode] = got
            dump(res, out, f"fp8_refit_{case}")
            try:
                run_mode(mode, cfgs[mode], trainer, pg, env, got, refits, warmup, max_tokens, case, hf, scales,
                         VllmGenerationWorker, spawn, R, P, block_quantized)
            except Exception as exc:  # noqa: BLE001 - the record says what broke
                got["error"] = f"{type(exc).__name__}: {str(exc)[-2500:]}"
                got["traceback"] = traceback.format_exc()[-4000:]
                print(f"== {mode} FAILED: {got['error']}", flush=True)
            got["seconds"] = t_mode()
            # the engine's process is gone once only the trainer's weights (and contexts) are left on the GPU
            trainer_mib = res["setup"]["bytes_local"] / (1 << 20)
            res["gpu_release_after_" + mode] = R.wait_for_idle_gpus(idle_mib=trainer_mib + 6000)
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {str(exc)[-2500:]}"
        res["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if trainer is not None:
            ray.kill(trainer)
        remove_placement_group(pg)
        ray.shutdown()
    res["summary"] = summarize(res)
    res["passed"] = res["summary"]["passed"]
    res["seconds"] = clock()
    dump(res, out, f"fp8_refit_{case}")
    return res


def run_mode(mode: str, cfg: dict, trainer: Any, pg: Any, env: dict, got: dict, refits: int, warmup: int,
             max_tokens: int, case: str, hf: dict, scales: str, worker_cls: Any, spawn: Any, R: Any, P: Any,
             block_quantized: Any) -> None:
    import ray  # noqa: PLC0415

    gen = spawn(worker_cls, pg=pg, bundle=0, num_gpus=0.5, env=env, name=f"fp8-gen-{mode}-{os.getpid()}",
                args=(cfg, 0, [0]))
    try:
        t0 = time.perf_counter()
        started = R._wait([gen.start.remote(dict(R.ENGINE_OVERRIDES))], f"vLLM start ({mode})")[0]
        got["engine"] = {"start_s": time.perf_counter() - t0, "memory": started.memory.as_dict()}
        got["engine"]["sleep_first"] = dataclasses.asdict(R._wait([gen.sleep.remote(2)], "vLLM sleep")[0])
        got["trainer_cfg"] = R._wait([trainer.call.remote(_set_cfg, cfg)], "trainer cfg")[0]
        session = f"fp8-{mode}-{uuid.uuid4().hex[:6]}"
        prep = R._wait([trainer.refit_prepare.remote(session, 0, 1, 300.0), gen.refit_prepare.remote(session, 300.0)],
                       "refit prepare")
        got["prepare"] = {"producer": prep[0], "consumer": prep[1]}
        print(f"== {case} {mode}: {prep[0]['num_tensors']} tensors, {prep[0]['bytes'] / 1e9:.2f} GB on the wire, "
              f"quantizer {prep[0].get('fp8_quantizer')}", flush=True)
        records: list[dict] = []
        got["refits"] = records
        for i in range(warmup + refits):
            negate = R._wait([trainer.call.remote(R._negate_weights)], "negate weights")[0]
            woke = R._wait([gen.wake_up.remote(["weights"])], "wake_up(weights)")[0]
            t1 = time.perf_counter()
            sent = R._wait([trainer.refit_send.remote(), gen.refit_receive.remote()], f"refit {i} ({mode})")
            transfer = time.perf_counter() - t1
            kv = R._wait([gen.wake_up.remote(["kv_cache"])], "wake_up(kv_cache)")[0]
            R._wait([gen.reset_prefix_cache.remote()], "reset prefix cache")
            last = i == warmup + refits - 1
            if last:
                got["throughput"] = R._wait([gen.call.remote(_throughput, PROMPTS[case], max_tokens,
                                                              int(hf["vocab_size"]), 7)], "generate tokens/s")[0]
                got["memory_awake"] = kv.memory.as_dict()
                if mode == "fp8":
                    got["verify"] = verify(trainer, gen, cfg, scales, R, block_quantized)
            slept = R._wait([gen.sleep.remote(2)], "sleep(2)")[0]
            records.append({"index": i, "warmup": i < warmup, "negate_s": negate, "transfer_s": transfer,
                            "wake_weights_s": woke.seconds, "wake_kv_s": kv.seconds, "sleep_s": slept.seconds,
                            "free_after_wake_gib": kv.memory.free_gib, "producers": [sent[0].raw],
                            "consumers": sent[1]})
            row = P.refit_row(records[-1])
            print(f"   {mode} refit {i}{' (warm-up)' if i < warmup else ''}: total {row['total_refit_s']:.3f} s "
                  f"(transfer {row['transfer_s']:.3f}, export+quantize {row['export_s']:.3f}, "
                  f"load {row['load_weights_s']:.3f}), {row['bytes_per_gpu'] / 1e9:.2f} GB", flush=True)
        got["summary"] = P.summarize_refits(records, warmup)
    finally:
        try:
            ray.get([trainer.refit_close.remote(), gen.refit_close.remote()], timeout=120)
        except Exception:  # noqa: BLE001 - the engine goes anyway
            pass
        try:
            ray.get(gen.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001
            pass
        ray.kill(gen)


def verify(trainer: Any, gen: Any, fp8_cfg: dict, scales: str, R: Any, block_quantized: Any) -> dict:
    """Snapshot vLLM, refit the same weights in bf16 into vLLM's own quantization, compare every parameter."""
    t = Timer()
    out: dict[str, Any] = {"snapshot": R._wait([gen.call.remote(_rpc, _snapshot)], "snapshot")[0]}
    bf16_cfg = copy.deepcopy(fp8_cfg)
    bf16_cfg["generation"]["precision"] = "auto"
    R._wait([trainer.call.remote(_set_cfg, bf16_cfg)], "trainer cfg (bf16 stream)")
    R._wait([gen.refit_close.remote()], "consumer close")
    session = f"fp8-ref-{uuid.uuid4().hex[:6]}"
    # the consumer pairs without the FP8 module check: this transfer carries bf16 on purpose
    prep = R._wait([trainer.refit_prepare.remote(session, 0, 1, 300.0), gen.call.remote(_prepare_plain, session)],
                   "reference prepare")
    out["reference_wire_bytes"] = prep[0]["bytes"]
    sent = R._wait([trainer.refit_send.remote(), gen.call.remote(_rpc, _reference_receive, scales, False)],
                   "reference refit (bf16 -> vLLM's own quantization)")
    out["reference_receive"] = sent[1]
    out["compare"] = R._wait([gen.call.remote(_rpc, _compare)], "compare")[0][0]
    names = [n for n in R._wait([trainer.call.remote(_export_names)], "export names")[0] if block_quantized(n, 2)]
    step = max(1, len(names) // SAMPLE_MIRROR)
    sample = names[::step][:SAMPLE_MIRROR]
    tensors = R._wait([trainer.export_named.remote(sample)], "mirror sample export")[0]
    out["mirror"] = R._wait([gen.call.remote(_mirror_check, tensors)], "mirror check")[0]
    R._wait([trainer.call.remote(_set_cfg, fp8_cfg)], "trainer cfg (back to FP8)")
    out["seconds"] = t()
    return out


def _rpc(gen: Any, fn: Any, *args: Any) -> list:
    """vLLM worker actor: run ``fn(worker, *args)`` in every vLLM worker of the engine."""
    return gen.llm.collective_rpc(fn, args=args)


def _prepare_plain(gen: Any, session: str) -> list:
    """vLLM worker actor: pair with the trainer as for a bf16 refit (no FP8 settings, no module check)."""
    return gen.llm.collective_rpc("rlc_refit_prepare", args=(session, gen.cfg.refit.transport, 300.0, None, False))


def _export_names(worker: Any) -> list[str]:
    return [s.name for s in worker.source.specs] if worker.source is not None else []


def summarize(res: dict) -> dict:
    """The verdict: both precisions refitted, the FP8 engine's module check passed, the FP8 check is bit exact."""
    reasons = []
    modes = res.get("modes", {})
    for mode in ("bf16", "fp8"):
        m = modes.get(mode, {})
        if "error" in m or "summary" not in m:
            reasons.append(f"{mode}: {m.get('error', 'not run')[:300]}")
    fp8 = modes.get("fp8", {})
    layout = fp8.get("prepare", {}).get("consumer", [{}])
    layout = layout[0].get("fp8_layout") if layout else None
    if res.get("scales") == "block" and not (layout and layout.get("ok")):
        reasons.append(f"FP8 module check at prepare: {layout}")
    compare = fp8.get("verify", {}).get("compare", {})
    if not compare.get("bit_exact"):
        reasons.append(f"FP8 parameters differ from vLLM's own quantization: {compare.get('mismatch_count')} "
                       f"parameter(s), e.g. {[m.get('name') for m in compare.get('mismatches', [])[:4]]}")
    if res.get("scales") == "block" and compare and compare.get("fp8_params", 0) == 0:
        reasons.append("no FP8 parameter was compared")
    if "error" in res:
        reasons.append(res["error"][:300])

    def med(mode: str, key: str) -> float | None:
        s = modes.get(mode, {}).get("summary", {}).get(key)
        return s.get("median") if isinstance(s, dict) else None

    tps = {m: modes.get(m, {}).get("throughput", {}).get("tokens_per_s") for m in ("bf16", "fp8")}
    out = {"passed": not reasons, "reasons": reasons,
           "total_refit_s": {m: med(m, "total_refit_s") for m in ("bf16", "fp8")},
           "transfer_s": {m: med(m, "transfer_s") for m in ("bf16", "fp8")},
           "export_s": {m: med(m, "export_s") for m in ("bf16", "fp8")},
           "load_weights_s": {m: med(m, "load_weights_s") for m in ("bf16", "fp8")},
           "bytes_per_refit": {m: med(m, "bytes_per_gpu") for m in ("bf16", "fp8")},
           "generate_tokens_per_s": tps,
           "fp8_over_bf16_tokens_per_s": (tps["fp8"] / tps["bf16"]) if tps["fp8"] and tps["bf16"] else None,
           "verified": {k: compare.get(k) for k in ("params_compared", "fp8_params", "scale_params", "bytes_compared",
                                                    "bit_exact")},
           "mirror": fp8.get("verify", {}).get("mirror")}
    return out


@pytest.mark.gpu
def test_fp8_refit_dense_8b(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    res = run("dense-8b", None, "block", 2, 1, 128, None, str(tmp_path))
    assert res["passed"], res["summary"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=CASES, default="dense-8b")
    ap.add_argument("--scales", choices=("block", "tensor"), default="block")
    ap.add_argument("--refits", type=int, default=3, help="measured refits per precision (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt for tokens/s")
    ap.add_argument("--fp8-util", type=float, default=None,
                    help="vLLM gpu_memory_utilization of the FP8 engine (default: the bf16 engine's)")
    ap.add_argument("--root", default="/tmp/rlc-fp8-refit")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="both engines with CUDA graphs (generation.enforce_eager: false) for the tokens/s comparison")
    ap.add_argument("--deep-gemm-warmup", choices=("skip", "relax", "full"), default="skip",
                    help="vLLM's VLLM_DEEP_GEMM_WARMUP for the engines: block scales run on DeepGEMM, whose start-up "
                         "warm-up compiles some 1,100 kernels (minutes on a fresh host); skipped, the kernels this "
                         "check uses compile in the untimed warm-up generation")
    a = ap.parse_args()
    r = run(a.case, a.out, a.scales, a.refits, a.warmup, a.max_tokens, a.fp8_util, a.root, a.deep_gemm_warmup,
            a.cuda_graphs)
    print("fp8_refit:", "passed" if r["passed"] else "FAILED: " + "; ".join(r["summary"]["reasons"]), flush=True)
    sys.exit(0 if r["passed"] else 1)
