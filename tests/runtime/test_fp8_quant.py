"""FP8 rollouts on CPU: the quantization arithmetic against an independent reference, which exported names are
quantized, the quantized export stream, and the check of the trainer's names against vLLM's FP8 modules.

The reference rounds with a table of all 256 float8_e4m3fn codes (decoded by torch, which is exact) and
numpy's IEEE float32 arithmetic, so it shares nothing with torch's float-to-fp8 cast or the code under test
but the formulas vLLM documents (``per_block_cast_to_fp8``; ``csrc/quantization/w8a8/fp8/common.cu``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlc.contract.fp8 import block_quantized, block_scale_shape, largest_wire_tensor, scale_name, wire_bytes
from rlc.runtime.refit.fp8 import (
    check_layout,
    quantize_blocks,
    quantize_export,
    quantize_rows,
    quantize_tensor,
    quantized_specs,
    vllm_module_of,
)
from rlc.runtime.refit.specs import TensorSpec

# ------------------------------------------------------------------ an independent reference

_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
_FINITE = np.isfinite(_CODES)


def ref_fp8_codes(v: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest float8_e4m3fn code, ties to the even code, saturating at ±448."""
    v = np.clip(v.astype(np.float64), -448.0, 448.0)
    codes = np.nonzero(_FINITE)[0]
    values = _CODES[codes].astype(np.float64)
    dist = np.abs(v.reshape(-1, 1) - values.reshape(1, -1))
    best = dist.min(axis=1, keepdims=True)
    candidates = dist == best
    # among equally near codes: the same sign as v (avoids -0 for +0 inputs), then the even code
    sign_ok = np.signbit(values).reshape(1, -1) == np.signbit(v).reshape(-1, 1)
    score = candidates * (2 + sign_ok * 1 + ((codes % 2) == 0).reshape(1, -1) * 4)
    return codes[score.argmax(axis=1)].reshape(v.shape).astype(np.uint8)


def ref_blocks(x: torch.Tensor, pow2: bool = False) -> tuple[np.ndarray, np.ndarray]:
    a = x.float().numpy()
    m, n = a.shape
    rows, cols = math.ceil(m / 128), math.ceil(n / 128)
    q = np.zeros((m, n), dtype=np.uint8)
    s = np.zeros((rows, cols), dtype=np.float32)
    for i in range(rows):
        for j in range(cols):
            blk = a[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = np.float32(max(np.abs(blk).max(), np.float32(1e-4)))
            sf = np.float32(amax / np.float32(448.0))
            if pow2:
                sf = np.float32(2.0 ** math.ceil(math.log2(float(sf))))
            recip = np.float32(np.float32(1.0) / sf)
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = ref_fp8_codes((blk * recip).astype(np.float32))
            s[i, j] = sf
    return q, s


def bf16(shape: tuple[int, ...], seed: int, scale: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)


def codes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


# ------------------------------------------------------------------ the arithmetic


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (130, 300), (1, 5), (257, 129), (64, 640)])
@pytest.mark.parametrize("pow2", [False, True])
def test_block_scales_match_the_reference_including_ragged_edges(shape, pow2):
    x = bf16(shape, seed=sum(shape))
    x[: min(shape[0], 3), : min(shape[1], 2)] *= 300  # outliers in the first block only
    q, s = quantize_blocks(x, pow2=pow2)
    want_q, want_s = ref_blocks(x, pow2)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == shape
    assert tuple(s.shape) == block_scale_shape(shape) and s.dtype == torch.float32
    assert np.array_equal(s.numpy(), want_s)
    assert np.array_equal(codes(q), want_q)
    if pow2:
        assert np.all(np.log2(s.numpy()) == np.round(np.log2(s.numpy())))


def test_a_ragged_block_ignores_the_padding_and_an_all_zero_block_gets_the_floor_scale():
    x = torch.zeros((200, 130), dtype=torch.bfloat16)
    x[150:, 128:] = -0.5  # the ragged corner block: its scale comes from its own 50 x 2 values
    _, s = quantize_blocks(x)
    assert s[1, 1] == torch.tensor(0.5 / 448.0, dtype=torch.float32)
    assert s[0, 0] == torch.tensor(1e-4, dtype=torch.float32) / 448.0  # zeros: max(0, 1e-4) / 448
    assert s[0, 1] == s[0, 0] and s[1, 0] == s[0, 0]


def test_block_dequantization_error_is_bounded_by_half_an_fp8_step():
    x = bf16((384, 256), seed=3)
    q, s = quantize_blocks(x)
    scales = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:384, :256]
    back = q.float() * scales
    rel = ((back - x.float()).abs() / (x.float().abs() + 1e-12))
    assert float(rel[x.float().abs() > scales * 2 ** -6 * 448 / 448 * 16].max()) <= 2 ** -4  # 3 mantissa bits


def test_per_tensor_scale_matches_the_reference():
    x = bf16((96, 200), seed=5)
    q, s = quantize_tensor(x)
    a = x.float().numpy()
    sf = np.float32(np.abs(a).max() / np.float32(448.0))
    recip = np.float32(np.float32(1.0) / sf)
    assert s.shape == (1,) and s.numpy()[0] == sf
    assert np.array_equal(codes(q), ref_fp8_codes((a * recip).astype(np.float32)))
    assert float(q.float().abs().max()) == 448.0  # the largest element lands on the largest code


def test_per_channel_scales_match_the_reference_with_the_floor_for_a_zero_row():
    x = bf16((33, 70), seed=9)
    x[7] = 0
    q, s = quantize_rows(x)
    a = x.float().numpy()
    sf = np.maximum(np.abs(a).max(axis=1, keepdims=True) / np.float32(448.0),
                    np.float32(1.0 / (448.0 * 512.0))).astype(np.float32)
    assert s.shape == (33, 1) and np.array_equal(s.numpy(), sf)
    assert np.array_equal(codes(q), ref_fp8_codes((a / sf).astype(np.float32)))
    assert not codes(q)[7].any()


# ------------------------------------------------------------------ which names are quantized


def _qwen3_dense(layers: int = 2) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        p = f"model.layers.{i}"
        names += [f"{p}.self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [f"{p}.mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")]
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
    return names + ["model.norm.weight", "lm_head.weight"]


def _qwen3_moe(experts: int = 3) -> list[str]:
    names = [n for n in _qwen3_dense(1) if ".mlp." not in n]
    names.insert(-2, "model.layers.0.mlp.gate.weight")
    for e in range(experts):
        names.insert(-2, f"model.layers.0.mlp.experts.{e}.gate_proj.weight")
        names.insert(-2, f"model.layers.0.mlp.experts.{e}.up_proj.weight")
        names.insert(-2, f"model.layers.0.mlp.experts.{e}.down_proj.weight")
    return names


def _deepseek_v3() -> list[str]:
    mla = [f"self_attn.{x}.weight" for x in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                             "kv_a_layernorm", "kv_b_proj", "o_proj")]
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.0.{x}" for x in mla] + [f"model.layers.0.mlp.{x}.weight" for x in
                                                    ("gate_proj", "up_proj", "down_proj")]
    names += [f"model.layers.3.{x}" for x in mla]
    names += ["model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias"]
    names += [
        f"model.layers.3.mlp.experts.{e}.{x}.weight" for e in (0, 255) for x in ("gate_proj", "up_proj", "down_proj")
    ]
    names += [f"model.layers.3.mlp.shared_experts.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")]
    names += ["model.layers.61.enorm.weight", "model.layers.61.hnorm.weight", "model.layers.61.eh_proj.weight",
              "model.layers.61.shared_head.norm.weight", "model.layers.61.shared_head.head.weight"]
    return names + ["model.norm.weight", "lm_head.weight"]


def _quantized(names: list[str]) -> set[str]:
    return {n for n in names if block_quantized(n, 1 if n.endswith(("norm.weight", "_bias")) else 2)}


def test_qwen3_dense_quantizes_the_seven_projections_and_keeps_embedding_norms_and_head():
    names = _qwen3_dense(2)
    got = _quantized(names)
    assert len(got) == 14
    assert {n.rsplit(".", 2)[-2] for n in got} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"}
    assert not got & {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                      "model.layers.0.self_attn.q_norm.weight"}


def test_qwen3_moe_quantizes_every_expert_and_keeps_the_router():
    got = _quantized(_qwen3_moe(3))
    assert "model.layers.0.mlp.gate.weight" not in got
    assert {f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(3)} <= got
    assert len(got) == 4 + 9


def test_deepseek_v3_quantizes_mla_dense_shared_and_routed_experts_only():
    names = _deepseek_v3()
    got = _quantized(names)
    kept = set(names) - got
    assert {"model.layers.3.self_attn.q_a_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.3.self_attn.kv_b_proj.weight", "model.layers.3.mlp.shared_experts.down_proj.weight",
            "model.layers.3.mlp.experts.255.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= got
    assert {"model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
            "model.layers.61.eh_proj.weight", "model.layers.61.shared_head.head.weight",
            "model.layers.3.self_attn.kv_a_layernorm.weight", "model.embed_tokens.weight", "lm_head.weight"} <= kept
    assert len(got) == 5 + 3 + 5 + 6 + 3


def test_stacked_experts_and_one_dimensional_tensors_are_not_block_quantized():
    assert not block_quantized("model.layers.0.mlp.experts.gate_up_proj", 3)
    assert not block_quantized("model.layers.0.self_attn.q_proj.bias", 1)
    assert block_quantized("model.layers.0.block_sparse_moe.experts.3.w2.weight", 2)


def test_wire_bytes_count_one_byte_per_weight_plus_the_block_scales():
    assert wire_bytes("model.layers.0.self_attn.q_proj.weight", (4096, 4096), 2, "block") == 4096 * 4096 + 32 * 32 * 4
    assert wire_bytes("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 7168), 2, "block") == \
        576 * 7168 + 5 * 56 * 4
    assert wire_bytes("lm_head.weight", (151936, 4096), 2, "block") == 151936 * 4096 * 2
    assert wire_bytes("model.layers.0.self_attn.q_proj.weight", (4096, 4096), 2, "tensor") == 4096 * 4096 * 2
    shapes = [
        ("model.layers.0.mlp.experts.0.up_proj.weight", (24576, 4096)),
        ("model.embed_tokens.weight", (16000, 4096)),
    ]
    assert largest_wire_tensor(shapes, 2, None)[0] == "model.layers.0.mlp.experts.0.up_proj.weight"
    assert largest_wire_tensor(shapes, 2, "block")[0] == "model.embed_tokens.weight"


# ------------------------------------------------------------------ the quantized export stream


def _export(names_shapes: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, bf16(s, seed=i) if len(s) == 2 else torch.ones(s, dtype=torch.bfloat16))
            for i, (n, s) in enumerate(names_shapes)]


EXPERTS = [(f"model.layers.0.mlp.experts.{e}.{p}.weight", (256, 200) if p != "down_proj" else (200, 256))
           for e in range(5) for p in ("gate_proj", "up_proj", "down_proj")]
LAYOUT = ([("model.embed_tokens.weight", (50, 200)), ("model.layers.0.self_attn.q_proj.weight", (130, 200)),
           ("model.layers.0.input_layernorm.weight", (200,))] + EXPERTS + [("lm_head.weight", (50, 200))])


@pytest.mark.parametrize("group_bytes", [1, 256 * 200 * 2 * 2, 64 << 20])
def test_the_stream_yields_what_the_specs_announce_and_grouping_changes_no_bit(group_bytes):
    exported = _export(LAYOUT)
    specs = quantized_specs([TensorSpec.from_tensor(n, t) for n, t in exported])
    got = list(quantize_export(iter(exported), quantize_blocks, group_bytes=group_bytes))
    assert [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in got] == \
        [(s.name, s.shape, s.dtype) for s in specs]
    alone = dict(quantize_export(iter(exported), quantize_blocks, group_bytes=0))
    for name, t in got:
        want = alone[name]
        assert t.dtype == want.dtype and np.array_equal(
            codes(t) if t.element_size() == 1 else t.float().numpy(),
            codes(want) if want.element_size() == 1 else want.float().numpy(),
        ), name
    assert scale_name("model.layers.0.mlp.experts.4.down_proj.weight") in alone


def test_grouping_calls_the_quantizer_once_per_group_of_same_shape_experts():
    calls: list[tuple[int, ...]] = []

    def counting(x: torch.Tensor):
        calls.append(tuple(x.shape))
        return quantize_blocks(x)

    list(quantize_export(iter(_export(LAYOUT)), counting, group_bytes=64 << 20))
    # q_proj (130 rows: not whole blocks) alone; each expert's gate and up (256 x 200) in one call; down (200 rows)
    # alone, and it ends the group: the next gate starts a new one
    assert calls[0] == (130, 200) and calls[1:3] == [(512, 200), (200, 256)] and len(calls) == 1 + 5 * 2
    calls.clear()
    same = [(f"model.layers.0.mlp.experts.{e}.down_proj.weight", (256, 128)) for e in range(6)]
    list(quantize_export(iter(_export(same)), counting, group_bytes=3 * 256 * 128 * 2))
    assert calls == [(768, 128), (768, 128)]


# ------------------------------------------------------------------ the trainer's names against vLLM's FP8 modules

QWEN3_MOE_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _wire(names: list[str]) -> list[str]:
    specs = quantized_specs([TensorSpec(n, (256, 256) if not n.endswith("norm.weight") else (256,), "bfloat16")
                             for n in names])
    return [s.name for s in specs]


def _vllm_modules(router_fp8: bool) -> tuple[set[str], set[str]]:
    p = "model.layers.0"
    every = {"model.embed_tokens", f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj", f"{p}.self_attn.q_norm",
             f"{p}.mlp.gate", f"{p}.mlp.experts", "model.norm", "lm_head"}
    fp8 = {f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj", f"{p}.mlp.experts"} | (
        {f"{p}.mlp.gate"} if router_fp8 else set()
    )
    return fp8, every


def test_vllm_module_names_follow_fusion_and_the_expert_stack():
    assert (
        vllm_module_of("model.layers.0.self_attn.k_proj.weight", QWEN3_MOE_PACKED)
        == "model.layers.0.self_attn.qkv_proj"
    )
    assert vllm_module_of("model.layers.2.mlp.experts.17.down_proj.weight", {}) == "model.layers.2.mlp.experts"
    assert (
        vllm_module_of(
            "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
            {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]},
        )
        == "model.layers.3.self_attn.fused_qkv_a_proj"
    )


def test_layout_check_passes_when_vllm_keeps_the_router_in_bf16_and_names_a_quantized_router():
    fp8, every = _vllm_modules(router_fp8=False)
    ok = check_layout(_wire(_qwen3_moe(2)), fp8, every, QWEN3_MOE_PACKED)
    assert ok.ok and ok.matched == 3 and ok.unmatched == []
    fp8, every = _vllm_modules(router_fp8=True)  # vLLM's own default for Qwen3-MoE: ReplicatedLinear with quant_config
    bad = check_layout(_wire(_qwen3_moe(2)), fp8, every, QWEN3_MOE_PACKED)
    assert not bad.ok and bad.sent_bf16_to_fp8 == ["model.layers.0.mlp.gate"]
    assert "model.layers.0.mlp.gate" in bad.error_text() and "scales: tensor" in bad.error_text()


def test_layout_check_names_a_projection_vllm_keeps_in_bf16():
    fp8, every = _vllm_modules(router_fp8=False)
    fp8.discard("model.layers.0.self_attn.o_proj")
    bad = check_layout(_wire(_qwen3_moe(2)), fp8, every, QWEN3_MOE_PACKED)
    assert bad.sent_fp8_to_bf16 == ["model.layers.0.self_attn.o_proj"] and not bad.ok
