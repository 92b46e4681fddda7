"""Build the tiny random-init Qwen3 (or Qwen3-MoE) checkpoint the GPU proofs train.

Nothing is downloaded: the model is made from a config with ``transformers`` (random init, fixed
seed), saved with ``save_pretrained`` next to the toy task's character-level tokenizer
(``rlc.runtime.toy.build_tokenizer``), so Megatron-Bridge (``AutoBridge.from_hf_pretrained``) and
vLLM both load the same directory. ``vocab_size`` is always the tokenizer's size, so vLLM never
samples an id the tokenizer cannot decode.

A config may name weight matrices drawn at another standard deviation than its ``initializer_range``
(``"_init_std": {"model.layers.*.self_attn.*": 0.07}``: fnmatch patterns over tensor names, first match wins;
see :func:`with_init_std`); the builder applies them to the checkpoint it writes.

``python -m rlc.runtime.toy_model OUT [--config config.json] [--moe] [--seed S]`` writes
``OUT/qwen3/`` (checkpoint + tokenizer) and ``OUT/data/{train,val}.jsonl`` (the toy task), the
layout ``rlc/recipes/tiny-qwen3-1gpu.yaml`` expects for ``OUT=/tmp/rlc-tiny``.
"""
from __future__ import annotations

import argparse
import fnmatch
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


#: The config key naming weight matrices drawn at another std (not a transformers field: rlc's builder reads it).
INIT_STD_KEY = "_init_std"


def build_toy_model(
    out_dir: str | Path,
    *,
    config: dict[str, Any] | str | Path | None = None,
    moe: bool = False,
    seed: int = 0,
    dtype: str = "bfloat16",
    vocab_size: int | None = None,
    init_std: dict[str, float] | None = None,
) -> Path:
    """Write a random-init HF checkpoint + the toy tokenizer into ``out_dir``; returns it.

    ``config``: a dict or a ``config.json`` path overriding the built-in tiny config (its
    ``vocab_size`` is ignored: the tokenizer's size is used). ``vocab_size``: the model's vocabulary
    instead (at least the tokenizer's; the rows past it are never produced by the tokenizer), e.g. padded
    so that Megatron can split the embedding over tensor parallelism.
    ``init_std``: the weight matrices drawn at another std (:func:`with_init_std`); ``None`` takes the
    config's ``_init_std`` (none if it has none), ``{}`` draws every matrix at ``initializer_range``.
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
    chosen = fields.get(INIT_STD_KEY) if init_std is None else init_std
    if chosen:
        rescale_init(out, {str(k): float(v) for k, v in dict(chosen).items()})
    toy.build_tokenizer(out)
    return out


def with_init_std(sd: dict[str, Any], cfg: dict[str, Any], init_std: dict[str, float]) -> dict[str, Any]:
    """``sd`` with the weight matrices named by ``init_std`` (fnmatch pattern over tensor names -> std) drawn at
    that std instead of ``initializer_range``; the first matching pattern wins.

    transformers initialises every weight matrix of these models (projections, experts, router, embedding,
    head) as ``N(0, initializer_range)`` (the embedding's padding row 0) and ``normal_`` scales one standard draw
    per element by the std; so each matched matrix is rescaled by ``std / initializer_range``: the builder's
    own draws of its seed at the new std (a pattern ``*`` at 0.07 is the checkpoint of ``initializer_range``
    0.07, up to one bf16 rounding). Vectors (norm weights, the router bias) keep their values. A pattern
    that names no weight matrix is an error.
    """
    import torch  # noqa: PLC0415

    base = float(cfg.get("initializer_range", 0.02))
    out, used = dict(sd), dict.fromkeys(init_std, 0)
    for name, t in sd.items():
        if t.ndim < 2 or not t.is_floating_point():
            continue
        pattern = next((p for p in init_std if fnmatch.fnmatchcase(name, p)), None)
        if pattern is None:
            continue
        used[pattern] += 1
        out[name] = (t.to(torch.float64) * (float(init_std[pattern]) / base)).to(t.dtype)
    unused = [p for p, n in used.items() if n == 0]
    if unused:
        raise ValueError(f"init_std: pattern(s) {unused} name no weight matrix of the checkpoint (e.g. "
                         f"'model.layers.*.self_attn.*', 'lm_head.weight'); fix or remove them")
    return out


def transform_checkpoint(ckpt: str | Path, change: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``change(state_dict, config) -> state_dict`` applied to a one-file safetensors checkpoint, in place;
    returns the state dicts before and after."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    ckpt = Path(ckpt)
    files = sorted(ckpt.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{ckpt}: expected one safetensors file, found {len(files)}")
    cfg = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    sd = load_file(str(files[0]))
    new = change(sd, cfg)
    save_file(new, str(files[0]), metadata={"format": "pt"})
    return sd, new


def rescale_init(ckpt: str | Path, init_std: dict[str, float]) -> dict[str, Any]:
    """:func:`with_init_std` applied to a one-file safetensors checkpoint, in place; returns how many tensors it
    changed."""
    sd, new = transform_checkpoint(ckpt, lambda sd, cfg: with_init_std(sd, cfg, init_std))
    return {"init_std": dict(init_std), "rescaled_tensors": sum(1 for k in sd if new[k] is not sd[k])}


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
