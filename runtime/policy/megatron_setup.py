"""Build the Megatron policy from an HF checkpoint: process groups, model (Megatron-Bridge), optimizer.

Everything here runs inside a policy worker (one process per GPU) and imports torch, megatron-core
and Megatron-Bridge. The parallel layout is exactly ``train_parallel`` of ``runtime.yaml``.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from rlc.contract.runtime_config import RuntimeConfig, TrainParallelConfig
from rlc.runtime.model_config import overridden_config
from rlc.runtime.policy.host_weights import HostWeights
from rlc.runtime.policy.provider_options import apply_provider_settings, ddp_settings, optimizer_settings

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"model.dtype={name!r}: expected one of {', '.join(DTYPES)}") from None


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """NCCL process group over all trainer ranks (each process sees its one GPU as cuda:0)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
    )
    torch.cuda.set_device(0)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", rank=rank, world_size=world_size)


def init_model_parallel(tp_cfg: TrainParallelConfig, seed: int) -> None:
    """megatron-core process groups for TP/PP/VPP/CP/EP/ETP; seeds the model-parallel RNG."""
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_cfg.tp,
            pipeline_model_parallel_size=tp_cfg.pp,
            virtual_pipeline_model_parallel_size=tp_cfg.vpp if tp_cfg.vpp > 1 else None,
            context_parallel_size=tp_cfg.cp,
            expert_model_parallel_size=tp_cfg.ep,
            expert_tensor_parallel_size=tp_cfg.etp,
        )
    model_parallel_cuda_manual_seed(seed)


def make_provider(bridge: Any, cfg: RuntimeConfig, *, load_weights: bool = True) -> Any:
    """The Bridge's GPT provider with ``runtime.yaml``'s layout and RL-friendly settings applied."""
    tp = cfg.train_parallel
    dtype = torch_dtype(cfg.model.dtype)
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    provider.tensor_model_parallel_size = tp.tp
    provider.pipeline_model_parallel_size = tp.pp
    provider.virtual_pipeline_model_parallel_size = tp.vpp if tp.vpp > 1 else None
    provider.context_parallel_size = tp.cp
    provider.expert_model_parallel_size = tp.ep
    provider.expert_tensor_parallel_size = tp.etp
    provider.sequence_parallel = bool(tp.sequence_parallel and tp.tp > 1)
    if tp.num_layers_in_first_pipeline_stage is not None:
        provider.num_layers_in_first_pipeline_stage = tp.num_layers_in_first_pipeline_stage
    if tp.num_layers_in_last_pipeline_stage is not None:
        provider.num_layers_in_last_pipeline_stage = tp.num_layers_in_last_pipeline_stage
    provider.params_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    if tp.pp > 1:
        provider.pipeline_dtype = dtype
    # No APEX on the hosts: the fused weight-gradient accumulation needs it.
    provider.gradient_accumulation_fusion = False
    # RL: the trainer's logprobs must match the sampler's, so no dropout anywhere.
    provider.hidden_dropout = 0.0
    provider.attention_dropout = 0.0
    ac = cfg.training.activation_checkpointing
    if ac == "full":
        provider.recompute_granularity = "full"
        provider.recompute_method = "uniform"
        provider.recompute_num_layers = 1
    elif ac == "selective":
        provider.recompute_granularity = "selective"
    elif ac != "none":
        raise ValueError(f"training.activation_checkpointing={ac!r}: expected none, selective or full")

    apply_provider_settings(provider, cfg)
    provider.finalize()
    return provider


def apply_model_overrides(bridge: Any, cfg: RuntimeConfig) -> None:
    """``model.overrides`` on the Bridge's HF config, before a model provider is made from it: the trainer, the
    reference policy and the Megatron generation backend are built from the checkpoint's ``config.json`` with
    them (:func:`rlc.runtime.model_config.overridden_config`), as the plan and vLLM read it."""
    if not cfg.model.overrides:
        return
    hf = bridge.hf_pretrained
    if hasattr(hf, "to_dict"):  # a bare config (``AutoBridge.from_hf_config``)
        bridge.hf_pretrained = overridden_config(hf, cfg.model.checkpoint, cfg.model.overrides)
    else:
        hf.config = overridden_config(hf.config, cfg.model.checkpoint, cfg.model.overrides)


@dataclass
class PolicyModel:
    """What a policy worker trains."""

    bridge: Any
    provider: Any
    model: list  # DDP-wrapped model chunks (one per virtual pipeline stage)
    optimizer: Any
    ddp_config: Any
    ref_model: list | None = None
    #: ``training.offload_reference_policy``: the reference policy's weights in host memory, on the GPU only
    #: for its logprob pass (:class:`rlc.runtime.policy.host_weights.HostWeights`)
    ref_host: Any = None


def build_policy(cfg: RuntimeConfig, *, bridge: Any = None) -> PolicyModel:
    """AutoBridge HF -> Megatron model under ``train_parallel``, DDP-wrapped, with its optimizer.

    ``bridge``: a bridge built elsewhere (GPU checks build one from a bare ``config.json`` and keep the
    random initialisation); by default the checkpoint's, whose weights are loaded."""
    from megatron.bridge import AutoBridge  # noqa: PLC0415
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads  # noqa: PLC0415
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: PLC0415
    from megatron.core.utils import get_model_config  # noqa: PLC0415

    dtype = torch_dtype(cfg.model.dtype)
    t = cfg.training
    load_weights = bridge is None
    if bridge is None:
        bridge = AutoBridge.from_hf_pretrained(
            cfg.model.checkpoint, trust_remote_code=cfg.model.trust_remote_code, torch_dtype=dtype
        )
    apply_model_overrides(bridge, cfg)
    provider = make_provider(bridge, cfg, load_weights=load_weights)
    ref_model, ref_host = None, None
    if cfg.loss.kl_penalty > 0 and t.offload_reference_policy:
        # Built before the trainer and moved to host memory at once, so that setup never holds both on the
        # GPU; the random-number state is put back as it was, so the trainer is initialised as it is with
        # the reference on the GPU (built after it).
        with _rng_state_kept():
            ref_model = build_reference(provider, cfg)
        ref_host = offload_reference(ref_model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=t.grad_reduce_in_fp32,
        overlap_grad_reduce=t.overlap_grad_reduce,
        overlap_param_gather=t.overlap_param_gather,
        use_distributed_optimizer=t.use_distributed_optimizer,
        check_for_nan_in_grad=True,
        average_in_collective=False,
        **ddp_settings(cfg),
    )
    model = provider.provide_distributed_model(
        ddp_config=ddp_config,
        wrap_with_ddp=True,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )
    o = t.optimizer
    opt_config = OptimizerConfig(
        optimizer=o.name,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        clip_grad=t.grad_clip,
        use_distributed_optimizer=t.use_distributed_optimizer,
        overlap_param_gather=t.overlap_param_gather,
        optimizer_cpu_offload=t.optimizer_cpu_offload,
        optimizer_offload_fraction=t.optimizer_offload_fraction,
        **optimizer_settings(cfg),
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    mcfg = get_model_config(model[0])
    mcfg.grad_scale_func = optimizer.scale_loss
    mcfg.finalize_model_grads_func = finalize_model_grads
    if t.overlap_grad_reduce:
        sync = [m.no_sync for m in model]
        mcfg.no_sync_func = sync[0] if len(sync) == 1 else sync
    if cfg.loss.kl_penalty > 0 and ref_model is None:
        ref_model = build_reference(provider, cfg)
    return PolicyModel(bridge=bridge, provider=provider, model=model, optimizer=optimizer,
                       ddp_config=ddp_config, ref_model=ref_model, ref_host=ref_host)


def build_reference(provider: Any, cfg: RuntimeConfig) -> list:
    """The reference policy: the same checkpoint and parallel layout as the trainer, frozen, no DDP, no optimizer."""
    dtype = torch_dtype(cfg.model.dtype)
    ref_model = provider.provide_distributed_model(
        wrap_with_ddp=False, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16
    )
    for m in ref_model:
        m.eval()
        for p in m.parameters():
            p.requires_grad_(False)
    return ref_model


def offload_reference(ref_model: list) -> Any:
    """The reference policy's parameters to pinned host memory (freed on the GPU); its buffers stay."""
    ref_host = HostWeights(p for m in ref_model for p in m.parameters())
    torch.cuda.empty_cache()
    return ref_host


@contextmanager
def _rng_state_kept() -> Iterator[None]:
    """Torch's CPU and CUDA random-number states and megatron-core's model-parallel CUDA states, put back on exit."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: PLC0415

    tracker = get_cuda_rng_tracker()
    states = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tracker.get_states().items()}
    cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        torch.cuda.set_rng_state(cuda)
        tracker.set_states(states)


def lr_at(step: int, cfg: RuntimeConfig, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup then constant/cosine/linear."""
    import math  # noqa: PLC0415

    o = cfg.training.optimizer
    sched = cfg.training.lr_schedule
    if sched.warmup_steps > 0 and step <= sched.warmup_steps:
        start = sched.warmup_start_lr
        return start + (o.lr - start) * step / sched.warmup_steps
    if sched.name == "constant":
        return o.lr
    span = max(1, total_steps - sched.warmup_steps)
    frac = min(1.0, max(0.0, (step - sched.warmup_steps) / span))
    if sched.name == "cosine":
        return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
    if sched.name == "linear":
        return o.lr + (o.min_lr - o.lr) * frac
    raise ValueError(f"training.lr_schedule.name={sched.name!r}: expected constant, cosine or linear")
