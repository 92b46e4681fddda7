"""Methods injected into every vLLM worker (``LLM(worker_extension_cls=...)``), called through
``LLM.collective_rpc``: the refit consumer lives here, next to ``model_runner.model``.

vLLM refuses extension attributes that clash with its worker's, so every name starts with ``rlc_``.
"""
from __future__ import annotations

from typing import Any


class RlcWorkerExtension:
    """Refit consumer side inside a vLLM worker process (one per GPU of an engine)."""

    model_runner: Any  # provided by the vLLM worker class this extends

    def rlc_device_uuid(self) -> str:
        import torch  # noqa: PLC0415

        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    def rlc_refit_prepare(self, session: str, transport: str, timeout_s: float = 600.0) -> dict[str, Any]:
        """Pair with the trainer rank on this GPU (it calls ``RefitProducer.prepare`` concurrently)."""
        import torch  # noqa: PLC0415

        from rlc.runtime.refit import RefitConsumer  # noqa: PLC0415

        consumer = getattr(self, "_rlc_consumer", None)
        if consumer is None:
            consumer = RefitConsumer(session=session, transport=transport, device=torch.cuda.current_device(),
                                     timeout_s=timeout_s)
            self._rlc_consumer = consumer
        specs = consumer.prepare()
        return {"device_key": consumer.device_key, "producer_rank": consumer.producer_rank,
                "num_tensors": len(specs), "bytes": sum(s.nbytes for s in specs)}

    def rlc_refit_receive(self) -> dict[str, Any]:
        """Receive one refit into the live model (``load_weights`` bucket by bucket)."""
        model = self.model_runner.model
        consumer = self._rlc_consumer

        def load(weights):
            model.load_weights(weights=weights)

        return consumer.receive(load).to_dict()

    def rlc_refit_verify(self, export_dir: str) -> dict[str, Any]:
        """``refit.verify_every``: compare every parameter, bit for bit, with vLLM's own load of the
        export the paired trainer rank wrote to ``export_dir`` (see ``rlc.runtime.refit.verify``)."""
        import os  # noqa: PLC0415

        import torch  # noqa: PLC0415

        from rlc.runtime.refit.verify import compare_parameters  # noqa: PLC0415

        model = self.model_runner.model
        rank = self._rlc_consumer.producer_rank
        path = os.path.join(export_dir, f"export-rank{rank}.pt")
        exported = torch.load(path, map_location="cpu", weights_only=True)
        refitted = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        loaded = model.load_weights(weights=iter(exported.items()))
        torch.cuda.synchronize()
        reference = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        report = compare_parameters(refitted, reference, loaded=set(loaded) if isinstance(loaded, set) else None)
        try:
            os.remove(path)
        except FileNotFoundError:  # another worker of a TP group paired with the same rank removed it
            pass
        return {"producer_rank": rank, "device_key": self._rlc_consumer.device_key,
                "exported_tensors": len(exported), **report.to_dict()}

    def rlc_refit_verify_tensors(self, exported_by_device: dict[str, dict[str, Any]],
                                 param_names: list[str]) -> dict[str, Any]:
        """Spot check at any model size: reload this GPU's share of ``exported_by_device`` (GPU UUID ->
        the paired trainer rank's HF tensors) through ``load_weights`` and compare ``param_names`` with
        their values after the refit (``rlc.runtime.refit.verify.verify_by_reload``)."""
        from rlc.runtime.refit.verify import verify_by_reload  # noqa: PLC0415

        key = self.rlc_device_uuid()
        if key not in exported_by_device:
            raise KeyError(f"no exported tensors for this worker's GPU {key} (have {sorted(exported_by_device)})")
        report = verify_by_reload(self.model_runner.model, exported_by_device[key], param_names)
        return {"device_key": key, **report}

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
