"""vLLM sampling settings and output parsing (pure Python; CPU-tested with stand-in objects).

``sampling_kwargs`` maps ``generation.sampling`` to ``vllm.SamplingParams`` keyword arguments; the
sampled token's logprob is always requested (``logprobs=0``) because the trainer compares it with its
own (gen-KL). ``logprobs_mode`` makes vLLM report logprobs of the distribution it actually samples
from when a temperature or a cut (min-p, top-k, top-p) is set (the trainer divides its logits by the same
temperature and applies the same cuts).
``parse_request_output`` turns one ``RequestOutput`` into plain data that crosses Ray cheaply.
"""
from __future__ import annotations

from typing import Any, Sequence

from rlc.contract.runtime_config import SamplingConfig
from rlc.contract.sampling_truncation import Truncation
from rlc.runtime.worker_api import Sample


def sampling_kwargs(sampling: SamplingConfig, n: int, *, eos_token_id: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``SamplingParams`` (``n`` generations per prompt)."""
    cut = Truncation.of(sampling)
    kw: dict[str, Any] = {
        "n": int(n),
        "temperature": float(sampling.temperature),
        "top_p": cut.top_p,
        "top_k": cut.top_k or -1,  # vLLM's "off" is -1
        "max_tokens": int(sampling.max_tokens),
        "logprobs": 0,
    }
    if cut.min_p > 0:
        kw["min_p"] = cut.min_p
    if sampling.stop:
        kw["stop"] = list(sampling.stop)
    stop_ids = [int(eos_token_id)] if eos_token_id is not None else []
    stop_ids += [int(t) for t in getattr(sampling, "stop_token_ids", ()) if int(t) not in stop_ids]
    if stop_ids:
        kw["stop_token_ids"] = stop_ids
    return kw


def logprobs_mode(sampling: SamplingConfig) -> str:
    """``raw_logprobs`` at temperature 1 without top-p/top-k/min-p, else ``processed_logprobs`` (the
    distribution vLLM samples from after each of them)."""
    plain = float(sampling.temperature) == 1.0 and not Truncation.of(sampling).active
    return "raw_logprobs" if plain else "processed_logprobs"


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The sampled token's logprob at each position (vLLM's ``logprobs`` list of {id: Logprob})."""
    if logprobs is None:
        raise ValueError("vLLM returned no logprobs; SamplingParams(logprobs=0) is required")
    out = []
    for pos, tid in enumerate(token_ids):
        entry = logprobs[pos]
        lp = entry[tid]
        out.append(float(getattr(lp, "logprob", lp)))
    return out


def parse_request_output(req: Any, moe_layers: Sequence[int] | None = None) -> list[Sample]:
    """One prompt's generations; with ``moe_layers`` (routing replay) each with ``routed_experts``: vLLM's routes
    of the completion reduced to those decoder layers (``rlc.runtime.policy.routes.compact``), or None where vLLM
    returned none."""
    samples = []
    for comp in req.outputs:
        ids = list(comp.token_ids)
        routes = None
        if moe_layers is not None:
            from rlc.runtime.policy.routes import compact  # noqa: PLC0415 - numpy and torch: routing replay only

            routes = compact(getattr(comp, "routed_experts", None), moe_layers)
        samples.append(Sample(token_ids=ids, logprobs=sampled_logprobs(ids, comp.logprobs), text=comp.text,
                              finish_reason=comp.finish_reason, routed_experts=routes))
    return samples


def prompt_logprobs_of(req: Any) -> list[float]:
    """Prompt-token logprobs of one request (position 0 has none and is skipped)."""
    ids = list(req.prompt_token_ids)
    out = []
    for pos in range(1, len(ids)):
        entry = req.prompt_logprobs[pos]
        lp = entry[ids[pos]]
        out.append(float(getattr(lp, "logprob", lp)))
    return out
