"""The trainer side of a refit: what to export, the field-report fixes around the export, and the producer.

- ``conversion_tasks``: Megatron-Bridge's export plan for this rank, with the MTP-replicated
  ``embedding.word_embeddings.weight`` dropped on the last pipeline stage when
  ``refit.dedupe_mtp_embedding`` is on (NeMo-RL #2471, failure 1), then checked: every parameter must be
  owned by exactly one pipeline stage, else the refit stops with "present on multiple PP ranks".
- ``sync_params``: ``refit.sync_params_before_refit`` forces the distributed optimizer's deferred
  parameter all-gather (``overlap_param_gather``) before the export reads the weights (NeMo-RL #4086).
- ``offload`` / ``onload``: ``refit.offload_optimizer_for_refit`` moves optimizer state and gradient
  buffers to the CPU for the refit and back before the next training step (NeMo-RL #3490).
- ``RefitSource``: specs (a dry export pass, once), ``prepare`` with the consumer on this GPU,
  ``send`` every step through ``rlc.runtime.refit.RefitProducer``. fp32 parameters stay fp32 on the
  wire (``refit.fp32_params``; SkyRL #1816) because the producer's wire specs keep them.
- FP8 rollouts with block scales (``generation.fp8.scales: block``): ``send`` quantizes the export stream
  on this GPU with vLLM's own per-block function (``rlc.runtime.refit.fp8``) and the wire carries each
  projection as float8_e4m3fn plus its fp32 ``weight_scale_inv``. ``export`` stays the bf16 stream:
  ``refit.verify_every`` checks vLLM against vLLM's own quantization of exactly these bf16 weights.
- ``refit.fused_transfer``: each MoE layer's routed experts travel as two stacked tensors
  (``rlc.runtime.policy.fused_export``) and the rest as Bridge exports it; ``export`` stays Bridge's per-expert
  stream, which ``refit.verify_every`` and the spot checks compare against. Off for FP8 rollouts.
- ``refit.direct_export``: tensors Bridge's conversion only renames, slices or reorders by rows travel as views
  (or one row gather) of the trainer's parameters (``rlc.runtime.policy.direct_export``), found and checked
  against Bridge's export at ``prepare``; ``export`` stays Bridge's full stream. Off for FP8 rollouts. With
  ``refit.zero_copy_views`` the contiguous views are not packed: the vLLM worker maps their parameters' storage
  and reads them in place (``RefitProducer.prepare(zero_copy=)``); with ``refit.offload_params_for_generation``
  the mappings are closed at the end of every refit, so the offload frees the parameters' memory.
- FP8 training with ``training.fp8.param_gather`` (FP8 primary weights): Megatron-Bridge's export
  dequantizes every Transformer Engine FP8 parameter to its nominal dtype (``maybe_dequantize`` in each
  parameter mapping), so the exporter yields ``model.dtype`` weights either way and the refit quantizes
  them for FP8 rollouts (or sends them as they are) like any other.
"""
from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

from rlc.contract.fp8 import SCALE_SUFFIX
from rlc.contract.refit_buffer import bf16_switch_applies, fused_transfer_applies
from rlc.runtime.refit.fused_layout import parse_fused
from rlc.runtime.refit.specs import TensorSpec

if TYPE_CHECKING:
    from rlc.runtime.refit import RefitProducer

MTP_SHARED_EMBEDDING = "embedding.word_embeddings.weight"


class MultipleOwnersError(ValueError):
    """A parameter is exported by more than one pipeline stage (NeMo-RL #2471, failure 1)."""


def dedupe_mtp_embedding(tasks: list, *, pp_size: int, is_first_stage: bool, is_last_stage: bool) -> list[str]:
    """Drop this rank's copy of the MTP-replicated word embedding on the last PP stage.

    Megatron places the MTP block on the last stage and replicates the word embedding there when the
    model shares it with MTP; Bridge's conversion tasks then give both stage 0 and the last stage a
    ``param_weight``. Stage 0 stays the canonical owner. Returns the dropped names.
    """
    dropped: list[str] = []
    if pp_size <= 1 or not is_last_stage or is_first_stage:
        return dropped
    for t in tasks:
        if t is None or t.param_weight is None:
            continue
        if t.global_param_name.endswith(MTP_SHARED_EMBEDDING) or t.param_name.endswith(MTP_SHARED_EMBEDDING):
            # WeightConversionTask is a frozen dataclass
            object.__setattr__(t, "param_weight", None)
            object.__setattr__(t, "megatron_module", None)
            dropped.append(t.global_param_name)
    return dropped


def owned_names(tasks: Iterable) -> list[str]:
    return sorted({t.global_param_name for t in tasks if t is not None and t.param_weight is not None})


def find_multiple_owners(owned_by_stage: list[list[str]]) -> dict[str, list[int]]:
    """``{name: [stages]}`` for names owned by more than one pipeline stage (pure; CPU-tested)."""
    owners: dict[str, list[int]] = {}
    for stage, names in enumerate(owned_by_stage):
        for n in names:
            owners.setdefault(n, []).append(stage)
    return {n: s for n, s in owners.items() if len(s) > 1}


def check_single_owner(tasks: list) -> None:
    """All-gather the owned names over the PP group; a name owned twice stops the refit."""
    from megatron.core import parallel_state  # noqa: PLC0415

    if parallel_state.get_pipeline_model_parallel_world_size() <= 1:
        return
    group = parallel_state.get_pipeline_model_parallel_group()
    gathered: list[list[str]] = [None] * torch.distributed.get_world_size(group)  # type: ignore[list-item]
    torch.distributed.all_gather_object(gathered, owned_names(tasks), group=group)
    dup = find_multiple_owners(gathered)
    if dup:
        raise multiple_owners_error(dup)


def multiple_owners_error(dup: dict[str, list[int]]) -> MultipleOwnersError:
    """The error for parameters owned by several pipeline stages (``find_multiple_owners``'s result)."""
    text = ", ".join(f"{n} on PP ranks {s}" for n, s in sorted(dup.items())[:4])
    return MultipleOwnersError(
        f"Object present on multiple PP ranks: {text}. The MTP block shares the word embedding "
        "and Megatron replicates it on the last pipeline stage (NeMo-RL #2471, failure 1); turn on "
        "refit.dedupe_mtp_embedding so that stage 0 is the only owner"
    )


def sync_params(model: list, ddp_config: Any) -> bool:
    """Force the deferred parameter all-gather of the distributed optimizer (NeMo-RL #4086).

    With ``overlap_param_gather`` the updated shards are gathered only in the next forward's
    pre-hooks; a refit between the optimizer step and that forward would read stale weights of the
    other DP ranks' shards. Returns True when a gather ran (a no-op otherwise).
    """
    if not (ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather):
        return False
    with torch.no_grad():
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    torch.cuda.synchronize()
    return True


def offload(model: list, optimizer: Any) -> None:
    """Optimizer state and gradient buffers to the CPU (NeMo-RL #3490), then release the cached blocks."""
    torch.cuda.synchronize()
    optimizer.offload_to_cpu()
    for chunk in model:
        chunk.offload_grad_buffers(synchronize=True, empty_cache=False)
    torch.cuda.empty_cache()


def onload(model: list, optimizer: Any) -> None:
    """Inverse of ``offload`` (gradient buffers come back zeroed)."""
    for chunk in model:
        chunk.restore_grad_buffers(synchronize=True)
    optimizer.restore_from_cpu()
    torch.cuda.synchronize()


class RefitSource:
    """Exports this rank's HF weights and streams them to the generation worker on the same GPU."""

    def __init__(self, bridge: Any, model: list, cfg: Any, *, session: str, local_rank: int, local_world: int) -> None:
        from megatron.core import parallel_state  # noqa: PLC0415

        self.bridge = bridge
        self.model = model
        self.cfg = cfg
        self.session = session
        self.local_rank = local_rank
        self.local_world = local_world
        self.producer: RefitProducer | None = None
        self.specs: list = []
        self.dropped: list[str] = []
        gen = cfg.generation
        self.block_fp8 = gen.precision == "fp8" and gen.fp8.scales == "block"
        self.quantizer: Any = None
        self.keep_bf16 = tuple(gen.fp8.keep_bf16)  # layers the FP8 engine keeps in the model dtype
        if self.block_fp8:
            from rlc.runtime.refit.fp8 import block_quantizer  # noqa: PLC0415

            self.quantizer = block_quantizer(gen.fp8.pow2_scales)
        self.fused_wanted, self.fused_reason = fused_transfer_applies(bool(cfg.refit.fused_transfer), gen.precision)
        self.fused: Any = None  # rlc.runtime.policy.fused_export.FusedExport once prepared with stacked layers
        self.direct_wanted, self.direct_reason = bf16_switch_applies("direct_export", bool(cfg.refit.direct_export),
                                                                     gen.precision)
        self.direct: Any = None  # rlc.runtime.policy.direct_export.DirectExport once prepared with direct tensors
        self.zero_copy_wanted, self.zero_copy_reason = bf16_switch_applies(
            "zero_copy_views", bool(cfg.refit.zero_copy_views), gen.precision)
        self.zero_copy_experts = bf16_switch_applies("zero_copy_experts", bool(cfg.refit.zero_copy_experts),
                                                     gen.precision)[0]
        self.tasks = bridge.get_conversion_tasks(model)
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if cfg.refit.dedupe_mtp_embedding:
            self.dropped = dedupe_mtp_embedding(
                self.tasks,
                pp_size=pp,
                is_first_stage=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
                is_last_stage=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            )
            for name in self.dropped:  # the line the field report grepped for, one per dropped copy
                print(
                    f"[mtp-shared-embed-skip] rank {torch.distributed.get_rank()} pp_rank "
                    f"{parallel_state.get_pipeline_model_parallel_rank()}/{pp}: dropped {name}",
                    flush=True,
                )
        check_single_owner(self.tasks)

    def export(self):
        """Bridge's streaming HF export (full tensors on every rank, on the GPU)."""
        return self._bridge_export(self.tasks)

    def _bridge_export(self, tasks: list):
        """Megatron-Bridge's export of ``tasks``, without its LoRA-adapter merge. With the merge on (Bridge's
        default) every call walks every parameter of the model looking for adapters (and all-gathers what it
        found over the pipeline group), and the walk's cache lives on a bridge object Bridge builds anew per call:
        the cost grows with the model's parameter count (a MoE's per-expert grouped-GEMM weights), not with the
        tensors asked for. The trainer has no adapters; without them the flag changes nothing in the export
        (Megatron-Bridge 0.6: it only gates the adapter collection and a rename of adapter-wrapped names)."""
        return self.bridge.export_hf_weights(self.model, cpu=False, show_progress=False, conversion_tasks=tasks,
                                             merge_adapter_weights=False)

    def dry_specs(self) -> list:
        """The export list (name, shape, dtype in stream order), from one pass over Bridge's export; with FP8 block
        scales, the list the quantized stream yields (``rlc.runtime.refit.fp8.quantized_specs``); with fused
        transfer, one layer's stacked experts checked against Bridge's per-expert tensors; with direct export,
        every tensor's source found (and the rest of Bridge's export checked by a second pass)."""
        fused = self._fused_discovery() if self.fused_wanted else None
        finder = self._direct_finder() if self.direct_wanted else None
        bridge_specs = []
        for name, tensor in self.export():
            bridge_specs.append(TensorSpec.from_tensor(name, tensor))
            if fused is not None:
                fused.observe(name, tensor)
            if finder is not None:
                finder.observe(name, tensor)
            del tensor
        specs, tasks = bridge_specs, self.tasks
        if fused is not None:
            self.fused, self.fused_reason = fused.finish(self.tasks, bridge_specs, self.fused_reason)
            if self.fused is not None:
                specs, tasks = self.fused.wire_specs(bridge_specs), self.fused.bridge_tasks
        if finder is not None:
            specs = self._plan_direct(finder, tasks, specs)
        if self.block_fp8:
            from rlc.runtime.refit.fp8 import quantized_specs  # noqa: PLC0415

            specs = quantized_specs(specs, self.keep_bf16)
        return specs

    def _plan_direct(self, finder: Any, tasks: list, specs: list) -> list:
        """Choose the direct tensors; a second pass checks that Bridge's export of the remaining tasks yields exactly
        the other tensors (else Bridge keeps everything, and the reason says why). Returns the export list."""
        from rlc.runtime.policy.direct_export import DirectExportError  # noqa: PLC0415

        direct = finder.plan(tasks, specs)
        if not direct.sources:
            self.direct_reason = "off: no tensor of Bridge's export is a view or rows of a parameter (" + (
                "; ".join(f"{k}: {v}" for k, v in sorted(direct.refused.items())[:3]) or "nothing exported") + ")"
            return specs
        try:
            direct.check_rest(specs, (name for name, _ in self._rest_stream(direct.bridge_tasks)))
        except DirectExportError as exc:
            self.direct_reason = f"off: {exc}"
            return specs
        self.direct = direct
        return direct.wire_specs(specs)

    def _fused_discovery(self) -> Any:
        """The fused transfer's part of the listing pass (``rlc.runtime.policy.fused_export.FusedDiscovery``)."""
        from megatron.core import parallel_state  # noqa: PLC0415

        from rlc.runtime.policy.fused_export import FusedDiscovery  # noqa: PLC0415

        return FusedDiscovery(self.model, etp=parallel_state.get_expert_tensor_parallel_world_size(),
                              pp=parallel_state.get_pipeline_model_parallel_world_size())

    def _direct_finder(self) -> Any:
        """The direct export's part of the listing pass, or None (and the reason) where the layout rules it out."""
        from megatron.core import parallel_state  # noqa: PLC0415

        from rlc.runtime.policy.direct_export import DirectFinder, ParamsByStorage, why_not_direct  # noqa: PLC0415

        why = why_not_direct(tp=parallel_state.get_tensor_model_parallel_world_size(),
                             pp=parallel_state.get_pipeline_model_parallel_world_size())
        if why is not None:
            self.direct_reason = f"off: {why}"
            return None
        params = ParamsByStorage(p for chunk in self.model for p in chunk.parameters())
        return DirectFinder(self.tasks, params, skip_experts=parallel_state.get_expert_model_parallel_world_size() > 1)

    def stream(self):
        """What a refit sends: the export, block-quantized for FP8 rollouts with block scales; otherwise the direct
        tensors (``refit.direct_export``), then Bridge's export of the remaining tasks, then the stacked layers'
        experts (``refit.fused_transfer``)."""
        if self.block_fp8:
            from rlc.runtime.refit.fp8 import quantize_export  # noqa: PLC0415

            return quantize_export(self.export(), self.quantizer, keep=self.keep_bf16)
        if self.fused is None and self.direct is None:
            return self.export()
        tasks = self.direct.bridge_tasks if self.direct is not None else self.fused.bridge_tasks
        rest = self._rest_stream(tasks)
        return itertools.chain(self.direct.stream(), rest) if self.direct is not None else rest

    def _rest_stream(self, tasks: list):
        """Bridge's export of ``tasks``, then the stacked layers' experts with fused transfer."""
        bridge = self._bridge_export(tasks)
        return self.fused.stream(bridge) if self.fused is not None else bridge

    def prepare(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Compute the specs and pair with the consumer (which must call prepare at the same time)."""
        from rlc.runtime.refit.producer import RefitProducer  # noqa: PLC0415 - zmq: the refit's transport

        t0 = time.perf_counter()
        self.specs = self.dry_specs()
        if self.producer is None:
            self.producer = RefitProducer(
                self.cfg.refit,
                session=self.session,
                rank=self.local_rank,
                world_size=self.local_world,
                export_dtype=self.cfg.model.dtype,
                device=torch.cuda.current_device(),
                timeout_s=timeout_s,
                extra_fp32_params=["*" + SCALE_SUFFIX] if self.block_fp8 else (),
                keep_shared_storages=not self.cfg.refit.offload_params_for_generation,
            )
        producer = self.producer
        producer.prepare(self.specs, zero_copy=self._zero_copy_names())
        return {
            "num_tensors": len(self.specs),
            "bytes": sum(s.nbytes for s in self.specs),
            "dropped_mtp_duplicates": self.dropped,
            "prepare_s": time.perf_counter() - t0,
            "device_key": producer.device_key,
            "fp8_quantizer": self.quantizer.source if self.quantizer is not None else None,
            "fused_transfer": {"on": self.fused is not None, "reason": self.fused_reason,
                               **(self.fused.summary() if self.fused is not None else {})},
            "direct_export": {"on": self.direct is not None, "reason": self.direct_reason,
                              **(self.direct.summary() if self.direct is not None else {})},
            "zero_copy_views": {"on": bool(producer.zero_copy_names), "reason": self.zero_copy_reason,
                                "tensors": len(producer.zero_copy_names),
                                "stacks": sum(parse_fused(n) is not None for n in producer.zero_copy_names)},
        }

    def _zero_copy_names(self) -> list[str]:
        """What the vLLM worker reads in place (``refit.zero_copy_views``): the direct export's contiguous views, and
        with ``refit.zero_copy_experts`` the fused transfer's stacked layers whose experts are contiguous parameters
        on this rank."""
        if not self.zero_copy_wanted:
            return []
        if self.direct is None:
            self.zero_copy_reason = "off: the direct export is off (" + self.direct_reason + ")"
            return []
        stacks = self.fused.in_place_stacks() if self.fused is not None and self.zero_copy_experts else []
        return self.direct.in_place_views() + stacks

    def send(self) -> dict[str, Any]:
        if self.producer is None:
            raise RuntimeError("RefitSource.send before prepare")
        return self.producer.send(self.stream()).to_dict()

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None
