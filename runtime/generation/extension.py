"""Methods injected into every vLLM worker (``LLM(worker_extension_cls=...)``), called through
``LLM.collective_rpc``: the refit consumer lives here, next to ``model_runner.model``.

vLLM refuses extension attributes that clash with its worker's, so every name starts with ``rlc_``.

FP8 rollouts (``generation.precision: fp8``): every load into the engine (the refit, and the reference load
of ``refit.verify_every``) runs inside vLLM's layerwise reload (``initialize_layerwise_reload`` /
``finalize_layerwise_reload``, what vLLM's own ``reload_weights`` does): each layer is rebuilt in its load
format, loaded, put through the quantization method's ``process_weights_after_loading`` (vLLM's quantization
of a bf16 weight with ``scales: tensor``; kernel layouts and fused-expert formats with ``scales: block``) and
copied into the parameters the engine holds. A layer is processed once all its tensors are in, possibly
buckets later, so the consumer hands ``load_weights`` a private copy of each bucket.

Fused expert transfer (``refit.fused_transfer``): at the first refit after pairing the worker builds the
direct-copy table from the producer's export list and the engine's fused MoE layers
(:mod:`rlc.runtime.refit.fused`); every later refit checks it against both before any byte moves. Tensors
the table does not cover go through ``load_weights`` as before. FP8 engines take no direct copies: their
loads run through the layerwise reload, which quantizes and re-lays out what it loads.

KV cache woken during the transfer (``refit.wake_kv_during_transfer``, with rlc's KV-only sleep): the worker announces
its KV cache's bytes when it pairs (the trainer plans its refit buffers without them) and maps the cache back in a
thread started when the producer's ``begin`` arrives, while the weights arrive; the refit returns once both are done.

Replayed load (``refit.replay_load``): the first refit after pairing runs ``load_weights`` with every copy it makes
recorded; every later refit checks the recorded table against the export list and the engine's parameters and
replays the copies, bucket by bucket, leaving to ``load_weights`` only the tensors it computes, converts or skips
(:mod:`rlc.runtime.refit.replay`). With fused expert transfer both apply: the fused tensors' direct copies first,
the rest replayed.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

from rlc.contract.fp8 import block_quantized, scale_name
from rlc.contract.refit_buffer import bf16_switch_applies
from rlc.runtime.generation.background import BackgroundCall
from rlc.runtime.refit.errors import RefitError


def _allocation_bytes(allocations: Iterable[Any]) -> int:
    """Bytes of vLLM sleep-mode allocations (their handle is ``(device, size, pointer, handle)``)."""
    return sum(int(d.handle[1]) for d in allocations)


class RlcWorkerExtension:
    """Refit consumer side inside a vLLM worker process (one per GPU of an engine)."""

    _rlc_consumer: Any  # rlc.runtime.refit.consumer.RefitConsumer once paired (rlc_refit_prepare), else None
    _rlc_routes: Any  # rlc.runtime.refit.fused.RouteTable after the first fused refit of a pairing, else None
    _rlc_replay_table: Any  # rlc.runtime.refit.replay.ReplayTable after the first replayed refit of a pairing

    model_runner: Any  # provided by the vLLM worker class this extends

    def rlc_device_uuid(self) -> str:
        import torch  # noqa: PLC0415

        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    def rlc_refit_prepare(self, session: str, transport: str, timeout_s: float = 600.0,
                          fp8_scales: str | None = None, fp8_pow2: bool = False,
                          fused: bool = False, replay: bool = False, wake_kv: bool = False,
                          fp8_keep: list[str] | None = None) -> dict[str, Any]:
        """Pair with the trainer rank on this GPU (it calls ``RefitProducer.prepare`` concurrently).

        ``fp8_scales`` / ``fp8_pow2``: ``generation.fp8`` of an FP8 engine (None: bf16 rollouts). With ``block``
        the trainer's quantized names are checked against the modules vLLM holds in FP8 before any transfer.
        ``fused``: ``refit.fused_transfer`` (direct copies into the fused expert parameters; bf16 engines).
        ``replay``: ``refit.replay_load`` (the first refit's copies recorded, replayed at every later one; bf16).
        ``wake_kv``: ``refit.wake_kv_during_transfer`` (the KV cache's bytes are announced to the trainer).
        ``fp8_keep``: ``generation.fp8.keep_bf16``, the layers the FP8 engine and the trainer keep unquantized."""
        import torch  # noqa: PLC0415

        from rlc.runtime.refit.consumer import RefitConsumer  # noqa: PLC0415 - torch and zmq: vLLM's workers have them

        consumer = getattr(self, "_rlc_consumer", None)
        if consumer is None:
            consumer = RefitConsumer(session=session, transport=transport, device=torch.cuda.current_device(),
                                     timeout_s=timeout_s)
            self._rlc_consumer = consumer
        kv_bytes = self._rlc_kv_cache_bytes() if wake_kv else 0
        specs = consumer.prepare(mapped_during_refit=kv_bytes)
        self._rlc_fp8_scales = fp8_scales
        self._rlc_fp8_pow2 = fp8_pow2
        self._rlc_fp8_keep = tuple(fp8_keep or ())
        self._rlc_fused = bool(fused) and fp8_scales is None
        self._rlc_routes = None  # built at the first refit after this pairing
        self._rlc_replay = bf16_switch_applies("replay_load", bool(replay), "fp8" if fp8_scales else "bf16")[0]
        self._rlc_replay_table = None  # recorded at the first refit after this pairing
        info: dict[str, Any] = {"device_key": consumer.device_key, "producer_rank": consumer.producer_rank,
                                "num_tensors": len(specs), "bytes": sum(s.nbytes for s in specs),
                                "fused_transfer": ("on" if self._rlc_fused else
                                                   "off: FP8 rollouts load through vLLM's layerwise reload"
                                                   if fused else "off"),
                                "replay_load": bf16_switch_applies("replay_load", bool(replay),
                                                                   "fp8" if fp8_scales else "bf16")[1],
                                "kv_cache_bytes_woken_during_transfer": kv_bytes}
        if fp8_scales == "block":
            from rlc.runtime.refit.fp8 import check_layout, fp8_module_names  # noqa: PLC0415

            model = self.model_runner.model
            fp8, every = fp8_module_names(model)
            report = check_layout([s.name for s in specs], fp8, every, getattr(model, "packed_modules_mapping", {}))
            info["fp8_layout"] = report.to_dict()
            if not report.ok:
                raise RefitError(f"{consumer.name}: {report.error_text()}")
        return info

    def rlc_refit_receive(self, wake_kv: bool = False) -> dict[str, Any]:
        """Receive one refit into the live model (``load_weights`` bucket by bucket); with ``wake_kv`` the KV cache
        of rlc's KV-only sleep is mapped back meanwhile (``refit.wake_kv_during_transfer``)."""
        waker = BackgroundCall(self._rlc_kv_waker(), "KV cache wake-up during the refit") if wake_kv else None
        try:
            metrics = self._rlc_receive(waker.start if waker is not None else None)
        except BaseException:
            if waker is not None:
                waker.join(raise_error=False)  # the refit's own error is the one to report
            raise
        if waker is not None:
            waited = waker.join()
            metrics["kv_wake"] = {"seconds": waker.seconds, "waited_after_transfer_s": waited}
        return metrics

    def _rlc_receive(self, on_begin: Any) -> dict[str, Any]:
        model = self.model_runner.model
        consumer = self._rlc_consumer

        def load(weights):
            model.load_weights(weights=weights)

        if getattr(self, "_rlc_fp8_scales", None) is None:
            if not (getattr(self, "_rlc_fused", False) or getattr(self, "_rlc_replay", False)):
                return consumer.receive(load, on_begin=on_begin).to_dict()
            return self._rlc_receive_direct(load, on_begin)
        with self._rlc_reload():
            metrics = consumer.receive(load, copy_buckets=True, on_begin=on_begin)
        return metrics.to_dict()

    def _rlc_kv_waker(self) -> Any:
        """What wakes the KV cache from a thread: vLLM's own ``wake_up(tags=["kv_cache"])`` of this worker (maps the
        cache back, re-initializes what a quantized cache needs), on this worker's GPU."""
        import torch  # noqa: PLC0415

        device = torch.cuda.current_device()

        def wake() -> None:
            torch.cuda.set_device(device)  # the current device is per thread
            self.wake_up(tags=["kv_cache"])  # type: ignore[attr-defined]  # vLLM's worker method
            torch.cuda.current_stream().synchronize()

        return wake

    def _rlc_kv_cache(self, switch: str) -> list[Any]:
        """This worker's KV cache allocations in vLLM's sleep-mode pool (tagged ``kv_cache``, mapped or not); none
        stops ``switch`` (engine started without sleep mode)."""
        from vllm.device_allocator.cumem import CuMemAllocator  # noqa: PLC0415

        found = [d for d in CuMemAllocator.get_instance().pointer_to_data.values() if d.tag == "kv_cache"]
        if not found:
            raise RefitError(f"{switch}: this vLLM worker holds no KV cache in its sleep-mode memory pool (engine "
                             "started without enable_sleep_mode?)")
        return found

    def _rlc_kv_cache_bytes(self) -> int:
        """Bytes of this worker's KV cache in vLLM's sleep-mode pool (mapped or not)."""
        return _allocation_bytes(self._rlc_kv_cache("refit.wake_kv_during_transfer"))

    def _rlc_receive_direct(self, load: Any, on_begin: Any = None) -> dict[str, Any]:
        """One refit with direct copies: into the fused expert parameters (``refit.fused_transfer``) and/or the
        replayed copies of vLLM's own loader (``refit.replay_load``); each table is built at the first refit of a
        pairing and checked at every later one, before any byte moves."""
        import time  # noqa: PLC0415

        from rlc.runtime.refit.fused import FusedLoader, build_routes, vllm_expert_destinations  # noqa: PLC0415
        from rlc.runtime.refit.replay import RecordingLoader, ReplayLoader  # noqa: PLC0415

        consumer = self._rlc_consumer
        model = self.model_runner.model
        t0 = time.perf_counter()
        rest: Any = load
        if self._rlc_replay:
            replay = self._rlc_replay_table
            if replay is None:
                rest = RecordingLoader(load, model)
            else:
                replay.check(consumer.expected, model)
                rest = ReplayLoader(load, replay)
        loader: Any = rest
        if self._rlc_fused:
            destinations = vllm_expert_destinations(model)
            table = self._rlc_routes
            if table is None:
                table = self._rlc_routes = build_routes(consumer.expected, destinations)
            else:
                table.check(consumer.expected, destinations)
            loader = FusedLoader(rest, table)
        table_s = time.perf_counter() - t0
        metrics = consumer.receive(loader, on_begin=on_begin).to_dict()
        if isinstance(loader, FusedLoader):
            metrics["fused"] = {**loader.stats.to_dict(), **loader.table.summary(), "table_s": table_s}
        if isinstance(rest, RecordingLoader):
            t1 = time.perf_counter()
            self._rlc_replay_table = rest.table(consumer.expected)
            metrics["replay"] = {"recorded": True, **self._rlc_replay_table.summary(),
                                 "record_s": time.perf_counter() - t1}
        elif isinstance(rest, ReplayLoader):
            metrics["replay"] = {"recorded": False, **rest.stats.to_dict(), **rest.table.summary(), "check_s": table_s}
        return metrics

    @contextlib.contextmanager
    def _rlc_reload(self) -> Iterator[None]:
        """vLLM's layerwise reload around a load (see the module docstring); the memory the rebuilt layers
        used goes back to the device at the end, for the trainer."""
        import torch  # noqa: PLC0415
        from vllm.model_executor.model_loader.reload import (  # noqa: PLC0415
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.model
        device = torch.device("cuda", torch.cuda.current_device())
        with torch.device(device):
            initialize_layerwise_reload(model)
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception), torch.device(device):
                finalize_layerwise_reload(model, self.model_runner.model_config)
            raise
        with torch.device(device):
            finalize_layerwise_reload(model, self.model_runner.model_config)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _rlc_reference(self, exported: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """What vLLM itself makes of the trainer's bf16 export: with block scales each projection quantized
        here by vLLM's own per-block function (one tensor at a time), else the bf16 tensors as they are
        (vLLM quantizes them as it loads)."""
        import torch  # noqa: PLC0415

        from rlc.runtime.refit.fp8 import block_quantizer  # noqa: PLC0415

        if getattr(self, "_rlc_fp8_scales", None) != "block":
            yield from exported
            return
        quantize = block_quantizer(bool(getattr(self, "_rlc_fp8_pow2", False)))
        self._rlc_reference_quantizer = quantize.source
        device = torch.device("cuda", torch.cuda.current_device())
        for name, tensor in exported:
            if block_quantized(name, tensor.dim(), getattr(self, "_rlc_fp8_keep", ())):
                with torch.no_grad():
                    q, s = quantize(tensor.to(device))
                yield name, q
                yield scale_name(name), s
            else:
                yield name, tensor

    def _rlc_reference_load(self, weights: Iterable[tuple[str, Any]]) -> Any:
        """``load_weights`` of the reference (:meth:`_rlc_reference` inside the layerwise reload for FP8)."""
        model = self.model_runner.model
        if getattr(self, "_rlc_fp8_scales", None) is None:
            return model.load_weights(weights=iter(weights))
        with self._rlc_reload():
            return model.load_weights(weights=self._rlc_reference(weights))

    def rlc_refit_verify(self, export_dir: str) -> dict[str, Any]:
        """``refit.verify_every``: compare every parameter, bit for bit, with vLLM's own load of the export the
        paired trainer rank writes to ``export_dir`` meanwhile, shard by shard (``rlc.runtime.refit.verify_stream``;
        ``rlc.runtime.refit.verify`` for the comparison). bf16 engines check each shard as it arrives (host memory:
        a shard, not the model); FP8 engines gather the shards and check once, inside vLLM's layerwise reload,
        which processes a layer only when all its tensors are in."""
        import torch  # noqa: PLC0415

        from rlc.runtime.refit.verify import compare_parameters  # noqa: PLC0415
        from rlc.runtime.refit.verify_stream import ShardFiles, check_streamed, gather_export_shards  # noqa: PLC0415

        model = self.model_runner.model
        rank = self._rlc_consumer.producer_rank
        files = ShardFiles(export_dir, rank)
        fp8 = getattr(self, "_rlc_fp8_scales", None)
        about = {"producer_rank": rank, "device_key": self._rlc_consumer.device_key, "fp8_scales": fp8}
        if fp8 is None:
            return {**about, "reference_quantizer": None, **check_streamed(model, files, self._rlc_reference_load)}
        exported = gather_export_shards(files)
        refitted = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        # FP8: vLLM's own quantization of the same bf16 weights, through the refit's load path
        loaded = self._rlc_reference_load(exported.items())
        torch.cuda.synchronize()
        reference = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        whole = compare_parameters(refitted, reference, loaded=set(loaded) if isinstance(loaded, set) else None)
        return {**about, "exported_tensors": len(exported),
                "reference_quantizer": getattr(self, "_rlc_reference_quantizer", None), **whole.to_dict()}

    def rlc_refit_verify_tensors(self, exported_by_device: dict[str, dict[str, Any]],
                                 param_names: list[str]) -> dict[str, Any]:
        """Spot check at any model size: reload this GPU's share of ``exported_by_device`` (GPU UUID ->
        the paired trainer rank's HF tensors) through ``load_weights`` and compare ``param_names`` with
        their values after the refit (``rlc.runtime.refit.verify.verify_by_reload``)."""
        from rlc.runtime.refit.verify import verify_by_reload  # noqa: PLC0415

        key = self.rlc_device_uuid()
        if key not in exported_by_device:
            raise KeyError(f"no exported tensors for this worker's GPU {key} (have {sorted(exported_by_device)})")
        if getattr(self, "_rlc_fp8_scales", None) is not None:
            raise RuntimeError("a spot check by reload needs every tensor of the layers it touches on an FP8 engine "
                               "(vLLM processes a layer once it is complete); use rlc_refit_verify")
        report = verify_by_reload(self.model_runner.model, exported_by_device[key], param_names)
        return {"device_key": key, **report}

    def rlc_sleep_kv_cache(self) -> int:
        """``refit.keep_weights_awake``: unmap this worker's KV cache (vLLM's sleep-mode allocations tagged
        ``kv_cache``) and keep the weights mapped; returns the bytes released. vLLM's own sleep has no such level:
        it releases every tag. The worker's ``wake_up(tags=["kv_cache"])`` maps the cache back (empty)."""
        import torch  # noqa: PLC0415
        from vllm.device_allocator.cumem import unmap_and_release  # noqa: PLC0415

        kv_cache = self._rlc_kv_cache("refit.keep_weights_awake")
        torch.cuda.synchronize()  # nothing in flight may still read or write the cache
        for data in kv_cache:
            unmap_and_release(data.handle)
        return _allocation_bytes(kv_cache)

    def rlc_refit_close(self) -> None:
        consumer = getattr(self, "_rlc_consumer", None)
        if consumer is not None:
            consumer.close()
            self._rlc_consumer = None

    def rlc_moe_layer_ids(self) -> dict[str, Any]:
        """Routing replay: the decoder layers whose MoE routes vLLM records (``recorded``), and every decoder
        layer with a fused MoE (``moe``); the MTP drafter's layers (ids from ``num_hidden_layers`` on) are not the
        decoder's and are left out."""
        from vllm.model_executor.layers.fused_moe.layer import FusedMoE  # noqa: PLC0415

        decoder_layers = int(self.model_runner.model_config.hf_text_config.num_hidden_layers)
        moe, recorded = set(), set()
        for module in self.model_runner.model.modules():
            if not isinstance(module, FusedMoE):
                continue
            layer = int(module.layer_id)
            if layer >= decoder_layers:
                continue
            moe.add(layer)
            if getattr(getattr(module, "router", None), "capture_fn", None) is not None:
                recorded.add(layer)
        return {"moe": sorted(moe), "recorded": sorted(recorded), "decoder_layers": decoder_layers}

    def rlc_named_parameters(self, names: list[str] | None = None) -> dict[str, Any]:
        """CPU copies of vLLM's parameters (tests: fp32 bias exactness, expert shards)."""
        out = {}
        for n, p in self.model_runner.model.named_parameters():
            if names is None or n in names:
                out[n] = p.detach().cpu().clone()
        return out
