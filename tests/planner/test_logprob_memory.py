"""The logprob pass's memory: ``training.logprob_batch_size`` sequences of fp32 logits on the last pipeline stage,
next to the trainer as the refit left it (and the reference policy, with a KL penalty); a pass that exceeds the
GPU is an error (RLC222) whose hint is the largest batch that fits."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from rlc.compiler import api
from rlc.compiler.planner.memory import logits_bytes

ROOT = Path(__file__).resolve().parents[2]
VERL = ROOT / "tests" / "validation" / "recipes" / "verl-grpo-qwen3-30ba3b-4n8g-h20.yaml"  # TP1, 10240 tokens
GROWTH = str(ROOT / "tests" / "validation" / "failures" / "nemo-rl-2619-qwen3.5-35b-a3b-tp1-ep16.yaml")
LOGITS = "fp32 logits of the logprob pass"
GIB = 2**30


@pytest.fixture(scope="module")
def padded_recipe(tmp_path_factory) -> str:
    """verl's Qwen3-30B-A3B recipe with padded micro batches (the published one packs): these tests vary the
    padded logprob batch, and the packed case turns packing on with its default budgets."""
    data = yaml.safe_load(VERL.read_text(encoding="utf-8"))
    del data["training"]["sequence_packing"]
    path = tmp_path_factory.mktemp("recipe") / VERL.name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return str(path)


#: The recipe ``_check`` plans by default: ``padded_recipe`` (set for every test).
RECIPE = str(VERL)


@pytest.fixture(autouse=True)
def _plan_the_padded_recipe(padded_recipe, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "RECIPE", padded_recipe)


def _check(*sets: str, recipe: str | None = None):
    result = api.check(recipe or RECIPE, list(sets))
    assert result.plan is not None
    return result


def _item(phase, label):
    return next((i.gib for i in phase.items if i.label == label), None)


def test_unset_it_is_the_micro_batch_and_the_logits_follow_the_batch():
    base = _check()
    recipe, plan = base.recipe, base.plan
    assert recipe.training.logprob_batch_size is None and recipe.logprob_batch_size == recipe.training.micro_batch_size
    vocab = base.facts.vocab
    expected = logits_bytes(recipe.training.micro_batch_size * recipe.max_sequence_length, vocab, 1)
    assert _item(plan.phases["logprob"], LOGITS) * GIB == expected == 2 * 2 * 10240 * vocab * 4
    four = _check("training.logprob_batch_size=4").plan
    assert _item(four.phases["logprob"], LOGITS) == pytest.approx(2 * _item(plan.phases["logprob"], LOGITS))
    assert "training.logprob_batch_size" in next(i.note for i in four.phases["logprob"].items if i.label == LOGITS)
    # the train pass's logits stay the micro batch's: the logprob batch does not reach the train step
    assert four.phases["train"].used_gib == pytest.approx(plan.phases["train"].used_gib)


def test_a_wider_tp_splits_the_logits():
    one = _check("training.logprob_batch_size=4").plan
    two = _check("training.logprob_batch_size=4", "parallelism.train.tp=2",
                 "parallelism.train.sequence_parallel=true").plan
    assert _item(two.phases["logprob"], LOGITS) == pytest.approx(_item(one.phases["logprob"], LOGITS) / 2)


def test_an_oversized_logprob_batch_is_an_error_naming_the_batch_that_fits():
    """Broken (64 sequences of 10240 tokens: ~740 GiB of logits), then fixed with the value the hint names."""
    broken = _check("training.logprob_batch_size=64")
    [err] = [d for d in broken.diagnostics if d.rule == "RLC222"]
    assert err.severity == "error" and err.path == "training.logprob_batch_size" and not broken.ok
    fix = broken.plan.logprob_fix
    assert fix is not None and fix.key == "training.logprob_batch_size" and 1 <= fix.value < 64
    assert f"training.logprob_batch_size: {fix.value}" in err.hint
    fixed = _check(f"training.logprob_batch_size={fix.value}")
    assert "RLC222" not in {d.rule for d in fixed.diagnostics} and fixed.plan.checks["logprob_fit"].ok
    # the largest that fits: one more sequence does not
    over = _check(f"training.logprob_batch_size={fix.value + 1}")
    assert over.plan.checks["logprob_fit"].ok is False


def test_when_one_sequence_does_not_fit_the_fix_is_a_wider_tp():
    result = _check("training.logprob_batch_size=1", "training.max_sequence_length=262144",
                    "generation.max_model_len=262144", "generation.sampling.max_tokens=250000",
                    "data.max_prompt_length=12144")
    [err] = [d for d in result.diagnostics if d.rule == "RLC222"]
    assert err.path == "parallelism.train.tp" and "one sequence's fp32 logits" in err.hint


def test_the_logits_sit_on_the_last_pipeline_stage():
    plan = _check("training.logprob_batch_size=4", "parallelism.train.pp=2", "parallelism.train.ep=4").plan
    phase = plan.phases["logprob"]
    assert phase.stage == len(plan.stages) - 1 and _item(phase, LOGITS) > 1.0


def test_from_step_2_the_grown_vllm_residue_is_in_the_logprob_pass_too():
    plan = _check(recipe=GROWTH).plan
    step1, late = plan.phases["logprob"], plan.phases["logprob_late"]
    growth = _item(late, "vLLM residue growth over steps")
    assert growth > 10 and late.used_gib == pytest.approx(step1.used_gib + growth)
    assert plan.checks["logprob_late_fit"].ok  # NeMo-RL #2619 ran out of memory in the loss pass, not here
    # a logprob batch that fits at step 1 but not once the residue has grown: RLC220 names the batch
    sets = ("training.logprob_batch_size=6",)
    grown = _check(*sets, recipe=GROWTH)
    assert grown.plan.checks["logprob_fit"].ok and grown.plan.checks["logprob_late_fit"].ok is False
    hits = [d for d in grown.diagnostics if d.rule == "RLC220" and d.path == "training.logprob_batch_size"]
    assert hits and hits[0].severity == "error"
    fits = grown.plan.logprob_fix.value
    assert _check(f"training.logprob_batch_size={fits}", recipe=GROWTH).plan.checks["logprob_late_fit"].ok


def test_with_sequence_packing_the_logprob_budget_bounds_the_logits_and_is_the_fix():
    """Packed, the pass holds logprob_mb_tokens tokens (default: max_sequence_length × logprob_batch_size, as
    NeMo-RL's); a budget too large is an error whose fix is the largest budget that fits, holding a sequence."""
    packed = _check("training.sequence_packing.enabled=true", "training.logprob_batch_size=3")
    assert packed.recipe.logprob_mb_tokens == 3 * 10240
    logits = _item(packed.plan.phases["logprob"], LOGITS)
    assert logits * GIB == logits_bytes(3 * 10240, packed.facts.vocab, 1)
    assert "30720 packed tokens" in next(i.note for i in packed.plan.phases["logprob"].items if i.label == LOGITS)
    key = "training.sequence_packing.logprob_mb_tokens"
    broken = _check("training.sequence_packing.enabled=true", f"{key}=1048576")
    [err] = [d for d in broken.diagnostics if d.rule == "RLC222"]
    fix = broken.plan.logprob_fix
    assert err.path == key and fix.key == key and 10240 <= fix.value < 1048576
    fixed = _check("training.sequence_packing.enabled=true", f"{key}={fix.value}")
    assert fixed.plan.checks["logprob_fit"].ok and "RLC222" not in {d.rule for d in fixed.diagnostics}
    assert _check("training.sequence_packing.enabled=true", f"{key}={fix.value + 4096}").plan.checks[
        "logprob_fit"].ok is False


def test_truncated_sampling_adds_a_copy_of_the_logits_and_the_kl_term_another():
    """With min-p / top-k / top-p each TP rank receives whole vocabulary rows to cut beside the logits and the kept
    distribution (one more copy in both passes); a KL penalty's term scores the full distribution too (one more in the
    loss only)."""
    from rlc.compiler.planner.passes import LOSS_LOGITS_LABEL

    base = _check().plan
    cut = _check("generation.sampling.top_p=0.9").plan
    assert _item(cut.phases["logprob"], LOGITS) == pytest.approx(1.5 * _item(base.phases["logprob"], LOGITS))
    assert "3 × " in next(i.note for i in cut.phases["logprob"].items if i.label == LOGITS)
    loss = _item(base.phases["train"], LOSS_LOGITS_LABEL)
    assert _item(cut.phases["train"], LOSS_LOGITS_LABEL) == pytest.approx(1.5 * loss)
    with_kl = _check("generation.sampling.min_p=0.05", "loss.kl_penalty=0.01").plan
    assert _item(with_kl.phases["train"], LOSS_LOGITS_LABEL) == pytest.approx(2 * loss)
    assert _item(_check("generation.sampling.top_k=-1", "generation.sampling.top_p=1.0").plan.phases["logprob"],
                 LOGITS) == pytest.approx(_item(base.phases["logprob"], LOGITS))
