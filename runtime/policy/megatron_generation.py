"""Megatron-core inference in the policy worker (``generation.backend: megatron``): the ``mg_*`` methods.

:class:`MegatronGenerationMixin` is a base of ``MegatronPolicyWorker``; the driver reaches it through
``rlc.runtime.generation.backend.MegatronBackend`` (start, generate, release) and
``rlc.runtime.weight_sync.MegatronInProcessSync`` (sync)::

    mg_start()           once after setup: the tokenizer, the dedicated model and its swap plan (dedicated mode),
                         the engine, suspended
    mg_sync(step, v)     every refit, after refit_offload(): shared mode syncs nothing more (the trainer's
                         parameters are what generates; its forward pre-hooks go off), dedicated mode swaps the
                         trainer's tensors into the inference model (and checks them bit for bit when ``v``);
                         then the engine resumes (KV pool back)
    mg_generate(p, n)    n samples per prompt with logprobs (the driver's sample dicts)
    mg_release(step)     the engine suspends (KV pool per generation.megatron.kv_cache), the training model back in
                         train mode with its pre-hooks, the dedicated model's weights freed

Every method answers with a frozen dataclass of ``rlc.runtime.worker_api``. The engine is built once and reused:
its KV pool comes and goes with suspend/resume, so the trainer's passes never run while megatron-core's
process-wide ``InferenceMode`` is on.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlc.contract.runtime_config import RuntimeConfig
from rlc.runtime.gc_heap import freeze_heap
from rlc.runtime.generation.megatron_sampling import TokenizerAdapter
from rlc.runtime.worker_api import EngineStarted, Generated, MegatronSynced, Memory, Slept


@dataclass
class _EngineState:
    engine: Any
    tokenizer: Any  # rlc.runtime.generation.megatron_sampling.TokenizerAdapter
    mode: str  # "shared" | "dedicated"
    inference_model: Any = None  # dedicated mode
    freed: Any = None  # megatron_engine.FreedWeights while the dedicated weights are given back
    hooks_off: bool = False  # the training chunks' forward pre-hooks are disabled (shared mode, generating)
    awake: bool = False
    swaps: int = 0
    facts: dict[str, Any] = field(default_factory=dict)


class MegatronGenerationMixin:
    """The ``mg_*`` methods of ``MegatronPolicyWorker`` (see the module docstring)."""

    cfg: RuntimeConfig
    rank: int
    _mg: _EngineState | None = None

    # the host class provides these
    pm: Any

    def memory(self) -> Memory: ...  # type: ignore[empty-body]

    def _params_back(self) -> None: ...

    @property
    def mg(self) -> _EngineState:
        if self._mg is None:
            raise RuntimeError(f"policy worker {self.rank}: Megatron generation used before mg_start()")
        return self._mg

    def _gen_model(self) -> Any:
        return self.mg.inference_model if self.mg.mode == "dedicated" else self.pm.model[0]

    # ------------------------------------------------------------------ lifecycle

    def mg_start(self) -> EngineStarted:
        """Build this rank's engine (and the dedicated model with its swap plan); the engine starts suspended."""
        from transformers import AutoTokenizer  # noqa: PLC0415

        from rlc.runtime.generation import megatron_engine as E  # noqa: PLC0415

        cfg = self.cfg
        m = cfg.generation.megatron
        if m is None:
            raise RuntimeError("mg_start: runtime.yaml has no generation.megatron (compiled for vLLM)")
        if len(self.pm.model) != 1:
            raise NotImplementedError(f"{len(self.pm.model)} virtual pipeline chunks: megatron-core's engine and "
                                      "swap_model_weights run one chunk (parallelism.train.vpp must be 1, RLC401)")
        if m.mode == "shared" and cfg.refit.offload_params_for_generation:
            raise ValueError("refit.offload_params_for_generation with generation.megatron.mode shared: the engine "
                             "generates with the trainer's parameters (RLC403); recompile")
        t0 = time.perf_counter()
        before = self.memory()
        attention = E.require_flash_attention()
        tokenizer = TokenizerAdapter(AutoTokenizer.from_pretrained(cfg.model.tokenizer,
                                                                   trust_remote_code=cfg.model.trust_remote_code))
        facts: dict[str, Any] = {"mode": m.mode, "flash_attention": attention}
        # the router casts a bf16 expert_bias to fp32 at its first forward; the first forward is a rollout, under
        # torch.inference_mode, which would make the bias an inference tensor the trainer's bias update cannot
        # write in place: cast it now, outside inference mode
        facts["routers_fp32"] = E.keep_router_bias_fp32(self.pm.model[0])
        inference_model = pg = None
        if m.mode == "dedicated":
            self._params_back()
            if E.resharded(cfg):
                layout = E.reshard_layout(cfg)
                if not layout.direct:
                    raise NotImplementedError(
                        f"inference TP{layout.inference.tp} EP{layout.inference.ep}: the bundled runtime runs one "
                        "engine per GPU (parallelism.generation tp, pp and ep 1, RLC311); recompile")
                facts["reshard"] = layout.describe(self.rank, getattr(self.pm.provider, "num_moe_experts", None))
                print(f"[megatron-inference] rank {self.rank}: resharding train TP{layout.train.tp} "
                      f"EP{layout.train.ep} -> inference TP{layout.inference.tp} EP{layout.inference.ep} "
                      f"({layout.replicas} replicas): {facts['reshard']}", flush=True)
            inference_model, pg = E.build_inference_model(self.pm.bridge, cfg)
            print(f"[megatron-inference] rank {self.rank}: built the dedicated inference model "
                  f"({m.transformer_impl})", flush=True)
            facts.update(E.prepare_swap(self.pm.model[0], inference_model))
        gen_model = inference_model if inference_model is not None else self.pm.model[0]
        engine = E.build_engine(gen_model, cfg, tokenizer, pg_collection=pg)
        facts["kv_pool"] = E.pool_facts(engine)
        self._mg = _EngineState(engine=engine, tokenizer=tokenizer, mode=m.mode, inference_model=inference_model,
                                facts=facts)
        if inference_model is not None:  # not written yet: the first swap fills it
            self._mg.freed = E.free_weights(inference_model)
        eos = tokenizer.eod if tokenizer.eod >= 0 else None
        # megatron-core's engine.suspend() runs a full gc.collect() at every release (delete_cuda_graphs, with or
        # without CUDA graphs), which walks every object of this process: Megatron's model, optimizer, Transformer
        # Engine and the engine itself. Moving what exists now into the permanent generation leaves each later
        # collection only what the steps allocate (vLLM's freeze_gc_heap does the same after its start-up).
        facts["gc_frozen_objects"] = freeze_heap()
        print(f"[megatron-inference] rank {self.rank}: engine ready ({m.mode} mode, KV pool {facts['kv_pool']})",
              flush=True)
        return EngineStarted(seconds=time.perf_counter() - t0, memory=self.memory(), eos_token_id=eos,
                             memory_before=before, facts=facts)

    def mg_sync(self, step: int, verify: bool = False) -> MegatronSynced:
        """After ``refit_offload``: the generating model gets the trainer's weights, then the engine resumes."""
        from rlc.runtime.generation import megatron_engine as E  # noqa: PLC0415

        st = self.mg
        t0 = time.perf_counter()
        self._params_back()
        moved, tensors, swap_s, report = 0, 0, None, None
        if st.mode == "dedicated":
            E.restore_weights(st.freed)
            st.freed = None
            megatron = self.cfg.generation.megatron
            if megatron is None:
                raise RuntimeError("mg_sync: runtime.yaml has no generation.megatron (compiled for vLLM)")
            swapped = E.swap(self.pm.model[0], st.inference_model, megatron.refit_backend)
            st.swaps += 1
            moved, tensors, swap_s = swapped["bytes"], swapped["num_tensors"], swapped["seconds"]
            if verify:
                report = E.verify_swap(self.pm.model[0], st.inference_model, resharded=E.resharded(self.cfg))
        else:
            # the engine's requests are scheduled per rank: a forward pre-hook that gathers parameters across
            # data-parallel ranks (overlap_param_gather) would wait on ranks that generate other requests
            hooked = [chunk for chunk in self.pm.model if getattr(chunk, "use_forward_hook", False)]
            if hooked and not st.hooks_off:
                for chunk in hooked:
                    chunk.disable_forward_pre_hook(param_sync=True)
                st.hooks_off = True
            for chunk in self.pm.model:
                chunk.eval()
        gen = self._gen_model()
        clear_model = gen if gen is not None else self.pm.model[0]
        E.clear_rotary_cache(clear_model)
        st.engine.resume()  # KV pool back; InferenceMode on
        st.awake = True
        torch.cuda.synchronize()
        return MegatronSynced(kind="megatron-swap" if st.mode == "dedicated" else "megatron-shared",
                              seconds=time.perf_counter() - t0, bytes=moved, num_tensors=tensors, memory=self.memory(),
                              step=step, swap_s=swap_s, verify=report)

    def mg_generate(self, prompt_token_ids: list[list[int]], n: int) -> Generated:
        """``n`` samples per prompt, with their logprobs."""
        from rlc.runtime.generation import megatron_engine as E  # noqa: PLC0415

        st = self.mg
        if not st.awake:
            raise RuntimeError(f"policy worker {self.rank}: mg_generate with the engine suspended (driver order bug: "
                               "the weight sync resumes it)")
        t0 = time.perf_counter()
        with torch.no_grad():
            samples = E.generate(st.engine, prompt_token_ids, n, self.cfg.generation.sampling,
                                 eos_token_id=st.tokenizer.eod if st.tokenizer.eod >= 0 else None,
                                 decode=st.tokenizer.detokenize)
        return Generated(samples=samples, seconds=time.perf_counter() - t0, memory=self.memory())

    def mg_release(self, step: int) -> Slept:
        """Before the trainer's passes: the engine suspends, the training model trains again, dedicated weights go."""
        from rlc.runtime.generation import megatron_engine as E  # noqa: PLC0415

        st = self.mg
        t0 = time.perf_counter()
        before = self.memory()
        st.engine.suspend()  # KV pool per generation.megatron.kv_cache; InferenceMode off
        st.awake = False
        E.clear_rotary_cache(self._gen_model())
        if st.mode == "dedicated":
            st.freed = E.free_weights(st.inference_model)
        else:
            for chunk in self.pm.model:
                chunk.train()
            if st.hooks_off:
                for chunk in self.pm.model:
                    if getattr(chunk, "use_forward_hook", False):
                        chunk.enable_forward_pre_hook()
                st.hooks_off = False
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        after = self.memory()
        return Slept(freed_gib=after.free_gib - before.free_gib, memory=after, memory_before=before,
                     seconds=time.perf_counter() - t0)

    def mg_named_tensors(self, names: list[str] | None = None, inference: bool = True) -> dict[str, torch.Tensor]:
        """CPU copies of the generating model's tensors (or the trainer's), for tests."""
        from rlc.runtime.generation import megatron_engine as E  # noqa: PLC0415

        model = self._gen_model() if inference else self.pm.model[0]
        return {n: t.detach().cpu().clone() for n, t in E.refit_tensors(model).items() if names is None or n in names}


__all__ = ["MegatronGenerationMixin"]
