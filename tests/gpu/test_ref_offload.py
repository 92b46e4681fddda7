"""GPU check: ``training.offload_reference_policy`` from a compiled bundle of the tiny recipe, on one GPU.

The shipped recipe ``tiny-qwen3-1gpu`` with a 0.2B-parameter toy Qwen3 (hidden 1024, 16 layers: the reference
copy is 0.38 GiB, large enough to measure; no download) and ``loss.kl_penalty=0.01``,
``training.offload_reference_policy=true``, ``training.logprob_batch_size=16``, compiled with ``rlc compile``.

1. ``worker`` (one policy worker of the bundle's runtime config, alone on the GPU, in a process of its own):
   three GRPO train steps on a toy batch change the policy; then

   a. the reference logprobs through the swap (``compute_ref_logprobs``: pinned host copy -> GPU -> freed)
      equal, bit for bit, those of a resident reference built in the same process from the same checkpoint
      (``build_reference``), while the policy's differ; the trainer's parameters, gradients, fp32 master
      weights and Adam moments are bit for bit the same before and after the swapped pass, and the pass
      leaves the allocated GPU memory as it found it;
   b. the switch's memory next to the planner's prediction for the same recipe (plan with the switch on and
      off): the GPU memory the resident reference holds and offloading it frees (``offload_reference``, the
      runtime's own function) against the plan's reference item; the host memory (RSS) the pinned copy takes
      and the runtime's pinned blocks against the plan's host item; the peak during the swapped pass over the
      trainer's memory against the plan's reference + logits items.
2. ``driver``: the bundle run by the bundled runtime for 3 GRPO steps (vLLM colocated, refit every step):
   exit 0, every step trained with a KL term; the measured GPU memory per phase next to the plan's.

Verdict thresholds are stated once below (``TOLERANCE`` is the issue's 10 %). Writes ``ref_offload.json``.

    python tests/gpu/test_ref_offload.py [--root /tmp/rlc-ref-offload] [--out DIR] [--skip-driver]   # one GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.common import Timer, dump, gpu_available

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml"
GIB = 2**30
#: A 0.2B toy Qwen3 (201M parameters, 0.38 GiB in bf16); the toy tokenizer's 23-token vocabulary
MEDIUM = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 16,
          "num_key_value_heads": 8, "head_dim": 64}
MODEL_ID = "rlc/tiny-qwen3-medium"
SETS = ("loss.kl_penalty=0.01", "training.offload_reference_policy=true", "training.logprob_batch_size=16",
        "grpo.prompts_per_step=32", "training.global_batch_size=512", "training.micro_batch_size=128",
        "grpo.max_steps=3", "checkpointing.enabled=false")
HOST_LABEL = "reference policy params (offloaded)"
REF_LABEL = "reference policy params (bf16)"
LOGITS_LABEL = "fp32 logits of the logprob pass"
TOLERANCE = 0.10  # measured vs planned memory (GPU and host)
EXACT_HOST = 0.01  # the runtime's pinned blocks vs the plan's host figure (same formula, the model's own count)
SWAP_RESIDUE = 16 << 20  # allocated bytes a swapped pass may leave behind (none expected)
POLICY_MOVED = 1e-3  # max |policy - reference| logprob after the train steps: the comparison is not trivial
TRAIN_STEPS = 3
BATCH = 256


# ------------------------------------------------------------------ compile and plan (CPU)


def workspace(root: Path) -> Path:
    from rlc.runtime.toy_model import build_toy_workspace  # noqa: PLC0415

    ckpt = root / "dense" / "qwen3"
    if not (ckpt / "config.json").exists():
        build_toy_workspace(root / "dense", config=MEDIUM, train=1024, val=16)
    return ckpt


def model_sets(ckpt: Path) -> tuple[str, ...]:
    return (f"model.config={ckpt}/config.json", f"model.id={MODEL_ID}")


def planned(ckpt: Path) -> dict:
    """The planner's figures for the probe's recipe with the switch on and off (bytes, one GPU)."""
    from rlc.compiler import api  # noqa: PLC0415

    out = {}
    for name, switch in (("on", "true"), ("off", "false")):
        result = api.check(str(RECIPE), [*SETS, *model_sets(ckpt), f"training.offload_reference_policy={switch}"])
        if not result.ok:
            raise RuntimeError("recipe has errors: " + "; ".join(d.message for d in result.errors))
        plan = result.plan
        items = {p: {i.label: i.gib for i in ph.items} for p, ph in plan.phases.items()}
        out[name] = {"phases_gib": {p: ph.used_gib for p, ph in plan.phases.items()},
                     "host_gib": plan.host.used_gib, "params_bytes": plan.stages[0]["params_bytes"],
                     "reference_host_bytes": int(round(plan.host.item_gib(HOST_LABEL) * GIB)),
                     "logprob_items_gib": items["logprob"], "train_items_gib": items["train"]}
    out["reference_gpu_bytes"] = int(round(out["off"]["train_items_gib"][REF_LABEL] * GIB))
    out["logprob_extra_bytes"] = int(round((out["on"]["logprob_items_gib"][REF_LABEL]
                                            + out["on"]["logprob_items_gib"][LOGITS_LABEL]) * GIB))
    return out


# ------------------------------------------------------------------ the worker probe (GPU, own process)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(n: int, seed: int) -> Any:
    import random  # noqa: PLC0415

    from rlc.runtime import toy  # noqa: PLC0415
    from rlc.runtime.policy.batches import pack_rollouts  # noqa: PLC0415

    rng = random.Random(seed)
    examples = toy.examples(n, seed)
    prompts = [toy.char_ids(ex["prompt"]) for ex in examples]
    responses = [toy.char_ids(ex["answer"], add_bos=False) + [toy.EOS_ID] for ex in examples]
    # random +-1 advantages: the train steps move the policy away from the reference
    return pack_rollouts(prompts, responses, [[0.0] * len(r) for r in responses],
                         [rng.choice((-1.0, 1.0)) for _ in range(n)], pad_id=toy.PAD_ID)


def _trainer_tensors(pm) -> list:
    """Every tensor of the trainer's state on the GPU: parameters, gradient buffers, fp32 master, Adam moments."""
    import torch  # noqa: PLC0415

    out = [p for m in pm.model for p in m.parameters()]
    for chunk in pm.model:
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            if buffer.grad_data is not None:
                out.append(buffer.grad_data)
    for opt in getattr(pm.optimizer, "chained_optimizers", None) or [pm.optimizer]:
        for group in getattr(opt, "shard_fp32_from_float16_groups", None) or []:
            out += [t for t in group if torch.is_tensor(t)]
        inner = getattr(opt, "optimizer", None)
        for state in (getattr(inner, "state", None) or {}).values():
            out += [v for v in state.values() if torch.is_tensor(v) and v.is_cuda]
    return out


def _used_bytes() -> int:
    import torch  # noqa: PLC0415

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _rss() -> int:
    import psutil  # noqa: PLC0415

    return int(psutil.Process().memory_info().rss)


def probe_worker(runtime_yaml: str) -> dict:
    """In this process: one policy worker of ``runtime_yaml`` on GPU 0; the checks 1a and 1b's measurements."""
    import torch  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    from rlc.runtime.policy.megatron_setup import build_reference, offload_reference  # noqa: PLC0415
    from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker  # noqa: PLC0415

    cfg = yaml.safe_load(Path(runtime_yaml).read_text(encoding="utf-8"))
    res: dict = {}
    w = MegatronPolicyWorker(cfg, 0, 1)
    setup = w.setup(("127.0.0.1", _free_port()), 10)
    host = w.pm.ref_host
    res["setup_s"] = round(setup.setup_s, 2)
    res["runtime_host_bytes"] = host.host_bytes
    res["reference_bytes"] = host.nbytes
    res["reference_storages"] = len(host.storages)
    res["resident_after_setup"] = host.device_bytes
    batch = _batch(BATCH, seed=7)
    for step in range(1, TRAIN_STEPS + 1):
        batch = dataclasses.replace(batch, old_logprobs=w.compute_logprobs(batch))
        batch = dataclasses.replace(batch, ref_logprobs=w.compute_ref_logprobs(batch))
        w.train_step(batch, step)
    # 1a: the swapped pass against the trainer's state and a resident reference
    tensors = _trainer_tensors(w.pm)
    before = [(t.data_ptr(), t.detach().clone()) for t in tensors]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    swapped = w.compute_ref_logprobs(batch)
    peak = torch.cuda.max_memory_allocated()
    res["swap"] = dict(w.last_reference_swap)
    res["allocated_before_pass"] = allocated
    res["allocated_after_pass"] = torch.cuda.memory_allocated()
    res["pass_peak_over_before"] = peak - allocated
    res["resident_after_pass"] = host.device_bytes
    res["trainer_tensors"] = len(tensors)
    res["trainer_untouched"] = all(
        t.data_ptr() == ptr and torch.equal(t, copy) for t, (ptr, copy) in zip(tensors, before)
    )
    del before
    policy = w.compute_logprobs(batch)
    torch.cuda.empty_cache()
    used_without, allocated_without = _used_bytes(), torch.cuda.memory_allocated()
    resident = build_reference(w.pm.provider, w.cfg)
    torch.cuda.empty_cache()  # what loading the checkpoint cached, not the reference
    used_with, allocated_with = _used_bytes(), torch.cuda.memory_allocated()
    first = w._logprobs(resident, batch.tensors())
    again = w._logprobs(resident, batch.tensors())
    mask = batch.mask > 0
    res["bit_exact"] = bool(torch.equal(swapped, first))
    res["resident_deterministic"] = bool(torch.equal(first, again))
    res["swapped_vs_resident_max_abs"] = float((swapped - first)[mask].abs().max())
    res["policy_vs_reference_max_abs"] = float((policy - first)[mask].abs().max())
    res["tokens_compared"] = int(mask.sum())
    # 1b: the switch on the resident reference, with the runtime's own offload
    rss_before = _rss()
    copy = offload_reference(resident)
    used_off, allocated_off, rss_after = _used_bytes(), torch.cuda.memory_allocated(), _rss()
    res["switch"] = {"gpu_used_reference_resident": used_with, "gpu_used_reference_offloaded": used_off,
                     "gpu_used_before_resident_reference": used_without,
                     "gpu_freed_by_offload": used_with - used_off, "gpu_taken_by_resident": used_with - used_without,
                     "allocated_by_resident": allocated_with - allocated_without,
                     "allocated_freed_by_offload": allocated_with - allocated_off,
                     "rss_before_offload": rss_before, "rss_after_offload": rss_after,
                     "rss_taken_by_copy": rss_after - rss_before, "copy_host_bytes": copy.host_bytes}
    copy.swap_in()
    res["second_copy_bit_exact"] = bool(torch.equal(w._logprobs(resident, batch.tensors()), first))
    copy.swap_out()
    w.shutdown()
    return res


def run_probe(bundle: Path, timeout_s: int) -> dict:
    """``probe_worker`` in a fresh process (its own CUDA context), with the policy workers' environment."""
    from rlc.contract.runtime_config import load_runtime_config  # noqa: PLC0415
    from rlc.runtime.workers import worker_env  # noqa: PLC0415
    from tests.gpu.test_four_gpu_grpo import _env  # noqa: PLC0415

    env = _env(REPO)
    env.update(worker_env(load_runtime_config(bundle / "runtime.yaml")))
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = env.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    out, log_path = bundle.parent / "probe.json", bundle.parent / "probe.log"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe-worker", str(bundle / "runtime.yaml"),
           "--probe-out", str(out)]
    print("$", " ".join(cmd), f"> {log_path}", flush=True)
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, timeout=timeout_s, stdout=log, stderr=subprocess.STDOUT,
                                check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    got = json.loads(out.read_text()) if out.exists() else {}
    tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-40:]
    return {"rc": rc, **got, **({} if rc == 0 else {"log_tail": [line[:300] for line in tail]})}


def machine() -> dict:
    """The GPU and the stack this ran on (nvidia-smi and package metadata: no CUDA context in this process)."""
    import importlib.metadata as md  # noqa: PLC0415

    info: dict = {}
    try:
        info["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["gpu"] = f"nvidia-smi: {exc}"
    for dist in ("torch", "vllm", "megatron-core", "megatron-bridge", "transformer-engine", "ray"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    return info


# ------------------------------------------------------------------ verdicts (pure; CPU-tested)


def _near(measured: float, planned: float, tolerance: float) -> bool:
    return planned > 0 and abs(measured - planned) <= tolerance * planned


def verdict_worker(probe: dict, plan: dict) -> tuple[bool, list[str]]:
    """1a and 1b on what the worker probe measured and the plan predicted."""
    problems = []
    if probe.get("rc") != 0:
        return False, [f"worker probe exit {probe.get('rc')}"]
    if not probe["bit_exact"]:
        problems.append(
            f"swapped vs resident reference logprobs differ (max |d| {probe['swapped_vs_resident_max_abs']:.3g}"
            f"; resident run to run equal: {probe['resident_deterministic']})"
        )
    if not probe["second_copy_bit_exact"]:
        problems.append("a second offload/swap-in round trip changed the reference logprobs")
    if probe["policy_vs_reference_max_abs"] <= POLICY_MOVED:
        problems.append(
            f"the policy did not move from the reference (max |d| {probe['policy_vs_reference_max_abs']:.3g})"
        )
    if not probe["trainer_untouched"]:
        problems.append("the swapped pass changed the trainer's parameters, gradients or optimizer state")
    if probe["resident_after_setup"] or probe["resident_after_pass"]:
        problems.append(f"reference storages left on the GPU: {probe['resident_after_setup']} bytes after setup, "
                        f"{probe['resident_after_pass']} after the pass")
    if abs(probe["allocated_after_pass"] - probe["allocated_before_pass"]) > SWAP_RESIDUE:
        problems.append(f"the swapped pass left {probe['allocated_after_pass'] - probe['allocated_before_pass']} "
                        "bytes allocated")
    switch = probe["switch"]
    for what, measured, predicted in (
            ("GPU memory the resident reference takes", switch["gpu_taken_by_resident"], plan["reference_gpu_bytes"]),
            ("GPU memory offloading it frees", switch["gpu_freed_by_offload"], plan["reference_gpu_bytes"]),
            ("host memory (RSS) its pinned copy takes", switch["rss_taken_by_copy"],
             plan["on"]["reference_host_bytes"]),
            ("peak of the swapped pass over the trainer", probe["pass_peak_over_before"], plan["logprob_extra_bytes"])):
        if not _near(measured, predicted, TOLERANCE):
            problems.append(f"{what}: {measured} bytes measured, {predicted} planned (more than {TOLERANCE:.0%} apart)")
    if not _near(probe["runtime_host_bytes"], plan["on"]["reference_host_bytes"], EXACT_HOST):
        problems.append(f"the runtime's pinned blocks hold {probe['runtime_host_bytes']} bytes, the plan counts "
                        f"{plan['on']['reference_host_bytes']}")
    return not problems, problems


def verdict_driver(run: dict, steps: int) -> tuple[bool, list[str]]:
    rows = [r for r in run.get("metrics", []) if "reward/mean" in r]
    problems = []
    if run.get("rc") != 0:
        problems.append(f"driver exit {run.get('rc')}")
    if len(rows) != steps:
        problems.append(f"{len(rows)} steps logged of {steps}")
    if not all("loss/kl_ref" in r for r in rows):
        problems.append("a step trained without the KL term (no loss/kl_ref)")
    return not problems, problems


# ------------------------------------------------------------------ the check


def run(root: str, out: str | None, skip_driver: bool = False) -> dict:
    from tests.gpu import test_moe_two_gpu as moe  # noqa: PLC0415

    clock = Timer()
    root_p = Path(root)
    res: dict = {"check": "training.offload_reference_policy: swapped-in reference logprobs bit for bit against a "
                          "resident reference, and the switch's GPU and host memory against the plan",
                 "command": "python tests/gpu/test_ref_offload.py --out DIR", "recipe": str(RECIPE.relative_to(REPO)),
                 "model": MEDIUM, "sets": list(SETS),
                 "thresholds": {"tolerance": TOLERANCE, "exact_host": EXACT_HOST, "swap_residue": SWAP_RESIDUE,
                                "policy_moved": POLICY_MOVED}}
    res["machine"] = machine()
    lab = moe.Lab(root, gpus=1)
    try:
        ckpt = workspace(root_p)
        res["plan"] = planned(ckpt)
        bundle = lab.compile(moe.DENSE, "ref_offload", (*SETS, *model_sets(ckpt)))
        res["bundle"] = str(bundle)
        res["worker"] = run_probe(bundle, timeout_s=240)
        res["worker_passed"], res["worker_problems"] = verdict_worker(res["worker"], res["plan"])
        if not skip_driver:
            got = lab.start_driver(bundle, [], "driver.log", 220)
            rows = [r for r in got["metrics"] if "reward/mean" in r]
            measured = {p: [round(float(r[f"memory/{p}/used_gib"]), 3) for r in rows if f"memory/{p}/used_gib" in r]
                        for p in ("logprobs", "train", "generate")}
            res["driver"] = {"rc": got["rc"], "seconds": got["seconds"], "steps": len(rows),
                             "kl_ref": [r.get("loss/kl_ref") for r in rows],
                             "gen_kl": [r.get("gen_kl") for r in rows],
                             "memory_used_gib": measured,
                             "planned_gib": {"train": res["plan"]["on"]["phases_gib"]["train"],
                                             "generate": res["plan"]["on"]["phases_gib"]["generate"],
                                             "logprob_peak": res["plan"]["on"]["phases_gib"]["logprob"]},
                             "log_tail": moe._tail(got["log"], 12 if got["rc"] == 0 else 40)}
            res["driver_passed"], res["driver_problems"] = verdict_driver(got, 3)
    except Exception:  # noqa: BLE001 - the record says what broke
        res["error"] = traceback.format_exc()[-3000:]
    finally:
        lab.close()
    res["passed"] = bool(res.get("worker_passed") and (skip_driver or res.get("driver_passed")) and "error" not in res)
    res["seconds"] = clock()
    dump(res, out, "ref_offload")
    print("ref_offload:", "passed" if res["passed"] else "FAILED",
          res.get("worker_problems", []), res.get("driver_problems", []), res.get("error", "")[-500:], flush=True)
    return res


# ------------------------------------------------------------------ CPU tests of the verdicts and the plan


def _good_probe(plan: dict) -> dict:
    ref, host = plan["reference_gpu_bytes"], plan["on"]["reference_host_bytes"]
    return {"rc": 0, "bit_exact": True, "second_copy_bit_exact": True, "resident_deterministic": True,
            "swapped_vs_resident_max_abs": 0.0, "policy_vs_reference_max_abs": 0.05, "trainer_untouched": True,
            "resident_after_setup": 0, "resident_after_pass": 0, "allocated_before_pass": 5 * GIB,
            "allocated_after_pass": 5 * GIB, "pass_peak_over_before": int(plan["logprob_extra_bytes"] * 1.04),
            "runtime_host_bytes": host,
            "switch": {"gpu_taken_by_resident": ref + (4 << 20), "gpu_freed_by_offload": ref,
                       "rss_taken_by_copy": int(host * 1.01)}}


def _plan_for_tests(tmp_path: Path) -> dict:
    from rlc.runtime.toy_model import _hf_config, DENSE_CONFIG  # noqa: PLC0415
    from rlc.runtime import toy  # noqa: PLC0415

    ckpt = tmp_path / "qwen3"
    _hf_config({**DENSE_CONFIG, **MEDIUM}, toy.vocab_size(), "bfloat16").save_pretrained(ckpt)
    return planned(ckpt)


def test_the_plan_of_the_probe_recipe_separates_the_switchs_memory(tmp_path):
    """CPU: with the switch the reference leaves the train step for host memory, in pinned blocks within
    2 MiB of its bytes, and is back (with the logits) in the logprob pass; the sizes are large enough to measure."""
    pytest.importorskip("transformers")
    plan = _plan_for_tests(tmp_path)
    ref = plan["reference_gpu_bytes"]
    assert ref == plan["on"]["params_bytes"] > 0.35 * GIB
    assert 0 <= plan["on"]["reference_host_bytes"] - ref < 2 << 20
    assert plan["off"]["phases_gib"]["train"] - plan["on"]["phases_gib"]["train"] == pytest.approx(ref / GIB)
    assert plan["on"]["phases_gib"]["logprob"] == pytest.approx(plan["off"]["phases_gib"]["logprob"])
    assert plan["logprob_extra_bytes"] >= ref


def test_worker_verdict_passes_good_evidence_and_fails_each_kind_of_bad(tmp_path):
    pytest.importorskip("transformers")
    plan = _plan_for_tests(tmp_path)
    assert verdict_worker(_good_probe(plan), plan) == (True, [])
    for change, words in (({"bit_exact": False}, "differ"), ({"trainer_untouched": False}, "trainer"),
                          ({"policy_vs_reference_max_abs": 0.0}, "did not move"),
                          ({"resident_after_pass": 4096}, "left on the GPU"),
                          ({"allocated_after_pass": 6 * GIB}, "left"),
                          ({"runtime_host_bytes": 512 << 20}, "pinned blocks"),
                          ({"pass_peak_over_before": plan["logprob_extra_bytes"] // 2}, "peak"),
                          ({"switch": {**_good_probe(plan)["switch"], "rss_taken_by_copy": 512 << 20}}, "RSS"),
                          ({"rc": 1}, "exit 1")):
        ok, problems = verdict_worker({**_good_probe(plan), **change}, plan)
        assert not ok and words in " ".join(problems), (change, problems)


def test_driver_verdict():
    good = {"rc": 0, "metrics": [{"reward/mean": 0.1, "loss/kl_ref": 0.0}] * 3}
    assert verdict_driver(good, 3) == (True, [])
    assert not verdict_driver({**good, "rc": 3}, 3)[0]
    assert "KL term" in " ".join(verdict_driver({"rc": 0, "metrics": [{"reward/mean": 0.1}] * 3}, 3)[1])


def test_ref_offload_on_gpu(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    assert run(str(tmp_path), str(tmp_path))["passed"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/rlc-ref-offload")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--skip-driver", action="store_true", help="only the worker checks (1a, 1b)")
    ap.add_argument("--probe-worker", help=argparse.SUPPRESS)  # internal: the worker probe's own process
    ap.add_argument("--probe-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe_worker:
        Path(a.probe_out).write_text(json.dumps(probe_worker(a.probe_worker), indent=2, default=str))
        sys.exit(0)
    r = run(a.root, a.out, a.skip_driver)
    sys.exit(0 if r["passed"] else 1)
