"""The vLLM generation worker: one engine per ``generation_parallel.tp * pp`` GPUs, as a Ray actor.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with ``enable_sleep_mode=True`` so
that it can give its GPU memory to the colocated trainer between rollouts:

    generate -> sleep(level=refit.sleep_level) -> ... trainer step ... ->
    wake_up(["weights"]) -> refit_receive() -> wake_up(["kv_cache"]) -> reset_prefix_cache()

Level 1 backs the weights up to CPU and frees the KV cache; level 2 frees both (the refit rewrites
every weight anyway; NeMo-RL #2471, failure 3). With ``refit.keep_weights_awake`` only the KV cache
sleeps (``sleep_kv_cache``) and the refit writes into the resident weights (no ``wake_up(["weights"])``); with
``refit.keep_kv_cache_awake`` too, nothing sleeps (``stay_awake``): the prefix cache is emptied in a thread while the
trainer runs (``rlc.runtime.generation.prefix_cache``), and the reset after the refit finds nothing left to do.

An engine of more than one GPU uses vLLM's Ray executor inside this actor's placement group
(``VLLM_RAY_BUNDLE_INDICES``); the refit consumer then runs in each of vLLM's workers and pairs with the
trainer rank on its GPU.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from rlc.contract.runtime_config import runtime_config_from_dict
from rlc.runtime.generation.engine_args import check_vllm_version, engine_kwargs
from rlc.runtime.generation.prefix_cache import PrefixCache
from rlc.runtime.generation.sampling import parse_request_output, prompt_logprobs_of, sampling_kwargs
from rlc.runtime.worker_api import EngineStarted, Generated, GenerationWorkerApi, Memory, Slept, WorkerInfo, Woke
from rlc.runtime.workers import gpu_memory_snapshot, local_worker_info


log = logging.getLogger(__name__)

#: what is asleep: everything, by vLLM's own ``sleep(level)``; or only the KV cache (``sleep_kv_cache``)
ASLEEP_ENGINE = "vLLM sleep"
ASLEEP_KV_ONLY = "KV cache only"


class VllmGenerationWorker:
    """One vLLM engine (see the module docstring)."""

    def __init__(self, cfg_dict: dict, engine_index: int, bundles: list[int]) -> None:
        self.cfg = runtime_config_from_dict(cfg_dict)
        self.engine_index = engine_index
        self.bundles = list(bundles)
        self._llm: Any = None  # vllm.LLM once started
        self.asleep: str | None = None  # ASLEEP_ENGINE, ASLEEP_KV_ONLY or None (awake)
        self._woken: set[str] = set()  # tags woken since vLLM's own sleep (it wakes them one call each)
        self.moe_layers: list[int] | None = None  # routing replay: the decoder layers whose routes vLLM records
        # reset once per rollout, skipped when nothing ran since; in a thread with refit.keep_kv_cache_awake (the
        # thread reaches the engine as self._llm: every use through self.llm waits for it first)
        self.prefix_cache = PrefixCache(lambda: self._llm.reset_prefix_cache())

    @property
    def llm(self) -> Any:
        """The engine (``vllm.LLM``); a call before ``start`` is a driver bug and says so."""
        self._require_started()
        self.prefix_cache.settle()  # a reset running in the background finishes before anything else
        return self._llm

    def _require_started(self) -> None:
        if self._llm is None:
            raise RuntimeError(f"vLLM engine {self.engine_index}: used before start()")

    def info(self) -> WorkerInfo:
        return local_worker_info("generation", self.engine_index, self.bundles[0] if self.bundles else -1)

    def start(self, engine_overrides: dict[str, Any] | None = None) -> EngineStarted:
        """Create the engine (loads the HF checkpoint, profiles memory, allocates the KV cache).

        ``engine_overrides``: extra ``vllm.LLM`` arguments applied last (benchmarks start the engine
        with ``load_format="dummy"`` and ``skip_tokenizer_init=True`` from a bare ``config.json``).
        """
        from vllm import LLM  # noqa: PLC0415

        cfg, gp, gen = self.cfg, self.cfg.generation_parallel, self.cfg.generation
        t0 = time.perf_counter()
        if importlib.util.find_spec("flashinfer") is None:
            # vLLM's default top-k/top-p sampler imports flashinfer when it is on by default; without
            # the package (the GPU host's stack) fall back to the PyTorch sampler instead of failing.
            os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        distributed = gp.tp * gp.pp > 1
        kwargs = engine_kwargs(cfg, self.engine_index, distributed=distributed)
        if distributed:
            # vLLM's workers are Ray actors in this actor's placement group, sharing each GPU with
            # the trainer rank there.
            os.environ["VLLM_RAY_PER_WORKER_GPUS"] = "0.5"
            os.environ["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in self.bundles)
        import vllm  # noqa: PLC0415

        mismatch = check_vllm_version(gen.vllm_version, getattr(vllm, "__version__", "unknown"))
        if mismatch:
            log.warning(mismatch)
        kwargs.update(engine_overrides or {})
        self._llm = LLM(**kwargs)
        self.eos_token_id = self._eos_token_id()
        if cfg.training.router_replay.enabled:
            self.moe_layers = self._recorded_moe_layers()
        return EngineStarted(seconds=time.perf_counter() - t0, memory=self.memory(), eos_token_id=self.eos_token_id,
                             moe_layers=self.moe_layers)

    def _recorded_moe_layers(self) -> list[int]:
        """Routing replay: the decoder layers whose routes every worker of this engine records (all MoE layers,
        or the run stops here: a layer vLLM routes without recording could not be replayed)."""
        reports = self.llm.collective_rpc("rlc_moe_layer_ids")
        first = reports[0]
        if not first["moe"]:
            raise RuntimeError("training.router_replay is on but vLLM found no MoE layer in the model; "
                               "turn training.router_replay.enabled off for a dense model")
        unrecorded = sorted(set(first["moe"]) - set(first["recorded"]))
        if unrecorded or any(r["recorded"] != first["recorded"] for r in reports):
            raise RuntimeError(f"training.router_replay: vLLM records no routes for MoE layers {unrecorded} of "
                               f"{first['moe']} (their router is not one vLLM's routes recorder hooks into); turn "
                               "training.router_replay.enabled off for this model")
        return list(first["recorded"])

    def _eos_token_id(self) -> int | None:
        try:
            tok = self.llm.get_tokenizer()
            return tok.eos_token_id
        except Exception:  # noqa: BLE001
            return None

    def memory(self) -> Memory:
        return gpu_memory_snapshot()

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(self, *args, **kwargs)`` in this worker (tests and debugging)."""
        return fn(self, *args, **kwargs)

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: list[list[int]], n: int) -> Generated:
        """``n`` samples per prompt, with their logprobs (and with routing replay their routes, see
        ``rlc.runtime.policy.routes``)."""
        from vllm import SamplingParams  # noqa: PLC0415

        if self.asleep is not None:
            raise RuntimeError(f"generation engine {self.engine_index}: generate() while asleep (driver order bug)")
        t0 = time.perf_counter()
        params = SamplingParams(**sampling_kwargs(self.cfg.generation.sampling, n, eos_token_id=self.eos_token_id))
        self.prefix_cache.used()
        outs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_token_ids], params, use_tqdm=False)
        samples = [parse_request_output(o, self.moe_layers) for o in outs]
        return Generated(samples=samples, seconds=time.perf_counter() - t0, memory=self.memory())

    def prompt_logprobs(self, prompt_token_ids: list[list[int]]) -> list[list[float]]:
        """Logprobs of each prompt token given its prefix (tests: compare with the trainer)."""
        from vllm import SamplingParams  # noqa: PLC0415

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        self.prefix_cache.used()
        outs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_token_ids], params, use_tqdm=False)
        return [prompt_logprobs_of(o) for o in outs]

    # ------------------------------------------------------------------ sleep / wake

    def sleep(self, level: int) -> Slept:
        """vLLM's own sleep at ``level``: the KV cache discarded, the weights offloaded (1) or discarded (2)."""
        self._refuse_asleep("sleep")
        t0 = time.perf_counter()
        before = self.memory()
        self.llm.sleep(level=level)
        self.prefix_cache.cleared()  # vLLM's sleep (level >= 1) clears its caches before releasing the KV pool
        self.asleep = ASLEEP_ENGINE
        after = self.memory()
        return Slept(freed_gib=after.free_gib - before.free_gib, memory=after, memory_before=before,
                     seconds=time.perf_counter() - t0)

    def sleep_kv_cache(self) -> Slept:
        """``refit.keep_weights_awake``: only the KV cache leaves the GPU (every worker of the engine unmaps its
        ``kv_cache`` allocations); the weights stay where the next refit writes them."""
        self._refuse_asleep("sleep_kv_cache")
        t0 = time.perf_counter()
        before = self.memory()
        self.llm.collective_rpc("rlc_sleep_kv_cache")
        # the cached blocks' contents are gone: their hashes go too, in a thread while the trainer runs (nothing uses
        # the engine before the next refit, which waits for it)
        self.prefix_cache.reset_in_background()
        self.asleep = ASLEEP_KV_ONLY
        after = self.memory()
        return Slept(freed_gib=after.free_gib - before.free_gib, memory=after, memory_before=before,
                     seconds=time.perf_counter() - t0)

    def stay_awake(self) -> Slept:
        """``refit.keep_kv_cache_awake`` (with ``refit.keep_weights_awake``): nothing leaves the GPU between rollouts;
        the prefix cache is reset in a thread meanwhile (the trainer's passes run in other processes), so that the
        synchronizer's reset after the refit has nothing left to do."""
        self._refuse_asleep("stay_awake")
        t0 = time.perf_counter()
        self.prefix_cache.reset_in_background()
        memory = self.memory()
        return Slept(freed_gib=0.0, memory=memory, memory_before=memory, seconds=time.perf_counter() - t0)

    def wake_up(self, tags: list[str] | None = None) -> Woke:
        """Back on the GPU: ``tags`` (``weights``, ``kv_cache``; None: both) of what is asleep. Weights kept
        awake by :meth:`sleep_kv_cache` need no waking: asking for them is a no-op."""
        t0 = time.perf_counter()
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        if self.asleep == ASLEEP_ENGINE:
            self.llm.wake_up(tags=tags)
            self._woken |= wanted
            if {"weights", "kv_cache"} <= self._woken:
                self.asleep, self._woken = None, set()
        elif self.asleep == ASLEEP_KV_ONLY and "kv_cache" in wanted:
            self.llm.collective_rpc("wake_up", kwargs={"tags": ["kv_cache"]})
            self.asleep = None
        return Woke(memory=self.memory(), tags=tags, seconds=time.perf_counter() - t0)

    def _refuse_asleep(self, what: str) -> None:
        if self.asleep is not None:
            raise RuntimeError(f"generation engine {self.engine_index}: {what}() while already asleep "
                               f"({self.asleep}; driver order bug)")

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (after a refit: it holds the old weights' keys and values); nothing to do when no
        request ran since the last reset. False when vLLM refused (blocks still in use)."""
        self._require_started()
        return self.prefix_cache.reset()

    # ------------------------------------------------------------------ refit

    def refit_prepare(self, session: str, timeout_s: float = 600.0) -> list[dict[str, Any]]:
        gen = self.cfg.generation
        fp8 = gen.fp8.scales if gen.precision == "fp8" else None
        return self.llm.collective_rpc("rlc_refit_prepare", args=(session, self.cfg.refit.transport, timeout_s,
                                                                  fp8, gen.fp8.pow2_scales,
                                                                  self.cfg.refit.fused_transfer,
                                                                  self.cfg.refit.replay_load,
                                                                  self._wakes_kv_in_refit,
                                                                  list(gen.fp8.keep_bf16)))

    @property
    def _wakes_kv_in_refit(self) -> bool:
        """``refit.wake_kv_during_transfer``: the refit maps the KV cache of the KV-only sleep back itself."""
        return bool(self.cfg.refit.wake_kv_during_transfer and self.cfg.refit.keep_weights_awake)

    def refit_receive(self) -> list[dict[str, Any]]:
        """One refit into every worker; with ``refit.wake_kv_during_transfer`` a KV cache asleep (KV-only sleep) is
        mapped back during it, and a later ``wake_up(["kv_cache"])`` has nothing left to do."""
        wake = self._wakes_kv_in_refit and self.asleep == ASLEEP_KV_ONLY
        out = self.llm.collective_rpc("rlc_refit_receive", args=(wake,))
        if wake:
            self.asleep = None
        return out

    def refit_verify(self, export_dir: str) -> list[dict[str, Any]]:
        """One ``rlc.runtime.refit.verify`` report per vLLM worker of this engine."""
        return self.llm.collective_rpc("rlc_refit_verify", args=(export_dir,))

    def refit_verify_tensors(self, exported_by_device: dict[str, dict], param_names: list[str]) -> list[dict]:
        """Spot check by reload (``rlc.runtime.refit.verify.verify_by_reload``), one report per worker."""
        return self.llm.collective_rpc("rlc_refit_verify_tensors", args=(exported_by_device, param_names))

    def refit_close(self) -> None:
        self.llm.collective_rpc("rlc_refit_close")

    def named_parameters(self, names: list[str] | None = None) -> list[dict]:
        return self.llm.collective_rpc("rlc_named_parameters", args=(names,))

    def shutdown(self) -> None:
        try:
            self.llm.collective_rpc("rlc_refit_close")
        except Exception:  # noqa: BLE001
            pass


if TYPE_CHECKING:  # the type checker holds the class to the protocol the driver calls it through
    _IMPLEMENTS: type[GenerationWorkerApi] = VllmGenerationWorker
