"""CPU parts of ``benchmarks/refit_at_scale.py``: shapes from the real HF configs, the memory budget,
the spot-check selection and slicing, the timing breakdown, the tiny-run overhead, the goals and
``--check``, argument errors, and a full run of the GPU-free cases writing the JSON and table."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import refit_at_scale as S
from benchmarks import refit_scale_plan as P

TINY_METRICS = Path(__file__).resolve().parents[2] / "docs" / "results" / "tiny-qwen3-h200-grpo" / "metrics.jsonl"


# --------------------------------------------------------------------------- shapes and budget


def test_shapes_match_the_measured_exports():
    moe = P.model_bytes(P.load_hf_config("qwen3-30b-a3b"))
    dense = P.model_bytes(P.load_hf_config("qwen3-8b"))
    # the exporter yielded 18,867 tensors / 61.1 GB (30B-A3B) and 399 / 16.4 GB (8B) on the GPU host
    assert (moe.num_tensors, round(moe.total / 1e9, 1)) == (18867, 61.1)
    assert (dense.num_tensors, round(dense.total / 1e9, 1)) == (399, 16.4)
    assert moe.experts / moe.total > 0.94 and dense.experts == 0
    assert moe.largest_tensor == 151936 * 2048 * 2  # the embedding (FUSED_TENSORS.md)


def test_trainer_shards_follow_the_layout():
    mb = P.model_bytes(P.load_hf_config("qwen3-30b-a3b"))
    layouts = P.default_layouts()
    ep2, tp2 = P.trainer_bytes(mb, layouts["moe-ep2"]), P.trainer_bytes(mb, layouts["moe-tp2"])
    assert ep2 == mb.non_expert + mb.experts // 2  # EP shards experts only; TP=1 keeps the rest whole
    assert tp2 < ep2 and abs(tp2 - mb.total / 2) < 0.02 * mb.total


def test_every_layout_can_be_asked_for_by_name_and_gives_a_valid_runtime_config(tmp_path):
    from rlc.contract.runtime_config import runtime_config_from_dict

    assert set(S.GPU_CASES) == set(P.default_layouts())
    for name, lay in P.default_layouts().items():
        a = S.parse_args(["--cases", name])
        assert a.case_list == [name]
        refit = runtime_config_from_dict(S.runtime_cfg_dict(lay, tmp_path, a, tmp_path)).refit
        assert (refit.direct_export, refit.replay_load, refit.zero_copy_views, refit.wake_kv_during_transfer,
                refit.keep_weights_awake, refit.keep_kv_cache_awake, refit.zero_copy_experts) == (
            lay.direct_export, lay.replay_load, lay.zero_copy_views, lay.wake_kv_during_transfer, lay.weights_awake,
            lay.kv_cache_awake, lay.zero_copy_experts), name


def test_a_kv_cache_kept_awake_needs_the_weights_awake():
    assert "never sleeps" in P.default_layouts()["dense-8b-resident"].describe()
    with pytest.raises(P.BenchmarkInputError, match="only with the weights"):
        P.Layout("x", "qwen3-8b", 1, kv_cache_awake=True)


def test_the_total_refit_counts_the_prefix_cache_reset():
    rec = {"wake_weights_s": 0.0, "transfer_s": 0.02, "wake_kv_s": 0.001, "reset_prefix_cache_s": 0.004,
           "sleep_s": 0.0, "producers": [{"seconds": 0.02, "export_seconds": 0.0, "pack_seconds": 0.0,
                                          "alloc_seconds": 0.0, "wait_ack_seconds": 0.0, "bytes": 1,
                                          "num_buckets": 1}],
           "consumers": [{"seconds": 0.02, "load_seconds": 0.01, "open_seconds": 0.0, "wait_seconds": 0.0}]}
    assert P.refit_row(rec)["total_refit_s"] == pytest.approx(0.025)
    assert P.refit_row({**rec, "reset_prefix_cache_s": 0.0})["total_refit_s"] == pytest.approx(0.021)


def test_budget_fits_on_an_h200_and_names_what_does_not():
    gpu = int(139.8 * P.GIB)
    for lay in P.default_layouts().values():
        assert P.memory_budget(P.model_bytes(P.load_hf_config(lay.model)), lay, gpu).fits, lay.name
    mb = P.model_bytes(P.load_hf_config("qwen3-30b-a3b"))
    small = P.Layout("x", "qwen3-30b-a3b", 2, train_ep=2, gen_tp=2, vllm_util=0.15)
    assert any("gpu_memory_utilization 0.15" in p for p in P.memory_budget(mb, small, gpu).problems)
    greedy = P.Layout("x", "qwen3-30b-a3b", 2, train_ep=2, gen_tp=2, vllm_util=0.9)
    assert any("peak at generation" in p for p in P.memory_budget(mb, greedy, gpu).problems)


@pytest.mark.parametrize("case", ["dense-8b-overlap", "dense-8b-resident"])
def test_the_budget_counts_a_kv_cache_mapped_during_the_refit(case):
    gpu = int(139.8 * P.GIB)
    lays = P.default_layouts()
    mb = P.model_bytes(P.load_hf_config("qwen3-8b"))
    before = P.memory_budget(mb, lays["dense-8b-zero-copy"], gpu)
    during = P.memory_budget(mb, lays[case], gpu)
    assert during.at_refit - before.at_refit == during.vllm_reserved - during.vllm_weights > 20 * P.GIB


def test_layout_and_config_errors_name_the_fix():
    with pytest.raises(P.BenchmarkInputError, match="EP 3"):
        P.Layout("x", "qwen3-30b-a3b", 2, train_ep=3)
    with pytest.raises(P.BenchmarkInputError, match="not one of"):
        P.load_hf_config("no-such-model")
    with pytest.raises(P.BenchmarkInputError, match="know qwen3 and qwen3_moe only"):
        P.model_bytes({"model_type": "llama"})


# --------------------------------------------------------------------------- spot checks


def test_spot_checks_cover_every_kind_on_both_ep_ranks():
    checks, notes = P.spot_checks(P.load_hf_config("qwen3-30b-a3b"))
    names = {c.hf_name for c in checks}
    assert {c.kind for c in checks} == {"embedding", "attention", "norm", "router", "expert"}
    # experts 0 and 127 of the last layer live on different trainer EP ranks (64 experts each)
    assert "model.layers.47.mlp.experts.0.gate_proj.weight" in names
    assert "model.layers.47.mlp.experts.127.down_proj.weight" in names
    assert {"model.layers.47.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight"} <= names
    assert {c.vllm_name for c in checks if c.kind == "expert"} == {"model.layers.47.mlp.experts.w13_weight",
                                                                   "model.layers.47.mlp.experts.w2_weight"}
    assert {c.vllm_name for c in checks if c.hf_name.endswith("k_proj.weight")} == {
        "model.layers.24.self_attn.qkv_proj.weight"
    }
    assert any("no bias" in n for n in notes)  # Qwen3-MoE's router has no e_score_correction_bias
    dense, _ = P.spot_checks(P.load_hf_config("qwen3-8b"))
    assert {c.kind for c in dense} == {"embedding", "attention", "norm", "mlp"}
    assert {c.vllm_name for c in dense if c.kind == "mlp"} == {"model.layers.18.mlp.gate_up_proj.weight",
                                                               "model.layers.18.mlp.down_proj.weight"}


class FusedTPModel(torch.nn.Module):
    """A stand-in for a vLLM model on TP rank 1 of 2: q/k/v fused into ``qkv_proj``, experts stacked
    into ``w13`` [E, 2I/tp, H] / ``w2`` [E, H, I/tp], vocab rows split; ``load_weights`` slices like vLLM."""

    H, I, E, V, TP, R = 8, 6, 4, 20, 2, 1  # noqa: E741 - the shapes' usual names (I: intermediate size)

    def __init__(self) -> None:
        super().__init__()
        h, i, e, v, tp = self.H, self.I, self.E, self.V, self.TP
        z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.bfloat16), requires_grad=False)  # noqa: E731
        self.params = {
            "model.embed_tokens.weight": z(v // tp, h),
            "model.layers.0.self_attn.qkv_proj.weight": z(3 * h // tp, h),
            "model.layers.0.mlp.experts.w13_weight": z(e, 2 * i // tp, h),
            "model.layers.0.mlp.experts.w2_weight": z(e, h, i // tp),
            "model.layers.0.mlp.gate.weight": z(e, h),
        }
        for n, p in self.params.items():
            self.register_parameter(n.replace(".", "_"), p)

    def named_parameters(self, *args, **kwargs):
        return iter(self.params.items())

    def load_weights(self, weights):
        h, i, tp, r = self.H, self.I, self.TP, self.R
        loaded = set()
        for name, w in weights:
            rows = lambda t: t.chunk(tp, 0)[r]  # noqa: E731
            if name == "model.embed_tokens.weight" or name == "model.layers.0.mlp.gate.weight":
                target, src = name, (rows(w) if "embed" in name else w)
                self.params[target].data.copy_(src)
            elif ".self_attn." in name:
                target = "model.layers.0.self_attn.qkv_proj.weight"
                k = "qkv".index(name.split(".")[-2][0])
                self.params[target].data[k * h // tp:(k + 1) * h // tp].copy_(rows(w))
            else:
                e, proj = int(name.split(".")[-3]), name.split(".")[-2]
                if proj == "down_proj":
                    target = "model.layers.0.mlp.experts.w2_weight"
                    self.params[target].data[e].copy_(w.chunk(tp, 1)[r])
                else:
                    target = "model.layers.0.mlp.experts.w13_weight"
                    half = 0 if proj == "gate_proj" else i // tp
                    self.params[target].data[e, half:half + i // tp].copy_(rows(w))
            loaded.add(target)
        return loaded


def _export(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = FusedTPModel
    shapes = {"model.embed_tokens.weight": (m.V, m.H), "model.layers.0.mlp.gate.weight": (m.E, m.H)}
    shapes.update({f"model.layers.0.self_attn.{p}_proj.weight": (m.H, m.H) for p in "qkv"})
    for e in range(m.E):
        shapes.update({f"model.layers.0.mlp.experts.{e}.gate_proj.weight": (m.I, m.H),
                       f"model.layers.0.mlp.experts.{e}.up_proj.weight": (m.I, m.H),
                       f"model.layers.0.mlp.experts.{e}.down_proj.weight": (m.H, m.I)})
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


SPOT = ["model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.experts.0.down_proj.weight",
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.gate.weight", "model.embed_tokens.weight"]
SPOT_PARAMS = [
    "model.embed_tokens.weight",
    "model.layers.0.mlp.experts.w13_weight",
    "model.layers.0.mlp.experts.w2_weight",
    "model.layers.0.mlp.gate.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
]


def test_reload_check_passes_after_a_correct_refit_and_names_a_wrong_expert_slice():
    from rlc.runtime.refit.verify import verify_by_reload

    export = _export()
    model = FusedTPModel()
    model.load_weights(export.items())  # the refit
    ok = verify_by_reload(model, {n: export[n] for n in SPOT}, SPOT_PARAMS)
    assert ok["bit_exact"] and ok["params_compared"] == 5 and not ok["missing_params"] and not ok["loaded_unchecked"]
    model.params["model.layers.0.mlp.experts.w13_weight"].data[3, 3:].neg_()  # expert 3's up_proj arrived wrong
    bad = verify_by_reload(model, {n: export[n] for n in SPOT}, SPOT_PARAMS)
    assert not bad["bit_exact"]
    assert [m["name"] for m in bad["mismatches"]] == ["model.layers.0.mlp.experts.w13_weight"]
    stale = FusedTPModel()
    stale.load_weights(_export(seed=1).items())  # a refit that delivered other weights
    assert len(verify_by_reload(stale, {n: export[n] for n in SPOT}, SPOT_PARAMS)["mismatches"]) == 5
    partial = verify_by_reload(
        model, {n: export[n] for n in SPOT}, ["model.norm.weight", "model.layers.0.mlp.gate.weight"]
    )
    assert (
        partial["missing_params"] == ["model.norm.weight"]
        and "model.embed_tokens.weight" in partial["loaded_unchecked"]
    )


def test_spot_check_verdict_needs_every_parameter_on_every_worker():
    checks, _ = P.spot_checks(P.load_hf_config("qwen3-30b-a3b"))
    params = sorted({c.vllm_name for c in checks})
    good = {
        "device_key": "GPU-a",
        "params_compared": len(params),
        "mismatches": [],
        "not_loaded": [],
        "missing_params": [],
    }
    assert P.spot_check_verdict(checks, [good, dict(good, device_key="GPU-b")])["passed"]
    v = P.spot_check_verdict(checks, [good, dict(good, device_key="GPU-b", params_compared=len(params) - 1,
                                                 missing_params=[params[0]])])
    assert not v["passed"] and v["problems"] == [f"vLLM worker 1 (GPU GPU-b): no parameter(s) {params[0]}"]
    mism = dict(good, mismatches=[{"name": params[1], "elements_differing": 7, "max_abs_diff": 0.5}])
    assert "differs in 7 element(s)" in P.spot_check_verdict(checks, [mism])["problems"][0]
    assert not P.spot_check_verdict(checks, [])["passed"]


# --------------------------------------------------------------------------- timing breakdown


def _record(i: int, export: float, load: float) -> dict:
    prod = {
        "seconds": export + 0.2,
        "export_seconds": export,
        "pack_seconds": 0.05,
        "alloc_seconds": 0.01,
        "wait_ack_seconds": 0.04,
        "done_wait_seconds": 0.03,
        "bytes": 61_000_000_000,
        "num_buckets": 58,
        "buffers_allocated": 2 if i == 0 else 0,
        "consumer": {"buffers_opened": 2 if i == 0 else 0},
    }
    slow = dict(prod, seconds=export + 0.3, export_seconds=export + 0.1)
    cons = {"seconds": export + 0.25, "load_seconds": load, "open_seconds": 0.001, "wait_seconds": 0.5}
    return {"transfer_s": export + 0.35, "wake_weights_s": 0.02, "wake_kv_s": 0.1, "sleep_s": 0.05,
            "producers": [prod, slow], "consumers": [cons, dict(cons, seconds=0.1)]}


def test_breakdown_uses_the_slowest_rank_and_skips_the_warmup():
    records = [_record(0, 9.0, 9.0)] + [_record(i, 1.0 + i / 10, 0.5) for i in range(1, 4)]
    s = P.summarize_refits(records, warmup=1)
    assert s["refits"] == 3
    assert s["export_s"]["median"] == pytest.approx(1.2 + 0.1)  # the slower producer rank
    assert s["total_refit_s"]["max"] == pytest.approx(0.02 + 1.3 + 0.35 + 0.1)
    # the wait for the consumer's verdict (its last device loads) is its own row, not "other"
    assert s["wait_done_s"]["median"] == pytest.approx(0.03)
    assert s["other_s"]["median"] == pytest.approx((1.2 + 0.3) - (1.3 + 0.05 + 0.01 + 0.04 + 0.03))
    assert s["buffers_allocated"]["max"] == 0  # the warm-up refit's allocations are not measured
    assert s["refit_plus_sleep_s"]["min"] == pytest.approx(s["total_refit_s"]["min"] + 0.05)
    with pytest.raises(P.BenchmarkInputError, match="none to measure"):
        P.summarize_refits(records[:1], warmup=1)


def test_tiny_overhead_from_the_recorded_grpo_run():
    t = P.tiny_step_overhead(TINY_METRICS)
    rows = [json.loads(line) for line in TINY_METRICS.read_text().splitlines()][1:]
    assert t["steps"] == len(rows) == 152
    # docs/gpu-results.md: median step 0.79 s with refit 0.127 s and sleep 0.098 s (28 %)
    assert t["step_s"] == pytest.approx(0.79, abs=0.01) and 0.2 < t["overhead_fraction"] < 0.35
    with pytest.raises(P.BenchmarkInputError, match="no such file"):
        P.tiny_step_overhead(TINY_METRICS.with_name("missing.jsonl"))


# --------------------------------------------------------------------------- goals, --check, arguments


def _results(total: float | None, ratio: float | None, tiny: float | None, slowest: float | None = None,
             dense: float | None = None) -> dict:
    cases: dict = {} if total is None else {
        "moe-1gpu": {"summary": {"total_refit_s": {"median": total, "max": total if slowest is None else slowest}}}}
    if dense is not None:
        cases["dense-8b"] = {"summary": {"total_refit_s": {"median": dense, "max": dense}}}
    return {"cases": cases, "engine": {"ratio": ratio} if ratio is not None else None,
            "tiny": {"overhead_fraction": tiny} if tiny is not None else None}


def test_goals_and_check_verdict():
    met = P.evaluate_goals(_results(0.42, 0.45, 0.1, slowest=0.9, dense=0.04))
    assert [g.name for g in met] == ["moe-1gpu total refit (s)", "moe-1gpu slowest refit (s)",
                                     "dense-8b total refit (s)", "engine ratio at 2 GiB",
                                     "tiny-run (refit + sleep) / step"]
    assert [g.met for g in met] == [True] * 5 and P.check_exit_code(met, [])[0] == 0
    missed = P.evaluate_goals(_results(0.45, 0.45, None, slowest=1.2, dense=0.06))
    assert [g.met for g in missed] == [True, False, False, True, None]
    code, text = P.check_exit_code(missed, [])
    assert code == 1 and "moe-1gpu slowest refit" in text and "dense-8b total refit" in text
    assert "not measured" in missed[-1].line()
    slow_median = P.evaluate_goals(_results(0.6, None, None, slowest=0.7))
    assert [g.met for g in slow_median[:2]] == [False, True]  # the median alone misses: 0.6 > 0.5
    assert P.check_exit_code(P.evaluate_goals(_results(None, None, None)), [])[0] == 1  # nothing measured
    assert P.check_exit_code(met, ["moe-tp2: RuntimeError"])[0] == 1
    failed_case = P.evaluate_goals({"cases": {"moe-tp2": {"error": "x"}}})
    assert not failed_case[0].measured and not failed_case[1].measured


def test_whole_30b_on_one_gpu_fits_only_in_a_narrow_vllm_window():
    """Trainer and vLLM each hold all 57 GiB: vLLM's share must cover its weights + 2 GiB and still leave
    the trainer room at generation; outside that window the budget names the problem."""
    gpu = int(139.8 * P.GIB)
    mb = P.model_bytes(P.load_hf_config("qwen3-30b-a3b"))
    one = P.default_layouts()["moe-1gpu"]
    assert one.gpus == 1 and P.trainer_bytes(mb, one) == mb.total
    assert P.memory_budget(mb, one, gpu).fits
    too_small = P.memory_budget(mb, P.Layout("x", "qwen3-30b-a3b", 1, vllm_util=0.40), gpu)
    too_big = P.memory_budget(mb, P.Layout("x", "qwen3-30b-a3b", 1, vllm_util=0.60), gpu)
    assert "raise it" in too_small.problems[0] and "at generation" in too_big.problems[0]


def test_arguments():
    a = S.parse_args([])
    assert a.case_list == ["engine", "dense-8b", "moe-ep2", "moe-tp2"] and (a.refits, a.warmup) == (10, 1)
    assert S.parse_args(["--tiny-metrics", "m.jsonl", "--cases", "engine"]).case_list == ["engine", "tiny"]
    for bad in (["--cases", "moe-ep4"], ["--cases", "tiny"], ["--refits", "0"]):
        with pytest.raises(SystemExit):
            S.parse_args(bad)
    assert [lay.name for lay in S.layouts_for(S.parse_args(["--cases", "moe-tp2,dense-8b"]))] == ["dense-8b", "moe-tp2"]
    assert (a.fused_transfer, a.keep_buffers_gb) == (False, a.buffer_gb)  # the halves are kept by default
    fast = S.parse_args(["--fused-transfer", "--cases", "engine,dense-8b,moe-1gpu", "--keep-buffers-gb", "0"])
    assert (fast.fused_transfer, fast.keep_buffers_gb) == (True, 0.0)
    with pytest.raises(SystemExit):
        S.parse_args(["--keep-buffers-gb", "-1"])


def test_each_case_compiles_to_a_runtime_config_the_runtime_accepts(tmp_path):
    from rlc.contract.runtime_config import runtime_config_from_dict

    a = S.parse_args([])
    for lay in S.layouts_for(a):
        cfg = runtime_config_from_dict(S.runtime_cfg_dict(lay, tmp_path / lay.model, a, tmp_path))
        assert (cfg.train_parallel.tp, cfg.train_parallel.ep, cfg.generation_parallel.tp) == (
            lay.train_tp, lay.train_ep, lay.gen_tp)
        assert cfg.refit.buffer_gb == lay.buffer_gb and cfg.refit.buffer_memory_ratio is None
        assert cfg.refit.sleep_level == 2 and cfg.cluster.world_size == lay.gpus
        assert cfg.refit.fused_transfer is False and cfg.refit.keep_buffers_gb == a.buffer_gb
    fast = S.parse_args(["--fused-transfer", "--cases", "moe-1gpu"])
    lay = S.layouts_for(fast)[0]
    cfg = runtime_config_from_dict(S.runtime_cfg_dict(lay, tmp_path / lay.model, fast, tmp_path))
    assert cfg.refit.fused_transfer is True and cfg.refit.keep_buffers_gb == fast.buffer_gb
    model_dir = S.write_model_dir(tmp_path, "qwen3-30b-a3b")
    written = json.loads((model_dir / "config.json").read_text())
    assert written["architectures"] == ["Qwen3MoeForCausalLM"] and not any(k.startswith("_") for k in written)


def test_dry_run_prints_the_plan_and_refuses_a_budget_that_does_not_fit(capsys):
    assert S.main(["--dry-run", "--gpu-memory-gib", "139.8"]) == 0
    out = capsys.readouterr().out
    assert "case moe-ep2: qwen3-30b-a3b on 2 GPU(s): trainer TP=1 EP=2, vLLM TP=2" in out
    assert "budget: fits" in out and "18867 HF tensors" in out
    assert S.main(["--dry-run", "--gpu-memory-gib", "60", "--cases", "moe-ep2"]) == 2
    assert "does not fit" in capsys.readouterr().err


def test_gpu_free_run_writes_json_and_table_and_check_fails_on_a_missed_goal(tmp_path, capsys):
    code = S.main(["--cases", "tiny", "--tiny-metrics", str(TINY_METRICS), "--out", str(tmp_path), "--check"])
    assert code == 1  # the recorded tiny run spends ~28 % of its step in refit + sleep (goal <= 15 %)
    data = json.loads((tmp_path / "refit_at_scale.json").read_text())
    assert data["command"].startswith("python benchmarks/refit_at_scale.py --cases tiny")
    assert data["machine"]["hostname"] and data["options"]["cases"] == ["tiny"]
    tiny_goal = next(g for g in data["goals"] if g["name"].startswith("tiny"))
    assert tiny_goal["met"] is False and math.isclose(tiny_goal["value"], data["tiny"]["overhead_fraction"])
    text = (tmp_path / "refit_at_scale.txt").read_text()
    assert "(refit + sleep) / step" in text and "NOT MET" in text
    assert "verdict: goal(s) not met" in capsys.readouterr().out


def test_report_renders_a_measured_case():
    records = [_record(i, 1.0, 0.5) for i in range(3)]
    case = {"describe": "d", "summary": P.summarize_refits(records, 1),
            "export_alone": [{"seconds": 1.4, "tensors": 18867, "bytes": 61_000_000_000}],
            "spot_checks": {"passed": False, "kinds": ["expert"], "tensors": 6, "params": ["w13", "w2"], "workers": 2,
                            "problems": ["vLLM worker 1 (GPU b): w13 differs in 3 element(s), max |diff| 0.5"]}}
    text = P.render_case("moe-ep2", case)
    assert "| total refit = wake-ups + transfer + prefix-cache reset" in text
    assert "Bridge export alone (no transfer): 1.400 s, 18867 tensors" in text
    assert "(expert; 6 HF tensors into 2 vLLM parameters on 2 worker(s)) -> FAILED" in text
    assert "  vLLM worker 1 (GPU b): w13 differs in 3 element(s)" in text


def test_docs_rows_from_a_run(tmp_path, capsys):
    records = [_record(i, 1.0, 0.5) for i in range(3)]
    results = {"command": "python benchmarks/refit_at_scale.py", "machine": {"hostname": "h"},
               "cases": {"moe-ep2": {"summary": P.summarize_refits(records, 1), "spot_checks": {"passed": True}},
                         "moe-tp2": {"error": "RuntimeError: trainer setup failed"}},
               "engine": {"ratio": 0.43}}
    path = tmp_path / "refit_at_scale.json"
    path.write_text(json.dumps(results))
    assert S.main(["--docs-rows", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| `moe-ep2` | 1.470 (1.470–1.470) | 1.350 (1.350–1.350) | 1.100 (1.100–1.100) |" in out
    assert out.count("| passed |") == 1 and "| `moe-tp2` | failed: RuntimeError: trainer setup failed |" in out
    assert "| engine ratio at 2 GiB (≥ 0.4) | 0.43 | met |" in out
    assert "| tiny-run (refit + sleep) / step (≤ 0.15) | not measured |  |" in out


def test_the_report_sets_each_part_against_the_same_runs_two_copy_bound(tmp_path, capsys):
    records = [_record(i, 1.0, 0.5) for i in range(3)]  # 61 GB per GPU
    summary = P.summarize_refits(records, 1)
    results = {"command": "python benchmarks/refit_at_scale.py", "machine": {"hostname": "h"},
               "cases": {"moe-1gpu": {"describe": "", "summary": summary}},
               "engine": {"command": "bench", "refit_gbps": 500.0, "copy_gbps": 2000.0, "ratio": 0.25,
                          "bytes": 2 << 30, "buckets": 4}}
    assert P.two_copy_bound_s(61e9, 2000.0) == pytest.approx(0.061)  # 61 GB copied twice at 2 TB/s
    path = tmp_path / "refit_at_scale.json"
    path.write_text(json.dumps(results))
    assert S.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "two-copy bound (pack + load at this run's 2000 GB/s device copy): 0.0610 s;" in out
    total = summary["total_refit_s"]["median"]
    assert f"total refit {total:.4f} s ({total / 0.061:.1f}x)" in out
    # without the engine case the run measured no copy rate, and no bound is claimed
    assert "two-copy bound" not in P.render_case("moe-1gpu", results["cases"]["moe-1gpu"])
    # bytes read in place (zero-copy views) are copied once: the bound shrinks by them
    for r in records:
        for p in r["producers"]:
            p["zero_copy_bytes"] = 40e9
    zero = P.summarize_refits(records, 1)
    assert P.two_copy_bound_s(61e9, 2000.0, 40e9) == pytest.approx(0.041)
    text = "\n".join(P.bound_lines(zero, 2000.0))
    assert ("copy bound (pack + load; the 40.00 GB read in place once at this run's 2000 GB/s device copy): "
            "0.0410 s") in text


def test_top_calls_names_the_slow_function_of_a_profile():
    import cProfile
    import time

    def slow_part():
        time.sleep(0.05)

    def fast_part():
        return sum(range(10))

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        slow_part()
        fast_part()
    profile.disable()
    rows = S.top_calls(profile, limit=5)
    assert len(rows) <= 5 and all(set(r) == {"function", "calls", "own_s", "cumulative_s"} for r in rows)
    slow = next(r for r in rows if r["function"].endswith("(slow_part)"))
    assert slow["calls"] == 3 and slow["cumulative_s"] >= 0.15
    assert rows == sorted(rows, key=lambda r: r["cumulative_s"], reverse=True)


def test_the_case_table_names_the_exporters_slowest_calls():
    results = json.loads((Path(__file__).resolve().parents[2] / "docs" / "results" / "refit-fast-h200"
                          / "refit_at_scale.json").read_text())
    case = results["cases"]["moe-1gpu"]
    assert "Bridge export alone" in P.render_case("moe-1gpu", case)
    assert "what a refit sends" not in P.render_case("moe-1gpu", case)  # recorded before the stream pass existed
    rows = [{"function": "refit_at_scale.py:257(_drain)", "calls": 1, "own_s": 0.01, "cumulative_s": 0.3},
            {"function": "model_bridge.py:1242(stream_weights_megatron_to_hf)", "calls": 1, "own_s": 0.0,
             "cumulative_s": 0.25}]
    case["export_alone"][0]["stream"] = {"seconds": 0.31, "tensors": 531, "bytes": 1, "profile_top": rows}
    text = P.render_case("moe-1gpu", case)
    assert ("what a refit sends, alone: 0.310 s, 531 tensors; slowest calls (cumulative s): "
            "model_bridge.py:1242(stream_weights_megatron_to_hf) 0.250") in text
    assert "_drain" not in text


def test_the_case_table_says_how_the_refits_ordered_their_buckets():
    records = [_record(i, 1.0, 0.5) for i in range(3)]
    for r in records:
        for p in r["producers"]:
            p["device_ordered"] = True
    ordered = P.render_case("moe-1gpu", {"describe": "", "summary": P.summarize_refits(records, warmup=1)})
    assert "buckets ordered by device events" in ordered
    records[2]["producers"][1]["device_ordered"] = False  # one rank fell back in one refit
    mixed = P.render_case("moe-1gpu", {"describe": "", "summary": P.summarize_refits(records, warmup=1)})
    assert "in some refits only" in mixed


def test_the_case_table_says_what_direct_export_and_replayed_load_did():
    results = json.loads((Path(__file__).resolve().parents[2] / "docs" / "results" / "refit-awake-h200"
                          / "refit_at_scale.json").read_text())
    case = results["cases"]["dense-8b-awake"]
    assert "direct export" not in P.render_case("dense-8b-awake", case)  # recorded before either existed
    case["prepare"]["producers"][0]["direct_export"] = {"on": True, "reason": "on", "tensors": 397, "views": 289,
                                                        "row_gathers": 108, "bridge_tasks": 1}
    case["refits"][-1]["consumers"][0]["replay"] = {
        "recorded": False, "direct_tensors": 397, "direct_copies": 397, "loader_tensors": 2, "replayed": 397,
        "not_replayed": 2, "not_replayed_examples": {"model.norm.weight": "computed"}}
    text = P.render_case("dense-8b-direct", case)
    assert "direct export: 397 tensors (289 views, 108 row gathers), 1 conversion tasks left to Bridge" in text
    assert ("replayed load (last refit): 397 tensors as 397 copies, 2 through load_weights; table 397 replayed, "
            "2 not (model.norm.weight: computed)") in text
    assert "zero-copy views" not in text
    case["prepare"]["producers"][0]["zero_copy_views"] = {"on": True, "reason": "on", "tensors": 289}
    case["refits"][-1]["producers"][0].update(zero_copy_tensors=289, zero_copy_bytes=14_500_000_000,
                                              storages_shared=0, zero_copy_seconds=0.002)
    text = P.render_case("dense-8b-zero-copy", case)
    assert ("zero-copy views: 289 tensors read in place by vLLM; last refit 289 tensors, 14.50 GB, 0 trainer "
            "storages shared anew") in text
    case["prepare"]["producers"][0]["direct_export"] = {"on": False, "reason": "off: trainer tensor parallelism 2"}
    case["prepare"]["producers"][0]["zero_copy_views"] = {"on": False, "reason": "off: the direct export is off"}
    text = P.render_case("x", case)
    assert "direct export off: trainer tensor parallelism 2" in text
    assert "zero-copy views off: the direct export is off" in text


def test_the_report_shows_the_engine_packed_and_zero_copy_side_by_side():
    engine = {"command": "refit_bandwidth.py --backend cuda_ipc --gib 2", "refit_gbps": 445.4, "copy_gbps": 1906.4,
              "ratio": 0.234, "bytes": 2 << 30, "buckets": 4}
    zero = {**engine, "command": engine["command"] + " --zero-copy", "refit_gbps": 1200.0, "ratio": 0.629}
    results = {"command": "python benchmarks/refit_at_scale.py --cases engine,engine-zero-copy", "engine": engine,
               "engine_zero_copy": zero, "cases": {}}
    text = P.render_report(results, P.evaluate_goals(results))
    assert "-> ratio 0.234 (2.00 GiB, 4 buckets)" in text
    assert "## engine, zero-copy: refit_bandwidth.py --backend cuda_ipc --gib 2 --zero-copy" in text
    assert "-> ratio 0.629 (every tensor read in place: one copy, the bound is 1.0)" in text
    engine_goal = next(g for g in P.evaluate_goals(results) if g.name.startswith("engine"))
    assert engine_goal.value == 0.234  # the goal is the packed engine's
    assert S.parse_args(["--cases", "engine-zero-copy"]).case_list == ["engine-zero-copy"]


def test_refits_can_be_spaced_like_the_steps_of_a_run():
    assert S.parse_args([]).step_gap_s == 0.0  # back to back, as every earlier run measured
    assert S.parse_args(["--step-gap-s", "0.5", "--cases", "dense-8b-zero-copy"]).step_gap_s == 0.5
