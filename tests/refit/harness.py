"""Process entry points for exercising the refit protocol across real processes (tests, demos).

Not used by the runtime. Each producer/consumer runs in its own spawned process over the shm
backend (real shared memory, real ZMQ sockets). Weights are synthetic but deterministic, so the
consumer can check every delivered tensor bit for bit against what its own producer exported.

Two synthetic ranks pack *different* tensor sets in *different* orders (like PP stages / EP
ranks), include an fp32 router bias (SkyRL #1816) and, on rank 1, a fused expert tensor larger than a
ping-pong half (a one-off bucket).
"""
from __future__ import annotations

import os
import signal
import traceback
import weakref
import zlib
from typing import Any

import torch

from rlc.contract.runtime_config import RefitConfig
from rlc.runtime.refit.specs import TensorSpec

# Shared with pool workers through the pool initializer (multiprocessing primitives can only be
# handed over at process creation).
_SHARED: dict[str, Any] = {}

FP32_PATTERNS = ["*.mlp.gate.e_score_correction_bias", "*.expert_bias"]
_SHM_DIR = "/dev/shm"


def init_worker(seq: Any, log: Any, gate: Any) -> None:
    """Pool initializer: a global sequence counter, an event-log queue, and a gate event."""
    _SHARED.update(seq=seq, log=log, gate=gate)


def refit_config(**overrides: Any) -> RefitConfig:
    """A resolved ``RefitConfig`` with CI-sized buffers (8 KiB halves); override any field."""
    base: dict[str, Any] = dict(
        buffer_memory_ratio=None,
        buffer_gb=16384 / (1 << 30),  # 16 KiB for both halves -> 8 KiB per half
        alignment_bytes=256,
        sleep_level=2,
        offload_optimizer_for_refit=True,
        offload_params_for_generation=False,
        sync_params_before_refit=True,
        dedupe_mtp_embedding=False,
        per_rank_ipc_metadata=True,
        fp32_params=list(FP32_PATTERNS),
        verify_every=0,
        transport="shm",
        decisions={},
    )
    base.update(overrides)
    return RefitConfig(**base)


def rank_specs(rank: int) -> list[TensorSpec]:
    """Exporter specs (source dtypes) of synthetic rank 0 / 1: different names, sizes and orders."""
    if rank == 0:
        specs = [
            TensorSpec("model.embed_tokens.weight", (64, 32), "float32"),
            TensorSpec("model.layers.0.input_layernorm.weight", (32,), "float32"),
            TensorSpec("model.layers.0.self_attn.qkv_proj.weight", (96, 32), "bfloat16"),
            TensorSpec("model.layers.0.mlp.gate.weight", (8, 32), "bfloat16"),
            TensorSpec("model.layers.0.mlp.gate.e_score_correction_bias", (8,), "float32"),
        ]
        specs += [
            TensorSpec(f"model.layers.0.mlp.experts.{e}.down_proj.weight", (32, 48), "bfloat16") for e in range(4)
        ]
        return specs
    if rank == 1:
        specs = [
            TensorSpec(f"model.layers.1.mlp.experts.{e}.down_proj.weight", (32, 48), "bfloat16") for e in (7, 5, 6, 4)
        ]
        specs += [
            TensorSpec("model.layers.1.mlp.gate.e_score_correction_bias", (8,), "float32"),
            TensorSpec("model.layers.1.mlp.experts.gate_up_proj", (8, 64, 32), "bfloat16"),  # 32 KiB > a half
            TensorSpec("model.layers.1.mlp.tokens_per_expert", (8,), "int64"),
            TensorSpec("model.norm.weight", (32,), "float32"),
            TensorSpec("lm_head.weight", (64, 32), "bfloat16"),
        ]
        return specs
    raise ValueError(f"no synthetic rank {rank}")


def synthetic_tensor(spec: TensorSpec, step: int) -> torch.Tensor:
    """Deterministic values per (name, step); router biases look like SkyRL #1816's (~30 +- 7e-4)."""
    g = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()) + 7919 * step)
    dtype = getattr(torch, spec.dtype)
    if not dtype.is_floating_point:
        return torch.randint(0, 1000, spec.shape, generator=g, dtype=dtype)
    x = torch.randn(spec.shape, generator=g, dtype=torch.float32)
    if "e_score_correction_bias" in spec.name:
        x = 30.0 + step + x * 7e-4
    return x.to(dtype)


def expected_on_wire(spec: TensorSpec, wire_dtype: str, step: int) -> torch.Tensor:
    return synthetic_tensor(spec, step).to(getattr(torch, wire_dtype))


def _hook(side: str, rank: int):
    seq, log, gate = _SHARED.get("seq"), _SHARED.get("log"), _SHARED.get("gate")
    if seq is None or log is None or gate is None:
        return None

    def hook(event: str, index: int) -> None:
        with seq.get_lock():
            seq.value += 1
            n = seq.value
        log.put((n, side, rank, event, index))
        if side == "producer" and event == "pack_start" and index == 1:
            gate.set()

    return hook


def _error(e: BaseException) -> dict[str, Any]:
    return {"ok": False, "error_type": type(e).__name__, "error": str(e), "traceback": traceback.format_exc()}


def producer_main(job: dict[str, Any]) -> dict[str, Any]:
    """Run one producer: prepare, then ``job['steps']`` refits. Returns metrics or the error."""
    from rlc.runtime.refit.buffers import ShmBackend
    from rlc.runtime.refit.producer import RefitProducer

    rank = job["rank"]
    specs = rank_specs(rank)
    producer = None
    metrics: list[dict[str, Any]] = []
    try:
        producer = RefitProducer(
            refit_config(**job.get("cfg", {})),
            session=job["session"],
            rank=rank,
            world_size=job.get("world_size", 2),
            export_dtype=job.get("export_dtype", "bfloat16"),
            backend=ShmBackend(f"shm-gpu{rank}"),
            free_bytes=job.get("free_bytes", 1 << 20),
            timeout_s=job.get("timeout_s", 20.0),
            event_hook=_hook("producer", rank),
            metadata_source_rank=job.get("metadata_source_rank"),
            metadata_subscribers=job.get("metadata_subscribers"),
            **({"keep_buffers_max_bytes": job["keep_buffers_max_bytes"]} if "keep_buffers_max_bytes" in job else {}),
        )
        producer.prepare(specs)
        held = []  # exported tensors still referenced when the exporter was asked for the next one

        def exporter(order: list[TensorSpec], step: int):
            previous = None
            for s in order:
                if previous is not None and previous() is not None:
                    held.append(s.name)
                t = synthetic_tensor(s, step)
                previous = weakref.ref(t)
                yield s.name, t
                del t

        for step in range(job.get("steps", 1)):
            if job.get("free_bytes_by_step"):  # free memory at refit time differs between refits
                producer.free_bytes = job["free_bytes_by_step"][step]
            order = list(specs)
            if job.get("drop_last") or step == job.get("drop_last_at_step"):
                order = order[:-1]
            metrics.append(producer.send(exporter(order, step)).to_dict())
        producer.close()
        leftover = [n for n in os.listdir(_SHM_DIR) if n.startswith(f"rlc-refit-{os.getpid()}-")]
        return {
            "ok": True,
            "metrics": metrics,
            "pid": os.getpid(),
            "held_previous": held,
            "shm_left_after_close": leftover,
        }
    except BaseException as e:  # report to the test, which asserts on it
        return {**_error(e), "pid": os.getpid(), "metrics": metrics}
    finally:
        if producer is not None:
            producer.close()


def consumer_main(job: dict[str, Any]) -> dict[str, Any]:
    """Run one consumer: prepare, then ``job['steps']`` refits; checks every tensor bit for bit."""
    from rlc.runtime.refit.buffers import ShmBackend
    from rlc.runtime.refit.consumer import RefitConsumer

    device = job["device"]  # the GPU index this consumer sits on = its producer's rank
    producer_specs = {s.name: s for s in rank_specs(device)}
    consumer = None
    result: dict[str, Any] = {"ok": True, "metrics": [], "mismatches": [], "dtypes": {}, "loaded": []}
    try:
        consumer = RefitConsumer(
            session=job["session"],
            backend=ShmBackend(f"shm-gpu{device}"),
            timeout_s=job.get("timeout_s", 20.0),
            event_hook=_hook("consumer", device),
        )
        wire = {s.name: s for s in consumer.prepare()}
        for step in range(job.get("steps", 1)):
            got: dict[str, torch.Tensor] = {}
            calls = [0]
            kept: list[torch.Tensor] = []

            def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
                if job.get("gate_first_bucket") and calls[0] == 0:  # noqa: B023
                    # Do not return (-> no ack for bucket 0) until the producer has started packing
                    # bucket 1. Only a ping-pong producer can get there; a serial one deadlocks.
                    result["gate_opened"] = _SHARED["gate"].wait(timeout=10)
                if job.get("die_in_load"):
                    os.kill(os.getpid(), signal.SIGKILL)
                calls[0] += 1  # noqa: B023
                for name, t in weights:
                    got[name] = t.clone()  # noqa: B023
                    if job.get("keep_views"):
                        kept.append(t)  # noqa: B023

            result["metrics"].append(consumer.receive(load_weights).to_dict())
            result["loaded"].append(sorted(got))
            for name, t in got.items():
                result["dtypes"][name] = str(t.dtype).removeprefix("torch.")
                want = expected_on_wire(producer_specs[name], wire[name].dtype, step)
                if t.dtype != want.dtype or t.shape != want.shape or not torch.equal(t, want):
                    result["mismatches"].append((step, name))
        return result
    except BaseException as e:
        out = _error(e)
        out.update({k: v for k, v in result.items() if k not in out})
        return out
    finally:
        if consumer is not None:
            consumer.close()
