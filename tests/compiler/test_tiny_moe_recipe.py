"""On the CPU: the 4-GPU tiny-MoE-with-MTP recipe compiles, resolves to the layout and the refit
fixes the issue needs, and refuses to compile with either fix switched off."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlc.compiler import api, cli, resolve
from rlc.runtime import toy
from rlc.contract.runtime_config import load_runtime_config, runtime_config_from_dict

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "rlc" / "recipes" / "tiny-moe-mtp-4gpu.yaml"
CONFIG = json.loads((ROOT / "rlc" / "recipes" / "models" / "tiny-moe-mtp" / "config.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def result():
    return api.check(RECIPE)


@pytest.fixture(scope="module")
def cfg(result):
    return runtime_config_from_dict(resolve.to_runtime_config(result))


def test_compiles_with_no_errors_or_warnings(result, tmp_path):
    assert result.ok
    assert [(d.severity, d.rule) for d in result.diagnostics if d.severity != "info"] == []
    assert cli.main(["compile", str(RECIPE), "-o", str(tmp_path / "b"), "--force"]) == 0
    bundled = load_runtime_config(tmp_path / "b" / "runtime.yaml")
    assert bundled.refit.dedupe_mtp_embedding and bundled.refit.per_rank_ipc_metadata
    plan = json.loads((tmp_path / "b" / "plan.json").read_text(encoding="utf-8"))
    assert plan["refit"]["free_at_refit"] == result.plan.free_at_refit_bytes


def test_model_fits_the_layout_and_the_toy_tokenizer(result):
    recipe = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    train, gen = recipe["parallelism"]["train"], recipe["parallelism"]["generation"]
    assert CONFIG["architectures"] == ["DeepseekV3ForCausalLM"] and CONFIG["num_nextn_predict_layers"] == 1
    assert CONFIG["num_hidden_layers"] % train["pp"] == 0
    assert CONFIG["n_routed_experts"] % train["ep"] == 0 and CONFIG["n_routed_experts"] % gen["ep"] == 0
    assert CONFIG["num_attention_heads"] % gen["tp"] == 0
    assert CONFIG["vocab_size"] >= toy.vocab_size()
    assert CONFIG["topk_method"] == "noaux_tc"  # the router has e_score_correction_bias (SkyRL #1816's fp32 case)
    f = result.facts
    assert (f.num_experts, f.mtp_num_layers, f.mtp_shared_embedding) == (8, 1, True)


def test_resolved_runtime_config(cfg):
    r = cfg.refit
    assert r.dedupe_mtp_embedding is True and r.decisions["dedupe_mtp_embedding"].startswith("RLC201: on:")
    assert r.per_rank_ipc_metadata is True and r.decisions["per_rank_ipc_metadata"].startswith("RLC203: on:")
    assert "*e_score_correction_bias*" in r.fp32_params and r.decisions["fp32_params"].startswith("RLC204")
    assert (r.sleep_level, cfg.generation.enforce_eager, cfg.colocated) == (2, True, True)
    tp = cfg.train_parallel
    assert (tp.tp, tp.pp, tp.ep, tp.dp, tp.expert_dp) == (1, 2, 2, 2, 1)
    gp = cfg.generation_parallel
    assert (gp.tp, gp.ep, gp.dp) == (2, 2, 2)
    assert cfg.cluster.world_size == 4 and cfg.model.mtp_num_layers == 1 and cfg.model.mtp_shared_embedding
    assert cfg.grpo.max_steps >= 30 and 0 < cfg.grpo.max_gen_kl <= 0.05
    assert cfg.reward.function == "prefix_match" and cfg.data.train_path.startswith("/tmp/rlc-tiny-moe/")


def test_plan_predicts_free_memory_at_refit_on_the_mtp_stage(result):
    plan = result.plan
    gib = plan.free_at_refit_bytes / 2**30
    assert 0 < gib < plan.gpu_memory_gib
    refit = plan.phases["refit"]  # the worst GPU at refit is the last stage: MTP block + embedding replica
    assert refit.stage == len(plan.stages) - 1
    assert refit.limit_gib - sum(i.gib for i in refit.items) == pytest.approx(gib, abs=0.01)
    last = plan.stages[-1]
    assert (last["mtp_blocks"], last["vocab_copies"]) == (1, 2) and plan.stages[0]["mtp_blocks"] == 0
    assert plan.per_side_bytes > plan.largest_tensor[1]
    # vLLM 0.22 (the GPU host's): the after-sleep residue growth reported for MoE models is planned too
    assert {k: c.ok for k, c in plan.checks.items()} == {"generate_fit": True, "train_fit": True,
                                                         "train_late_fit": True, "logprob_fit": True,
                                                         "logprob_late_fit": True, "buffer": True, "stack": True,
                                                         "generate_kv_request": True}
    assert "free at refit" in plan.to_text()


@pytest.mark.parametrize("switch,rule", [("dedupe_mtp_embedding", "RLC201"), ("per_rank_ipc_metadata", "RLC203")])
def test_switching_a_needed_fix_off_is_an_error(switch, rule, tmp_path):
    res = api.check(RECIPE, [f"refit.{switch}=off"])
    assert not res.ok
    assert [(d.rule, d.path) for d in res.errors] == [(rule, f"refit.{switch}")]
    assert cli.main(["compile", str(RECIPE), "-o", str(tmp_path / "b"), "--set", f"refit.{switch}=off"]) == 1
    assert not (tmp_path / "b").exists()


def test_sending_the_router_bias_in_bf16_is_an_error():
    res = api.check(RECIPE, ["refit.fp32_params=[]"])
    assert [d.rule for d in res.errors] == ["RLC204"]
