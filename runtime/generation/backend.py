"""The generation interface the driver calls, and its two implementations (pure Python; no ray, no torch).

A backend starts its engines, generates ``n`` samples per prompt with the sampled tokens' logprobs
(``rlc.runtime.worker_api.Sample``), and releases its GPU memory before the trainer's passes::

    started = backend.start()                       # once, after the policy workers exist (megatron) or before (vllm)
    results = backend.generate([(engine, prompts), ...], n)   # each engine's Generated: [[sample] * n per prompt]
    slept = backend.release(step)                   # before the trainer's logprob pass
    # ... trainer passes, then the weight sync (rlc.runtime.weight_sync) readies the engines again

* :class:`VllmBackend`: one vLLM engine per generation data-parallel rank (``GenerationGroup``), put to sleep at
  ``refit.sleep_level`` (with ``refit.keep_weights_awake`` only its KV cache sleeps; with
  ``refit.keep_kv_cache_awake`` too, nothing).
* :class:`MegatronBackend`: megatron-core's engine inside every policy worker (``PolicyGroup``, the ``mg_*``
  methods of ``rlc.runtime.policy.megatron_generation``); each trainer rank generates its share of the prompts.
"""
from __future__ import annotations

from typing import Protocol

from rlc.contract.refit_buffer import kv_cache_kept_awake
from rlc.contract.runtime_config import RefitConfig
from rlc.runtime.worker_api import EngineStarted, Generated, Slept
from rlc.runtime.worker_groups import GenerationGroup, PolicyGroup


class GenerationBackend(Protocol):
    """What the driver needs from a generation backend (see the module docstring)."""

    name: str
    #: ``timing/<timer>_s`` of the generate calls (``vllm_generate`` keeps the vLLM backend's metric name).
    timer: str

    @property
    def engines(self) -> int: ...

    def start(self) -> EngineStarted: ...

    def generate(self, chunks: list[tuple[int, list[list[int]]]], n: int) -> list[Generated]: ...

    def release(self, step: int) -> Slept: ...


class VllmBackend:
    """vLLM engines (``GenerationGroup``): start then sleep; generate; sleep (``refit.sleep_level``,
    ``refit.keep_weights_awake``)."""

    name = "vllm"
    timer = "vllm_generate"

    def __init__(self, group: GenerationGroup, refit: RefitConfig) -> None:
        self.group = group
        self.refit = refit

    @property
    def engines(self) -> int:
        return len(self.group)

    def start(self) -> EngineStarted:
        """Start every engine (loads the checkpoint, allocates the KV cache); the caller logs the memory, then
        :meth:`sleep_after_start` frees it for the trainer."""
        return self.group.start()[0]

    def sleep_after_start(self) -> None:
        self.release(0)

    def generate(self, chunks: list[tuple[int, list[list[int]]]], n: int) -> list[Generated]:
        return self.group.generate(chunks, n)

    def release(self, step: int) -> Slept:
        """Every engine asleep at ``refit.sleep_level``, or with ``refit.keep_weights_awake`` only its KV cache, or
        with ``refit.keep_kv_cache_awake`` too nothing (the engines keep their memory)."""
        if kv_cache_kept_awake(self.refit):
            return self.group.stay_awake()[0]
        if self.refit.keep_weights_awake:
            return self.group.sleep_kv_cache()[0]
        return self.group.sleep(self.refit.sleep_level)[0]


class MegatronBackend:
    """megatron-core's dynamic inference engine inside each policy worker (one per GPU, direct mode)."""

    name = "megatron"
    timer = "megatron_generate"

    def __init__(self, policy: PolicyGroup) -> None:
        self.policy = policy

    @property
    def engines(self) -> int:
        return len(self.policy)

    def start(self) -> EngineStarted:
        """Build every rank's engine (and, in dedicated mode, its inference model); the engines start suspended."""
        return self.policy.mg_start()[0]

    def generate(self, chunks: list[tuple[int, list[list[int]]]], n: int) -> list[Generated]:
        """``chunks``: (trainer rank, prompts); each rank's samples in that order."""
        return self.policy.mg_generate(chunks, n)

    def release(self, step: int) -> Slept:
        """Suspend every engine (its KV pool per ``generation.megatron.kv_cache``) before the trainer's passes."""
        return self.policy.mg_release(step)[0]


__all__ = ["GenerationBackend", "MegatronBackend", "VllmBackend"]
