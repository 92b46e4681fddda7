"""The two-GPU reshard proofs' verdicts on the CPU: they pass on the evidence of a working run and fail on each way
a broken one shows (a rank's swap not exact or not checked, too few refits, a bias left in bf16, the inference
model not built in its own layout, one engine missing)."""
from __future__ import annotations

import pytest

from tests.gpu import test_mcore_reshard as proofs

BIAS = "decoder.layers.{}.mlp.router.expert_bias"


def _record(step: int, worker: int, *, exact: bool = True, biases: int = 3, tensors: int = 60) -> dict:
    return {"step": step, "worker": worker, "bit_exact": exact, "params_compared": tensors, "bytes_compared": 1000,
            "fp32_params": [BIAS.format(i) for i in range(1, biases + 1)],
            "mismatches": [] if exact else [{"name": "decoder.layers.1.mlp.experts.linear_fc1.weight4"}]}


def _run(records: list[dict], rc: int = 0, log: str = "") -> dict:
    return {"rc": rc, "verify": records, "log": log, "metrics": [], "ranks": []}


def _good(steps: int = 25, **kw) -> list[dict]:
    return [_record(s, w, **kw) for s in range(steps) for w in (0, 1)]


def test_swaps_pass_when_every_rank_is_exact_over_enough_refits():
    res = proofs.verdict_reshard_swaps(_run(_good()), 20, 2, 3)
    assert res["passed"] and res["verified_swaps"] == 25 and res["fp32_router_biases_min"] == 3
    # a run the timeout cut after enough exact swaps still counts them
    assert proofs.verdict_reshard_swaps(_run(_good(), rc=124), 20, 2, 3)["passed"]


def test_swaps_fail_on_each_broken_run():
    assert not proofs.verdict_reshard_swaps(_run(_good(19)), 20, 2, 3)["passed"]  # too few refits
    bad = _good() + [_record(25, 0, exact=False), _record(25, 1)]
    res = proofs.verdict_reshard_swaps(_run(bad), 20, 2, 3)
    assert not res["passed"] and res["not_exact"][0][2] == ["decoder.layers.1.mlp.experts.linear_fc1.weight4"]
    one_rank = [r for r in _good() if not (r["step"] == 7 and r["worker"] == 1)]
    res = proofs.verdict_reshard_swaps(_run(one_rank), 20, 2, 3)
    assert not res["passed"] and res["steps_missing_a_rank"] == [7]
    assert not proofs.verdict_reshard_swaps(_run(_good(biases=2)), 20, 2, 3)["passed"]  # a bias not fp32
    assert proofs.verdict_reshard_swaps(_run(_good(biases=0)), 20, 2, 0)["passed"]  # the dense model has none
    mixed = _good() + [_record(25, 0, tensors=59), _record(25, 1)]
    assert not proofs.verdict_reshard_swaps(_run(mixed), 20, 2, 3)["passed"]  # a rank compared fewer tensors
    assert not proofs.verdict_reshard_swaps(_run(_good(), rc=1), 20, 2, 3)["passed"]
    assert not proofs.verdict_reshard_swaps(_run([]), 20, 2, 0)["passed"]


def _log(ranks=(0, 1), built: int = 2, engines: str = "Megatron inference engines up in 9.0 s") -> str:
    lines = [f"[megatron-inference] rank {r}: resharding train TP2 EP1 -> inference TP1 EP1 (2 replicas): {{...}}"
             for r in ranks]
    lines += ["[megatron-inference] rank 0: built the dedicated inference model (transformer_engine)"] * built
    return "\n".join([*lines, engines])


def test_layout_verdict():
    assert proofs.verdict_layout(_log(), "TP2 EP1", "TP1 EP1", 2)["passed"]
    assert not proofs.verdict_layout(_log(ranks=(0,)), "TP2 EP1", "TP1 EP1", 2)["passed"]
    assert not proofs.verdict_layout(_log(built=1), "TP2 EP1", "TP1 EP1", 2)["passed"]
    assert not proofs.verdict_layout(_log(engines="vLLM engines up"), "TP2 EP1", "TP1 EP1", 2)["passed"]
    assert not proofs.verdict_layout(_log(), "TP1 EP2", "TP1 EP1", 2)["passed"]  # another layout than asked


def test_the_cases_name_the_shipped_recipes_and_their_layouts():
    from rlc.compiler import api

    for case in proofs.CASES.values():
        result = api.check(str(proofs.RECIPES / f"{case['recipe']}.yaml"), [])
        t = result.recipe.parallelism.train
        g = result.recipe.parallelism.generation
        assert result.ok and case["train"] == f"TP{t.tp} EP{t.ep}" and case["inference"] == f"TP{g.tp} EP{g.ep}"
    assert proofs.moe_router_biases() == 3


def test_the_dense_workspace_has_the_recipes_padded_vocabulary(tmp_path):
    """The checkpoint the TP case trains has the vocabulary the recipe's model config declares (32: the trainer
    splits it over TP 2), not the toy tokenizer's 23, which Megatron could not split."""
    import json

    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    ws = proofs.build_workspace(tmp_path, "dense")
    cfg = json.loads((ws["checkpoint"] / "config.json").read_text(encoding="utf-8"))
    declared = json.loads(proofs.DENSE_CONFIG.read_text(encoding="utf-8"))
    assert cfg["vocab_size"] == declared["vocab_size"] == 32 and cfg["vocab_size"] % 2 == 0
    (weights,) = sorted(ws["checkpoint"].glob("*.safetensors"))
    assert load_file(str(weights))["model.embed_tokens.weight"].shape[0] == 32
    assert ws["data"].exists()
