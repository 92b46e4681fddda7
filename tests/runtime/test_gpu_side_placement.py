"""CPU tests of the GPU side's pure parts: placement math, worker env, identity, calibration records."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlc.contract.runtime_config import load_runtime_config, runtime_config_from_dict, runtime_config_to_dict
from rlc.runtime import workers as W

TINY = Path(__file__).resolve().parents[1] / "gpu" / "tiny_runtime.yaml"


def cfg_with(**changes):
    d = runtime_config_to_dict(load_runtime_config(TINY))
    for key, value in changes.items():
        node = d
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return runtime_config_from_dict(d)


def test_tiny_runtime_yaml_matches_the_contract():
    cfg = load_runtime_config(TINY)
    assert cfg.cluster.world_size == 1 and cfg.colocated


def test_import_is_light():
    """The driver, workers and worker packages import without torch, ray, vllm or megatron."""
    import subprocess  # noqa: PLC0415

    code = (
        "import sys, rlc.runtime, rlc.contract.runtime_config, rlc.runtime.workers, rlc.runtime.driver, "
        "rlc.runtime.policy, rlc.runtime.generation, rlc.runtime.generation.sampling, rlc.runtime.__main__; "
        "bad = [m for m in ('torch', 'ray', 'vllm', 'megatron') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_one_gpu_placement():
    p = W.plan_placement(load_runtime_config(TINY))
    assert p.world_size == 1 and p.bundles == [{"GPU": 1.0, "CPU": 2.0}]
    assert p.policy_bundles == [0] and p.engine_bundles == [[0]] and p.gpu_fraction == 0.5


def test_multi_node_placement_engines_cover_all_gpus():
    cfg = cfg_with(**{
        "cluster.nodes": 4, "cluster.gpus_per_node": 8, "cluster.world_size": 32,
        "train_parallel.tp": 4, "train_parallel.pp": 2, "train_parallel.dp": 4,
        "generation_parallel.tp": 8, "generation_parallel.dp": 4,
    })
    p = W.plan_placement(cfg)
    assert p.num_engines == 4 and p.gpus_per_engine == 8
    assert sorted(b for e in p.engine_bundles for b in e) == list(range(32))
    assert p.policy_bundles == list(range(32))


@pytest.mark.parametrize("change,needle", [
    ({"train_parallel.tp": 3}, "does not divide"),
    ({"train_parallel.dp": 2}, "train_parallel.dp=2"),
    ({"generation_parallel.dp": 2}, "generation_parallel.dp=2"),
    ({"colocated": False}, "colocated: false"),
    ({"cluster.world_size": 2}, "cluster.world_size=2"),
])
def test_bad_layouts_name_the_key(change, needle):
    with pytest.raises(W.PlacementError, match=needle.replace("*", r"\*")):
        W.plan_placement(cfg_with(**change))


def test_bundles_ordered_by_node():
    assert W.order_bundles_by_node(["b", "a", "b", "a"]) == [0, 2, 1, 3]
    assert W.order_bundles_by_node(["x", "x", "y"]) == [0, 1, 2]


def test_worker_env_forwards_and_refuses_expandable_segments():
    cfg = cfg_with(env={"FOO": "1"})
    env = W.worker_env(cfg, host_env={"PYTHONPATH": "/site", "NCCL_NVLS_ENABLE": "0", "OTHER": "x"})
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["PYTHONPATH"] == "/site" and env["NCCL_NVLS_ENABLE"] == "0" and env["FOO"] == "1"
    assert "OTHER" not in env
    with pytest.raises(W.PlacementError, match="expandable_segments"):
        W.worker_env(cfg_with(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}), host_env={})


def test_worker_info_describes_node_and_gpu():
    info = W.WorkerInfo(
        role="policy", rank=3, node_ip="10.0.0.7", hostname="gpu17", gpu_ids=[3], gpu_uuid="GPU-abc", pid=42, bundle=3
    )
    text = info.describe()
    for part in ("policy worker 3", "10.0.0.7", "gpu17", "GPU 3", "GPU-abc"):
        assert part in text
    assert W.WorkerInfo(**info.to_dict()) == info
