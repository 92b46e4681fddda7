"""Converters of single NeMo-RL values to rlc values: each returns the rlc value or raises :class:`Unmappable` with
the reason (the one-to-one key tables of :mod:`.mapping` and the key functions name one per key)."""
from __future__ import annotations

from typing import Any, Callable

from rlc.compiler.importers.nemo_rl.results import Unmappable


def one_of(what: str, choices: tuple[str, ...], says: str) -> Callable[[Any], str]:
    """A converter that keeps a value among ``choices`` and refuses any other: "``what`` 'v': ``says``" with the
    choices written "a, b or c" in place of ``{}``."""
    listed = f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]

    def convert(v: Any) -> str:
        if v in choices:
            return str(v)
        raise Unmappable(f"{what} {v!r}: {says.format(listed)}")

    return convert


def same(v: Any) -> Any:
    return v


def positive_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise Unmappable(f"expected a positive integer, got {v!r}")
    return v


def non_negative_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise Unmappable(f"expected an integer >= 0, got {v!r}")
    return v


def boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise Unmappable(f"expected true or false, got {v!r}")
    return v


def number(v: Any) -> float | int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        if isinstance(v, str):
            try:
                return float(v)  # YAML 1.1 reads 1e-8 (no dot) as a string
            except ValueError:
                pass
        raise Unmappable(f"expected a number, got {v!r}")
    return v


_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


def dtype(v: Any) -> str:
    try:
        return _DTYPES[str(v).lower()]
    except KeyError:
        raise Unmappable(f"precision {v!r} is not one of bfloat16, float16, float32") from None


_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def state_dtype(v: Any) -> str:
    """A Mamba state dtype (``float32``, ``torch.float32``, ``bf16`` ...) as rlc writes it (``fp32``, ``bf16``,
    ``fp16``); NeMo-RL resolves the string to a torch dtype."""
    try:
        return _SHORT_DTYPES[_DTYPES[str(v).lower().removeprefix("torch.")]]
    except KeyError:
        raise Unmappable(f"Mamba state dtype {v!r} is not one of float32, bfloat16, float16") from None


def optimizer_name(v: Any) -> str:
    if str(v).lower() in ("adam", "adamw"):
        return "adam"
    if str(v).lower() == "sgd":
        return "sgd"
    raise Unmappable(f"optimizer {v!r}: rlc runs adam or sgd")


def lr_style(v: Any) -> str:
    if v in ("constant", "cosine", "linear"):
        return str(v)
    raise Unmappable(f"lr_decay_style {v!r}: rlc schedules are constant, cosine or linear")


def recompute(v: Any) -> str:
    return "full" if boolean(v) else "none"


def top_k(v: Any) -> int:
    k = int(v)
    return -1 if k <= 0 else k


def string_list(v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise Unmappable(f"expected a list of strings, got {v!r}")
    return v


def generation_backend(v: Any) -> str:
    """NeMo-RL ``policy.generation.backend``: ``vllm`` or ``megatron`` (megatron-core inference)."""
    if v in ("vllm", "megatron"):
        return str(v)
    raise Unmappable(f"generation backend {v!r}: rlc generates with vllm or megatron")


def int_list(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v):
        raise Unmappable(f"expected a list of token ids, got {v!r}")
    return v


def router_dtype(v: Any) -> str:
    if str(v).lower() in ("fp32", "float32"):
        return "fp32"
    if str(v).lower() in ("fp64", "float64"):
        return "fp64"
    raise Unmappable(f"moe_router_dtype {v!r}: rlc takes fp32 or fp64")


token_dispatcher = one_of("token dispatcher", ("alltoall", "allgather", "flex"), "rlc takes {}")


fp8_format = one_of("fp8 format", ("e4m3", "hybrid"), "rlc takes {}")


fp8_recipe = one_of("fp8_recipe", ("tensorwise", "delayed", "blockwise", "mxfp8"), "rlc takes {}")


_PACKING = {
    "modified_first_fit_decreasing": "modified_first_fit_decreasing",
    "modified_ffd": "modified_first_fit_decreasing",
    "first_fit_decreasing": "first_fit_decreasing",
    "first_fit_shuffle": "first_fit_shuffle",
    "concatenative": "concatenative",
}


kl_type = one_of("reference_policy_kl_type", ("k1", "k2", "k3"), "rlc's loss.kl_estimator is {}")


def packing_algorithm(v: Any) -> str:
    try:
        return _PACKING[str(v)]
    except KeyError:
        raise Unmappable(f"packing algorithm {v!r}: rlc takes {', '.join(sorted(set(_PACKING.values())))}") from None


kv_cache_mode = one_of("kv_cache_management_mode", ("persist", "offload", "recompute"), "rlc runs {}")


refit_backend = one_of("refit_backend", ("nccl", "gloo"), "rlc's swap runs {}")


transformer_impl = one_of("transformer_impl", ("transformer_engine", "inference_optimized"), "rlc builds {} layers")


def gib_to_bytes(v: Any) -> int:
    return int(float(number(v)) * (1 << 30))
