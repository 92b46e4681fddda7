"""megatron-core inference settings and outputs as plain data (pure Python; CPU-tested with stand-in objects).

* :func:`inference_config_kwargs`: ``runtime.yaml`` -> megatron-core ``InferenceConfig`` keyword arguments
  (eager, direct engine, the fixed KV pool of ``generation.kv_cache_memory_bytes``).
* :func:`sampling_params_kwargs`: ``generation.sampling`` -> megatron-core ``SamplingParams`` keyword
  arguments. megatron-core's conventions differ from rlc's (= vLLM's): top-k 0 and top-p 0.0 mean "off"; a
  request stops on one termination id. What the engine cannot do as vLLM does is refused (the compiler refuses
  it first, RLC404).
* :func:`parse_request`: one finished megatron-core request -> a :class:`~rlc.runtime.worker_api.Sample`, as the
  driver gets them from vLLM (``rlc.runtime.generation.sampling.parse_request_output``).
* :class:`TokenizerAdapter`: the tokenizer interface megatron-core's controller calls (``eod``, ``bos``,
  ``tokenize``, ``detokenize``) over a Hugging Face tokenizer.
"""
from __future__ import annotations

from typing import Any, Callable

from rlc.contract.runtime_config import RuntimeConfig, SamplingConfig
from rlc.contract.mamba_states import MAMBA_STATE_DTYPES
from rlc.contract.sampling_truncation import Truncation
from rlc.runtime.generation.sampling import logprobs_mode
from rlc.runtime.worker_api import Sample

GIB = float(1 << 30)
#: megatron-core ``inference_request.Status.FAILED``.
FAILED = "FAILED"


class MegatronSamplingError(ValueError):
    """Sampling settings megatron-core's engine cannot reproduce (RLC404 refuses them at compile time)."""


class MegatronRequestFailed(RuntimeError):
    """The engine failed a request (it did not fit the KV pool, the token budget or the sequence length)."""


def mamba_state_dtypes(cfg: RuntimeConfig) -> dict[str, str | None]:
    """``MambaInferenceStateConfig.from_model``'s ``conv_states_dtype`` / ``ssm_states_dtype`` as torch attribute
    names, None where megatron-core's default (the model's dtype) applies."""
    m = cfg.generation.megatron
    if m is None:
        raise ValueError("generation.megatron is missing: runtime.yaml was compiled for the vLLM backend")
    return {"conv_states_dtype": MAMBA_STATE_DTYPES.get(m.mamba_conv_states_dtype),
            "ssm_states_dtype": MAMBA_STATE_DTYPES.get(m.mamba_ssm_states_dtype)}


def inference_config_kwargs(cfg: RuntimeConfig) -> dict[str, Any]:
    """Keyword arguments of megatron-core's ``InferenceConfig`` for ``runtime.yaml`` ``cfg`` (the KV management
    mode as its string value; the worker turns it into ``KVCacheManagementMode``)."""
    gen = cfg.generation
    m = gen.megatron
    if m is None:
        raise ValueError("generation.megatron is missing: runtime.yaml was compiled for the vLLM backend")
    if gen.kv_cache_memory_bytes is None:
        raise ValueError("generation.kv_cache_memory_bytes is required with generation.backend megatron "
                         "(megatron-core's fixed KV pool); recompile the bundle")
    kwargs: dict[str, Any] = {
        "block_size_tokens": int(m.block_size_tokens),
        "buffer_size_gb": int(gen.kv_cache_memory_bytes) / GIB,  # megatron-core allocates int(gb * 2**30) bytes
        "max_sequence_length": int(gen.max_model_len),
        "kv_cache_management_mode": m.kv_cache,
        "static_kv_memory_pointers": False,  # eager: no CUDA graph holds the pool's addresses
        "unified_memory_level": 0,
        "materialize_only_last_token_logits": True,  # decode logprobs only (skip_prompt_log_probs)
        "logprobs_mode": logprobs_mode(gen.sampling),  # the distribution the trainer scores against
        "sampling_backend": "torch",
        "use_flashinfer_fused_rope": False,
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
        "num_speculative_tokens": 0,
    }
    if m.max_tokens is not None:
        kwargs["max_tokens"] = int(m.max_tokens)
    if m.max_requests is not None:
        kwargs["max_requests"] = int(m.max_requests)
    return kwargs


def sampling_params_kwargs(sampling: SamplingConfig, eos_token_id: int | None) -> dict[str, Any]:
    """Keyword arguments of megatron-core's ``SamplingParams`` for ``generation.sampling``."""
    cut = Truncation.of(sampling)
    top_k, top_p = cut.top_k, cut.top_p if cut.top_p < 1.0 else 0.0  # megatron-core's "off" is 0 for both
    if top_k and top_p:
        raise MegatronSamplingError(f"generation.sampling top_k {top_k} with top_p {top_p}: megatron-core's sampler "
                                    "refuses both at once; recompile with one of them off")
    if cut.min_p > 0:
        raise MegatronSamplingError(f"generation.sampling.min_p {sampling.min_p}: megatron-core's sampler has "
                                    "temperature, top-k and top-p only; recompile with min_p: 0 (or the vLLM backend)")
    if list(sampling.stop) or list(getattr(sampling, "stop_token_ids", ())):
        raise MegatronSamplingError("generation.sampling.stop / stop_token_ids: megatron-core stops a request on the "
                                    "tokenizer's EOS only (as rlc runs it); recompile without them")
    return {
        "temperature": float(sampling.temperature),
        "top_k": top_k,
        "top_p": top_p,
        "return_log_probs": True,
        "skip_prompt_log_probs": True,
        "num_tokens_to_generate": int(sampling.max_tokens),
        "termination_id": -1 if eos_token_id is None else int(eos_token_id),
    }


def _status_name(status: Any) -> str:
    return str(getattr(status, "name", status))


def _errors(req: Any) -> str:
    found = []
    for event in getattr(req, "events", None) or []:
        payload = getattr(event, "payload", None)
        if payload is not None and not isinstance(payload, dict):
            found.append(f"{type(payload).__name__}: {payload}")
    return "; ".join(found) or "no error recorded"


def parse_request(req: Any, *, eos_token_id: int | None, max_tokens: int,
                  decode: Callable[[list[int]], str]) -> Sample:
    """One finished request (merged ``DynamicInferenceRequest``) as a sample.

    ``token_ids`` keep the EOS token that ended the sample, as vLLM's do; ``text`` is ``decode`` of the tokens
    without it; ``finish_reason`` is ``stop`` (EOS) or ``length`` (``max_tokens`` or the model length reached),
    vLLM's names. A failed
    request raises :class:`MegatronRequestFailed` naming the engine's error (a silently empty sample would train
    on nothing)."""
    if _status_name(getattr(req, "status", None)) == FAILED:
        raise MegatronRequestFailed(
            f"megatron-core failed request {getattr(req, 'request_id', '?')} "
            f"({len(getattr(req, 'prompt_tokens', []) or [])} prompt tokens): {_errors(req)}; check "
            "generation.kv_cache_memory_bytes, generation.max_model_len and "
            "generation.megatron.max_tokens (rlc plan shows the KV pool)"
        )
    ids = [int(t) for t in (req.generated_tokens or [])]
    logprobs = [float(x) for x in (req.generated_log_probs or [])]
    if len(logprobs) != len(ids):
        raise ValueError(f"megatron-core returned {len(logprobs)} logprobs for {len(ids)} generated tokens of request "
                         f"{getattr(req, 'request_id', '?')}; the trainer needs one per token "
                         "(SamplingParams(return_log_probs=True, skip_prompt_log_probs=True))")
    if len(ids) > max_tokens:
        raise ValueError(f"request {getattr(req, 'request_id', '?')} generated {len(ids)} tokens, more than "
                         f"generation.sampling.max_tokens {max_tokens}")
    stopped = bool(ids) and eos_token_id is not None and ids[-1] == eos_token_id
    text_ids = ids[:-1] if stopped else ids
    return Sample(
        token_ids=ids, logprobs=logprobs, text=decode(text_ids), finish_reason="stop" if stopped else "length"
    )


def group_samples(flat: list[Sample], n: int) -> list[list[Sample]]:
    """``n`` consecutive samples per prompt (requests are submitted prompt by prompt, ``n`` each)."""
    if n < 1 or len(flat) % n:
        raise ValueError(f"{len(flat)} samples do not split into groups of {n}")
    return [flat[i:i + n] for i in range(0, len(flat), n)]


class TokenizerAdapter:
    """What megatron-core's ``TextGenerationController`` and engine call on a tokenizer, over a Hugging Face one."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        eos = getattr(hf_tokenizer, "eos_token_id", None)
        self.eod = -1 if eos is None else int(eos)
        self.bos = getattr(hf_tokenizer, "bos_token_id", None)
        self.vocab_size = len(hf_tokenizer)

    def tokenize(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))


__all__ = ["MegatronRequestFailed", "MegatronSamplingError", "TokenizerAdapter", "group_samples",
           "inference_config_kwargs", "mamba_state_dtypes", "parse_request", "sampling_params_kwargs"]
