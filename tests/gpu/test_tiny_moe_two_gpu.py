"""The 2-GPU tiny MoE+MTP proofs on the CPU: both shipped recipes compile to the switches their layout
needs (and refuse to compile with a needed fix off), and the GPU script's verdicts fail on the
evidence of a broken run and pass on a working one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlc.compiler import api, resolve
from rlc.contract.runtime_config import runtime_config_from_dict

from tests.gpu import test_moe_two_gpu as proofs

ROOT = Path(__file__).resolve().parents[2]

RECIPES = ROOT / "rlc" / "recipes"
CONFIG = json.loads((RECIPES / "models" / "tiny-moe-mtp" / "config.json").read_text(encoding="utf-8"))


def _cfg(name: str, overrides: tuple[str, ...] = ()):
    result = api.check(RECIPES / f"{name}.yaml", list(overrides))
    return result, (runtime_config_from_dict(resolve.to_runtime_config(result)) if result.ok else None)


@pytest.mark.parametrize("name, pp, ep, gen_tp, dedupe", [
    (proofs.PP2, 2, 1, 2, True),   # the MTP block and its embedding replica on the last of 2 stages
    (proofs.EP2, 1, 2, 1, False),  # one stage: a single owner of the embedding, nothing to dedupe
])
def test_two_gpu_recipes_compile_to_the_switches_their_layout_needs(name, pp, ep, gen_tp, dedupe):
    result, cfg = _cfg(name)
    assert result.ok and [d.rule for d in result.diagnostics if d.severity == "warning"] == []
    assert cfg.cluster.world_size == 2 and (cfg.train_parallel.pp, cfg.train_parallel.ep) == (pp, ep)
    assert cfg.generation_parallel.tp == gen_tp
    assert CONFIG["num_hidden_layers"] % pp == 0 and CONFIG["n_routed_experts"] % ep == 0
    assert cfg.refit.dedupe_mtp_embedding is dedupe
    assert cfg.refit.per_rank_ipc_metadata is True
    assert "*e_score_correction_bias*" in cfg.refit.fp32_params
    assert cfg.grpo.max_steps == 200 and cfg.checkpointing.enabled


@pytest.mark.parametrize("name, override, rule", [
    (proofs.PP2, "refit.dedupe_mtp_embedding=off", "RLC201"),
    (proofs.EP2, "refit.per_rank_ipc_metadata=off", "RLC203"),
])
def test_the_compiler_refuses_the_fix_off(name, override, rule):
    result, _ = _cfg(name, (override,))
    assert not result.ok and rule in {d.rule for d in result.errors}


def _run(**kw) -> dict:
    base = {"rc": 0, "log": "", "metrics": [], "verify": [], "ranks": [], "calibration": []}
    return {**base, **kw}


def test_mtp_off_verdict():
    err = ("MultipleOwnersError: Object present on multiple PP ranks: embedding.word_embeddings.weight on PP ranks "
           "[0, 1]. ... turn on refit.dedupe_mtp_embedding")
    assert proofs.verdict_mtp_off(_run(rc=2, log=err))["passed"]
    assert not proofs.verdict_mtp_off(_run(rc=124, log=err))["passed"]            # hung instead of stopping
    assert not proofs.verdict_mtp_off(_run(rc=2, log="out of memory"))["passed"]  # stopped for another reason
    assert not proofs.verdict_mtp_off(_run(rc=2, log=err, ranks=[{"step": 0}]))["passed"]  # bytes moved first


def test_per_rank_off_verdict():
    err = ("RefitManifestError: consumer of producer rank 1 (GPU b), refit 1: bucket 0 carries slicing metadata "
           "from producer rank 0 (GPU a), not from this GPU's producer rank 1 (GPU b); slicing")
    assert proofs.verdict_per_rank_off(_run(rc=2, log=err))["passed"]
    assert not proofs.verdict_per_rank_off(_run(rc=0, log=""))["passed"]  # loaded silently
    assert not proofs.verdict_per_rank_off(_run(rc=1, log="RefitTimeoutError"))["passed"]


def _mismatch(name: str, rounded: bool = True) -> dict:
    return {"name": name, "rounded_to_bf16": rounded, "mantissa_bits_lost": 16 if rounded else 0, "max_abs_diff": 0.06}


def test_fp32_off_verdict():
    biases = [_mismatch(f"model.layers.{i}.mlp.gate.e_score_correction_bias") for i in (1, 2, 3)]
    rec = lambda w, mism: {"step": 0, "worker": w, "mismatches": mism}  # noqa: E731
    assert proofs.verdict_fp32_off(_run(rc=1, verify=[rec(0, biases), rec(1, biases)]), 3)["passed"]
    assert not proofs.verdict_fp32_off(_run(rc=1, verify=[rec(0, biases[:2]), rec(1, biases)]), 3)["passed"]
    other = biases + [_mismatch("model.embed_tokens.weight", rounded=False)]
    assert not proofs.verdict_fp32_off(_run(rc=1, verify=[rec(0, other), rec(1, biases)]), 3)["passed"]
    assert not proofs.verdict_fp32_off(_run(rc=1, verify=[]), 3)["passed"]


def test_bit_exact_and_learning_verdicts():
    ok = {"step": 0, "worker": 0, "bit_exact": True, "mismatches": [], "params_compared": 55, "bytes_compared": 9,
          "fp32_params": ["a", "b", "c"]}
    verify = [{**ok, "step": s} for s in (0, 10, 20)]
    assert proofs.verdict_bit_exact(_run(verify=verify), refits=3, min_fp32=3)["passed"]
    assert not proofs.verdict_bit_exact(_run(verify=verify[:2]), refits=3)["passed"]
    bad = verify + [{**ok, "step": 30, "bit_exact": False, "mismatches": [{"name": "x"}]}]
    assert not proofs.verdict_bit_exact(_run(verify=bad), refits=3)["passed"]

    def learning(rewards, kl=1e-4, refits=None):
        metrics = [{"step": i + 1, "reward/mean": r, "gen_kl": kl} for i, r in enumerate(rewards)]
        ranks = [{"step": s} for s in (refits if refits is not None else range(len(rewards) + 1))]
        return proofs.verdict_learning(_run(metrics=metrics, ranks=ranks), len(rewards), {})

    rising = [0.1] * 20 + [0.9] * 20
    assert (
        learning(rising)["passed"] and learning(rising)["step_10mean_reached_goal"] == 29
    )  # steps 20-29: (0.1 + 9 x 0.9) / 10
    assert not learning([0.1] * 20 + [0.5] * 20)["passed"]          # below the goal
    assert not learning(rising, kl=0.05)["passed"]                   # gen-KL above the goal
    assert not learning(rising, refits=range(0, 41, 2))["passed"]    # a step without its refit


def test_a_run_stops_at_the_first_step_past_the_minimum_by_which_the_goal_is_reached():
    def metrics(rewards):
        return [{"step": i + 1, "reward/mean": r} for i, r in enumerate(rewards)]

    rising = [0.1] * 20 + [0.9] * 20                      # the 10-step mean reaches 0.8 at step 29
    assert proofs.goal_stop_step(metrics(rising[:28]), 1) is None
    assert proofs.goal_stop_step(metrics(rising[:29]), 1) == 29
    assert proofs.goal_stop_step(metrics(rising[:29]), 35) is None  # two verified refits wanted: not yet
    assert proofs.goal_stop_step(metrics(rising[:36]), 35) == 36
    assert proofs.goal_stop_step(metrics([0.1] * 60), 1) is None
    gap = metrics(rising[:30])
    del gap[5]                                              # a step missing from the log: never stop on it
    assert proofs.goal_stop_step(gap, 1) is None


def test_a_run_stopped_at_its_goal_passes_the_learning_and_bit_exact_verdicts():
    rising = [0.1] * 20 + [0.9] * 20
    metrics = [{"step": i + 1, "reward/mean": r, "gen_kl": 1e-4} for i, r in enumerate(rising)]
    ok = {"worker": 0, "bit_exact": True, "mismatches": [], "params_compared": 5, "bytes_compared": 9,
          "fp32_params": ["a"]}
    stopped = _run(rc=-15, stopped_at_goal=40, metrics=metrics, ranks=[{"step": s} for s in range(41)],
                   verify=[{**ok, "step": s} for s in (0, 20)])
    v = proofs.verdict_learning(stopped, 150, {})
    assert v["passed"] and v["stopped_at_goal"] == 40 and v["step_10mean_reached_goal"] == 29
    assert proofs.verdict_bit_exact(stopped, refits=2)["passed"]
    # signalled without the harness having seen the goal: an ordinary failure
    assert not proofs.verdict_learning({**stopped, "stopped_at_goal": None}, 150, {})["passed"]
    assert not proofs.verdict_bit_exact({**stopped, "stopped_at_goal": None}, refits=2)["passed"]
    # a step before the stop without its refit
    assert not proofs.verdict_learning({**stopped, "ranks": [{"step": s} for s in range(41) if s != 7]},
                                       150, {})["passed"]


def test_resume_verdict():
    metrics = [{"step": s, "reward/mean": 0.35} for s in (201, 202, 203)]
    ok = proofs.verdict_resume(_run(metrics=metrics, log="resumed from /x/step_000200 (step 200)"), 0.37, 200)
    assert ok["passed"]
    assert not proofs.verdict_resume(_run(metrics=metrics, log="starting fresh"), 0.37, 200)["passed"]
    low = [{"step": s, "reward/mean": 0.1} for s in (201, 202)]
    assert not proofs.verdict_resume(_run(metrics=low, log="resumed from /x/step_000200"), 0.37, 200)["passed"]


@pytest.fixture(scope="module")
def moe_export(tmp_path_factory):
    """The tiny MoE's HF tensors (the names and shapes a refit exports), built on the CPU."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from rlc.runtime.toy_model import build_toy_model
    from tests.gpu.test_four_gpu_grpo import MODEL_CONFIG, with_mtp_layers

    ckpt = build_toy_model(tmp_path_factory.mktemp("moe") / "deepseek_v3", config=MODEL_CONFIG)
    (file,) = sorted(ckpt.glob("*.safetensors"))
    return with_mtp_layers(load_file(str(file)), json.loads((ckpt / "config.json").read_text(encoding="utf-8")))


@pytest.mark.parametrize("name", [proofs.PP2, proofs.EP2])
def test_refit_plan_of_the_moe_export_list(name, moe_export):
    """The compiled refit settings pack the whole MoE export with no one-off buffer, each tensor once, and
    the fp32 router biases travel as fp32 (the rest as the export dtype)."""
    from rlc.runtime.refit.bucket_planner import plan_from_config
    from rlc.runtime.refit.specs import TensorSpec, wire_specs

    result, cfg = _cfg(name)
    specs = [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in moe_export.items()]
    wire = wire_specs(specs, cfg.model.dtype, cfg.refit.fp32_params)
    fp32 = sorted(s.name for s in wire if s.dtype == "float32")
    biases = sorted(n for n in moe_export if n.endswith("e_score_correction_bias"))
    assert fp32 == biases and len(biases) == CONFIG["num_hidden_layers"] - CONFIG["first_k_dense_replace"] + 1
    plan = plan_from_config(wire, result.plan.free_at_refit_bytes, cfg.refit)
    placed = [e.spec.name for b in plan.buckets for e in b.entries]
    assert sorted(placed) == sorted(moe_export) and plan.num_oneoff == 0 and not plan.warnings
    assert plan.total_bytes == sum(s.nbytes for s in wire)
    dropped = wire_specs(specs, cfg.model.dtype, [])  # refit.fp32_params off: the biases become bf16
    assert {s.dtype for s in dropped if s.name in biases} == {"bfloat16"}
    with pytest.raises(Exception, match="appears twice"):  # a replicated name must never reach the wire
        wire_specs(specs + specs[:1], cfg.model.dtype, cfg.refit.fp32_params)
