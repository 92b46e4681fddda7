"""GPU probe of the FlashAttention megatron-core's dynamic inference engine calls (``host_run.sh`` stage
``flash_attn_probe``; run it before the ``mcore_*`` stages, so that a packaging fault shows as one and not as a
failed GRPO run). One GPU, no model, no Ray; about a minute, most of it importing megatron-core.

- detection: megatron-core 0.19's own import flags (``HAVE_FA4``, ``HAVE_FA3``, flash-attn >= 2.7.3: the assert of
  its dynamic-batching forward), ``rlc.runtime.generation.megatron_engine.flash_attention()``, and what the rest of
  the stack sees of it (vLLM 0.22's rotary embedding imports ``flash_attn.ops`` whenever a ``flash_attn`` module
  exists, vLLM #42675; Transformer Engine's own FlashAttention-3/4 detection, which picks training kernels);
- one mixed prefill step and one decode-only step through megatron-core's own
  ``Attention.flash_decode_and_prefill`` (the FA4 ``flash_attn.cute.flash_attn_varlen_func``, the FA3
  ``_flash_attn_forward`` / ``flash_attn_with_kvcache`` or the FA2 functions, as megatron-core picks them), on a paged
  KV pool laid out as ``DynamicInferenceContext`` lays it out: ``[2, layers, blocks, block_tokens, kv_heads,
  head_dim]`` bf16, an int32 block table with -1 past each request's blocks, eager-mode padding (tokens to a multiple
  of 64, request slots with no keys and block id -1), decode requests first; at the tiny recipes' attention shape
  (4 heads, 2 KV heads, head_dim 32) and an 8B-class one (32, 8, 128), 64-token blocks;
- each compared with an fp32 torch reference over the real requests' rows: passes at max abs diff <= ``TOL``.
  The pool's unused slots hold large finite garbage (a kernel reading keys past a request's length shows); the
  same calls with NaN there are reported (``nan_pool``), not judged: megatron-core allocates the pool with
  ``torch.empty``.

    python tests/gpu/test_flash_attn_probe.py [--out DIR]        # DIR/flash_attn_probe.json, exit 0 = passed
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from tests.gpu.common import Timer, dump, gpu_available

TOL = 2e-2  # bf16 output against an fp32 reference of the same bf16 inputs
BLOCK = 64  # generation.megatron.block_size_tokens' default
TOKEN_ROUNDER, REQUEST_ROUNDER = 64, 4  # DynamicInferenceContext's eager-mode padding (megatron-core 0.19)
MAX_BLOCKS = 8  # block-table columns: 512-token requests at most
POOL_BLOCKS = 48
GARBAGE = 100.0  # scale of the values left in unused pool slots
SHAPES = {
    "tiny recipes (4 heads, 2 KV, head_dim 32)": (4, 2, 32),
    "8B-class (32 heads, 8 KV, head_dim 128)": (32, 8, 128),
}
# (query tokens, keys already cached) per request, decode requests first as the dynamic context orders them
MIXED = [(1, 70), (1, 130), (40, 64), (100, 0), (5, 0)]  # 2 decodes, a chunked-prefill continuation, 2 prompts
DECODE = [(1, 0), (1, 62), (1, 63), (1, 64), (1, 299)]  # 1, 63, 64, 65 and 300 keys: block edges


# ------------------------------------------------------------------ the paged batch and the reference (CPU-tested)


@dataclass
class PagedBatch:
    """One step's attention inputs as megatron-core's dynamic context hands them to ``flash_decode_and_prefill``."""

    q: Any  # (padded tokens, 1, heads, head_dim)
    pool: Any  # (2, 1 layer, blocks, BLOCK, kv_heads, head_dim)
    block_table: Any  # (padded requests, MAX_BLOCKS) int32, -1 past a request's blocks and for padding slots
    cu_q: Any  # (padded requests + 1,) int32; padding slots repeat the last real offset
    cu_k: Any
    kv_lens_t: Any  # (padded requests,) int32, 0 for padding slots
    q_lens: list[int]
    kv_lens: list[int]
    max_q: int
    max_k: int
    keys: list[Any] = field(default_factory=list)  # per real request, contiguous (kv_len, kv_heads, head_dim)
    values: list[Any] = field(default_factory=list)

    @property
    def real_tokens(self) -> int:
        return sum(self.q_lens)


def round_up(n: int, m: int) -> int:
    return m * math.ceil(n / m)


def make_batch(torch: Any, requests: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, *,
               decode_only: bool, device: str = "cpu", dtype: Any = None, seed: int = 0,
               garbage: float = GARBAGE) -> PagedBatch:
    """``requests``: (query tokens, cached keys) each. Keys and values of each request go to shuffled pool blocks;
    every other slot of the pool holds ``garbage`` (NaN: ``float('nan')``; else that scale of random values)."""
    dtype = dtype or torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in requests]
    kv_lens = [q + prior for q, prior in requests]
    real = len(requests)
    tokens = sum(q_lens)
    if decode_only:  # eager decode: min(max_tokens, max_requests, round_up_tokens(active)) request slots, 1 token each
        padded_requests = padded_tokens = round_up(tokens, TOKEN_ROUNDER)
    else:
        padded_tokens, padded_requests = round_up(tokens, TOKEN_ROUNDER), round_up(real, REQUEST_ROUNDER)
    q = torch.randn(padded_tokens, 1, heads, head_dim, generator=g).to(dtype)
    pool = torch.randn(2, 1, POOL_BLOCKS, BLOCK, kv_heads, head_dim, generator=g) * garbage  # NaN: all NaN
    pool = pool.to(dtype)
    free = torch.randperm(POOL_BLOCKS, generator=g).tolist()
    table = torch.full((padded_requests, MAX_BLOCKS), -1, dtype=torch.int32)
    keys, values = [], []
    for r, kl in enumerate(kv_lens):
        n = math.ceil(kl / BLOCK)
        if n > MAX_BLOCKS or n > len(free):
            raise ValueError(f"request {r}: {kl} keys need {n} blocks (table {MAX_BLOCKS}, free {len(free)})")
        ids = [free.pop() for _ in range(n)]
        table[r, :n] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(kl, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(kl, kv_heads, head_dim, generator=g).to(dtype)
        for j, b in enumerate(ids):
            lo, hi = j * BLOCK, min(kl, (j + 1) * BLOCK)
            pool[0, 0, b, :hi - lo] = k[lo:hi]
            pool[1, 0, b, :hi - lo] = v[lo:hi]
        keys.append(k)
        values.append(v)
    kv_t = torch.zeros(padded_requests, dtype=torch.int32)
    kv_t[:real] = torch.tensor(kv_lens, dtype=torch.int32)
    cu_q = torch.zeros(padded_requests + 1, dtype=torch.int32)
    cu_q[1:real + 1] = torch.cumsum(torch.tensor(q_lens), 0)
    cu_q[real + 1:] = cu_q[real]
    cu_k = torch.zeros(padded_requests + 1, dtype=torch.int32)
    cu_k[1:real + 1] = torch.cumsum(torch.tensor(kv_lens), 0)
    cu_k[real + 1:] = cu_k[real]
    return PagedBatch(q.to(device), pool.to(device), table.to(device), cu_q.to(device), cu_k.to(device),
                      kv_t.to(device), q_lens, kv_lens, max(q_lens), max(kv_lens), keys, values)


def reference(torch: Any, b: PagedBatch) -> Any:
    """Causal attention in fp32 read through the block table (the last query row sees every key of its request):
    (real tokens, heads, head_dim)."""
    heads, head_dim = b.q.shape[2], b.q.shape[3]
    k_pool, v_pool = b.pool[0, 0].float(), b.pool[1, 0].float()
    table = b.block_table.cpu().long()
    out = []
    start = 0
    for r, (ql, kl) in enumerate(zip(b.q_lens, b.kv_lens)):
        ids = table[r, :math.ceil(kl / BLOCK)].to(k_pool.device)
        k = k_pool[ids].reshape(-1, *k_pool.shape[2:])[:kl]
        v = v_pool[ids].reshape(-1, *v_pool.shape[2:])[:kl]
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = b.q[start:start + ql, 0].float()
        s = torch.einsum("qhd,khd->hqk", q, k) * head_dim ** -0.5
        last = torch.arange(kl - ql, kl, device=s.device)  # each query's own position among the keys
        s = s.masked_fill(torch.arange(kl, device=s.device)[None, :] > last[:, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v))
        start += ql
    return torch.cat(out)


def compare(torch: Any, got: Any, b: PagedBatch) -> dict:
    """The kernel's rows of the real requests against the reference."""
    rows = got.reshape(got.shape[0], *got.shape[-2:])[:b.real_tokens].float()
    ref = reference(torch, b).to(rows.device)
    finite = bool(torch.isfinite(rows).all())
    diff = float((rows - ref).abs().max()) if finite else float("inf")
    return {"max_abs_diff": round(diff, 6), "finite": finite, "ref_max_abs": round(float(ref.abs().max()), 4),
            "ok": finite and diff <= TOL}


def verdict(res: dict) -> dict:
    """Passed: megatron-core accepts a FlashAttention for dynamic batching, rlc's own check agrees, vLLM's rotary
    embedding still imports, and every kernel call matched the reference."""
    d = res.get("detection") or {}
    calls = res.get("calls") or {}
    reasons = []
    if not d.get("dynamic_batching_assert_passes"):
        errors = "; ".join(f"{k}: {v}" for k, v in d.items() if k.endswith("import error"))
        reasons.append("megatron-core finds no FlashAttention it accepts for dynamic batching"
                       + (f" ({errors})" if errors else ""))
    if not d.get("rlc_flash_attention"):
        reasons.append("rlc's flash_attention() finds none (the megatron backend's workers would stop)")
    if d.get("vllm_rotary_import_ok") is False:
        reasons.append("a flash_attn module without flash_attn.ops: vLLM 0.22's rotary embedding fails (vLLM #42675)")
    if not calls:
        reasons.append("no kernel call ran")
    for name, c in calls.items():
        if not c.get("ok"):
            why = c.get("error") or f"max abs diff {c.get('max_abs_diff')} > {TOL}"
            reasons.append(f"{name}: {why}")
    return {"passed": not reasons, "reasons": reasons}


# ------------------------------------------------------------------ the GPU side


def detection() -> dict:
    """What megatron-core, rlc, vLLM and Transformer Engine see of the installed FlashAttention."""
    import importlib.metadata as md  # noqa: PLC0415
    import importlib.util  # noqa: PLC0415

    import megatron.core.transformer.attention as A  # noqa: PLC0415

    out: dict[str, Any] = {"HAVE_FA4": bool(A.HAVE_FA4), "HAVE_FA3": bool(A.HAVE_FA3),
                           "fa2_functions_imported": A.flash_attn_varlen_func is not None}
    try:
        from megatron.core.utils import is_fa_min_version  # noqa: PLC0415

        fa2 = bool(is_fa_min_version("2.7.3"))
    except Exception as exc:  # noqa: BLE001 - megatron-core raises when no flash-attn distribution exists
        fa2, out["fa2_version_check"] = False, f"{type(exc).__name__}: {exc}"
    out["fa2_min_2_7_3"] = fa2
    # megatron-core swallows the ImportError: import what it tried again to record why it failed
    for flag, module in (("HAVE_FA3", "flash_attn_3.flash_attn_interface"), ("HAVE_FA4", "flash_attn.cute")):
        if not out[flag]:
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - reported only
                out[f"{module} import error"] = f"{type(exc).__name__}: {exc}"[:600]
    out["dynamic_batching_assert_passes"] = bool(A.HAVE_FA4 or A.HAVE_FA3 or fa2)  # attention.py's forward assert
    out["megatron_kernel"] = ("flash-attn-4 flash_attn.cute.flash_attn_varlen_func" if A.HAVE_FA4 else
                              "FlashAttention-3 _flash_attn_forward (prefill) / flash_attn_with_kvcache (decode)"
                              if A.HAVE_FA3 else "flash-attn 2 flash_attn_varlen_func / flash_attn_with_kvcache"
                              if fa2 else None)
    for name in ("flash_attn_3.flash_attn_interface", "flash_attn_interface", "flash_attn", "flash_attn.cute"):
        try:
            spec = importlib.util.find_spec(name)
            out[f"module {name}"] = None if spec is None else (spec.origin or "namespace")
        except (ImportError, ValueError) as exc:
            out[f"module {name}"] = f"{type(exc).__name__}: {exc}"
    out["distributions"] = {}
    for dist in ("tokenspeed-fa3", "flash-attn-3", "flash-attn-4", "flash-attn", "nvidia-cutlass-dsl",
                 "apache-tvm-ffi", "megatron-core", "vllm", "transformer-engine", "torch"):
        try:
            out["distributions"][dist] = md.version(dist)
        except md.PackageNotFoundError:
            out["distributions"][dist] = None
    from rlc.runtime.generation.megatron_engine import fa3_layout_hint, flash_attention  # noqa: PLC0415

    out["rlc_flash_attention"] = flash_attention()
    out["rlc_fa3_layout_hint"] = fa3_layout_hint()
    # vLLM 0.22 (model_executor/layers/rotary_embedding/common.py): find_spec("flash_attn") -> import flash_attn.ops...
    if importlib.util.find_spec("flash_attn") is None:
        out["vllm_rotary_import_ok"] = True
    else:
        try:
            importlib.import_module("flash_attn.ops.triton.rotary")
            out["vllm_rotary_import_ok"] = True
        except ImportError as exc:
            out["vllm_rotary_import_ok"], out["vllm_rotary_import_error"] = False, f"{type(exc).__name__}: {exc}"
    try:
        from transformer_engine.pytorch.attention.dot_product_attention import backends  # noqa: F401, PLC0415
        from transformer_engine.pytorch.attention.dot_product_attention.utils import (  # noqa: PLC0415
            FlashAttentionUtils)

        out["transformer_engine_sees"] = {"fa2": FlashAttentionUtils.is_installed,
                                          "fa3": FlashAttentionUtils.v3_is_installed,
                                          "fa4": FlashAttentionUtils.v4_is_installed}
    except Exception as exc:  # noqa: BLE001 - reported only
        out["transformer_engine_sees"] = f"{type(exc).__name__}: {exc}"
    return out


def megatron_call(b: PagedBatch, decode_only: bool) -> Any:
    """megatron-core 0.19's ``Attention.flash_decode_and_prefill`` on ``b``: a stand-in layer carries the attributes
    it reads (eval mode, layer 1, no sliding window, no batch-invariant mode, TransformerConfig's default
    ``flash_attention_version`` None: the newest FlashAttention installed)."""
    import megatron.core.transformer.attention as A  # noqa: PLC0415

    class Layer:
        training = False
        layer_number = 1
        batch_invariant_mode = False
        flash_attention_version = None
        config = SimpleNamespace(window_size=None, window_attn_skip_freq=None)
        flash_decode_and_prefill = A.Attention.flash_decode_and_prefill
        _resolve_flash_version = A.Attention._resolve_flash_version
        _flash_attention_3_forward_wrapper = A.Attention._flash_attention_3_forward_wrapper

    k, v = b.pool[0, 0], b.pool[1, 0]  # DynamicInferenceContext.key_value_cache(layer)
    return Layer().flash_decode_and_prefill(b.q, k, v, b.max_q, b.max_k, b.cu_q, b.cu_k, b.kv_lens_t,
                                            b.block_table, decode_only, softmax_offset=None)


def run_calls(res: dict) -> None:
    import torch  # noqa: PLC0415

    res["calls"], res["nan_pool"] = {}, {}
    for label, (heads, kv_heads, head_dim) in SHAPES.items():
        for step, requests, decode_only in (("mixed prefill", MIXED, False), ("decode", DECODE, True)):
            name = f"{step}, {label}"
            entry: dict[str, Any] = {"requests (query tokens, cached keys)": requests}
            try:
                b = make_batch(torch, requests, heads, kv_heads, head_dim, decode_only=decode_only, device="cuda")
                entry.update(padded_tokens=int(b.q.shape[0]), padded_requests=int(b.kv_lens_t.shape[0]))
                clock = Timer()
                got = megatron_call(b, decode_only)
                torch.cuda.synchronize()
                entry["first_call_s"] = clock()
                entry["out_shape"] = list(got.shape)
                entry.update(compare(torch, got, b))
                nb = make_batch(torch, requests, heads, kv_heads, head_dim, decode_only=decode_only, device="cuda",
                                garbage=float("nan"))
                res["nan_pool"][name] = compare(torch, megatron_call(nb, decode_only), nb)
            except Exception as exc:  # noqa: BLE001 - recorded per call; the verdict fails on it
                entry["ok"] = False
                entry["error"] = f"{type(exc).__name__}: {exc}"
                entry["traceback"] = traceback.format_exc()[-2500:]
            res["calls"][name] = entry
            print(f"[flash_attn_probe] {name}: {'ok' if entry.get('ok') else 'FAILED'} "
                  f"max_abs_diff={entry.get('max_abs_diff')} {entry.get('error', '')}", flush=True)


def run(out: str | None) -> dict:
    from tests.gpu.test_mcore_generation import machine  # noqa: PLC0415

    clock = Timer()
    res: dict = {"check": "FlashAttention for megatron-core's dynamic inference engine",
                 "command": " ".join([sys.executable, *sys.argv]), "tolerance": TOL, "block_tokens": BLOCK}
    try:
        res["machine"] = machine()
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        res["device"] = {"name": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0))}
        res["detection"] = detection()
        print(f"[flash_attn_probe] detection: {res['detection']}", flush=True)
        if res["detection"]["dynamic_batching_assert_passes"]:
            run_calls(res)
    except Exception:  # noqa: BLE001 - the record says what broke
        res["error"] = traceback.format_exc()[-4000:]
    res.update(verdict(res))
    if res.get("error"):
        res["passed"] = False
        res["reasons"].append("the probe stopped: see error")
    res["elapsed_s"] = clock()
    dump(res, out, "flash_attn_probe")
    return res


@pytest.mark.gpu
def test_flash_attn_probe(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with vLLM, Ray and Megatron-Bridge (GPU host only)")
    assert run(str(tmp_path))["passed"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    # flash-attn-4 builds its kernels with the CUTLASS DSL at the first call (in process, no nvcc or ptxas); its
    # optional disk cache goes under /tmp
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/tmp/rlc-flash-attn-cute-cache")
    r = run(a.out)
    print("flash_attn_probe:", "passed" if r.get("passed") else f"FAILED ({'; '.join(r.get('reasons', []))[:600]})",
          flush=True)
    sys.exit(0 if r.get("passed") else 1)
