"""FP8 rollouts on the torch side: the quantization the refit applies, and the checks around it.

Where the quantization runs (``generation.fp8.scales``):

* ``block`` (128×128 block scales, the DeepSeek-V3 checkpoint format): **on the trainer, before packing**.
  Each block's scale depends only on that block, so quantizing every exported HF tensor on its own gives
  exactly what vLLM would hold after quantizing the fused, tensor-parallel-sliced bf16 parameter itself —
  provided every fused part and slice starts on a block boundary, which ``rlc compile`` checks (RLC330)
  and vLLM checks again at start. The wire then carries 1 byte per weight plus 4 bytes per block instead
  of 2 bytes per weight. The quantizing function is vLLM's own (``vllm.utils.deep_gemm.
  per_block_cast_to_fp8``, the function vLLM's online block quantization applies to a bf16 weight), so the
  rounding is vLLM's by construction; :func:`quantize_blocks` restates its formula in plain torch for machines
  without vLLM (CPU tests, the shared-memory transport). The restatement is not a bit-exact substitute: on an
  H200 it matched vLLM's function on 1 of 12 sampled Qwen3-8B-shaped weights (``tests/gpu/test_fp8_refit.py``
  reports the comparison), so nothing that vLLM verifies against uses it where vLLM is importable.
* ``tensor`` (one scale per weight matrix): **in vLLM, while it loads**. A per-tensor scale is the maximum
  over the whole parameter vLLM holds, i.e. over the q/k/v (gate/up) projections it fuses and only over
  its own tensor-parallel slice, which the trainer does not see; quantizing each exported tensor on its own
  and letting vLLM requantize to a common scale would round twice. The refit moves ``model.dtype``.

In both cases vLLM re-runs its own post-load processing (kernel layouts, fused-expert formats) through its
layerwise reload (:mod:`vllm.model_executor.model_loader.reload`), which copies the result into the
parameters the engine already holds, so CUDA graphs keep pointing at them.

:func:`quantize_tensor` and :func:`quantize_rows` restate vLLM's per-tensor and per-row (per-channel, for a
weight) dynamic quantization kernels (``csrc/quantization/w8a8/fp8/common.cu``) the same way; they document
the arithmetic vLLM applies with ``scales: tensor`` and are compared with vLLM's kernels on the GPU host (equal on
9 of 12 sampled weights per tensor, 0 of 12 per row: the kernels round differently), never used in their place.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from rlc.contract.fp8 import BLOCK, block_quantized, block_scale_shape, scale_name
from rlc.runtime.refit.specs import TensorSpec

FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite float8_e4m3fn value (vLLM's ``get_fp8_min_max`` on CUDA).
FP8_MAX = 448.0
#: Smallest per-row scale of vLLM's dynamic per-token kernel (``min_scaling_factor``: 1 / (448 × 512)).
MIN_ROW_SCALE = 1.0 / (FP8_MAX * 512.0)
#: Smallest block amax of ``per_block_cast_to_fp8`` (``clamp(1e-4)``): an all-zero block gets a finite scale.
MIN_BLOCK_AMAX = 1e-4
#: Consecutive same-shape weights (one MoE layer's experts) are quantized in one call up to this many bytes.
GROUP_BYTES = 64 << 20

Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------- the arithmetic


def quantize_blocks(x: torch.Tensor, block: tuple[int, int] = BLOCK, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """128×128 block quantization by the formula of vLLM's ``per_block_cast_to_fp8`` (not bit-exact with it on the
    GPU: see the module docstring).

    The tensor is zero-padded to whole blocks (padding never raises a block's maximum), each block's
    scale is ``max(|x|, 1e-4) / 448`` in fp32 (rounded up to a power of two with ``pow2``, vLLM's
    ``use_ue8m0``), and each element becomes ``float8_e4m3fn(x * (1 / scale))``. Returns the FP8 tensor in
    ``x``'s shape and the fp32 scales ``[ceil(rows / 128), ceil(cols / 128)]``.
    """
    if x.dim() != 2:
        raise ValueError(f"block quantization takes a 2-D weight, got shape {list(x.shape)}")
    m, n = x.shape
    bm, bn = block
    padded = torch.zeros((math.ceil(m / bm) * bm, math.ceil(n / bn) * bn), dtype=x.dtype, device=x.device)
    padded[:m, :n] = x
    view = padded.view(-1, bm, padded.size(1) // bn, bn)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(MIN_BLOCK_AMAX)
    scale = amax / FP8_MAX
    if pow2:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale.abs())))
    q = (view * (1.0 / scale)).to(FP8_DTYPE)
    return q.view_as(padded)[:m, :n].contiguous(), scale.view(view.size(0), view.size(2))


def _saturate(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(v, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor, as vLLM's ``dynamic_scaled_fp8_quant`` (``scaled_fp8_quant`` with
    no scale): ``scale = max|x| / 448`` and ``q = sat(x * (1 / scale))``. Scale shape ``[1]``."""
    xf = x.float()
    scale = (xf.abs().amax() / FP8_MAX).reshape(1)
    return _saturate(xf * (1.0 / scale)), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (per output channel of a weight), as vLLM's ``dynamic_per_token_scaled_fp8_quant``:
    ``scale = max(max|row| / 448, 1 / (448 × 512))`` and ``q = sat(x / scale)``. Scale shape ``[rows, 1]``."""
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX, min=MIN_ROW_SCALE)
    return _saturate(xf / scale), scale


# --------------------------------------------------------------------------- which function runs


@dataclass(frozen=True)
class BlockQuantizer:
    """The block quantization the refit applies: vLLM's own function when vLLM is importable."""

    fn: Quantize
    source: str  # "vllm.utils.deep_gemm.per_block_cast_to_fp8" | "rlc.runtime.refit.fp8.quantize_blocks"
    pow2: bool

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(x)


def vllm_block_function() -> Any:
    """vLLM's ``per_block_cast_to_fp8``, or None when vLLM is not importable here."""
    try:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - no vLLM (or no GPU stack): the plain-torch restatement runs
        return None
    return per_block_cast_to_fp8


def block_quantizer(pow2: bool, *, use_vllm: bool = True) -> BlockQuantizer:
    """vLLM's function (``use_vllm`` and importable) or :func:`quantize_blocks`, with ``pow2`` scales."""
    vllm_fn = vllm_block_function() if use_vllm else None
    if vllm_fn is not None:
        return BlockQuantizer(lambda x: vllm_fn(x, block_size=list(BLOCK), use_ue8m0=pow2),
                              "vllm.utils.deep_gemm.per_block_cast_to_fp8", pow2)
    return BlockQuantizer(lambda x: quantize_blocks(x, BLOCK, pow2), "rlc.runtime.refit.fp8.quantize_blocks", pow2)


# --------------------------------------------------------------------------- what the trainer sends


def quantized_specs(specs: Sequence[TensorSpec], keep: Sequence[str] = ()) -> list[TensorSpec]:
    """The export list after block quantization: each quantized ``X.weight`` becomes ``X.weight`` in
    float8_e4m3fn followed by ``X.weight_scale_inv`` (fp32, one per block); the rest (and the layers ``keep``,
    ``generation.fp8.keep_bf16``, names) is unchanged."""
    out: list[TensorSpec] = []
    for s in specs:
        if block_quantized(s.name, len(s.shape), keep):
            out.append(TensorSpec(s.name, s.shape, "float8_e4m3fn"))
            out.append(TensorSpec(scale_name(s.name), block_scale_shape(s.shape), "float32"))
        else:
            out.append(s)
    return out


def quantize_export(named: Iterable[tuple[str, torch.Tensor]], quantizer: Quantize,
                    group_bytes: int = GROUP_BYTES, keep: Sequence[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Block-quantize an export stream in its order (:func:`quantized_specs` with the same ``keep`` is the list it
    yields).

    Consecutive quantized weights of one shape whose rows are whole blocks (one MoE layer's experts) are
    quantized in one call on their row-wise concatenation, up to ``group_bytes``: no block spans two of
    them, so each one's result is exactly what quantizing it alone gives, with one call per group instead
    of one per expert (a 30B MoE exports ~18,000 of them per refit).
    """
    group: list[tuple[str, torch.Tensor]] = []
    group_nbytes = 0

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal group, group_nbytes
        if not group:
            return
        if len(group) == 1:
            name, t = group[0]
            with torch.no_grad():  # an exported tensor may be the trainer's parameter itself
                q, s = quantizer(t)
            yield name, q
            yield scale_name(name), s
        else:
            rows = group[0][1].shape[0]
            with torch.no_grad():
                q, s = quantizer(torch.cat([t for _, t in group], dim=0))
            srows = rows // BLOCK[0]
            for i, (name, _) in enumerate(group):
                yield name, q[i * rows:(i + 1) * rows]
                yield scale_name(name), s[i * srows:(i + 1) * srows]
        group, group_nbytes = [], 0

    for name, t in named:
        if not block_quantized(name, t.dim(), keep):
            yield from flush()
            yield name, t
            continue
        nbytes = t.numel() * t.element_size()
        joinable = t.shape[0] % BLOCK[0] == 0 and nbytes <= group_bytes
        if group and not (joinable and t.shape == group[0][1].shape and t.dtype == group[0][1].dtype
                          and group_nbytes + nbytes <= group_bytes):
            yield from flush()
        group.append((name, t))
        group_nbytes += nbytes
        if not joinable:
            yield from flush()
    yield from flush()


# --------------------------------------------------------------------------- what vLLM holds


_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.[^.]+$")


def vllm_module_of(hf_weight: str, packed: Mapping[str, Sequence[str]]) -> str:
    """The vLLM module an HF ``X.weight`` loads into: routed experts into the layer's fused ``experts``,
    q/k/v and gate/up (and the model's other ``packed_modules_mapping`` parts) into their fused module."""
    module = hf_weight[: -len(".weight")] if hf_weight.endswith(".weight") else hf_weight
    m = _EXPERT.match(module)
    if m:
        return m.group(1)
    head, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return f"{head}.{fused}" if head else fused
    return module


@dataclass
class LayoutCheck:
    """Whether the trainer's quantized names and vLLM's FP8 modules agree (block scales)."""

    fp8_modules: int = 0  # vLLM modules holding FP8 weights
    matched: int = 0  # of them, fed quantized weights by the trainer
    sent_fp8_to_bf16: list[str] = field(default_factory=list)  # trainer quantizes, vLLM keeps bf16
    sent_bf16_to_fp8: list[str] = field(default_factory=list)  # vLLM holds FP8, the trainer sends bf16
    unmatched: list[str] = field(default_factory=list)  # vLLM FP8 modules no exported name maps to

    @property
    def ok(self) -> bool:
        return not self.sent_fp8_to_bf16 and not self.sent_bf16_to_fp8

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        for key in ("sent_fp8_to_bf16", "sent_bf16_to_fp8", "unmatched"):
            d[key] = d[key][:20]
        return d

    def error_text(self) -> str:
        parts = []
        if self.sent_bf16_to_fp8:
            parts.append(f"vLLM holds {len(self.sent_bf16_to_fp8)} module(s) in FP8 that the trainer sends in "
                         f"bf16, e.g. {', '.join(self.sent_bf16_to_fp8[:4])}")
        if self.sent_fp8_to_bf16:
            parts.append(f"the trainer quantizes weights of {len(self.sent_fp8_to_bf16)} module(s) vLLM keeps in "
                         f"bf16, e.g. {', '.join(self.sent_fp8_to_bf16[:4])}")
        return ("FP8 refit layout: " + "; ".join(parts) + ". The quantized projections are those of "
                "rlc.contract.fp8.QUANTIZED_PROJECTIONS less the layers generation.fp8.keep_bf16 names; "
                "generation.fp8.scales: tensor lets vLLM quantize whatever it holds in FP8")


def check_layout(wire_names: Iterable[str], fp8_modules: Iterable[str], modules: Iterable[str],
                 packed: Mapping[str, Sequence[str]]) -> LayoutCheck:
    """Compare the wire (``X.weight`` with an ``X.weight_scale_inv`` next to it is quantized) with vLLM's
    modules: ``fp8_modules`` hold FP8 weights, ``modules`` are all of them. Exported names that map to no
    vLLM module (MTP layers the main model skips, renamed checkpoints) are not judged."""
    names = set(wire_names)
    fp8 = set(fp8_modules)
    known = set(modules)
    quantized_to: set[str] = set()
    plain_to: set[str] = set()
    for name in names:
        if not name.endswith(".weight"):
            continue
        target = vllm_module_of(name, packed)
        if target not in known:
            continue
        (quantized_to if scale_name(name) in names else plain_to).add(target)
    report = LayoutCheck(fp8_modules=len(fp8))
    report.sent_fp8_to_bf16 = sorted(quantized_to - fp8)
    report.sent_bf16_to_fp8 = sorted((plain_to & fp8) - quantized_to)
    report.matched = len(fp8 & quantized_to)
    report.unmatched = sorted(fp8 - quantized_to - plain_to)
    return report


def fp8_module_names(model: Any) -> tuple[list[str], list[str]]:
    """``(modules holding a float8 parameter of their own, all module names)`` of a vLLM model."""
    fp8, every = [], []
    for name, module in model.named_modules():
        every.append(name)
        if any(p is not None and p.dtype == FP8_DTYPE for p in module._parameters.values()):
            fp8.append(name)
    return fp8, every


__all__ = ["BlockQuantizer", "FP8_MAX", "GROUP_BYTES", "LayoutCheck", "block_quantizer", "check_layout",
           "fp8_module_names", "quantize_blocks", "quantize_export", "quantize_rows", "quantize_tensor",
           "quantized_specs", "vllm_block_function", "vllm_module_of"]
