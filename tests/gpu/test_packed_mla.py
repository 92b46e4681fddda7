"""GPU check: packed (``thd``) rows through multi-latent attention's RoPE and the MTP block's shift, megatron-core's
per-sequence paths against what sequence packing now uses.

* **RoPE.** Unfused, megatron-core 0.19's multi-latent attention (MLA) applies its rotary embedding to a packed row
  one sequence at a time, to the queries and to the keys, with its MLA interleaving. With ``apply_rope_fusion`` on
  (what sequence packing now sets for MLA's YaRN embedding), megatron-core's Triton kernels
  ``fused_apply_mla_rope_for_q`` / ``fused_apply_mla_rope_for_kv`` take the whole row and assemble query, key and
  value themselves. Both are called here exactly as ``MultiLatentAttention`` calls them, at the tiny DeepSeek-V3's
  head dims (4 heads; 128 no-RoPE + 64 RoPE dims per query/key head, 128 value dims) on a tiny GRPO step's rows, and
  at DeepSeek-V3's own (128 heads over tensor parallelism 8, YaRN factor 40) on one long bin; the error of each is
  taken against the unfused path computed in fp32 (outputs and input gradients).
* **MTP shift.** megatron-core's own ``_roll_tensor_packed_seq`` against the whole-row shift the runtime installs
  (:mod:`rlc.runtime.policy.packed_roll`), through megatron-core's ``roll_tensor``: the same tensors bit for bit
  (token ids, positions, a float loss mask, a bool mask), and the time of each.

Verdict: on the tiny step fused RoPE is at least ``MIN_SPEEDUP`` times faster forward and forward + backward and
never more than ``MAX_SLOWDOWN`` slower on the long bin; its error against fp32 is at most the unfused path's plus
one bf16 rounding of the largest value, for query, key, value and every input gradient; the whole-row shift equals
megatron-core's everywhere and is at least ``MIN_ROLL_SPEEDUP`` times faster on the tiny step.

    python tests/gpu/test_packed_mla.py [--out DIR]     # one GPU, about a minute
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from tests.gpu.common import Timer, dump, gpu_available
from tests.gpu.test_packed_rope import _lengths, _OneRank

TINY = {"heads": 4, "qk_head_dim": 128, "pos_dim": 64, "v_dim": 128, "yarn": {}}
# DeepSeek-V3's attention per tensor-parallel rank at TP 8, and its YaRN settings (config.json's rope_scaling)
DEEPSEEK_V3_TP8 = {"heads": 16, "qk_head_dim": 128, "pos_dim": 64, "v_dim": 128,
                   "yarn": {"scaling_factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
CASES = {
    "tiny_step": {"n": 2048, "lengths": (5, 15), "seed": 0, "model": TINY},
    "long_bin": {"n": None, "tokens": 16384, "lengths": (100, 4000), "seed": 2, "model": DEEPSEEK_V3_TP8},
}
REPEATS = 3
MIN_SPEEDUP = 20.0
MAX_SLOWDOWN = 1.5
MIN_ROLL_SPEEDUP = 10.0
BF16_EPS = 2.0 ** -8


def _best(fn: Callable[[], Any]) -> float:
    import torch  # noqa: PLC0415

    fn()  # warm-up (and Triton's autotuning)
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def _rope(model: dict[str, Any]):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding  # noqa: PLC0415

    yarn = {"scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, **model["yarn"]}  # the Bridge's defaults
    return YarnRotaryEmbedding(model["pos_dim"], rotary_base=10000, cp_group=_OneRank(), **yarn)


def _unfused(q, kv, k_pos, cu, max_len, rope, model):
    """``MultiLatentAttention``'s unfused path for a packed row (``qkv_up_proj_and_rope_apply``)."""
    import torch  # noqa: PLC0415
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # noqa: PLC0415

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=True,
                             mrope_section=None)
    freqs, mscale = rope(max_len, packed_seq=True)
    q_no_pe, q_pos = torch.split(q, [model["qk_head_dim"], model["pos_dim"]], dim=-1)
    k_no_pe, value = torch.split(kv, [model["qk_head_dim"], model["v_dim"]], dim=-1)
    kwargs = {"config": config, "cu_seqlens": cu, "mscale": mscale, "cp_group": _OneRank(),
              "mla_rotary_interleaved": True}
    q_pos = apply_rotary_pos_emb(q_pos, freqs, **kwargs)
    k_pos = apply_rotary_pos_emb(k_pos, freqs, **kwargs)
    query = torch.cat([q_no_pe, q_pos], dim=-1)
    key = torch.cat([k_no_pe, k_pos.expand(-1, model["heads"], -1)], dim=-1)
    return query, key, value


def _fused(q, kv, k_pos, cu, max_len, rope, model):
    """The same with ``apply_rope_fusion`` (the query is rotated in place, as in ``MultiLatentAttention``)."""
    from megatron.core.fusions.fused_mla_yarn_rope_apply import (  # noqa: PLC0415
        fused_apply_mla_rope_for_kv,
        fused_apply_mla_rope_for_q,
    )

    cos, sin = rope.get_cached_cos_sin(max_len, dtype=q.dtype, packed_seq=True)
    query = fused_apply_mla_rope_for_q(q, cos, sin, model["qk_head_dim"], model["pos_dim"], cu, 0, 1)
    key, value = fused_apply_mla_rope_for_kv(kv, k_pos, cos, sin, model["pos_dim"], model["qk_head_dim"],
                                             model["v_dim"], cu, 0, 1)
    return query, key, value


def measure_rope(case: dict[str, Any]) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    model, lengths = case["model"], _lengths(case)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(case["seed"])
    cu = torch.tensor([0] + lengths, device=dev, dtype=torch.int64).cumsum(0).to(torch.int32)
    total, heads, max_len = int(cu[-1]), model["heads"], max(lengths)
    qd, kvd = model["qk_head_dim"] + model["pos_dim"], model["qk_head_dim"] + model["v_dim"]

    def rand(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)

    inputs = {"q": rand(total, heads, qd), "kv": rand(total, heads, kvd), "k_pos": rand(total, 1, model["pos_dim"])}
    grads = {"query": rand(total, heads, qd), "key": rand(total, heads, qd),
             "value": rand(total, heads, model["v_dim"])}
    rope = _rope(model)

    def outputs_and_grads(path, dtype):
        leaves = {k: v.detach().to(dtype).clone().requires_grad_(True) for k, v in inputs.items()}
        # the fused query kernel works in place: it gets a copy, as MultiLatentAttention's q is a fresh view
        query, key, value = path(leaves["q"].clone(), leaves["kv"], leaves["k_pos"], cu, max_len, rope, model)
        out = {"query": query, "key": key, "value": value}
        torch.autograd.backward([out[k] for k in grads], [grads[k].to(dtype) for k in grads])
        return ({k: v.detach().float() for k, v in out.items()},
                {f"d_{k}": v.grad.float() for k, v in leaves.items()})

    ref_out, ref_grad = outputs_and_grads(_unfused, torch.float32)
    res: dict[str, Any] = {"sequences": len(lengths), "tokens": total, "heads": heads, "max_len": max_len,
                           "ref_max_abs": {k: float(v.abs().max()) for k, v in {**ref_out, **ref_grad}.items()}}
    for mode, path in (("unfused", _unfused), ("fused", _fused)):
        out, grad = outputs_and_grads(path, torch.bfloat16)
        errors = {k: float((v - ref_out[k]).abs().max()) for k, v in out.items()}
        errors.update({k: float((v - ref_grad[k]).abs().max()) for k, v in grad.items()})

        def forward(path=path):
            with torch.no_grad():
                path(inputs["q"].clone(), inputs["kv"], inputs["k_pos"], cu, max_len, rope, model)

        def forward_backward(path=path):
            outputs_and_grads(path, torch.bfloat16)

        res[mode] = {"forward_s": _best(forward), "forward_backward_s": _best(forward_backward),
                     "max_abs_err": errors}
    for key in ("forward", "forward_backward"):
        res[f"speedup_{key}"] = res["unfused"][f"{key}_s"] / max(res["fused"][f"{key}_s"], 1e-9)
    return res


def measure_roll(case: dict[str, Any]) -> dict[str, Any]:
    """megatron-core's per-sequence shift and the installed whole-row one, through ``roll_tensor``."""
    import torch  # noqa: PLC0415
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: PLC0415
    from megatron.core.transformer import multi_token_prediction as mtp  # noqa: PLC0415

    from rlc.runtime.policy import packed_roll  # noqa: PLC0415

    lengths = _lengths(case)
    lengths[len(lengths) // 2] = 0  # an empty sequence (a dummy bin's), which must not disturb its neighbour
    dev = torch.device("cuda")
    cu = torch.tensor([0] + lengths, device=dev, dtype=torch.int64).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    gen = torch.Generator(device=dev).manual_seed(case["seed"])
    starts = torch.repeat_interleave(cu[:-1].long(), torch.tensor(lengths, device=dev))
    tensors = {"input_ids": torch.randint(1, 150000, (1, total), device=dev, generator=gen),
               "position_ids": (torch.arange(total, device=dev) - starts).unsqueeze(0),
               "loss_mask": torch.rand(1, total, device=dev, generator=gen).round(),
               "padding_mask": torch.rand(1, total, device=dev, generator=gen) > 0.1}
    original = getattr(mtp._roll_tensor_packed_seq, "rlc_original", mtp._roll_tensor_packed_seq)
    mtp._roll_tensor_packed_seq = original

    def roll_all():
        return {k: mtp.roll_tensor(v, shifts=-1, dims=-1, cp_group=None, packed_seq_params=params)
                for k, v in tensors.items()}

    want = roll_all()
    per_sequence_s = _best(roll_all)
    installed = packed_roll.install(mtp)
    got = roll_all()
    whole_row_s = _best(roll_all)
    equal = {k: bool(torch.equal(got[k][0], want[k][0]) and torch.equal(got[k][1], want[k][1])) for k in tensors}
    # the negative control: a plain roll that ignores the boundaries is told apart
    plain = torch.roll(tensors["input_ids"], -1, -1)
    return {"sequences": len(lengths), "tokens": total, "installed": installed, "equal": equal,
            "control_differs": not bool(torch.equal(plain, want["input_ids"][0])),
            "per_sequence_s": per_sequence_s, "whole_row_s": whole_row_s,
            "speedup": per_sequence_s / max(whole_row_s, 1e-9)}


def verdict(rope: dict[str, dict[str, Any]], roll: dict[str, dict[str, Any]]) -> tuple[bool, list[str]]:
    """Pass/fail of the measured cases (see the module docstring); the reasons for a failure."""
    why = []
    tiny, long_bin = rope["tiny_step"], rope["long_bin"]
    for key in ("speedup_forward", "speedup_forward_backward"):
        if tiny[key] < MIN_SPEEDUP:
            why.append(f"RoPE, tiny step: fused only {tiny[key]:.1f}x faster ({key}), expected >= {MIN_SPEEDUP}x")
        if long_bin[key] < 1.0 / MAX_SLOWDOWN:
            why.append(f"RoPE, long bin: fused {1 / long_bin[key]:.2f}x slower ({key}), allowed {MAX_SLOWDOWN}x")
    for name, c in rope.items():
        for err, fused_err in c["fused"]["max_abs_err"].items():
            allowed = c["unfused"]["max_abs_err"][err] + BF16_EPS * c["ref_max_abs"][err]
            if not fused_err <= allowed:
                why.append(f"RoPE, {name}: fused {err} error {fused_err:.3g} > unfused "
                           f"{c['unfused']['max_abs_err'][err]:.3g} + one bf16 rounding of {c['ref_max_abs'][err]:.3g}")
    for name, r in roll.items():
        if not r["installed"]:
            why.append(f"MTP shift, {name}: the whole-row shift was not installed")
        for k, same in r["equal"].items():
            if not same:
                why.append(f"MTP shift, {name}: {k} differs from megatron-core's per-sequence shift")
        if not r["control_differs"]:
            why.append(f"MTP shift, {name}: the boundary-blind control equals the reference (the rows test nothing)")
    if roll["tiny_step"]["speedup"] < MIN_ROLL_SPEEDUP:
        why.append(f"MTP shift, tiny step: whole-row only {roll['tiny_step']['speedup']:.1f}x faster, expected >= "
                   f"{MIN_ROLL_SPEEDUP}x")
    return not why, why


def run(out_dir: str | None) -> dict[str, Any]:
    timer = Timer()
    result: dict[str, Any] = {
        "check": "packed rows through multi-latent attention's RoPE and the MTP shift: megatron-core's per-sequence "
                 "paths vs fused RoPE and the whole-row shift",
        "command": " ".join([sys.executable, *sys.argv]),
        "passed": False,
    }
    try:
        import torch  # noqa: PLC0415

        result["machine"] = f"{platform.node()} {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        result["rope"] = {name: measure_rope(case) for name, case in CASES.items()}
        result["roll"] = {name: measure_roll(case) for name, case in CASES.items()}
        result["passed"], result["failures"] = verdict(result["rope"], result["roll"])
    except Exception:  # noqa: BLE001 - the report says what broke
        result["error"] = traceback.format_exc()
    result["seconds"] = timer()
    dump(result, out_dir, "packed_mla")
    print("PASS" if result["passed"] else f"FAIL: {result.get('failures') or result.get('error')}", flush=True)
    return result


def _good() -> tuple[dict[str, Any], dict[str, Any]]:
    errs = {k: 0.03 for k in ("query", "key", "value", "d_q", "d_kv", "d_k_pos")}

    def rope(unfused_s: float, fused_s: float) -> dict[str, Any]:
        return {"unfused": {"forward_s": unfused_s, "forward_backward_s": 2 * unfused_s, "max_abs_err": dict(errs)},
                "fused": {"forward_s": fused_s, "forward_backward_s": 2 * fused_s, "max_abs_err": dict(errs)},
                "ref_max_abs": {k: 5.0 for k in errs},
                "speedup_forward": unfused_s / fused_s, "speedup_forward_backward": unfused_s / fused_s}

    def roll(speedup: float) -> dict[str, Any]:
        return {"installed": True, "equal": {"input_ids": True, "loss_mask": True}, "control_differs": True,
                "speedup": speedup}

    return ({"tiny_step": rope(0.5, 0.0002), "long_bin": rope(0.003, 0.0006)},
            {"tiny_step": roll(200.0), "long_bin": roll(3.0)})


def test_verdict_passes_on_good_evidence_and_fails_on_each_kind_of_bad():
    """CPU: the verdict the GPU run is judged by."""
    assert verdict(*_good()) == (True, [])
    rope, roll = _good()
    rope["tiny_step"]["speedup_forward"] = 3.0
    assert "RoPE, tiny step" in verdict(rope, roll)[1][0]
    rope, roll = _good()
    rope["long_bin"]["speedup_forward_backward"] = 0.5
    assert "RoPE, long bin" in verdict(rope, roll)[1][0]
    rope, roll = _good()
    rope["long_bin"]["fused"]["max_abs_err"]["d_kv"] = 0.1
    assert "fused d_kv error" in verdict(rope, roll)[1][0]
    rope, roll = _good()
    roll["long_bin"]["equal"]["loss_mask"] = False
    assert "loss_mask differs" in verdict(rope, roll)[1][0]
    rope, roll = _good()
    roll["tiny_step"]["control_differs"] = False
    assert "control" in verdict(rope, roll)[1][0]
    rope, roll = _good()
    roll["tiny_step"]["speedup"] = 2.0
    assert "whole-row only" in verdict(rope, roll)[1][0]


def test_packed_mla_on_gpu(tmp_path):
    if not gpu_available():
        pytest.skip("needs a CUDA GPU with megatron-core (GPU host only)")
    assert run(str(tmp_path))["passed"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.exit(0 if run(a.out)["passed"] else 1)
