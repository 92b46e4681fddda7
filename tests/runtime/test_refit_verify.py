"""The bit-for-bit refit check (``refit.verify_every``): its comparison and its verdict text."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rlc.runtime.refit.verify import compare_parameters, verify_error_text  # noqa: E402


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "model.layers.1.mlp.gate.e_score_correction_bias": (30 + 0.05 * torch.randn(8, generator=g)).float(),
        "model.embed_tokens.weight": torch.randn(16, 4, generator=g).to(torch.bfloat16),
    }


def test_identical_states_are_bit_exact():
    ref = _state()
    report = compare_parameters({k: v.clone() for k, v in ref.items()}, ref)
    assert report.bit_exact and report.params_compared == 3
    assert report.fp32_params == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert report.bytes_compared == 8 * 4 * 2 + 8 * 4 + 16 * 4 * 2


def test_fp32_bias_sent_as_bf16_is_named_with_the_bits_lost():
    ref = _state()
    got = {k: v.clone() for k, v in ref.items()}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    got[bias] = ref[bias].to(torch.bfloat16).to(torch.float32)  # what a bf16 wire does to it
    report = compare_parameters(got, ref)
    assert not report.bit_exact
    (m,) = report.mismatches
    assert m.name == bias and m.rounded_to_bf16 and m.mantissa_bits_lost == 16
    assert 0 < m.max_abs_diff <= 0.125  # bf16's step at 30 is 0.125: at most half of it... or one step
    text = verify_error_text(3, [report.to_dict()])
    assert "refit 3 is not bit-exact" in text and "16 mantissa bits lost" in text and "refit.fp32_params" in text


def test_one_flipped_bit_in_a_bf16_tensor_is_caught():
    ref = _state()
    got = {k: v.clone() for k, v in ref.items()}
    name = "model.embed_tokens.weight"
    bits = got[name].view(torch.int16)
    bits[3, 1] ^= 1  # lowest mantissa bit of one element
    report = compare_parameters(got, ref)
    (m,) = report.mismatches
    assert m.name == name and m.elements_differing == 1 and not m.rounded_to_bf16
    assert "refit.per_rank_ipc_metadata" in verify_error_text(0, [report.to_dict()])


def test_missing_or_reshaped_parameter_is_a_mismatch_and_unloaded_names_are_not_compared():
    ref = _state()
    got = {k: v.clone() for k, v in ref.items() if "embed" not in k}
    report = compare_parameters(got, ref)
    assert [m.name for m in report.mismatches] == ["model.embed_tokens.weight"]
    loaded = {"model.layers.0.self_attn.qkv_proj.weight"}
    report = compare_parameters(got, ref, loaded=loaded)
    assert report.params_compared == 1 and report.bit_exact
    assert sorted(report.not_loaded) == sorted(set(ref) - loaded)


def test_nothing_compared_is_not_bit_exact():
    assert not compare_parameters({}, {}).bit_exact
