"""``training.sequence_packing`` end to end: schema → typed recipe → runtime.yaml → the runtime's config,
the budget rule (RLC315), context parallelism (packed only), and the planner's logits term."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlc.compiler import api
from rlc.compiler.bundle.build import BundleError, build_bundle
from rlc.compiler.resolve import resolve_runtime_config, to_runtime_config
from rlc.contract.runtime_config import runtime_config_from_dict

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml")
SKYRL = str(ROOT / "tests" / "validation" / "recipes" / "skyrl-grpo-qwen3-30ba3b-search-4n8g.yaml")
ON = "training.sequence_packing.enabled=true"
TWO_GPUS_CP2 = ("cluster.gpus_per_node=2", "parallelism.train.cp=2")


def _rules(result, severity=None):
    return {d.rule for d in result.diagnostics if severity is None or d.severity == severity}


def test_the_budgets_reach_the_runtime_config_stated_or_derived():
    derived = api.check(TINY, [ON])
    assert derived.ok and "RLC311" not in _rules(derived)
    cfg = resolve_runtime_config(derived)
    # tiny-qwen3-1gpu: max_sequence_length 64 × micro_batch_size 2048
    assert cfg.training.sequence_packing.enabled and cfg.training.sequence_packing.train_mb_tokens == 64 * 2048
    assert cfg.training.sequence_packing.logprob_mb_tokens == 64 * 2048
    stated = api.check(TINY, [ON, "training.sequence_packing.train_mb_tokens=4096",
                              "training.sequence_packing.logprob_mb_tokens=8192",
                              "training.sequence_packing.algorithm=first_fit_shuffle"])
    assert stated.recipe.train_mb_tokens == 4096 and stated.recipe.logprob_mb_tokens == 8192
    data = to_runtime_config(stated)
    # through runtime.yaml (YAML text) into the runtime's strict loader
    back = runtime_config_from_dict(yaml.safe_load(yaml.safe_dump(data)))
    sp = back.training.sequence_packing
    assert (sp.enabled, sp.algorithm, sp.train_mb_tokens, sp.logprob_mb_tokens) == (
        True,
        "first_fit_shuffle",
        4096,
        8192,
    )


def test_a_bundle_with_packing_compiles(tmp_path):
    result = api.check(TINY, [ON, f"cluster.log_dir={tmp_path}/logs"])
    built = build_bundle(result, tmp_path / "bundle")
    written = yaml.safe_load((tmp_path / "bundle" / "runtime.yaml").read_text(encoding="utf-8"))
    assert written["training"]["sequence_packing"]["enabled"] is True and built is not None


def test_the_schema_refuses_a_budget_below_one_token():
    result = api.check(TINY, [ON, "training.sequence_packing.train_mb_tokens=0"])
    assert not result.ok and any("train_mb_tokens" in d.path for d in result.errors)


def test_a_budget_that_cannot_hold_the_longest_sequence_is_an_error_naming_the_padded_size():
    full = "generation.sampling.max_tokens=48"  # a 16-token prompt and 48 sampled: max_sequence_length 64 reached
    short = api.check(TINY, [ON, full, "training.sequence_packing.logprob_mb_tokens=63"])
    (err,) = [d for d in short.errors if d.rule == "RLC315"]
    assert err.path == "training.sequence_packing.logprob_mb_tokens" and "64 or more" in err.hint
    # CP 2: each sequence is padded to 2 × CP = 4 tokens; max_sequence_length 66 becomes 68
    cp = api.check(TINY, [ON, *TWO_GPUS_CP2, "training.max_sequence_length=66", "generation.max_model_len=128",
                          "generation.sampling.max_tokens=100", "training.sequence_packing.train_mb_tokens=66"])
    (err,) = [d for d in cp.errors if d.rule == "RLC315"]
    assert "padded to a multiple of 4: 68 tokens" in err.message and "68 or more" in err.hint
    assert api.check(TINY, [ON, full, "training.sequence_packing.train_mb_tokens=64"]).ok
    # the longest rollout is a full prompt and a full response when those end below max_sequence_length
    # (NeMo-RL's Nemotron-3-Super QA recipe: 49152-token budget, 65536-token model, 1024 + 32768 tokens a rollout)
    bounded = [ON, "generation.max_model_len=256", "training.max_sequence_length=256", "data.max_prompt_length=16",
               "generation.sampling.max_tokens=32"]
    assert "RLC315" not in _rules(api.check(TINY, [*bounded, "training.sequence_packing.train_mb_tokens=48"]))
    (err,) = [d for d in api.check(TINY, [*bounded, "training.sequence_packing.train_mb_tokens=47"]).errors
              if d.rule == "RLC315"]
    assert "(48 tokens; a prompt of data.max_prompt_length 16 + generation.sampling.max_tokens 32)" in err.message
    # the engine stops a rollout at max_model_len, whatever the prompt and response limits add up to
    capped = api.check(TINY, [ON, "generation.max_model_len=256", "training.max_sequence_length=512",
                              "data.max_prompt_length=200", "generation.sampling.max_tokens=200"]).recipe
    assert capped.longest_sequence == 256
    assert "RLC315" not in _rules(api.check(TINY, ["training.sequence_packing.train_mb_tokens=1"]))  # packing off


def test_context_parallelism_runs_only_packed(tmp_path):
    padded = api.check(TINY, [*TWO_GPUS_CP2, f"cluster.log_dir={tmp_path}/logs"])
    (gap,) = [d for d in padded.diagnostics if d.rule == "RLC311"]
    assert gap.path == "parallelism.train.cp" and "training.sequence_packing.enabled: true" in gap.hint
    with pytest.raises(BundleError, match="set training.sequence_packing.enabled: true"):
        build_bundle(padded, tmp_path / "bundle")
    packed = api.check(TINY, [*TWO_GPUS_CP2, ON, f"cluster.log_dir={tmp_path}/logs"])
    assert packed.ok and "RLC311" not in _rules(packed)
    assert resolve_runtime_config(packed).train_parallel.cp == 2


def _logits(result):
    item = next(i for i in result.plan.phases["train_late"].items if "logits" in i.label)
    return item.gib, item.note


def test_the_planner_counts_the_logits_of_the_tokens_a_packed_micro_batch_holds_on_a_gpu():
    padded_gib, padded_note = _logits(api.check(SKYRL))
    assert "1 × 4096 tokens" in padded_note
    # the default budget is micro batch × sequence: the same tokens, the same logits
    same_gib, same_note = _logits(api.check(SKYRL, [ON]))
    assert same_gib == pytest.approx(padded_gib) and "4096 packed tokens" in same_note
    double_gib, _ = _logits(api.check(SKYRL, [ON, "training.sequence_packing.train_mb_tokens=8192"]))
    assert double_gib == pytest.approx(2 * padded_gib)
    # with CP each rank holds half of the packed row
    cp = api.check(SKYRL, [ON, "parallelism.train.cp=2"])
    cp_gib, cp_note = _logits(cp)
    assert cp_gib == pytest.approx(padded_gib / 2) and "/ CP2" in cp_note
