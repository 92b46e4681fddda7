"""The FlashAttention probe's CPU half (tests/gpu/test_flash_attn_probe.py): the paged batch is laid out as
megatron-core's dynamic context lays it out, the reference read through the block table equals plain causal attention
on each request's own keys, and the verdict fails on a kernel that is wrong, NaN, missing, or a stack that breaks
vLLM."""
from __future__ import annotations

import math

import pytest

from tests.gpu import test_flash_attn_probe as p

torch = pytest.importorskip("torch")

SHAPE = (4, 2, 32)  # the tiny recipes' heads, KV heads, head_dim


def _sdpa(b: p.PagedBatch) -> torch.Tensor:
    """Causal attention of each real request on its contiguous keys (no block table), fp32."""
    out, start = [], 0
    for ql, kl, k, v in zip(b.q_lens, b.kv_lens, b.keys, b.values):
        q = b.q[start:start + ql, 0].float().transpose(0, 1)  # (heads, ql, d)
        group = q.shape[0] // k.shape[1]
        kk = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
        vv = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        allowed = torch.ones(ql, kl, dtype=torch.bool).tril(diagonal=kl - ql)  # bottom-right aligned
        out.append(torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=allowed).transpose(0, 1))
        start += ql
    return torch.cat(out)


@pytest.mark.parametrize("requests, decode_only", [(p.MIXED, False), (p.DECODE, True)])
def test_reference_through_the_block_table_is_causal_attention(requests, decode_only):
    b = p.make_batch(torch, requests, *SHAPE, decode_only=decode_only)
    assert torch.allclose(p.reference(torch, b), _sdpa(b), atol=1e-4, rtol=1e-4)


def test_batch_is_padded_and_paged_as_megatron_cores_dynamic_context():
    mixed = p.make_batch(torch, p.MIXED, *SHAPE, decode_only=False)
    assert mixed.q.shape[0] == 192 and mixed.kv_lens_t.shape[0] == 8  # 147 tokens -> 64s, 5 requests -> 4s
    assert mixed.cu_q.tolist() == [0, 1, 2, 42, 142, 147, 147, 147, 147]
    assert mixed.kv_lens_t.tolist() == [71, 131, 104, 100, 5, 0, 0, 0]
    decode = p.make_batch(torch, p.DECODE, *SHAPE, decode_only=True)
    assert decode.q.shape[0] == decode.kv_lens_t.shape[0] == 64  # eager decode pads request slots to 64 tokens
    assert (decode.block_table[5:] == -1).all() and (decode.kv_lens_t[5:] == 0).all()
    t = decode.block_table
    assert t.dtype == torch.int32 and [int((row >= 0).sum()) for row in t[:5]] == [1, 1, 1, 2, 5]
    used = t[t >= 0].tolist()
    assert len(used) == len(set(used)) and mixed.pool.shape == (2, 1, p.POOL_BLOCKS, p.BLOCK, 2, 32)


def test_reference_reads_no_pool_slot_past_a_requests_keys():
    finite = p.make_batch(torch, p.MIXED, *SHAPE, decode_only=False)
    nan = p.make_batch(torch, p.MIXED, *SHAPE, decode_only=False, garbage=float("nan"))
    assert torch.isnan(nan.pool).any()
    assert torch.equal(p.reference(torch, nan), p.reference(torch, finite))


def _kernel_output(b: p.PagedBatch, error: float = 0.0) -> torch.Tensor:
    """What a kernel returns for ``b`` (padded rows included), as bf16, off by ``error`` on the real rows."""
    out = torch.full((b.q.shape[0], 1, *b.q.shape[2:]), 7.0)
    out[:b.real_tokens, 0] = p.reference(torch, b) + error
    return out.to(torch.bfloat16)


def test_compare_passes_a_correct_bf16_kernel_and_fails_a_wrong_or_nan_one():
    b = p.make_batch(torch, p.DECODE, *SHAPE, decode_only=True)
    assert p.compare(torch, _kernel_output(b), b)["ok"]  # padded rows (7.0) are not judged
    wrong = p.compare(torch, _kernel_output(b, error=0.1), b)
    assert not wrong["ok"] and wrong["max_abs_diff"] > p.TOL
    bad = _kernel_output(b)
    bad[3, 0, 1, 5] = math.nan
    nan = p.compare(torch, bad, b)
    assert not nan["finite"] and not nan["ok"]


GOOD = {"detection": {"dynamic_batching_assert_passes": True, "rlc_flash_attention": "FlashAttention-3",
                      "vllm_rotary_import_ok": True},
        "calls": {"mixed prefill": {"ok": True, "max_abs_diff": 0.004}, "decode": {"ok": True, "max_abs_diff": 0.003}}}


def test_verdict_passes_a_working_stack():
    assert p.verdict(GOOD) == {"passed": True, "reasons": []}


@pytest.mark.parametrize("change, why", [
    ({"detection": {**GOOD["detection"], "dynamic_batching_assert_passes": False}}, "megatron-core finds no"),
    ({"detection": {**GOOD["detection"], "rlc_flash_attention": None}}, "rlc's flash_attention() finds none"),
    ({"detection": {**GOOD["detection"], "vllm_rotary_import_ok": False}}, "vLLM #42675"),
    ({"calls": {}}, "no kernel call ran"),
    ({"calls": {**GOOD["calls"], "decode": {"ok": False, "max_abs_diff": 0.3}}}, "decode: max abs diff 0.3"),
    ({"calls": {**GOOD["calls"], "decode": {"ok": False, "error": "RuntimeError: boom"}}}, "decode: RuntimeError"),
])
def test_verdict_fails_and_says_why(change, why):
    v = p.verdict({**GOOD, **change})
    assert not v["passed"] and any(why in r for r in v["reasons"]), v
