"""GPU check: ``generation.fp8.keep_bf16`` keeps the named layers in bf16 in the FP8 engine and on the refit's wire.

A tiny Qwen3 whose projections are 128-aligned (head_dim 64), FP8 rollouts with ``keep_bf16: [mlp]``:

1. block scales: vLLM's parameters of the MLP layers are bf16 and those of the attention float8_e4m3fn; the
   trainer (a Megatron policy worker) and vLLM pair for the refit, where vLLM checks the trainer's quantized names
   against the modules it holds in FP8 (the prepare's layout check); one refit after a level-2 sleep (the weights
   dropped, every one rewritten by the refit) and vLLM's prompt logprobs within FP8 noise of the trainer's;
2. tensor scales: the same parameter dtypes (vLLM's online quantization with ``ignore`` patterns).

DeepGEMM is left off (``VLLM_USE_DEEP_GEMM=0``): its kernels would be compiled at engine start for minutes, and
the check is about which layers are quantized, not how fast.

    python tests/gpu/test_fp8_keep.py [--root /tmp/rlc-fp8-keep] [--out DIR]   # one GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import pytest

from tests.gpu.common import Timer, dump, fresh_tiny_workspace, gpu_available, tiny_cfg_dict
from tests.gpu.test_refit_logprobs import _batch, _compare, _refit, _sequences

KEEP = ["mlp"]
#: trainer (bf16) vs vLLM (FP8 attention) prompt logprobs after the refit, on the random-init tiny model
MAX_MEAN_ABS = 0.02


def _param_dtypes(worker: Any) -> dict:
    """Inside vLLM's worker process: each parameter's dtype."""
    return {name: str(p.dtype).replace("torch.", "") for name, p in worker.model_runner.model.named_parameters()}


def _engine_dtypes(gen: Any) -> dict:
    import ray  # noqa: PLC0415

    return ray.get(gen.call.remote(lambda w: w.llm.collective_rpc(_param_dtypes)[0]))


def _judge(dtypes: dict) -> dict:
    """MLP weights bf16, attention projection weights FP8."""
    mlp = {n: d for n, d in dtypes.items() if ".mlp." in n and n.endswith("weight")}
    attn = {n: d for n, d in dtypes.items() if ".self_attn." in n and n.endswith("proj.weight")}
    return {"mlp_weights": mlp, "attention_weights": attn,
            "passed": bool(mlp) and bool(attn) and all(d == "bfloat16" for d in mlp.values())
            and all(d == "float8_e4m3fn" for d in attn.values())}


def run(root: str = "/tmp/rlc-fp8-keep", out: str | None = None) -> dict:
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group  # noqa: PLC0415

    from rlc.contract.runtime_config import runtime_config_from_dict  # noqa: PLC0415
    from rlc.runtime.generation.vllm_worker import VllmGenerationWorker  # noqa: PLC0415
    from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker  # noqa: PLC0415
    from rlc.runtime.workers import spawn, worker_env  # noqa: PLC0415

    clock = Timer()
    if __name__ != "__main__":  # functions sent to the workers must travel by value
        import ray.cloudpickle  # noqa: PLC0415

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    base = fresh_tiny_workspace(root, {"head_dim": 64})
    res: dict = {"keep_bf16": KEEP, "goal": {"trainer_vs_vllm_mean_abs": MAX_MEAN_ABS}}
    block = tiny_cfg_dict(base, **{"generation.precision": "fp8", "generation.fp8.scales": "block",
                                   "generation.fp8.keep_bf16": KEEP, "refit.sleep_level": 2})
    tensor = tiny_cfg_dict(base, **{"generation.precision": "fp8", "generation.fp8.scales": "tensor",
                                    "generation.fp8.keep_bf16": KEEP})
    env = {**worker_env(runtime_config_from_dict(block)), "VLLM_USE_DEEP_GEMM": "0"}
    if not ray.is_initialized():
        ray.init(address="local", num_gpus=1, runtime_env={"env_vars": env}, include_dashboard=False)
    try:
        pg = placement_group([{"GPU": 1.0, "CPU": 4.0}], strategy="PACK")
        ray.get(pg.ready(), timeout=300)
        gen = spawn(VllmGenerationWorker, pg=pg, bundle=0, num_gpus=0.5, env=env, name="keep-block",
                    args=(block, 0, [0]))
        policy = spawn(MegatronPolicyWorker, pg=pg, bundle=0, num_gpus=0.5,
                       env={**env, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}, name="keep-policy", args=(block, 0, 1, 0))
        try:
            res["vllm_start_s"] = ray.get(gen.start.remote()).seconds
            res["block"] = _judge(_engine_dtypes(gen))
            master = ray.get(policy.master_address.remote())
            res["policy_setup"] = {k: v for k, v in dataclasses.asdict(
                ray.get(policy.setup.remote(master, 10))).items() if k != "memory"}
            session = "keep-block"
            prep = ray.get([policy.refit_prepare.remote(session, 0, 1), gen.refit_prepare.remote(session)])
            res["fp8_layout"] = prep[1][0].get("fp8_layout")
            res["refit"] = _refit(policy, gen, 2)
            seqs = _sequences()
            batch = _batch(seqs)
            trainer = ray.get(policy.compute_logprobs.remote(batch))
            res["trainer_vs_vllm"] = _compare(trainer, batch, ray.get(gen.prompt_logprobs.remote(seqs)))
            res["block"]["after_refit"] = _judge(_engine_dtypes(gen))["passed"]
        finally:
            ray.kill(policy)
            ray.kill(gen)
        gen = spawn(VllmGenerationWorker, pg=pg, bundle=0, num_gpus=0.5, env=env, name="keep-tensor",
                    args=(tensor, 0, [0]))
        try:
            ray.get(gen.start.remote())
            res["tensor"] = _judge(_engine_dtypes(gen))
        finally:
            ray.kill(gen)
    finally:
        ray.shutdown()
    layout_ok = bool(res.get("fp8_layout") and res["fp8_layout"].get("ok"))
    close = res["trainer_vs_vllm"]["mean_abs"] <= MAX_MEAN_ABS
    res["passed"] = bool(res["block"]["passed"] and res["block"]["after_refit"] and layout_ok and close
                         and res["tensor"]["passed"])
    res["elapsed_s"] = clock()
    dump(res, out, "fp8_keep")
    return res


@pytest.mark.gpu
def test_fp8_keep_bf16(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    res = run(str(tmp_path / "fp8-keep"))
    assert res["passed"], res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/rlc-fp8-keep")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    result = run(a.root, a.out)
    sys.exit(0 if result["passed"] else 1)
