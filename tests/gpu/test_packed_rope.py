"""GPU check: rotary embeddings on packed (``thd``) rows, megatron-core's unfused path against the fused one.

With ``apply_rope_fusion`` off (the Megatron-Bridge Qwen3 providers' default), megatron-core 0.19 applies RoPE to a
packed row one sequence at a time (``_apply_rotary_pos_emb_thd``: a Python loop of about a dozen small kernels per
sequence), in every attention layer, to the queries and to the keys, and autograd runs the same again backward.
With it on, Transformer Engine's fused kernel (``fused_apply_rotary_pos_emb_thd``) takes the whole row in one
launch. This check calls both through megatron-core's own ``apply_rotary_pos_emb`` on rows shaped like the packed
passes (the tiny recipe's step: 2,048 sequences of 5..15 tokens; the packing check's 512 of 8..512; one
16,384-token bin of 100..4,000-token sequences at 32 heads x 128), and records per call:

* the time forward (the logprob passes) and forward + backward (the train pass), CUDA-synchronised, best of
  ``REPEATS`` after a warm-up;
* the error of each against an fp32 reference computed here from the RoPE formula with every sequence's
  positions restarting at 0 (outputs and input gradients).

Verdict: on the tiny step the fused call is at least ``MIN_SPEEDUP`` times faster forward and forward + backward,
never more than ``MAX_SLOWDOWN`` slower on the long-sequence bin, and its error against fp32 is at most the unfused
path's (plus one bf16 rounding of the largest value) in every case.

    python tests/gpu/test_packed_rope.py [--out DIR]     # one GPU, about a minute
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

import pytest

from tests.gpu.common import Timer, dump, gpu_available

CASES = {
    "tiny_step": {"n": 2048, "lengths": (5, 15), "heads": 4, "head_dim": 32, "seed": 0},
    "packing_check": {"n": 512, "lengths": (8, 512), "heads": 4, "head_dim": 32, "seed": 1},
    "long_bin": {"n": None, "tokens": 16384, "lengths": (100, 4000), "heads": 32, "head_dim": 128, "seed": 2},
}
REPEATS = 3
MIN_SPEEDUP = 20.0  # tiny step, fused vs unfused
MAX_SLOWDOWN = 1.5  # long-sequence bin, fused vs unfused
BF16_EPS = 2.0 ** -8


class _OneRank:
    """A context-parallel group of one (what the packed passes run with at CP 1)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _lengths(case: dict[str, Any]) -> list[int]:
    import random  # noqa: PLC0415

    rng = random.Random(case["seed"])
    lo, hi = case["lengths"]
    if case["n"] is not None:
        return [rng.randint(lo, hi) for _ in range(case["n"])]
    out: list[int] = []
    while True:  # sequences into one bin of ``tokens``, the last one cut to fill it
        n = rng.randint(lo, hi)
        if sum(out) + n >= case["tokens"]:
            out.append(case["tokens"] - sum(out))
            return out
        out.append(n)


def _reference(t, cu, inv_freq):
    """fp32 RoPE with the positions restarting at every sequence (rotate-half layout)."""
    import torch  # noqa: PLC0415

    total = t.shape[0]
    sizes = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], sizes)
    pos = torch.arange(total, device=t.device, dtype=torch.float32) - starts.float()
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    x = t.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def measure(case: dict[str, Any]) -> dict[str, Any]:
    import torch  # noqa: PLC0415
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # noqa: PLC0415
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: PLC0415

    lengths = _lengths(case)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(case["seed"])
    cu = torch.tensor([0] + lengths, device=dev, dtype=torch.int64).cumsum(0)
    total, heads, dim = int(cu[-1]), case["heads"], case["head_dim"]
    t = torch.randn(total, heads, dim, device=dev, generator=gen).to(torch.bfloat16)
    grad_out = torch.randn(total, heads, dim, device=dev, generator=gen).to(torch.bfloat16)
    rope = RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, rotary_base=10000, cp_group=_OneRank())
    freqs = rope(max(lengths), packed_seq=True)  # [max_s, 1, 1, dim] fp32, as GPTModel builds it for thd
    cu32 = cu.to(torch.int32)
    ref = _reference(t, cu, rope.inv_freq)
    x32 = t.float().requires_grad_(True)
    (_reference(x32, cu, rope.inv_freq) * grad_out.float()).sum().backward()
    ref_grad = x32.grad
    out: dict[str, Any] = {"sequences": len(lengths), "tokens": total, "heads": heads, "head_dim": dim}
    for mode, fused in (("unfused", False), ("fused", True)):
        config = SimpleNamespace(apply_rope_fusion=fused, rotary_interleaved=False, multi_latent_attention=False,
                                 mrope_section=None)

        def call(x):
            return apply_rotary_pos_emb(x, freqs, config, cu_seqlens=cu32, cp_group=_OneRank())  # noqa: B023

        def forward():
            with torch.no_grad():
                return call(t)

        def forward_backward():
            x = t.detach().requires_grad_(True)
            y = call(x)
            y.backward(grad_out)
            return y, x.grad

        def best(fn) -> float:
            fn()  # warm-up
            torch.cuda.synchronize()
            times = []
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            return min(times)

        y = forward()
        _, g = forward_backward()
        out[mode] = {
            "forward_s": best(forward), "forward_backward_s": best(forward_backward),
            "max_abs_err": float((y.float() - ref).abs().max()),
            "grad_max_abs_err": float((g.float() - ref_grad).abs().max()),
        }
    out["ref_max_abs"] = float(ref.abs().max())
    out["ref_grad_max_abs"] = float(ref_grad.abs().max())
    for key in ("forward", "forward_backward"):
        out[f"speedup_{key}"] = out["unfused"][f"{key}_s"] / max(out["fused"][f"{key}_s"], 1e-9)
    return out


def verdict(cases: dict[str, dict[str, Any]]) -> tuple[bool, list[str]]:
    """Pass/fail of the measured cases (see the module docstring); the reasons for a failure."""
    why = []
    tiny = cases["tiny_step"]
    for key in ("speedup_forward", "speedup_forward_backward"):
        if tiny[key] < MIN_SPEEDUP:
            why.append(f"tiny step: fused only {tiny[key]:.1f}x faster ({key}), expected >= {MIN_SPEEDUP}x")
    long_bin = cases["long_bin"]
    for key in ("speedup_forward", "speedup_forward_backward"):
        if long_bin[key] < 1.0 / MAX_SLOWDOWN:
            why.append(f"long bin: fused {1 / long_bin[key]:.2f}x slower ({key}), allowed {MAX_SLOWDOWN}x")
    for name, c in cases.items():
        for err, scale in (("max_abs_err", "ref_max_abs"), ("grad_max_abs_err", "ref_grad_max_abs")):
            allowed = c["unfused"][err] + BF16_EPS * c[scale]
            if not c["fused"][err] <= allowed:
                why.append(f"{name}: fused {err} {c['fused'][err]:.3g} > unfused {c['unfused'][err]:.3g} + one bf16 "
                           f"rounding of {c[scale]:.3g}")
    return not why, why


def run(out_dir: str | None) -> dict[str, Any]:
    timer = Timer()
    result: dict[str, Any] = {
        "check": "RoPE on packed rows: megatron-core's unfused per-sequence path vs Transformer Engine's fused kernel",
        "command": " ".join([sys.executable, *sys.argv]),
        "passed": False,
    }
    try:
        import torch  # noqa: PLC0415

        result["machine"] = f"{platform.node()} {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        result["cases"] = {name: measure(case) for name, case in CASES.items()}
        result["passed"], result["failures"] = verdict(result["cases"])
        tiny = result["cases"]["tiny_step"]
        # the tiny recipe's model: 2 layers, RoPE on the queries and the keys in each
        result["tiny_model_per_pass_s"] = {mode: {"forward": 4 * tiny[mode]["forward_s"],
                                                  "forward_backward": 4 * tiny[mode]["forward_backward_s"]}
                                           for mode in ("unfused", "fused")}
    except Exception:  # noqa: BLE001 - the report says what broke
        result["error"] = traceback.format_exc()
    result["seconds"] = timer()
    dump(result, out_dir, "packed_rope")
    print("PASS" if result["passed"] else f"FAIL: {result.get('failures') or result.get('error')}", flush=True)
    return result


def _good() -> dict[str, dict[str, Any]]:
    def case(unfused_s: float, fused_s: float) -> dict[str, Any]:
        errs = {"max_abs_err": 0.03, "grad_max_abs_err": 0.03}
        return {"unfused": {"forward_s": unfused_s, "forward_backward_s": 2 * unfused_s, **errs},
                "fused": {"forward_s": fused_s, "forward_backward_s": 2 * fused_s, **errs},
                "ref_max_abs": 5.0, "ref_grad_max_abs": 5.0,
                "speedup_forward": unfused_s / fused_s, "speedup_forward_backward": unfused_s / fused_s}

    return {"tiny_step": case(0.3, 0.0001), "packing_check": case(0.08, 0.0001), "long_bin": case(0.002, 0.0005)}


def test_verdict_passes_on_good_evidence_and_fails_on_each_kind_of_bad():
    """CPU: the verdict the GPU run is judged by."""
    assert verdict(_good()) == (True, [])
    slow = _good()
    slow["tiny_step"]["speedup_forward"] = 3.0
    assert "tiny step" in verdict(slow)[1][0]
    slower = _good()
    slower["long_bin"]["speedup_forward_backward"] = 0.5
    assert "long bin" in verdict(slower)[1][0]
    worse = _good()
    worse["packing_check"]["fused"]["grad_max_abs_err"] = 0.1
    assert "packing_check: fused grad_max_abs_err" in verdict(worse)[1][0]


def test_the_long_bin_fills_its_tokens():
    lengths = _lengths(CASES["long_bin"])
    assert sum(lengths) == CASES["long_bin"]["tokens"] and len(lengths) > 2 and min(lengths) >= 1


def test_packed_rope_on_gpu(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    assert run(str(tmp_path))["passed"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.exit(0 if run(a.out)["passed"] else 1)
