"""megatron-core inference settings and outputs <-> the driver's sample dicts (CPU; stand-ins for megatron-core's
request objects, with the attribute names of megatron-core 0.19's ``DynamicInferenceRequest``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlc.contract.runtime_config import MegatronGenerationConfig, SamplingConfig, load_runtime_config
from rlc.runtime.generation.megatron_sampling import (MegatronRequestFailed, MegatronSamplingError, TokenizerAdapter,
                                                      group_samples, inference_config_kwargs, parse_request,
                                                      sampling_params_kwargs)
from rlc.runtime.generation.sampling import parse_request_output
from rlc.runtime.worker_api import Sample

ROOT = Path(__file__).resolve().parents[2]
EOS = 2


def _sampling(**kw) -> SamplingConfig:
    base = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=8, stop=[], stop_token_ids=[])
    return SamplingConfig(**{**base, **kw})


def _cfg(**megatron):
    cfg = load_runtime_config(ROOT / "tests" / "gpu" / "tiny_runtime.yaml")
    m = MegatronGenerationConfig(**{**dict(mode="shared", transformer_impl="transformer_engine", kv_cache="recompute",
                                           block_size_tokens=64, max_tokens=None, max_requests=None,
                                           refit_backend="nccl", reset_router_num_groups=False, router_dtype="auto",
                                           mamba_ssm_states_dtype="auto", mamba_conv_states_dtype="auto"),
                                        **megatron})
    return dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, backend="megatron", megatron=m,
                                                                   kv_cache_memory_bytes=3 << 27))


def _req(tokens, logprobs, status="COMPLETED", rid=7, events=()):
    return SimpleNamespace(request_id=rid, status=SimpleNamespace(name=status), generated_tokens=list(tokens),
                           generated_log_probs=None if logprobs is None else list(logprobs), prompt_tokens=[1, 4, 5],
                           events=list(events))


# --------------------------------------------------------------------------- settings


def test_rlc_off_values_become_megatron_off_values():
    kw = sampling_params_kwargs(_sampling(temperature=0.7, max_tokens=16), EOS)
    assert kw == {"temperature": 0.7, "top_k": 0, "top_p": 0.0, "return_log_probs": True,
                  "skip_prompt_log_probs": True, "num_tokens_to_generate": 16, "termination_id": EOS}
    assert sampling_params_kwargs(_sampling(top_k=20), EOS)["top_k"] == 20
    assert sampling_params_kwargs(_sampling(top_p=0.9), EOS)["top_p"] == 0.9
    assert sampling_params_kwargs(_sampling(), None)["termination_id"] == -1


@pytest.mark.parametrize("kw, needle", [(dict(top_k=20, top_p=0.9), "refuses both"),
                                        (dict(stop=["\n"]), "EOS only"),
                                        (dict(stop_token_ids=[7]), "EOS only")])
def test_what_the_engine_cannot_do_is_refused(kw, needle):
    with pytest.raises(MegatronSamplingError, match=needle):
        sampling_params_kwargs(_sampling(**kw), EOS)


def test_inference_config_is_the_fixed_pool_and_decode_logprobs():
    kw = inference_config_kwargs(_cfg(max_tokens=4096, max_requests=256, kv_cache="persist"))
    assert kw["buffer_size_gb"] * (1 << 30) == 3 << 27  # megatron-core allocates int(gb * 2**30) bytes
    assert (kw["block_size_tokens"], kw["max_sequence_length"], kw["max_tokens"], kw["max_requests"]) == (64, 64, 4096,
                                                                                                         256)
    assert kw["kv_cache_management_mode"] == "persist" and kw["static_kv_memory_pointers"] is False
    assert kw["materialize_only_last_token_logits"] is True and kw["num_speculative_tokens"] == 0
    assert kw["logprobs_mode"] == "raw_logprobs"  # temperature 1, no truncation: the trainer's distribution
    defaults = inference_config_kwargs(_cfg())
    assert "max_tokens" not in defaults and "max_requests" not in defaults  # megatron-core's defaults


def test_a_temperature_asks_for_processed_logprobs_like_vllm():
    cfg = _cfg()
    cfg = dataclasses.replace(cfg, generation=dataclasses.replace(
        cfg.generation, sampling=dataclasses.replace(cfg.generation.sampling, temperature=0.8)))
    assert inference_config_kwargs(cfg)["logprobs_mode"] == "processed_logprobs"


def test_a_runtime_yaml_without_the_pool_or_the_section_is_refused():
    cfg = _cfg()
    with pytest.raises(ValueError, match="kv_cache_memory_bytes is required"):
        inference_config_kwargs(dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation,
                                                                                        kv_cache_memory_bytes=None)))
    with pytest.raises(ValueError, match="compiled for the vLLM backend"):
        inference_config_kwargs(dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, megatron=None)))


# --------------------------------------------------------------------------- outputs


def test_a_sample_ended_by_eos_reads_like_vllms():
    got = parse_request(_req([5, 9, EOS], [-0.1, -0.2, -0.3]), eos_token_id=EOS, max_tokens=8,
                        decode=lambda ids: "".join(map(str, ids)))
    assert got == Sample(token_ids=[5, 9, EOS], logprobs=[-0.1, -0.2, -0.3], text="59", finish_reason="stop")
    # the same sample as vLLM's parse (rlc.runtime.generation.sampling)
    vllm = parse_request_output(SimpleNamespace(outputs=[SimpleNamespace(
        token_ids=[5, 9, EOS], text="59", finish_reason="stop",
        logprobs=[{5: -0.1}, {9: -0.2}, {EOS: -0.3}])]))[0]
    assert vllm == got


def test_a_sample_cut_at_max_tokens_is_length():
    got = parse_request(_req([5, 9], [-0.1, -0.2]), eos_token_id=EOS, max_tokens=2, decode=str)
    assert got.finish_reason == "length" and got.token_ids == [5, 9]


def test_a_failed_request_stops_with_the_engines_error():
    err = type("BlockOverflowError", (Exception,), {})("request 7")
    with pytest.raises(MegatronRequestFailed, match=r"BlockOverflowError: request 7.*kv_cache_memory_bytes"):
        parse_request(_req([], None, status="FAILED", events=[SimpleNamespace(payload=err)]), eos_token_id=EOS,
                      max_tokens=8, decode=str)


@pytest.mark.parametrize("tokens, logprobs, max_tokens, needle", [
    ([5, 9, EOS], [-0.1, -0.2], 8, "2 logprobs for 3 generated tokens"),
    ([5, 9, 9], [-0.1, -0.2, -0.3], 2, "more than generation.sampling.max_tokens"),
])
def test_outputs_the_trainer_cannot_use_are_refused(tokens, logprobs, max_tokens, needle):
    with pytest.raises(ValueError, match=needle):
        parse_request(_req(tokens, logprobs), eos_token_id=EOS, max_tokens=max_tokens, decode=str)


def test_samples_group_by_prompt_in_submission_order():
    flat = [Sample(token_ids=[i], logprobs=[0.0], text="", finish_reason="stop") for i in range(6)]
    assert [[s.token_ids[0] for s in g] for g in group_samples(flat, 3)] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="do not split"):
        group_samples(flat, 4)


def test_tokenizer_adapter_speaks_megatrons_interface(tmp_path):
    from transformers import AutoTokenizer

    from rlc.runtime.toy import EOS_ID, build_tokenizer, char_ids

    build_tokenizer(tmp_path)
    adapter = TokenizerAdapter(AutoTokenizer.from_pretrained(str(tmp_path)))
    assert adapter.eod == EOS_ID and adapter.vocab_size > 10
    assert adapter.tokenize("3+4=") == char_ids("3+4=", add_bos=False)
    assert adapter.detokenize(char_ids("3+4=", add_bos=False) + [EOS_ID]) == "3+4="


def test_mamba_state_dtypes_reach_megatron_cores_state_config():
    """``generation.megatron.mamba_*_states_dtype`` -> ``MambaInferenceStateConfig.from_model``'s dtypes (None:
    megatron-core's default, the model's dtype)."""
    import torch

    from rlc.runtime.generation.megatron_sampling import mamba_state_dtypes

    assert mamba_state_dtypes(_cfg()) == {"conv_states_dtype": None, "ssm_states_dtype": None}
    got = mamba_state_dtypes(_cfg(mamba_ssm_states_dtype="fp32", mamba_conv_states_dtype="bf16"))
    assert got == {"conv_states_dtype": "bfloat16", "ssm_states_dtype": "float32"}
    assert getattr(torch, got["ssm_states_dtype"]) is torch.float32
