"""The Megatron policy worker: one per GPU, a Ray actor colocated with a vLLM worker.

Lifecycle (driven by ``rlc.runtime.driver``)::

    w = MegatronPolicyWorker(cfg_dict, rank, world_size, bundle)     # cheap; no GPU work yet
    addr = w.master_address()                                        # rank 0 only
    w.setup(addr)               # NCCL, process groups, AutoBridge model, DDP, optimizer
    w.refit_prepare(session)    # with the vLLM worker on this GPU calling refit_prepare too
    loop: w.compute_logprobs(batch) [-> w.compute_ref_logprobs(batch)] -> w.train_step(batch, step)
          -> w.refit_offload() -> w.refit_send()
          [-> w.offload_params() while vLLM generates -> w.onload_params()]  refit.offload_params_for_generation

Every method the driver calls is one of ``rlc.runtime.worker_api.PolicyWorkerApi`` and answers with its
frozen dataclasses (or CPU tensors), so the driver never needs megatron.
"""
from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Iterator

import torch

from rlc.contract.files import parse_json, read_text_capped
from rlc.contract.runtime_config import runtime_config_from_dict
from rlc.contract.sampling_truncation import Truncation
from rlc.contract.sequence_packing import pad_multiples
from rlc.runtime.gc_heap import freeze_heap
from rlc.runtime.policy import batches as B
from rlc.runtime.policy.megatron_generation import MegatronGenerationMixin
from rlc.runtime.policy.routes import micro_batch_routes
from rlc.runtime.worker_api import (CheckpointIO, ExportWritten, Memory, Offloaded, ParamsMoved, PolicyWorkerApi,
                                    RankCoords, RefitSent, ReplayCheck, TrainBatch, TrainStepResult, WorkerInfo)
from rlc.runtime.workers import gpu_memory_snapshot, library_versions, local_worker_info

if TYPE_CHECKING:
    from rlc.runtime.policy.megatron_setup import PolicyModel
    from rlc.runtime.policy.refit_source import RefitSource
    from rlc.runtime.policy.router_replay import ReplayRouters


def _scored(logits: torch.Tensor, targets: torch.Tensor, truncation: Truncation | None) -> torch.Tensor:
    """Logprob of each target under fp32 ``logits`` ``[..., V/TP]`` (vocab-parallel over TP), shaped as ``targets``:
    under the rollout engine's cuts when ``truncation`` applies (``rlc.runtime.policy.truncated_logprobs``)."""
    if truncation is None or not truncation.active:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: PLC0415

        return -vocab_parallel_cross_entropy(logits.contiguous(), targets.contiguous())
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    from rlc.runtime.policy.truncated_logprobs import truncated_logprobs  # noqa: PLC0415

    flat = truncated_logprobs(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), truncation,
                              ps.get_tensor_model_parallel_group())
    return flat.view(targets.shape)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                   truncation: Truncation | None = None) -> torch.Tensor:
    """Logprob of ``tokens[:, j+1]`` under ``logits[:, j]`` (vocab-parallel over TP): ``[b, L-1]``; with
    ``truncation``, under the rollout engine's cuts (``-inf`` where they leave the token out)."""
    lg = logits[:, :-1, :].float()
    if temperature != 1.0:
        lg = lg / temperature
    return _scored(lg, tokens[:, 1:], truncation)


def packed_token_logprobs(logits: torch.Tensor, mb: dict, temperature: float, cp_group: Any = None,
                          truncation: Truncation | None = None) -> torch.Tensor:
    """Logprobs of a packed micro batch (``rlc.runtime.policy.packing``) in the rollout layout ``[k, L-1]``.

    ``logits`` ``[1, T/CP, V/TP]`` are this rank's share of the packed row; each position is scored
    against its label (the next token of the same sequence), the CP ranks' scores are gathered into
    packed order, and :func:`~rlc.runtime.policy.packing.unpack` puts them back per row.
    """
    from rlc.runtime.policy.packing import gather_context_parallel, unpack  # noqa: PLC0415

    lg = logits.float()
    if temperature != 1.0:
        lg = lg / temperature
    dev = lg.device
    lp = _scored(lg, mb["labels"].to(dev), truncation)[0]
    if "cp_restore" in mb:
        lp = gather_context_parallel(lp, cp_group)[mb["cp_restore"].to(dev)]
    return unpack(lp, mb["unpack_index"].to(dev), mb["unpack_valid"].to(dev))


class MegatronPolicyWorker(MegatronGenerationMixin):
    """Megatron-Bridge model + megatron-core optimizer on one GPU (see the module docstring); with
    ``generation.backend: megatron`` also megatron-core's inference engine (``MegatronGenerationMixin``)."""

    def __init__(self, cfg_dict: dict, rank: int, world_size: int, bundle: int = -1) -> None:
        self.cfg = runtime_config_from_dict(cfg_dict)
        self.rank = rank
        self.world_size = world_size
        self.bundle = bundle
        self._pm: PolicyModel | None = None
        self.source: RefitSource | None = None
        self.offloaded = False  # optimizer state + grads in host memory (refit_offload)
        self.params_offloaded = False  # bf16 parameter buffers in host memory (offload_params)
        self.opt_steps = 0
        self.total_opt_steps = 1
        self.pack_calls = 0  # packed passes planned so far (seeds the packing alike on every rank)
        self.last_reference_swap: dict = {}  # training.offload_reference_policy: the last pass's swap
        self._replay: ReplayRouters | None = None  # training.router_replay
        self._replay_layers: list[int] = []
        self._replay_stats: dict[str, int] = {}

    @property
    def pm(self) -> PolicyModel:
        """Model, optimizer and bridge; a call before ``setup`` is a driver bug and says so."""
        if self._pm is None:
            raise RuntimeError(f"policy worker {self.rank}: used before setup()")
        return self._pm

    # ------------------------------------------------------------------ identity / setup

    def info(self) -> WorkerInfo:
        return local_worker_info("policy", self.rank, self.bundle)

    def master_address(self) -> tuple[str, int]:
        """This node's IP and a free port for the NCCL rendezvous (called on rank 0)."""
        try:
            import ray  # noqa: PLC0415

            ip = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001
            ip = socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ip, port

    def setup(self, master: tuple[str, int], total_opt_steps: int) -> RankCoords:
        """Process groups, model, optimizer. Returns this rank's parallel coordinates."""
        from megatron.core import parallel_state as ps  # noqa: PLC0415

        from rlc.runtime.policy.megatron_setup import build_policy, init_distributed, init_model_parallel  # noqa: PLC0415

        t0 = time.perf_counter()
        if self.cfg.train_parallel.cp > 1 and not self.cfg.training.sequence_packing.enabled:
            raise NotImplementedError(
                "train_parallel.cp > 1: this runtime splits sequences over context-parallel ranks only in packed "
                "micro batches; set training.sequence_packing.enabled: true (or cp: 1)"
            )
        init_distributed(self.rank, self.world_size, master[0], master[1])
        init_model_parallel(self.cfg.train_parallel, self.cfg.training.seed)
        torch.manual_seed(self.cfg.training.seed)
        self._pm = build_policy(self.cfg)
        if self.cfg.training.sequence_packing.enabled and self.cfg.model.mtp_num_layers:
            from rlc.runtime.policy import packed_roll  # noqa: PLC0415

            packed_roll.install()  # the MTP block's shift of a packed row, whole-row instead of per sequence
        self.total_opt_steps = max(1, int(total_opt_steps))
        self.coords = {
            "rank": self.rank,
            "dp_rank": ps.get_data_parallel_rank(),
            "dp_size": ps.get_data_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "cp_rank": ps.get_context_parallel_rank(),
            "is_last_stage": ps.is_pipeline_last_stage(ignore_virtual=True),
        }
        # one output rank per data-parallel rank: the CP ranks of a micro batch gather the same logprobs
        self.coords["is_output"] = bool(self.coords["is_last_stage"] and self.coords["tp_rank"] == 0
                                        and self.coords["cp_rank"] == 0)
        if self.cfg.training.router_replay.enabled:
            self._setup_router_replay()
        n_params = sum(p.numel() for m in self.pm.model for p in m.parameters())
        frozen = freeze_heap()  # the model, optimizer and libraries just built: later collections skip them
        return RankCoords(**self.coords, params_local=int(n_params), setup_s=time.perf_counter() - t0,
                          memory=self.memory(), gc_frozen_objects=frozen)

    def memory(self) -> Memory:
        return gpu_memory_snapshot()

    # ------------------------------------------------------------------ routing replay

    def _setup_router_replay(self) -> None:
        """``training.router_replay``: the model's MoE decoder layers (every pipeline stage's, gathered) and the
        replay of this rank's routers."""
        from megatron.core import parallel_state as ps  # noqa: PLC0415

        from rlc.runtime.policy.router_replay import ReplayRouters, local_moe_layers  # noqa: PLC0415

        provider = self.pm.provider
        if getattr(provider, "moe_router_fusion", False):
            raise ValueError("training.router_replay: megatron-core's fused router (moe_router_fusion) routes without "
                             "the replay; recompile without training.megatron_kwargs.moe_router_fusion")
        stages: list[list[int] | None] = [None] * ps.get_pipeline_model_parallel_world_size()
        torch.distributed.all_gather_object(stages, local_moe_layers(self.pm.model),
                                            group=ps.get_pipeline_model_parallel_group())
        self._replay_layers = sorted({layer for stage in stages for layer in (stage or [])})
        recompute_modules = getattr(provider, "recompute_modules", None) or []
        keep = provider.recompute_granularity == "full" or (provider.recompute_granularity == "selective"
                                                             and "moe" in recompute_modules)
        sp = bool(getattr(provider, "sequence_parallel", False)) and self.cfg.train_parallel.tp > 1
        self._replay = ReplayRouters(self._replay_layers, num_experts=self.cfg.model.num_experts,
                                     keep_for_recompute=keep, sp_rank=self.coords["tp_rank"] if sp else 0,
                                     sp_size=self.cfg.train_parallel.tp if sp else 1,
                                     check=getattr(provider, "moe_expert_capacity_factor", None) is None)

    def router_replay_layers(self) -> list[int]:
        """The model's MoE decoder layers (0-based), the order of the routes' M axis."""
        return list(self._replay_layers)

    def router_replay_check(self) -> ReplayCheck:
        """The routing the routers returned in the logprob passes since the last call vs. the replayed routes."""
        stats = {"routes_checked": 0, "routes_mismatched": 0, "layers_unarmed": 0, **self._replay_stats}
        self._replay_stats = {}
        return ReplayCheck(**stats)

    def versions(self) -> dict:
        return library_versions()

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(self, *args, **kwargs)`` in this worker (tests and debugging)."""
        return fn(self, *args, **kwargs)

    # ------------------------------------------------------------------ forward passes

    def _seq_len(self, batch: dict) -> int:
        return int(batch["tokens"].shape[1])

    def _run(self, model: list, mbs: list[dict], forward_only: bool, loss_fn: Any) -> list:
        """One megatron-core forward(-backward) over micro-batches ``mbs``; returns the collected data.

        A packed micro batch (``cu_seqlens`` in it, ``rlc.runtime.policy.packing``) runs through
        Megatron's packed-sequence path; a padded one with its positions from 0 and no mask (causal).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415

        seq_len = max(int(mb.get("seq_length", mb["tokens"].shape[1])) for mb in mbs)
        mb_size = int(mbs[0]["tokens"].shape[0])

        replay = self._replay

        def forward_step(data_iterator, model_chunk):
            mb = next(data_iterator)
            tokens = mb["tokens"].cuda(non_blocking=True)
            if replay is not None:
                routes = micro_batch_routes(mb, num_experts=self.cfg.model.num_experts,
                                            cp_size=self.cfg.train_parallel.cp, cp_rank=self.coords["cp_rank"])
                replay.arm(model_chunk, routes, int(tokens.shape[1]))
            if "cu_seqlens" in mb:
                from megatron.core.packed_seq_params import PackedSeqParams  # noqa: PLC0415

                cu = mb["cu_seqlens"].cuda(non_blocking=True)
                packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                         cu_seqlens_kv_padded=cu, max_seqlen_q=int(mb["max_seqlen"]),
                                         max_seqlen_kv=int(mb["max_seqlen"]), total_tokens=int(tokens.shape[1]))
                out = model_chunk(input_ids=tokens, position_ids=mb["position_ids"].cuda(non_blocking=True),
                                  attention_mask=None, packed_seq_params=packed)
            else:
                pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
                out = model_chunk(input_ids=tokens, position_ids=pos, attention_mask=None)
            if replay is not None:
                replay.after_forward(model_chunk, forward_only)
            return out, partial(loss_fn, mb, tokens)

        iters = [iter(mbs) for _ in model] if len(model) > 1 else iter(mbs)
        fb = get_forward_backward_func()
        if replay is not None:
            replay.clear(model)  # nothing left armed by a pass that stopped (callers clear after each pass)
        return fb(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=model if len(model) > 1 else model[0],
            num_microbatches=len(mbs),
            seq_length=seq_len,
            micro_batch_size=mb_size,
            forward_only=forward_only,
            collect_non_loss_data=forward_only,
        )

    def _packing(self) -> bool:
        return bool(self.cfg.training.sequence_packing.enabled)

    def _packed_microbatches(self, batch: dict, rows: tuple[int, int] | None, budget: int,
                             budget_key: str) -> list[dict]:
        """This rank's packed micro batches of rows ``rows = (lo, hi)`` of its DP shard (all rows when None).

        Every rank plans the bins of every data-parallel shard from the whole batch's lengths, so the
        ranks agree on the number of micro batches without communicating; the ranks of one shard
        (TP, PP, CP) plan identical bins.
        """
        from rlc.runtime.policy import packing as P  # noqa: PLC0415

        cfg = self.cfg
        tp, t = cfg.train_parallel, cfg.training
        dp, dp_rank = self.coords["dp_size"], self.coords["dp_rank"]
        pad = pad_multiples(tp=tp.tp, sequence_parallel=tp.sequence_parallel, cp=tp.cp,
                            fp8_recipe=t.fp8.recipe if t.fp8.enabled else None)
        shards = [B.dp_shard(batch, d, dp) for d in range(dp)]
        if rows is not None:
            shards = [B.take(sh, rows[0], rows[1]) for sh in shards]
        self.pack_calls += 1  # the same on every rank: seeds first_fit_shuffle alike everywhere
        bins = P.plan_bins([P.sequence_lengths(sh) for sh in shards], dp_rank, budget, t.sequence_packing.algorithm,
                           pad, seed=t.seed * 1_000_003 + self.pack_calls, common_length=tp.pp > 1,
                           count_multiple=tp.pp if tp.vpp > 1 else 1, budget_key=budget_key)
        cp_rank = self.coords["cp_rank"]
        mbs = P.packed_microbatches(shards[dp_rank], bins, cp_size=tp.cp, cp_rank=cp_rank)
        return [{**mb, "seq_length": b.total} for mb, b in zip(mbs, bins)]

    @torch.no_grad()
    def _logprobs(self, model: list, batch: dict, truncation: Truncation | None) -> torch.Tensor | None:
        """Trainer logprobs ``[n_local, L-1]`` of this DP shard (on output ranks; None elsewhere), under the rollout
        engine's cuts with ``truncation``."""
        temperature = self.cfg.generation.sampling.temperature
        if self._packing():
            from megatron.core import parallel_state as ps  # noqa: PLC0415

            sp = self.cfg.training.sequence_packing
            mbs = self._packed_microbatches(batch, None, sp.logprob_mb_tokens,
                                            "training.sequence_packing.logprob_mb_tokens")
            cp_group = ps.get_context_parallel_group() if self.cfg.train_parallel.cp > 1 else None

            def lp_fn(mb, tokens, output_tensor, non_loss_data=True):
                n = mb["num_real"]
                lp = packed_token_logprobs(output_tensor, mb, temperature, cp_group, truncation)
                return mb["rows"][:n], lp[:n].float().cpu()
        else:
            shard = B.dp_shard(batch, self.coords["dp_rank"], self.coords["dp_size"])
            mbs = B.microbatches(shard, self.cfg.training.logprob_batch_size)

            def lp_fn(mb, tokens, output_tensor, non_loss_data=True):
                return token_logprobs(output_tensor, tokens, temperature, truncation)[: mb["num_real"]].float().cpu()

        for m in model:
            m.eval()
        if self._replay is not None:
            self._replay.start_check()
        out = self._run(model, mbs, forward_only=True, loss_fn=lp_fn)
        if self._replay is not None:
            self._replay.clear(model)
            for k, v in self._replay.stop_check().items():
                self._replay_stats[k] = self._replay_stats.get(k, 0) + v
        for m in model:
            m.train()
        if not self.coords["is_output"]:
            return None
        if not self._packing():
            return torch.cat(list(out), dim=0)
        n_local = B.batch_size(batch) // self.coords["dp_size"]
        result = torch.zeros((n_local, int(batch["tokens"].shape[1]) - 1), dtype=torch.float32)
        for rows, lp in out:
            result[rows] = lp
        return result

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """Logprobs of the current policy on the batch's tokens (the GRPO "old" logprobs), under the distribution
        the rollout engine sampled from (its min-p, top-k and top-p cuts)."""
        self._params_back()
        return self._logprobs(self.pm.model, batch.tensors(), Truncation.of(self.cfg.generation.sampling))

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """Logprobs of the frozen reference policy (the KL penalty's) under the full distribution, as the KL term
        compares them (with truncated sampling too); with ``training.offload_reference_policy``
        its weights come from host memory for this pass and leave the GPU after it."""
        if self.pm.ref_model is None:
            raise RuntimeError("compute_ref_logprobs: loss.kl_penalty is 0, there is no reference model")
        with self._reference_on_gpu():
            return self._logprobs(self.pm.ref_model, batch.tensors(), None)

    @contextmanager
    def _reference_on_gpu(self) -> Iterator[None]:
        """The reference policy's weights on the GPU for the block (a no-op when they stay there); the
        trainer's parameters, gradients and optimizer state are not touched."""
        host = self.pm.ref_host
        if host is None:
            yield
            return
        t0 = time.perf_counter()
        moved = host.swap_in()
        swapped_in = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            freed = host.swap_out()
            torch.cuda.empty_cache()  # the freed blocks go back to the device for vLLM's next wake-up
            self.last_reference_swap = {"bytes_in": moved, "bytes_out": freed, "swap_in_s": swapped_in - t0,
                                        "pass_s": t1 - swapped_in, "swap_out_s": time.perf_counter() - t1,
                                        "host_bytes": host.host_bytes}

    # ------------------------------------------------------------------ parameters while vLLM generates

    def offload_params(self) -> ParamsMoved:
        """After the refit: the bf16 parameter buffers to host memory (``refit.offload_params_for_generation``)."""
        from rlc.runtime.policy.param_offload import offload_params  # noqa: PLC0415

        t0 = time.perf_counter()
        moved = 0
        if not self.params_offloaded:
            moved = offload_params(self.pm.model)
            self.params_offloaded = True
        return ParamsMoved(bytes=moved, seconds=time.perf_counter() - t0, memory=self.memory())

    def onload_params(self) -> ParamsMoved:
        """Before the trainer's next forward: the parameters back on the GPU (a no-op when they are there)."""
        from rlc.runtime.policy.param_offload import onload_params  # noqa: PLC0415

        t0 = time.perf_counter()
        restored = 0
        if self.params_offloaded:
            restored = onload_params(self.pm.model)
            self.params_offloaded = False
        return ParamsMoved(bytes=restored, seconds=time.perf_counter() - t0, memory=self.memory())

    def _params_back(self) -> None:
        """Every method that reads or writes the parameters calls this first, so a driver that skipped
        ``onload_params`` still gets correct weights (the storage of an offloaded buffer is empty)."""
        if self.params_offloaded:
            self.onload_params()

    @contextmanager
    def _resident_for_checkpoint(self) -> Iterator[None]:
        """Everything on the GPU for a checkpoint, then offloaded again as it was: a checkpoint taken
        between the refit and generation must not leave vLLM's memory to the trainer."""
        optimizer_was_off, params_were_off = self.offloaded, self.params_offloaded
        self._params_back()
        self.onload()
        try:
            yield
        finally:
            if optimizer_was_off:
                from rlc.runtime.policy.refit_source import offload  # noqa: PLC0415

                offload(self.pm.model, self.pm.optimizer)
                self.offloaded = True
            if params_were_off:
                self.offload_params()

    # ------------------------------------------------------------------ training

    def onload(self) -> None:
        """Bring optimizer state and gradient buffers back after a refit (no-op if not offloaded)."""
        from rlc.runtime.policy.refit_source import onload  # noqa: PLC0415

        if self.offloaded:
            onload(self.pm.model, self.pm.optimizer)
            self.offloaded = False

    def train_step(self, batch: TrainBatch, step: int) -> TrainStepResult | None:
        """One GRPO update: ``ceil(N / global_batch_size)`` optimizer steps over the batch.

        The loss of each micro-batch is the clipped GRPO loss normalised by the *global* token count
        of its optimizer step, scaled so that megatron-core's division by the number of micro-batches
        and DDP's averaging over data-parallel ranks give exactly the global token mean.
        """
        from megatron.core import parallel_state as ps  # noqa: PLC0415

        from rlc.runtime.grpo.loss import grpo_loss  # noqa: PLC0415
        from rlc.runtime.policy.megatron_setup import lr_at  # noqa: PLC0415

        self._params_back()
        self.onload()
        cfg = self.cfg
        t0 = time.perf_counter()
        rows = batch.tensors()
        n = B.batch_size(rows)
        dp, dp_rank = self.coords["dp_size"], self.coords["dp_rank"]
        shard = B.dp_shard(rows, dp_rank, dp)
        slices = B.optimizer_step_slices(n, cfg.training.global_batch_size, dp)
        temperature = cfg.generation.sampling.temperature
        truncation = Truncation.of(cfg.generation.sampling)
        # the KL term compares the reference's full distribution with the policy's full distribution
        full_for_kl = truncation.active and cfg.loss.kl_penalty > 0
        # the engine's logprobs weigh the policy term (importance sampling) or the KL term (on-policy weighting)
        needs_gen = cfg.loss.importance_sampling_correction or (
            cfg.loss.kl_penalty > 0 and cfg.loss.kl_weighting == "on_policy")
        packing = self._packing()
        cp_group = ps.get_context_parallel_group() if cfg.train_parallel.cp > 1 else None
        loss_sums: dict[str, float] = {}
        weighted: dict[str, float] = {}
        maxes: dict[str, float] = {}
        tokens_total = 0.0
        grad_norms, lrs = [], []
        for lo, hi in slices:
            local = B.take(shard, lo, hi)
            # the global normaliser: tokens (or sequences) of this optimizer step over all DP ranks
            tokens_or_rows = local["mask"].sum() if cfg.loss.token_level else (local["mask"].sum(-1) > 0).sum()
            local_count = float(tokens_or_rows)
            count = torch.tensor([local_count], device="cuda")
            torch.distributed.all_reduce(count, group=ps.get_data_parallel_group())
            normalizer = max(float(count.item()), 1.0)
            if packing:
                mbs = self._packed_microbatches(rows, (lo, hi), cfg.training.sequence_packing.train_mb_tokens,
                                                "training.sequence_packing.train_mb_tokens")
            else:
                mbs = B.microbatches(local, cfg.training.micro_batch_size)
            # megatron-core divides each micro batch's loss by their number and DDP averages over the DP
            # ranks; with CP, megatron-core's factor CP on the loss and DDP's average over DP × CP cancel
            scale = len(mbs) * dp

            def loss_fn(mb, tokens, output_tensor):
                def scored(cut: Truncation | None) -> torch.Tensor:
                    if "cu_seqlens" in mb:
                        return packed_token_logprobs(output_tensor, mb, temperature, cp_group, cut)
                    return token_logprobs(output_tensor, tokens, temperature, cut)

                # the cut first: megatron-core's vocab_parallel_cross_entropy (the full distribution's, for the KL
                # term) rewrites fp32 logits in place, and the cut reads them
                lp = scored(truncation)
                dev = lp.device
                ref = mb["ref_logprobs"].to(dev) if "ref_logprobs" in mb else None
                loss, metrics = grpo_loss(
                    lp, mb["old_logprobs"].to(dev), mb["advantages"].to(dev), mb["mask"].to(dev), cfg.loss,
                    ref_logprobs=ref, normalizer=normalizer,  # noqa: B023
                    gen_logprobs=mb["gen_logprobs"].to(dev) if needs_gen else None,
                    truncated=truncation.active, kl_logprobs=scored(None) if full_for_kl else None,
                )
                return loss * scale, metrics  # noqa: B023

            for m in self.pm.model:
                m.zero_grad_buffer()
            self.pm.optimizer.zero_grad()
            self.opt_steps += 1
            lr = lr_at(self.opt_steps, cfg, self.total_opt_steps)
            for g in self.pm.optimizer.param_groups:
                g["lr"] = lr
            collected = self._run(self.pm.model, mbs, forward_only=False, loss_fn=loss_fn)
            if self._replay is not None:
                self._replay.clear(self.pm.model)  # no routes held on the GPU past the pass
            ok, grad_norm, _ = self.pm.optimizer.step()
            if not ok:
                raise RuntimeError(f"optimizer step {self.opt_steps} (GRPO step {step}) was skipped: inf/nan gradients")
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
            lrs.append(lr)
            for met in collected or []:
                w = float(met.get("num_tokens", 0.0))
                tokens_total += w
                for k, v in met.items():
                    if k == "num_tokens":
                        continue
                    if k.startswith("loss/"):
                        # already normalised by the global count: sum over micro-batches and DP ranks,
                        # mean over the optimizer steps of this GRPO step
                        loss_sums[k] = loss_sums.get(k, 0.0) + float(v) / len(slices)
                    elif k == "ratio_max":
                        maxes[k] = max(maxes.get(k, float("-inf")), float(v))
                    else:
                        weighted[k] = weighted.get(k, 0.0) + float(v) * w
        if not self.coords["is_output"]:
            return None
        return TrainStepResult(loss_sums=loss_sums, weighted_sums=weighted, maxes=maxes, num_tokens=tokens_total,
                               grad_norm=sum(grad_norms) / len(grad_norms), lr=lrs[-1], optimizer_steps=len(slices),
                               train_s=time.perf_counter() - t0)

    # ------------------------------------------------------------------ refit

    def refit_prepare(self, session: str, local_rank: int, local_world: int,
                      timeout_s: float = 600.0) -> dict[str, Any]:
        """Build the export plan and pair with this GPU's consumer (concurrently with it)."""
        from rlc.runtime.policy.refit_source import RefitSource  # noqa: PLC0415

        if self.source is None:
            self.source = RefitSource(self.pm.bridge, self.pm.model, self.cfg, session=session,
                                      local_rank=local_rank, local_world=local_world)
        return self.source.prepare(timeout_s=timeout_s)

    def refit_offload(self) -> Offloaded:
        """Before a refit: forced param sync (NeMo-RL #4086) and optimizer offload (NeMo-RL #3490), then memory."""
        from rlc.runtime.policy.refit_source import offload, sync_params  # noqa: PLC0415

        t0 = time.perf_counter()
        self._params_back()  # the export reads them
        synced = False
        if self.cfg.refit.sync_params_before_refit:
            synced = sync_params(self.pm.model, self.pm.ddp_config)
        if self.cfg.refit.offload_optimizer_for_refit and not self.offloaded:
            offload(self.pm.model, self.pm.optimizer)
            self.offloaded = True
        return Offloaded(synced_params=synced, offloaded=self.offloaded, seconds=time.perf_counter() - t0,
                         memory=self.memory())

    def refit_close(self) -> None:
        """Drop the producer (a failed refit leaves it unusable; a new session pairs again)."""
        if self.source is not None:
            self.source.close()
            self.source = None

    def refit_send(self) -> RefitSent:
        """Stream the weights to the consumer on this GPU (it must be receiving)."""
        if self.source is None:
            raise RuntimeError("refit_send before refit_prepare")
        self._params_back()
        return RefitSent.of(self.source.send())

    def refit_dump_export(self, export_dir: str) -> ExportWritten:
        """``refit.verify_every``: write this rank's export (what the refit just sent) to ``export_dir`` in shards
        for the vLLM worker on this GPU, which reads and checks each as it comes (both sides run at once;
        ``rlc.runtime.refit.verify_stream``). Collective: every trainer rank calls it at once (the export gathers
        across ranks)."""
        from rlc.runtime.refit.verify_stream import ShardFiles, write_export_shards  # noqa: PLC0415

        if self.source is None:
            raise RuntimeError("refit_dump_export before refit_prepare")
        self._params_back()
        return write_export_shards(ShardFiles(export_dir, self.source.local_rank), self.source.export())

    def export_named(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """The exported HF tensors (CPU copies), for tests; ``names`` filters."""
        from rlc.runtime.policy.refit_source import RefitSource  # noqa: PLC0415

        self._params_back()
        src = self.source or RefitSource(self.pm.bridge, self.pm.model, self.cfg, session="export",
                                         local_rank=0, local_world=1)
        return {n: t.detach().cpu().clone() for n, t in src.export() if names is None or n in names}

    # ------------------------------------------------------------------ checkpoints

    def _sharded_state(self, is_loading: bool) -> dict:
        model_sd = {}
        for i, chunk in enumerate(self.pm.model):
            model_sd[f"model{i}"] = chunk.module.sharded_state_dict()
        flat = {}
        for sd in model_sd.values():
            flat.update(sd)
        state = dict(model_sd)
        state["optimizer"] = self.pm.optimizer.sharded_state_dict(
            flat, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        return state

    def save_checkpoint(self, path: str) -> CheckpointIO:
        """megatron-core distributed checkpoint of model + optimizer into ``path`` (all ranks)."""
        from megatron.core import dist_checkpointing  # noqa: PLC0415

        t0 = time.perf_counter()
        with self._resident_for_checkpoint():
            os.makedirs(path, exist_ok=True)
            torch.distributed.barrier()
            dist_checkpointing.save(self._sharded_state(is_loading=False), path)
            torch.distributed.barrier()
        meta = {"opt_steps": self.opt_steps}
        if self.rank == 0:
            with open(os.path.join(path, "rlc_policy.json"), "w", encoding="utf-8") as f:
                json.dump(meta, f)
        return CheckpointIO(seconds=time.perf_counter() - t0, opt_steps=self.opt_steps)

    def load_checkpoint(self, path: str) -> CheckpointIO:
        from megatron.core import dist_checkpointing  # noqa: PLC0415

        t0 = time.perf_counter()
        self._params_back()
        self.onload()
        state = self._sharded_state(is_loading=True)
        loaded = dist_checkpointing.load(state, path)
        for i, chunk in enumerate(self.pm.model):
            chunk.module.load_state_dict(loaded[f"model{i}"], strict=False)
        self.pm.optimizer.load_state_dict(loaded["optimizer"])
        self.opt_steps = int(parse_json(read_text_capped(os.path.join(path, "rlc_policy.json")))["opt_steps"])
        torch.distributed.barrier()
        return CheckpointIO(seconds=time.perf_counter() - t0, opt_steps=self.opt_steps)

    def shutdown(self) -> None:
        if self.source is not None:
            self.source.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if TYPE_CHECKING:  # the type checker holds the class to the protocol the driver calls it through
    _IMPLEMENTS: type[PolicyWorkerApi] = MegatronPolicyWorker
