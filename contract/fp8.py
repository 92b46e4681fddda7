"""FP8 rollouts: which exported weights the refit quantizes, and what it moves (pure Python, no torch).

Shared by the planner (the refit buffer must hold the largest tensor *on the wire*) and the runtime (the
trainer quantizes exactly these names before packing), so the two agree by construction.

``generation.fp8.scales: block`` is the DeepSeek-V3 checkpoint format that vLLM's ``Fp8Config`` reads
(``quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}``): every linear projection
weight ``X.weight`` is sent as ``float8_e4m3fn`` of the same shape plus ``X.weight_scale_inv``, one fp32
scale per 128 × 128 block (the last row and column of blocks may be ragged). The embedding, the LM head,
the norms, the MoE routers (``mlp.gate``), the MTP ``eh_proj`` and every bias stay in ``model.dtype``.
With ``scales: tensor`` nothing is quantized on the trainer: vLLM quantizes the bf16 weights as it loads
them, so the wire carries ``model.dtype``.

``generation.fp8.keep_bf16`` (NeMo-RL ``quantization_ignored_layer_kws``) names fragments of module names whose
layers stay in ``model.dtype`` on both sides (:func:`kept`): the trainer does not quantize them and vLLM builds
them unquantized (its ``ignored_layers`` with block scales, ``ignore`` patterns with tensor scales).
"""
from __future__ import annotations

import math
import re
from typing import Optional, Sequence

#: Rows x columns of one scale block (DeepSeek-V3 / vLLM ``weight_block_size``).
BLOCK: tuple[int, int] = (128, 128)
#: Bytes of one block scale (fp32) and of one quantized weight element (float8_e4m3fn).
SCALE_BYTES = 4
FP8_BYTES = 1
#: Suffix of the scale tensor next to ``X.weight`` (``X.weight_scale_inv``, DeepSeek-V3's name).
SCALE_SUFFIX = "_scale_inv"
#: Projection names (the module's last name component) whose ``.weight`` vLLM builds as an FP8 linear
#: layer (or an FP8 fused-expert stack): attention, MLA, dense / shared / routed expert MLPs (Llama, Qwen,
#: DeepSeek, Mixtral ``w1 w2 w3``).
QUANTIZED_PROJECTIONS: frozenset[str] = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
    "gate_proj", "up_proj", "down_proj", "gate_up_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    "w1", "w2", "w3",
})
#: Router modules: kept in bf16 by the trainer and listed as ignored layers for vLLM, which would otherwise
#: quantize Qwen3-MoE's ``mlp.gate`` (a plain linear layer there).
ROUTER_LEAF = "gate"


def module_of(name: str) -> str:
    """The module an HF parameter ``name`` belongs to (``X.weight`` -> ``X``)."""
    return name.rsplit(".", 1)[0] if "." in name else name


def kept(name: str, keep: Sequence[str]) -> bool:
    """Whether HF parameter ``name`` belongs to a layer ``generation.fp8.keep_bf16`` keeps in the model dtype:
    its module name contains one of the fragments ``keep``."""
    module = module_of(name)
    return any(fragment in module for fragment in keep)


def block_quantized(name: str, ndim: int, keep: Sequence[str] = ()) -> bool:
    """Whether the refit sends HF tensor ``name`` (with ``ndim`` dimensions) as FP8 + block scales (``keep``:
    ``generation.fp8.keep_bf16``)."""
    if ndim != 2 or not name.endswith(".weight") or kept(name, keep):
        return False
    return module_of(name).rsplit(".", 1)[-1] in QUANTIZED_PROJECTIONS


def scale_name(name: str) -> str:
    """The scale tensor sent after quantized weight ``name``."""
    return name + SCALE_SUFFIX


def block_scale_shape(shape: Sequence[int], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """One scale per block, ragged edges rounded up: ``[ceil(rows / 128), ceil(cols / 128)]``."""
    rows, cols = (int(d) for d in shape)
    return (math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def wire_bytes(name: str, shape: Sequence[int], bytes_per_param: int, scales: Optional[str],
               keep: Sequence[str] = ()) -> int:
    """Bytes the refit moves for exported tensor ``name`` of ``shape`` (weight plus its scales).

    ``scales``: ``"block"`` when the trainer quantizes (FP8 rollouts with block scales), else ``None`` /
    ``"tensor"`` (the tensor travels in the export dtype, ``bytes_per_param``); ``keep``:
    ``generation.fp8.keep_bf16``."""
    numel = math.prod(int(d) for d in shape)
    if scales == "block" and block_quantized(name, len(shape), keep):
        rows, cols = block_scale_shape(shape)
        return numel * FP8_BYTES + rows * cols * SCALE_BYTES
    return numel * bytes_per_param


def largest_wire_tensor(tensors: Sequence[tuple[str, tuple[int, ...]]], bytes_per_param: int,
                        scales: Optional[str], keep: Sequence[str] = ()) -> tuple[str, int]:
    """``(name, bytes)`` of the largest single tensor on the wire (a scale tensor is never the largest)."""
    sized = [(n, wire_bytes(n, s, bytes_per_param, scales, keep)) for n, s in tensors]
    return max(sized, key=lambda t: t[1])


def router_ignore_prefixes(num_layers: int) -> list[str]:
    """vLLM module names of the MoE routers of ``num_layers`` decoder layers (names of layers without a
    router match nothing): vLLM's ``ignored_layers`` keep them unquantized."""
    return [f"model.layers.{i}.mlp.{ROUTER_LEAF}" for i in range(num_layers)]


#: The same routers as one regular expression (vLLM's online quantization takes ``re:`` patterns).
ROUTER_IGNORE_REGEX = r"re:.*\.mlp\.gate$"


def keep_regexes(keep: Sequence[str]) -> list[str]:
    """``generation.fp8.keep_bf16`` as vLLM's online quantization's ``ignore`` patterns (one per fragment)."""
    return [f"re:.*{re.escape(fragment)}.*" for fragment in keep]


__all__ = ["BLOCK", "FP8_BYTES", "QUANTIZED_PROJECTIONS", "ROUTER_IGNORE_REGEX", "ROUTER_LEAF", "SCALE_BYTES",
           "SCALE_SUFFIX", "block_quantized", "block_scale_shape", "keep_regexes", "kept", "largest_wire_tensor",
           "module_of", "router_ignore_prefixes", "scale_name", "wire_bytes"]
