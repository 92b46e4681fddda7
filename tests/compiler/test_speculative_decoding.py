"""generation.speculative_decoding: the schema's shape, the refusal of vLLM's speculative_config as a pass-through
option, and the rule that method mtp needs MTP layers in the checkpoint (not in the trainer)."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api
from rlc.contract.model_overrides import MTP_COUNT_KEYS
from rlc.compiler.catalog.models import model_facts

ROOT = Path(__file__).resolve().parents[2]
TINY_DENSE = ROOT / "rlc/recipes/tiny-qwen3-1gpu.yaml"
TINY_MTP = ROOT / "rlc/recipes/tiny-moe-mtp-2gpu-pp2.yaml"
DEEPSEEK = ROOT / "tests/validation/recipes/nemo-rl-grpo-deepseek-v3-32n8g.yaml"
SPEC = "generation.speculative_decoding"


def errors(path, *sets):
    result = api.check(str(path), list(sets))
    return [(d.path, d.rule, d.message, d.hint) for d in result.errors]


@pytest.mark.parametrize("sets", [
    (f"{SPEC}.method=mtp", f"{SPEC}.num_speculative_tokens=1"),
    (f"{SPEC}.method=mtp", f"{SPEC}.num_speculative_tokens=3"),
    (f"{SPEC}=null",),
])
def test_the_schema_accepts_each_method_and_off(sets):
    assert errors(TINY_MTP, "refit.sleep_level=1", *sets) == []


def test_ngram_is_accepted_on_a_model_without_mtp():
    assert errors(TINY_DENSE, f"{SPEC}.method=ngram", f"{SPEC}.num_speculative_tokens=4",
                  f"{SPEC}.prompt_lookup_min=3", f"{SPEC}.prompt_lookup_max=5") == []


@pytest.mark.parametrize("sets,path,words", [
    ((f"{SPEC}.method=eagle", f"{SPEC}.num_speculative_tokens=1"), f"{SPEC}.method", "'mtp', 'ngram'"),
    ((f"{SPEC}.method=mtp", f"{SPEC}.num_speculative_tokens=0"), f"{SPEC}.num_speculative_tokens", "1 to 64"),
    ((f"{SPEC}.method=mtp",), f"{SPEC}.num_speculative_tokens", "missing required key"),
    ((f"{SPEC}.method=ngram", f"{SPEC}.num_speculative_tokens=2", f"{SPEC}.prompt_lookup_min=0"),
     f"{SPEC}.prompt_lookup_min", "out of range"),
    ((f"{SPEC}.methd=mtp", f"{SPEC}.num_speculative_tokens=1"), f"{SPEC}.methd", "did you mean 'method'"),
    ((f"{SPEC}=mtp",), SPEC, "mapping"),
])
def test_the_schema_rejects_bad_values_naming_the_key(sets, path, words):
    found = errors(TINY_MTP, *sets)
    assert [p for p, *_ in found] == [path], found
    assert words in found[0][2]


def test_speculative_config_in_vllm_kwargs_is_refused_with_the_typed_key():
    found = errors(TINY_MTP, "generation.vllm_kwargs.speculative_config.method=mtp",
                   "generation.vllm_kwargs.speculative_config.num_speculative_tokens=1")
    assert found == [("generation.vllm_kwargs.speculative_config", "RLC310",
                      "generation.vllm_kwargs.speculative_config is set by rlc from generation.speculative_decoding",
                      "use generation.speculative_decoding instead")]
    [(path, rule, message, _)] = errors(TINY_MTP, "generation.vllm_kwargs.speculative_confg.method=mtp")
    assert rule == "RLC310" and "looks like 'speculative_config'" in message


def test_mtp_on_a_checkpoint_without_mtp_layers_is_an_error_naming_the_key():
    [(path, rule, message, hint)] = errors(TINY_DENSE, f"{SPEC}.method=mtp", f"{SPEC}.num_speculative_tokens=1")
    assert (path, rule) == (f"{SPEC}.method", "RLC314")
    assert "has none" in message and "method: ngram" in hint


def test_mtp_counts_the_checkpoints_layers_not_the_trainers():
    """The DeepSeek-V3 recipe builds its trainer without MTP (model.overrides num_nextn_predict_layers: 0), as
    NeMo-RL's mtp_num_layers: 0 does; vLLM's drafter still loads the checkpoint's MTP layer, so mtp is allowed."""
    found = errors(DEEPSEEK, f"{SPEC}.method=mtp", f"{SPEC}.num_speculative_tokens=1")
    assert not [e for e in found if e[1] == "RLC314" or e[0].startswith(SPEC)], found  # (the refit check is
    # the planner's: tests/planner/test_speculative_decoding_plan.py)
    facts = model_facts("deepseek-ai/DeepSeek-V3", ROOT, overrides={"num_nextn_predict_layers": 0})
    assert (facts.mtp_num_layers, facts.checkpoint_mtp_num_layers) == (0, 1)
    qwen = model_facts("Qwen/Qwen3.5-397B-A17B", ROOT, overrides={"mtp_num_hidden_layers": 0, "vocab_size": 1000})
    assert (qwen.mtp_num_layers, qwen.checkpoint_mtp_num_layers, qwen.vocab) == (0, 1, 1000)
    assert set(MTP_COUNT_KEYS) == {"num_nextn_predict_layers", "mtp_num_hidden_layers"}
    plain = model_facts("deepseek-ai/DeepSeek-V3", ROOT)
    assert (plain.mtp_num_layers, plain.checkpoint_mtp_num_layers) == (1, 1)


def test_the_ngram_window_is_checked_and_stays_with_ngram():
    [(path, rule, message, _)] = errors(TINY_DENSE, f"{SPEC}.method=ngram", f"{SPEC}.num_speculative_tokens=2",
                                        f"{SPEC}.prompt_lookup_min=5")
    assert (path, rule) == (f"{SPEC}.prompt_lookup_min", "RLC314") and "5 > prompt_lookup_max 4" in message
    [(path, rule, message, _)] = errors(TINY_MTP, "refit.sleep_level=1", f"{SPEC}.method=mtp",
                                        f"{SPEC}.num_speculative_tokens=1", f"{SPEC}.prompt_lookup_max=6")
    assert (path, rule) == (f"{SPEC}.prompt_lookup_max", "RLC314") and "n-gram setting" in message


def test_mtp_with_sleep_level_2_is_refused_ngram_is_not():
    """Level 2 frees the drafter's weights and nothing writes them back (vLLM restores the target model's buffers,
    the refit the target model's weights)."""
    [(path, rule, message, hint)] = errors(TINY_MTP, f"{SPEC}.method=mtp", f"{SPEC}.num_speculative_tokens=1",
                                           "refit.sleep_level=2")
    assert (path, rule, hint.split(" (")[0]) == ("refit.sleep_level", "RLC314", "refit.sleep_level: 1")
    assert errors(TINY_MTP, f"{SPEC}.method=ngram", f"{SPEC}.num_speculative_tokens=1", "refit.sleep_level=2") == []
