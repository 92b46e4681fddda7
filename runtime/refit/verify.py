"""Bit-for-bit check of a refit (``refit.verify_every``): did vLLM get exactly the trainer's weights?

The reference is independent of the refit engine: the trainer rank writes its export (the same
``export_hf_weights`` stream a refit packs) to local files with ``torch.save``, which keeps every
dtype and bit, in shards that the vLLM worker on the same GPU reads as they come
(``rlc.runtime.refit.verify_stream``). The worker snapshots the parameters a shard touches, loads the shard
through vLLM's own ``load_weights`` (the path a checkpoint load takes: same fusing, same tensor-parallel
slicing) and compares each parameter with its snapshot. Equal everywhere means the engine delivered
every tensor, under the right name, with the right slicing metadata and dtype; anything else is named
with how far it is off, and a value that equals the reference rounded to bf16 is called out as such
(an fp32 parameter sent in bf16: ``refit.fp32_params``). With FP8 rollouts the reference load is vLLM's
own quantization of the same bf16 export (``rlc.runtime.generation.extension``), and FP8 weights are
compared byte for byte.

Pure comparison logic here (torch only, CPU-tested); the worker side is in
``rlc.runtime.generation.extension`` and ``rlc.runtime.policy.megatron_worker``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch

from rlc.runtime.refit.errors import RefitError

#: Mantissa bits of each floating dtype (what a cast to bf16 keeps of an fp32 value: 7 of 23).
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}


class RefitVerifyError(RefitError):
    """After a refit, vLLM's parameters differ from vLLM's own load of the trainer's export."""


@dataclass(frozen=True)
class ParamMismatch:
    """One vLLM parameter that the refit left different from the reference load."""

    name: str
    dtype: str
    shape: list[int]
    elements_differing: int
    max_abs_diff: float
    #: The refitted value equals the reference rounded to bf16 (an fp32 tensor sent as bf16).
    rounded_to_bf16: bool
    #: Mantissa bits the refitted value lost against the reference (23 - 7 = 16 for fp32 -> bf16).
    mantissa_bits_lost: int


@dataclass(frozen=True)
class VerifyReport:
    """One vLLM worker's verdict for one refit."""

    params_compared: int
    bytes_compared: int
    fp32_params: list[str]
    mismatches: list[ParamMismatch] = field(default_factory=list)
    #: Names the reference load did not touch (no exported tensor maps to them): not verifiable.
    not_loaded: list[str] = field(default_factory=list)
    #: Names the reference load wrote that the check had not snapshotted (a shard of the streamed check wrote
    #: outside the layers it names): not compared, so the check cannot call the refit bit-exact.
    unchecked: list[str] = field(default_factory=list)

    @property
    def bit_exact(self) -> bool:
        return not self.mismatches and not self.unchecked and self.params_compared > 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bit_exact"] = self.bit_exact
        return d


def _bits_lost(refitted: torch.Tensor, reference: torch.Tensor) -> tuple[bool, int]:
    if reference.dtype != torch.float32:
        return False, 0
    as_bf16 = reference.to(torch.bfloat16).to(torch.float32)
    if torch.equal(refitted, as_bf16):
        return True, MANTISSA_BITS[torch.float32] - MANTISSA_BITS[torch.bfloat16]
    return False, 0


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality; 1-byte floats (FP8 weights) are compared as bytes (``torch.equal`` compares
    values: it would take -0 for +0)."""
    if a.dtype.is_floating_point and a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def compare_parameters(refitted: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                       *, loaded: set[str] | None = None) -> VerifyReport:
    """Compare every parameter of ``refitted`` (the snapshot after the refit) with ``reference``
    (after vLLM loaded the trainer's export directly). ``loaded``: the names the reference load wrote,
    when known; a parameter outside it is listed as not verifiable instead of being compared."""
    mismatches: list[ParamMismatch] = []
    not_loaded: list[str] = []
    compared = nbytes = 0
    fp32 = []
    for name in sorted(reference):
        ref = reference[name]
        if loaded is not None and name not in loaded:
            not_loaded.append(name)
            continue
        got = refitted.get(name)
        compared += 1
        nbytes += ref.numel() * ref.element_size()
        if ref.dtype == torch.float32:
            fp32.append(name)
        if got is not None and got.shape == ref.shape and got.dtype == ref.dtype and _same_bits(got, ref):
            continue
        if got is None or got.shape != ref.shape:
            mismatches.append(ParamMismatch(name, str(ref.dtype).removeprefix("torch."), list(ref.shape),
                                            ref.numel(), float("inf"), False, 0))
            continue
        diff = got.to(torch.float64) - ref.to(torch.float64)
        rounded, lost = _bits_lost(got.to(ref.dtype), ref)
        mismatches.append(ParamMismatch(
            name, str(ref.dtype).removeprefix("torch."), list(ref.shape), int((diff != 0).sum()),
            float(diff.abs().max()), rounded, lost))
    return VerifyReport(compared, nbytes, fp32, mismatches, not_loaded)


def verify_error_text(step: int, reports: list[dict[str, Any]]) -> str:
    """The message that stops a run whose refit was not bit-exact (``reports``: ``to_dict()`` per worker)."""
    lines = [f"refit {step} is not bit-exact: vLLM's parameters differ from vLLM's own load of the trainer's export"]
    for i, r in enumerate(reports):
        for m in r["mismatches"][:6]:
            how = (f"rounded to bf16, {m['mantissa_bits_lost']} mantissa bits lost" if m["rounded_to_bf16"]
                   else f"max |diff| {m['max_abs_diff']:.3g}")
            lines.append(f"  worker {i}: {m['name']} ({m['dtype']}, {m['elements_differing']} elements): {how}")
    unchecked = sorted({n for r in reports for n in r.get("unchecked", [])})
    if unchecked:
        lines.append(f"  {len(unchecked)} parameter(s) written by the reference load outside the layer the check "
                     f"snapshotted, not compared: {', '.join(unchecked[:6])}")
    if any(m["rounded_to_bf16"] for r in reports for m in r["mismatches"]):
        lines.append("fix: an fp32 parameter crossed the refit in bf16; list it in refit.fp32_params "
                     "(auto does so for router biases the model keeps in fp32)")
    elif unchecked and not any(r["mismatches"] for r in reports):
        lines.append("fix: this model's loader writes a layer's tensors into another layer's parameters, which the "
                     "streamed check cannot follow; report the model and its parameter names")
    else:
        lines.append("fix: check refit.per_rank_ipc_metadata and refit.dedupe_mtp_embedding (auto decides "
                     "both from the layout); report the parameters above if they are on")
    return "\n".join(lines)


def verify_by_reload(model: Any, exported: Mapping[str, torch.Tensor], param_names: list[str],
                     load: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None) -> dict[str, Any]:
    """Spot check of a refit, cheap enough for a 30B model: snapshot ``param_names`` of the live model,
    load ``exported`` (a few of the trainer's HF tensors) through the model's own ``load_weights`` and
    compare each snapshot with the reloaded parameter. The loader does the fusing and tensor-parallel
    slicing, so no layout is assumed; a tensor the refit delivered wrongly shows up as a mismatch.

    Returns ``VerifyReport.to_dict()`` plus ``missing_params`` (asked for, absent from the model) and
    ``loaded_unchecked`` (written by the reload but not snapshotted: the check did not cover them).
    ``load``: how to load (default ``model.load_weights``).
    """
    params = dict(model.named_parameters())
    missing = sorted(n for n in param_names if n not in params)
    with torch.no_grad():
        refitted = {n: params[n].detach().clone() for n in param_names if n in params}
        items = list(exported.items())
        loaded = model.load_weights(weights=items) if load is None else load(items)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    loaded_set = set(loaded) if isinstance(loaded, (set, list, tuple)) else None
    reference = {n: params[n].detach() for n in refitted}
    report = compare_parameters(refitted, reference, loaded=loaded_set)
    unchecked = sorted(loaded_set - set(refitted)) if loaded_set is not None else []
    return {**report.to_dict(), "exported_tensors": len(exported), "missing_params": missing,
            "loaded_unchecked": unchecked}
