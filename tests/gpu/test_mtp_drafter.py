"""GPU check: MTP speculative decoding in the runtime's vLLM worker, measured against the planner's drafter.

The engine is the one the shipped recipe ``tiny-moe-mtp-2gpu-ep2`` compiles to (a tiny random DeepSeek-V3 with
one MTP layer, built from its ``config.json`` with transformers plus the MTP layer's weights: no download) with
``generation.speculative_decoding: {method: mtp, num_speculative_tokens: 1}`` and ``refit.sleep_level: 1``,
started alone on GPU 0 with the runtime's own ``VllmGenerationWorker``:

1. ``drafter``: the drafter's own parameter bytes (vLLM's ``model_runner.drafter.model`` less what it shares with
   the model: the embedding and ``lm_head``, both shared) match the planner's ``vllm_weights(...).drafter`` for the
   recipe within ``DRAFTER_TOLERANCE``;
2. ``generate``: the engine generates with the drafter on, before and after ``sleep(1)`` + ``wake_up``;
3. ``sleep``: the freed memory is overwritten after each sleep (as the trainer's step would) before
   ``wake_up``: after level 1 the drafter's weights are back bit for bit (host backup); after level 2 they are
   not (nothing writes them back: why RLC314 refuses mtp with sleep level 2).

GPU memory (device-wide used GiB) is printed at start, after each sleep and after each wake-up.

    python tests/gpu/test_mtp_drafter.py [--root /tmp/rlc-specdec] [--out DIR]   # one GPU
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import pytest

from tests.gpu.common import Timer, dump, gpu_available, lone_vllm_worker

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "rlc" / "recipes" / "tiny-moe-mtp-2gpu-ep2.yaml"
SPEC = ("generation.speculative_decoding.method=mtp", "generation.speculative_decoding.num_speculative_tokens=1",
        "refit.sleep_level=1")
OVERWRITE_SHARE = 0.9  # of the free memory after a sleep, filled before the wake-up
#: measured vs planned drafter bytes: the plan counts every parameter in the model dtype, vLLM keeps the router
#: bias (8 values here) in fp32; an unshared embedding (64 x 128 here) would be 0.8 % more
DRAFTER_TOLERANCE = 0.005


def compile_check(root: Path):
    """The compiler's check of the recipe with speculative decoding and this probe's folders (what
    ``rlc compile`` resolves into runtime.yaml)."""
    from rlc.compiler import api  # noqa: PLC0415

    sets = [*SPEC, f"model.checkpoint={root}/moe/deepseek_v3", f"data.train={root}/moe/data/train.jsonl",
            f"cluster.log_dir={root}/logs", f"logging.dir={root}/logs", f"checkpointing.dir={root}/ckpt"]
    result = api.check(str(RECIPE), sets)
    if not result.ok:
        raise RuntimeError("recipe has errors: " + "; ".join(d.message for d in result.errors))
    return result


def _drafter_params(worker) -> dict:
    """Inside vLLM's worker: the drafter's own parameters (not shared with the model) as bytes and a checksum."""
    runner = worker.model_runner
    shared = {p.data_ptr() for p in runner.model.parameters()}
    own = [p for p in runner.drafter.model.parameters() if p.data_ptr() not in shared]
    return {"bytes": sum(p.numel() * p.element_size() for p in own), "tensors": len(own),
            "checksum": float(sum(p.detach().double().abs().sum().item() for p in own)),
            "shared": sum(1 for p in runner.drafter.model.parameters() if p.data_ptr() in shared),
            "dtype": str(own[0].dtype) if own else ""}


def drafter_params(gen_worker) -> dict:
    """In the generation actor: ``_drafter_params`` on vLLM's (in-process) worker."""
    return gen_worker.llm.collective_rpc(_drafter_params)[0]


def overwrite_free_memory(gen_worker) -> float:
    """In the generation actor: fill ``OVERWRITE_SHARE`` of the free GPU memory with a pattern, then free it."""
    import torch  # noqa: PLC0415

    free, _ = torch.cuda.mem_get_info()
    n = int(free * OVERWRITE_SHARE) // 2
    block = torch.full((n,), 7.0, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    del block
    torch.cuda.empty_cache()
    return n * 2 / 2**30


def verdict(observed: dict) -> tuple[bool, list[str]]:
    """Pure: the three checks of the module docstring on what the probe recorded."""
    problems = []
    d = observed.get("drafter") or {}
    measured, planned = d.get("bytes"), observed.get("predicted_drafter_bytes")
    if not measured or not planned or abs(measured - planned) > DRAFTER_TOLERANCE * planned:
        problems.append(f"drafter bytes {measured} vs planned {planned}: more than {DRAFTER_TOLERANCE:.1%} apart")
    if d.get("shared", 0) < 2:
        problems.append(f"the drafter shares {d.get('shared')} parameters with the model (expected the embedding "
                        "and lm_head)")
    for name in ("generated_before", "generated_after_level1"):
        if not observed.get(name):
            problems.append(f"{name}: no tokens")
    sums = observed.get("checksums", {})
    if sums.get("after_level1") != sums.get("start"):
        problems.append(f"drafter changed across sleep(1): {sums.get('start')} -> {sums.get('after_level1')}")
    if sums.get("after_level2") is None or sums.get("after_level2") == sums.get("start"):
        problems.append("drafter unchanged across sleep(2) with the freed memory overwritten (or not measured)")
    return not problems, problems


def run(root: str, out: str | None) -> dict:
    import ray  # noqa: PLC0415

    from rlc.compiler.planner.memory import vllm_weights  # noqa: PLC0415
    from rlc.compiler.resolve import to_runtime_config  # noqa: PLC0415
    from tests.gpu.test_four_gpu_grpo import _env, build_workspace  # noqa: PLC0415

    # the probe's functions run in the generation actor, which cannot import this file: send them by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    t = Timer()
    root_p = Path(root)
    res: dict = {"check": "MTP speculative decoding: drafter bytes vs plan, generation, sleep levels",
                 "command": "python tests/gpu/test_mtp_drafter.py --out DIR", "recipe": RECIPE.name,
                 "sets": list(SPEC), "memory": {}, "checksums": {}}
    try:
        if not (root_p / "moe" / "deepseek_v3" / "config.json").exists():
            build_workspace(root_p / "moe")
        result = compile_check(root_p)
        weights, unknown = vllm_weights(result.recipe, result.facts)
        res["predicted_drafter_bytes"] = None if weights is None else weights.drafter
        res["planned_unknown"] = unknown
        prompts = [[3, 4, 5, 6], [7, 8, 9, 10]]
        with lone_vllm_worker(to_runtime_config(result), "specdec-probe", _env(REPO)["PYTHONPATH"]) as gen:

            def tokens() -> int:
                out = ray.get(gen.generate.remote(prompts, 2), timeout=300)
                return sum(len(s.token_ids) for group in out.samples for s in group)

            started = ray.get(gen.start.remote(), timeout=600)
            res["memory"]["started_used_gib"] = round(started.memory.used_gib, 3)
            res["drafter"] = ray.get(gen.call.remote(drafter_params), timeout=120)
            res["checksums"]["start"] = res["drafter"]["checksum"]
            res["generated_before"] = tokens()
            for level in (1, 2):
                slept = ray.get(gen.sleep.remote(level), timeout=300)
                res["memory"][f"after_sleep{level}_used_gib"] = round(slept.memory.used_gib, 3)
                res[f"overwritten_level{level}_gib"] = round(ray.get(gen.call.remote(overwrite_free_memory)), 3)
                woke = ray.get(gen.wake_up.remote(None), timeout=300)
                res["memory"][f"after_wake{level}_used_gib"] = round(woke.memory.used_gib, 3)
                res["checksums"][f"after_level{level}"] = ray.get(gen.call.remote(drafter_params))["checksum"]
                if level == 1:
                    res["generated_after_level1"] = tokens()
            ray.get(gen.shutdown.remote(), timeout=120)
    except Exception as exc:
        res.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}"[:3000])
        print(traceback.format_exc(), flush=True)
    res["passed"], res["problems"] = verdict(res)
    if res.get("errors"):
        res["passed"] = False
    res["seconds"] = t()
    dump(res, out, "speculative_decoding")
    print("memory (GiB used):", res["memory"], "\npassed:", res["passed"], res["problems"], flush=True)
    return res


def _good() -> dict:
    return {"drafter": {"bytes": 1000, "shared": 2}, "predicted_drafter_bytes": 1002, "generated_before": 8,
            "generated_after_level1": 8, "checksums": {"start": 1.5, "after_level1": 1.5, "after_level2": 9.0}}


def test_verdict_passes_on_good_evidence_and_fails_on_each_kind_of_bad():
    """CPU: the verdict the GPU run is judged by."""
    assert verdict(_good()) == (True, [])
    for change, words in (({"predicted_drafter_bytes": 900}, "planned 900"), ({"generated_before": 0}, "no tokens"),
                          ({"drafter": {"bytes": 1000, "shared": 0}}, "shares 0 parameters"),
                          ({"checksums": {"start": 1.5, "after_level1": 2.0, "after_level2": 9.0}}, "sleep(1)"),
                          ({"checksums": {"start": 1.5, "after_level1": 1.5, "after_level2": 1.5}}, "sleep(2)")):
        ok, problems = verdict({**_good(), **change})
        assert not ok and words in " ".join(problems)


def test_speculative_decoding_on_gpu(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    assert run(str(tmp_path), str(tmp_path))["passed"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/rlc-specdec")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.exit(0 if run(a.root, a.out)["passed"] else 1)
