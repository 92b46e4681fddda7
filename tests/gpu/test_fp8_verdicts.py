"""CPU checks of the FP8 GPU checks' verdicts: each passes on good evidence and fails on each kind of bad."""
from __future__ import annotations

import copy

from tests.gpu.test_fp8_grpo import verdict
from tests.gpu.test_fp8_refit import summarize


def _stats(x: float) -> dict:
    return {"median": x, "min": x, "max": x}


def _refit_result() -> dict:
    mode = {"summary": {"total_refit_s": _stats(0.2), "transfer_s": _stats(0.1), "export_s": _stats(0.05),
                        "load_weights_s": _stats(0.04), "bytes_per_gpu": _stats(16e9)},
            "throughput": {"tokens_per_s": 1000.0}}
    fp8 = copy.deepcopy(mode)
    fp8["summary"]["bytes_per_gpu"] = _stats(9e9)
    fp8["throughput"] = {"tokens_per_s": 1500.0}
    fp8["prepare"] = {"consumer": [{"fp8_layout": {"ok": True, "fp8_modules": 252}}]}
    fp8["verify"] = {"compare": {"bit_exact": True, "params_compared": 400, "fp8_params": 252, "scale_params": 252,
                                 "mismatch_count": 0, "mismatches": []}, "mirror": {"block_equal": 12}}
    return {"scales": "block", "modes": {"bf16": mode, "fp8": fp8}}


def test_fp8_refit_passes_on_a_bit_exact_verified_refit_and_reports_the_comparison():
    s = summarize(_refit_result())
    assert s["passed"] and s["fp8_over_bf16_tokens_per_s"] == 1.5
    assert s["bytes_per_refit"] == {"bf16": 16e9, "fp8": 9e9}


def test_fp8_refit_fails_on_a_mismatch_a_failed_module_check_an_error_or_nothing_compared():
    bad = _refit_result()
    bad["modes"]["fp8"]["verify"]["compare"].update(bit_exact=False, mismatch_count=1,
                                                    mismatches=[{"name": "model.layers.0.mlp.down_proj.weight"}])
    assert "down_proj" in "; ".join(summarize(bad)["reasons"])
    bad = _refit_result()
    bad["modes"]["fp8"]["prepare"]["consumer"][0]["fp8_layout"]["ok"] = False
    assert not summarize(bad)["passed"]
    bad = _refit_result()
    bad["modes"]["bf16"] = {"error": "RuntimeError: vLLM start (bf16) failed"}
    assert not summarize(bad)["passed"]
    bad = _refit_result()
    bad["modes"]["fp8"]["verify"]["compare"]["fp8_params"] = 0
    assert "no FP8 parameter" in "; ".join(summarize(bad)["reasons"])


def _grpo(rc=0, steps=150, reached=60, verified=(0, 50, 100, 150), exact=True) -> dict:
    return {"rc": rc, "summary": {"steps_logged": steps, "refits_logged": steps, "step_10mean_reached_goal": reached,
                                  "reward_last10_mean": 0.9},
            "verify": [{"step": s, "bit_exact": exact, "mismatches": [] if exact else [{"name": "x"}]}
                       for s in verified]}


def test_fp8_grpo_verdict():
    assert verdict(_grpo(), 150, 50, need_learning=True) == (True, [])
    assert not verdict(_grpo(rc=3), 150, 50, True)[0]
    assert not verdict(_grpo(reached=None), 150, 50, True)[0]
    assert verdict(_grpo(reached=None), 150, 50, need_learning=False)[0]  # block scales: learning reported only
    assert not verdict(_grpo(verified=(0, 50)), 150, 50, True)[0]
    assert not verdict(_grpo(exact=False), 150, 50, True)[0]
