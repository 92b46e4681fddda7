"""The train step counts the loss's fp32 logits from step 1, with either generation backend, by one formula.

The loss keeps the fp32 logits of a train micro batch and their log-softmax for the backward: on NeMo-RL #2619's
Qwen3.5-35B-A3B layout (TP1, 248,320 vocabulary) that is 7.6 GiB per GPU at every step, not only once vLLM's
after-sleep residue has grown.
"""
from __future__ import annotations

from pathlib import Path

from rlc.compiler import api
from rlc.compiler.planner.passes import LOSS_LOGITS_LABEL

ROOT = Path(__file__).resolve().parents[2]
TP1 = str(ROOT / "tests" / "validation" / "failures" / "nemo-rl-2619-qwen3.5-35b-a3b-tp1-ep16.yaml")


def _items(plan, phase: str) -> dict[str, float]:
    return {i.label: i.gib for i in plan.phases[phase].items}


def test_the_train_step_holds_the_loss_logits_at_step_one():
    plan = api.check(TP1).plan
    train = _items(plan, "train")
    assert train[LOSS_LOGITS_LABEL] > 7.5
    # the step-2 phase is the step-1 phase plus the residue growth: the logits are not counted twice
    late = _items(plan, "train_late")
    assert set(late) - set(train) == {"vLLM residue growth over steps"}
    assert plan.phases["train_late"].used_gib - plan.phases["train"].used_gib == \
        late["vLLM residue growth over steps"]
    assert "with the loss's logits" in plan.checks["train_fit"].text


def test_mtp_blocks_add_their_logits_only_where_the_mtp_loss_trains():
    off = _items(api.check(TP1).plan, "train")[LOSS_LOGITS_LABEL]
    on = _items(api.check(TP1, ["training.mtp_loss_scale=0.1"]).plan, "train")[LOSS_LOGITS_LABEL]
    assert on == 2 * off  # one MTP block computes its own logits over the vocabulary


def test_both_backends_count_the_same_loss_logits():
    recipe = str(ROOT / "recipes" / "tiny-qwen3-1gpu.yaml")
    megatron = str(ROOT / "recipes" / "tiny-qwen3-1gpu-megatron.yaml")
    sets = ["training.micro_batch_size=64"]
    assert _items(api.check(recipe, sets).plan, "train")[LOSS_LOGITS_LABEL] == \
        _items(api.check(megatron, sets).plan, "train")[LOSS_LOGITS_LABEL] > 0
