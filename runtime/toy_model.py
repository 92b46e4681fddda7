"""Build the tiny random-init Qwen3 (or Qwen3-MoE) checkpoint the GPU proofs train.

Nothing is downloaded: the model is made from a config with ``transformers`` (random init, fixed
seed), saved with ``save_pretrained`` next to the toy task's character-level tokenizer
(``rlc.runtime.toy.build_tokenizer``), so Megatron-Bridge (``AutoBridge.from_hf_pretrained``) and
vLLM both load the same directory. ``vocab_size`` is always the tokenizer's size, so vLLM never
samples an id the tokenizer cannot decode.

``python -m rlc.runtime.toy_model OUT [--config config.json] [--moe] [--seed S]`` writes
``OUT/qwen3/`` (checkpoint + tokenizer) and ``OUT/data/{train,val}.jsonl`` (the toy task), the
layout ``rlc/recipes/tiny-qwen3-1gpu.yaml`` expects for ``OUT=/tmp/rlc-tiny``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rlc.contract.files import parse_json, read_text_capped
from rlc.runtime import toy

def _shipped_tiny_config() -> dict[str, Any]:
    """The dense tiny Qwen3 of ``rlc/recipes/models/tiny-qwen3/config.json`` (the recipe plans with it)."""
    from importlib.resources import files  # noqa: PLC0415

    text = (files("rlc.recipes") / "models" / "tiny-qwen3" / "config.json").read_text(encoding="utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_") and k != "torch_dtype"}


#: The dense tiny Qwen3 (hidden 128, 2 layers); ``vocab_size`` is replaced by the tokenizer's size.
DENSE_CONFIG: dict[str, Any] = _shipped_tiny_config()

#: The tiny Qwen3-MoE for the expert-parallel proofs (4 experts, top-2).
MOE_CONFIG: dict[str, Any] = {
    **DENSE_CONFIG,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.0,
    "output_router_logits": False,
}


def _hf_config(fields: dict[str, Any], vocab_size: int, dtype: str):
    from transformers import AutoConfig  # noqa: PLC0415

    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    model_type = fields.pop("model_type")
    fields.pop("torch_dtype", None)
    fields.pop("dtype", None)
    fields["vocab_size"] = vocab_size

    fields.setdefault("bos_token_id", toy.BOS_ID)
    fields.setdefault("eos_token_id", toy.EOS_ID)
    fields.setdefault("pad_token_id", toy.PAD_ID)
    config = AutoConfig.for_model(model_type, **fields)
    config.dtype = dtype
    return config


def build_toy_model(
    out_dir: str | Path,
    *,
    config: dict[str, Any] | str | Path | None = None,
    moe: bool = False,
    seed: int = 0,
    dtype: str = "bfloat16",
    vocab_size: int | None = None,
) -> Path:
    """Write a random-init HF checkpoint + the toy tokenizer into ``out_dir``; returns it.

    ``config``: a dict or a ``config.json`` path overriding the built-in tiny config (its
    ``vocab_size`` is ignored: the tokenizer's size is used). ``vocab_size``: the model's vocabulary
    instead (at least the tokenizer's; the rows past it are never produced by the tokenizer), e.g. padded
    so that Megatron can split the embedding over tensor parallelism.
    """
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    fields = dict(MOE_CONFIG if moe else DENSE_CONFIG)
    if config is not None:
        extra = config if isinstance(config, dict) else parse_json(read_text_capped(config))
        fields.update(extra)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if vocab_size is not None and vocab_size < toy.vocab_size():
        raise ValueError(f"vocab_size {vocab_size} is smaller than the toy tokenizer's {toy.vocab_size()} tokens")
    hf_config = _hf_config(fields, vocab_size or toy.vocab_size(), dtype)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    model = model.to(getattr(torch, dtype))
    model.generation_config.bos_token_id = toy.BOS_ID
    model.generation_config.eos_token_id = toy.EOS_ID
    model.generation_config.pad_token_id = toy.PAD_ID
    model.save_pretrained(str(out), safe_serialization=True)
    toy.build_tokenizer(out)
    return out


def build_toy_workspace(root: str | Path, *, moe: bool = False, seed: int = 0, config: Any = None,
                        train: int = 4096, val: int = 128, vocab_size: int | None = None) -> dict[str, Path]:
    """``root/qwen3`` (checkpoint + tokenizer) and ``root/data/{train,val}.jsonl``."""
    root = Path(root)
    ckpt = build_toy_model(root / ("qwen3_moe" if moe else "qwen3"), config=config, moe=moe, seed=seed,
                           vocab_size=vocab_size)
    train_path = toy.write_dataset(root / "data" / "train.jsonl", train, seed)
    val_path = toy.write_dataset(root / "data" / "val.jsonl", val, seed + 1)
    return {"checkpoint": ckpt, "train": train_path, "val": val_path}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlc.runtime.toy_model", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="output folder (e.g. /tmp/rlc-tiny)")
    parser.add_argument("--config", type=Path, default=None, help="config.json overriding the built-in tiny config")
    parser.add_argument("--moe", action="store_true", help="tiny Qwen3-MoE instead of the dense model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = build_toy_workspace(args.out, moe=args.moe, seed=args.seed, config=args.config)
    for k, v in paths.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
