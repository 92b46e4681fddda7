"""Shared helpers of the GPU-host proofs (no GPU imports at module level: CI collects this file).

Each proof is a function returning a JSON-able dict, a pytest test marked ``gpu`` (skipped without
CUDA/vLLM/Megatron), and a ``__main__`` entry so ``tests/gpu/host_run.sh`` can run it as a script.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TINY_RUNTIME_YAML = HERE / "tiny_runtime.yaml"


def gpu_available() -> bool:
    try:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            return False
        import megatron.bridge  # noqa: F401,PLC0415
        import ray  # noqa: F401,PLC0415
        import vllm  # noqa: F401,PLC0415
    except Exception:
        return False
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
