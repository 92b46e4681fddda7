"""Shared helpers of the GPU-host proofs (no GPU imports at module level: CI collects this file).

Each proof is a function returning a JSON-able dict, a pytest test marked ``gpu`` (skipped without
CUDA/vLLM/Megatron), and a ``__main__`` entry so ``tests/gpu/host_run.sh`` can run it as a script.
"""
from __future__ import annotations

import copy
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
TINY_RUNTIME_YAML = HERE / "tiny_runtime.yaml"


GPU_STACK = ("torch", "megatron.bridge", "ray", "vllm")


class GpuStackBroken(RuntimeError):
    """A GPU host whose GPU stack does not import: the GPU tests must fail there, not skip."""


def is_gpu_host() -> bool:
    """An NVIDIA driver is present (``nvidia-smi`` on PATH or ``/dev/nvidiactl``), whatever Python can import."""
    import shutil  # noqa: PLC0415

    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidiactl").exists()


def gpu_available(*, gpu_host: bool | None = None, importer=None) -> bool:
    """False on a machine without an NVIDIA GPU (CI: the GPU tests skip there).

    On a GPU host it is True, or raises :class:`GpuStackBroken` when CUDA is not usable or one of
    torch, Megatron-Bridge, Ray, vLLM does not import: a broken stack must fail the run, not turn
    every GPU proof into a silent skip. ``gpu_host`` / ``importer`` replace the probes in tests.
    """
    import importlib  # noqa: PLC0415

    if not (is_gpu_host() if gpu_host is None else gpu_host):
        return False
    importer = importer or importlib.import_module
    for name in GPU_STACK:
        try:
            module = importer(name)
        except Exception as exc:  # noqa: BLE001 - any import failure on a GPU host is the failure to report
            raise GpuStackBroken(f"GPU host, but {name} does not import: {type(exc).__name__}: {exc}") from exc
        if name == "torch" and not module.cuda.is_available():
            raise GpuStackBroken("GPU host, but torch.cuda.is_available() is False (driver/CUDA mismatch?)")
    return True


def tiny_cfg_dict(root: str | Path, **overrides: Any) -> dict:
    """The tiny runtime.yaml as a dict, paths moved under ``root``; ``overrides`` as dotted keys."""
    import yaml  # noqa: PLC0415

    d = yaml.safe_load(TINY_RUNTIME_YAML.read_text(encoding="utf-8"))
    root = str(root)
    d["model"]["checkpoint"] = f"{root}/qwen3"
    d["model"]["tokenizer"] = f"{root}/qwen3"
    d["cluster"]["log_dir"] = f"{root}/logs"
    d["data"]["train_path"] = f"{root}/data/train.jsonl"
    d["checkpointing"]["dir"] = f"{root}/ckpt"
    d["logging"]["dir"] = f"{root}/logs"
    for key, value in overrides.items():
        node = d
        parts = key.split(".")
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = copy.deepcopy(value)
    return d


def fresh_tiny_workspace(root: str | Path, config: dict[str, Any], prompts: int = 64) -> Path:
    """``root`` emptied, then the tiny Qwen3 checkpoint (built-in config with ``config`` on top) in ``root/qwen3``
    and ``prompts`` toy prompts in ``root/data/train.jsonl``, where :func:`tiny_cfg_dict` looks; returns ``root``."""
    import shutil  # noqa: PLC0415

    from rlc.runtime import toy  # noqa: PLC0415
    from rlc.runtime.toy_model import build_toy_model  # noqa: PLC0415

    base = Path(root)
    shutil.rmtree(base, ignore_errors=True)
    build_toy_model(base / "qwen3", config=config)
    toy.write_dataset(base / "data" / "train.jsonl", prompts, 0)
    return base


def write_yaml(d: dict, path: str | Path) -> Path:
    import yaml  # noqa: PLC0415

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(d, sort_keys=False), encoding="utf-8")
    return p


def dump(result: dict, out: str | Path | None, name: str) -> None:
    text = json.dumps(result, indent=2, default=str)
    print(f"== {name} ==\n{text}", flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(text + "\n", encoding="utf-8")


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return round(time.perf_counter() - self.t0, 2)


@contextmanager
def lone_vllm_worker(cfg: dict, name: str, pythonpath: str) -> Iterator[Any]:
    """The runtime's ``VllmGenerationWorker`` for runtime config ``cfg``, alone on GPU 0 in its own Ray instance.

    For probes that measure vLLM by itself: Ray starts with the worker environment the runtime would give it
    (``PYTHONPATH`` = ``pythonpath``), the worker gets half of a one-GPU placement group, and the worker, the
    group and Ray are torn down on the way out, whatever happened.
    """
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group, remove_placement_group  # noqa: PLC0415

    from rlc.contract.runtime_config import runtime_config_from_dict  # noqa: PLC0415
    from rlc.runtime.generation.vllm_worker import VllmGenerationWorker  # noqa: PLC0415
    from rlc.runtime.workers import spawn, worker_env  # noqa: PLC0415

    env = worker_env(runtime_config_from_dict(cfg))
    env["PYTHONPATH"] = pythonpath
    ray.init(address="local", num_gpus=1, runtime_env={"env_vars": env}, include_dashboard=False)
    try:
        pg = placement_group([{"GPU": 1.0, "CPU": 4.0}], strategy="PACK")
        ray.get(pg.ready(), timeout=300)
        gen = spawn(VllmGenerationWorker, pg=pg, bundle=0, num_gpus=0.5, env=env, name=name, args=(cfg, 0, [0]))
        try:
            yield gen
        finally:
            ray.kill(gen)
            remove_placement_group(pg)
    finally:
        ray.shutdown()
