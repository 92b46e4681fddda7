"""GPU check: ``model.overrides`` build the model on both sides, the trainer (Megatron-Bridge) and vLLM.

A tiny Qwen3 (weights drawn at std 0.1, so that its attention and its next-token distributions are sharp enough
for a RoPE change to show) is loaded three times from one HF checkpoint:

1. vLLM without overrides: prompt logprobs ``plain``;
2. vLLM with ``model.overrides: {rope_theta: 100.0}`` (the checkpoint says 10000): logprobs ``engine``, and the
   engine's HF config says 100;
3. the Megatron policy worker with the same overrides: logprobs ``trainer`` on the same tokens, and its
   provider's ``rotary_base`` is 100.

Passes when the override shows in the engine (``engine`` far from ``plain``) and the trainer read the same
config (``trainer`` within bf16 noise of ``engine``: ten times closer to it than to ``plain``). Without the
overrides applied, ``engine`` equals ``plain``; applied on one side only, ``trainer`` sits at ``plain``.

4. MTP blocks: a tiny DeepSeek-V3 with one MTP block (``rlc/recipes/models/tiny-moe-mtp``): Megatron-Bridge's
   provider builds ``mtp_num_layers`` 1 from the checkpoint and none with ``num_nextn_predict_layers: 0``.

    python tests/gpu/test_model_overrides.py [--root /tmp/rlc-model-overrides] [--out DIR]   # one GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.common import Timer, dump, fresh_tiny_workspace, gpu_available, tiny_cfg_dict
from tests.gpu.test_refit_logprobs import _batch, _compare, _sequences

REPO = Path(__file__).resolve().parents[2]
ROPE_THETA = 100.0
INIT_STD = 0.1
#: the trainer must sit this many times closer to the overridden engine than to the plain one
SEPARATION = 10.0
#: the override must move the engine's logprobs at least this much (max |d|)
VISIBLE = 0.2


def _engine_rope(worker: Any) -> Any:
    """Inside vLLM's worker: the RoPE parameters of the config the engine was built from."""
    engine = worker.llm.llm_engine
    config = (getattr(engine, "model_config", None) or engine.vllm_config.model_config).hf_config
    return dict(getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", None)})


def _trainer_rope(worker: Any) -> dict:
    """Inside the policy worker: the provider's RoPE base and the Bridge config's RoPE parameters."""
    hf = worker.pm.bridge.hf_pretrained
    config = hf if hasattr(hf, "to_dict") else hf.config
    return {"rotary_base": float(worker.pm.provider.rotary_base),
            "rope_parameters": dict(getattr(config, "rope_parameters", None) or {})}


def _engine_logprobs(cfg_dict: dict, pg: Any, env: dict, name: str, seqs: list) -> tuple[list, Any, float]:
    import ray  # noqa: PLC0415

    from rlc.runtime.generation.vllm_worker import VllmGenerationWorker  # noqa: PLC0415
    from rlc.runtime.workers import spawn  # noqa: PLC0415

    gen = spawn(VllmGenerationWorker, pg=pg, bundle=0, num_gpus=0.5, env=env, name=name, args=(cfg_dict, 0, [0]))
    try:
        started = ray.get(gen.start.remote()).seconds
        return ray.get(gen.prompt_logprobs.remote(seqs)), ray.get(gen.call.remote(_engine_rope)), started
    finally:
        ray.kill(gen)


def _mtp_blocks(root: Path) -> dict:
    """Megatron-Bridge's provider of the tiny DeepSeek-V3 with and without ``num_nextn_predict_layers: 0``."""
    from megatron.bridge import AutoBridge  # noqa: PLC0415

    from rlc.contract.runtime_config import runtime_config_from_dict  # noqa: PLC0415
    from rlc.runtime.policy.megatron_setup import apply_model_overrides  # noqa: PLC0415

    ckpt = root / "tiny-moe-mtp"
    ckpt.mkdir(parents=True, exist_ok=True)
    text = (REPO / "rlc" / "recipes" / "models" / "tiny-moe-mtp" / "config.json").read_text(encoding="utf-8")
    (ckpt / "config.json").write_text(json.dumps({k: v for k, v in json.loads(text).items()
                                                  if not k.startswith("_")}), encoding="utf-8")
    out = {}
    for label, overrides in (("checkpoint", {}), ("overridden", {"num_nextn_predict_layers": 0})):
        cfg = runtime_config_from_dict(tiny_cfg_dict(root, **{"model.checkpoint": str(ckpt),
                                                               "model.overrides": overrides}))
        bridge = AutoBridge.from_hf_pretrained(str(ckpt))
        apply_model_overrides(bridge, cfg)
        provider = bridge.to_megatron_provider(load_weights=False)
        out[label] = int(getattr(provider, "mtp_num_layers", None) or 0)
    out["passed"] = out["checkpoint"] == 1 and out["overridden"] == 0
    return out


def run(root: str = "/tmp/rlc-model-overrides", out: str | None = None) -> dict:
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group  # noqa: PLC0415

    from rlc.contract.runtime_config import runtime_config_from_dict  # noqa: PLC0415
    from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker  # noqa: PLC0415
    from rlc.runtime.workers import spawn, worker_env  # noqa: PLC0415

    clock = Timer()
    if __name__ != "__main__":  # functions sent to the workers must travel by value
        import ray.cloudpickle  # noqa: PLC0415

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    base = fresh_tiny_workspace(root, {"initializer_range": INIT_STD})
    res: dict = {"goal": {"rope_theta": ROPE_THETA, "visible_max_abs": VISIBLE, "separation": SEPARATION},
                 "init_std": INIT_STD}
    plain_dict = tiny_cfg_dict(base)
    over_dict = tiny_cfg_dict(base, **{"model.overrides": {"rope_theta": ROPE_THETA}})
    env = worker_env(runtime_config_from_dict(over_dict))
    if not ray.is_initialized():
        ray.init(address="local", num_gpus=1, runtime_env={"env_vars": env}, include_dashboard=False)
    try:
        pg = placement_group([{"GPU": 1.0, "CPU": 4.0}], strategy="PACK")
        ray.get(pg.ready(), timeout=300)
        seqs = _sequences()
        plain, res["plain_engine_rope"], _ = _engine_logprobs(plain_dict, pg, env, "mo-plain", seqs)
        engine, res["engine_rope"], res["vllm_start_s"] = _engine_logprobs(over_dict, pg, env, "mo-over", seqs)
        policy = spawn(MegatronPolicyWorker, pg=pg, bundle=0, num_gpus=0.5,
                       env={**env, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}, name="mo-policy", args=(over_dict, 0, 1, 0))
        try:
            master = ray.get(policy.master_address.remote())
            res["policy_setup"] = {k: v for k, v in dataclasses.asdict(
                ray.get(policy.setup.remote(master, 10))).items() if k != "memory"}
            res["trainer_rope"] = ray.get(policy.call.remote(_trainer_rope))
            batch = _batch(seqs)
            trainer = ray.get(policy.compute_logprobs.remote(batch))
        finally:
            ray.kill(policy)
    finally:
        ray.shutdown()
    res["engine_vs_plain"] = _compare_lists(engine, plain)
    res["trainer_vs_engine"] = _compare(trainer, batch, engine)
    res["trainer_vs_plain"] = _compare(trainer, batch, plain)
    visible = res["engine_vs_plain"]["max_abs"] >= VISIBLE
    same = res["trainer_vs_engine"]["mean_abs"] * SEPARATION <= res["trainer_vs_plain"]["mean_abs"]
    configs = (res["engine_rope"].get("rope_theta") == ROPE_THETA
               and res["trainer_rope"]["rotary_base"] == ROPE_THETA
               and res["plain_engine_rope"].get("rope_theta") != ROPE_THETA)
    res["checks"] = {"override_visible_in_engine": visible, "trainer_reads_the_same_config": same,
                     "both_configs_say_the_override": configs}
    try:
        res["mtp_blocks"] = _mtp_blocks(base)
    except Exception:  # reported, and the check fails
        res["mtp_blocks"] = {"passed": False, "error": traceback.format_exc()[-2000:]}
    res["passed"] = bool(visible and same and configs and res["mtp_blocks"]["passed"])
    res["elapsed_s"] = clock()
    dump(res, out, "model_overrides")
    return res


def _compare_lists(a: list[list[float]], b: list[list[float]]) -> dict:
    diffs = [abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)]
    return {"max_abs": max(diffs), "mean_abs": sum(diffs) / len(diffs), "tokens": len(diffs)}


@pytest.mark.gpu
def test_model_overrides_build_both_sides(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    res = run(str(tmp_path / "model-overrides"))
    assert res["passed"], res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/rlc-model-overrides")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    result = run(a.root, a.out)
    sys.exit(0 if result["passed"] else 1)
