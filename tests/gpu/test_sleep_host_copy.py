"""GPU check: the host memory of vLLM's sleep-level-1 weight copy, measured against the planner's pinned blocks.

The planner counts sleep level 1's copy as PyTorch's pinned blocks (``rlc/compiler/planner/pinned_copy.py``):
vLLM backs each allocation of its weight pool up in a pinned CPU tensor of its own, and PyTorch rounds every
pinned allocation up to a power of two and keeps the blocks cached after wake-up. This probe builds a random
Qwen3-MoE whose expert tensors are not powers of two (16 experts of 704: ``w13`` 44 MiB, ``w2`` 22 MiB per
layer; no download), starts it alone on GPU 0 with the runtime's own ``VllmGenerationWorker`` and records:

1. ``pool``: the allocations of vLLM's weight pool (``CuMemAllocator``'s handles tagged ``weights``), their
   bytes and the sum of their sizes rounded up to a power of two;
2. ``rss``: the resident memory of the generation actor (and its children) before ``sleep(1)``, after it and
   after ``wake_up``.

Verdict: the pool's rounded sum is within ``POOL_TOLERANCE`` of the planner's copy (the segment model), the
RSS growth at ``sleep(1)`` within ``RSS_TOLERANCE`` of the planner's copy and at least ``ROUNDING_SEEN`` × the
raw weights (what the planner counted before), and after ``wake_up`` at least ``KEPT_SHARE`` of the growth is
still resident (the cached pinned blocks the planner keeps counting through the refit).

    python tests/gpu/test_sleep_host_copy.py [--root /tmp/rlc-host-copy] [--out DIR]   # one GPU
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import pytest

from tests.gpu.common import Timer, dump, gpu_available, lone_vllm_worker

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml"
#: Qwen3-MoE with expert tensors of 44 and 22 MiB (rounded to 64 and 32 MiB blocks): 16 layers, ~1.1 GiB of
#: weights whose copy the planner puts at ~1.6 GiB
MODEL = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 704,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "router_aux_loss_coef": 0.0,
    "output_router_logits": False, "tie_word_embeddings": False, "max_position_embeddings": 256,
}
SETS = ("refit.sleep_level=1", "generation.enforce_eager=true", "generation.gpu_memory_utilization=0.2")
POOL_TOLERANCE = 0.05  # the pool's handles rounded vs the planner's segment model
RSS_TOLERANCE = 0.10  # RSS growth at sleep(1) vs the planner's copy
ROUNDING_SEEN = 1.2  # RSS growth over the raw weights: the rounding is there
KEPT_SHARE = 0.9  # of the growth still resident after wake_up


def power_of_two_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


def build_model(root: Path) -> Path:
    from rlc.runtime.toy_model import build_toy_workspace  # noqa: PLC0415

    if not (root / "qwen3_moe" / "config.json").exists():
        build_toy_workspace(root, moe=True, config=MODEL, train=64, val=8)
    return root / "qwen3_moe"


def compile_check(root: Path, ckpt: Path):
    """The planner's view of the probe's engine: the tiny recipe with this model and sleep level 1."""
    from rlc.compiler import api  # noqa: PLC0415

    sets = [*SETS, f"model.config={ckpt}/config.json", f"model.checkpoint={ckpt}", "model.id=rlc/host-copy-moe",
            f"data.train={root}/data/train.jsonl", f"cluster.log_dir={root}/logs", f"logging.dir={root}/logs",
            f"checkpointing.dir={root}/ckpt"]
    result = api.check(str(RECIPE), sets)
    if not result.ok:
        raise RuntimeError("recipe has errors: " + "; ".join(d.message for d in result.errors))
    return result


def pool_allocations(gen_worker) -> list[int]:
    """In the generation actor: bytes of each allocation of vLLM's weight pool."""
    from vllm.device_allocator.cumem import CuMemAllocator  # noqa: PLC0415

    return [int(data.handle[1]) for data in CuMemAllocator.get_instance().pointer_to_data.values()
            if data.tag == "weights"]


def resident_bytes(gen_worker) -> int:
    """In the generation actor: resident memory of this process and its children."""
    import psutil  # noqa: PLC0415

    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])


def verdict(observed: dict) -> tuple[bool, list[str]]:
    """Pure: the checks of the module docstring on what the probe recorded."""
    problems = []
    planned, raw = observed.get("planned_copy_bytes"), observed.get("planned_weight_bytes")
    pool = observed.get("pool_rounded_bytes")
    rss = observed.get("rss", {})
    if not planned or not raw:
        return False, ["no planned copy"]
    if not pool or abs(pool - planned) > POOL_TOLERANCE * planned:
        problems.append(f"vLLM's weight pool rounded to pinned blocks is {pool} bytes, the plan {planned}")
    before, slept, woke = rss.get("before"), rss.get("after_sleep1"), rss.get("after_wake1")
    if before is None or slept is None or woke is None:
        return False, problems + ["RSS not measured"]
    growth = slept - before
    if abs(growth - planned) > RSS_TOLERANCE * planned:
        problems.append(f"RSS grew {growth} bytes at sleep(1), the plan's copy is {planned}")
    if growth < ROUNDING_SEEN * raw:
        problems.append(f"RSS grew {growth} bytes at sleep(1), under {ROUNDING_SEEN} x the {raw} bytes of weights")
    if woke - before < KEPT_SHARE * growth:
        problems.append(f"after wake_up {woke - before} of the {growth} bytes are still resident")
    return not problems, problems


def run(root: str, out: str | None) -> dict:
    import ray  # noqa: PLC0415

    from rlc.compiler.resolve import to_runtime_config  # noqa: PLC0415
    from tests.gpu.test_four_gpu_grpo import _env  # noqa: PLC0415

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    t = Timer()
    root_p = Path(root)
    res: dict = {"check": "sleep level 1's host copy: vLLM's pool and RSS vs the planner's pinned blocks",
                 "command": "python tests/gpu/test_sleep_host_copy.py --out DIR", "model": MODEL, "sets": list(SETS),
                 "rss": {}}
    try:
        ckpt = build_model(root_p)
        result = compile_check(root_p, ckpt)
        host = result.plan.host
        res["planned_copy_bytes"] = int(host.item_gib("vLLM weight copy (sleep level 1)") * 2**30)
        res["planned_weight_bytes"] = int(result.plan.vllm_weights_gib * 2**30)
        with lone_vllm_worker(to_runtime_config(result), "host-copy-probe", _env(REPO)["PYTHONPATH"]) as gen:
            ray.get(gen.start.remote(), timeout=600)
            sizes = ray.get(gen.call.remote(pool_allocations), timeout=120)
            res["pool_allocations"] = len(sizes)
            res["pool_bytes"] = sum(sizes)
            res["pool_rounded_bytes"] = sum(power_of_two_ceil(s) for s in sizes)
            res["rss"]["before"] = ray.get(gen.call.remote(resident_bytes), timeout=60)
            ray.get(gen.sleep.remote(1), timeout=300)
            res["rss"]["after_sleep1"] = ray.get(gen.call.remote(resident_bytes), timeout=60)
            ray.get(gen.wake_up.remote(None), timeout=300)
            res["rss"]["after_wake1"] = ray.get(gen.call.remote(resident_bytes), timeout=60)
            ray.get(gen.shutdown.remote(), timeout=120)
    except Exception as exc:
        res.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}"[:3000])
        print(traceback.format_exc(), flush=True)
    res["passed"], res["problems"] = verdict(res)
    if res.get("errors"):
        res["passed"] = False
    res["seconds"] = t()
    dump(res, out, "sleep_host_copy")
    print("passed:", res["passed"], res["problems"], flush=True)
    return res


GIB = 2**30


def _good() -> dict:
    return {"planned_copy_bytes": int(1.6 * GIB), "planned_weight_bytes": int(1.1 * GIB),
            "pool_rounded_bytes": int(1.62 * GIB),
            "rss": {"before": 5 * GIB, "after_sleep1": int(6.65 * GIB), "after_wake1": int(6.6 * GIB)}}


def test_verdict_passes_on_good_evidence_and_fails_on_each_kind_of_bad():
    """CPU: the verdict the GPU run is judged by."""
    assert verdict(_good()) == (True, [])
    for change, words in (({"pool_rounded_bytes": int(1.1 * GIB)}, "weight pool"),
                          ({"rss": {"before": 5 * GIB, "after_sleep1": int(6.1 * GIB), "after_wake1": 6 * GIB}},
                           "under 1.2"),
                          ({"rss": {"before": 5 * GIB, "after_sleep1": int(6.65 * GIB), "after_wake1": 5 * GIB}},
                           "still resident"),
                          ({"rss": {"before": 5 * GIB}}, "RSS not measured")):
        ok, problems = verdict({**_good(), **change})
        assert not ok and words in " ".join(problems)


def test_the_probe_model_is_planned_with_rounding(tmp_path):
    """CPU: the planner's copy of the probe's model is well above its weights (so the GPU run can tell them apart)."""
    import json  # noqa: PLC0415

    from rlc.compiler import api  # noqa: PLC0415

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**MODEL, "vocab_size": 23, "torch_dtype": "bfloat16"}))
    result = api.check(str(RECIPE), [*SETS, f"model.config={tmp_path}/m/config.json", "model.id=rlc/host-copy-moe"])
    copy = result.plan.host.item_gib("vLLM weight copy (sleep level 1)")
    assert copy > 1.35 * result.plan.vllm_weights_gib > 1.0


def test_sleep_host_copy_on_gpu(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    assert run(str(tmp_path), str(tmp_path))["passed"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/rlc-host-copy")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.exit(0 if run(a.root, a.out)["passed"] else 1)
