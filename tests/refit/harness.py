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
import re
import signal
import traceback
import weakref
import zlib
from typing import Any

import torch

from rlc.contract.refit_buffer import align_up
from rlc.contract.runtime_config import RefitConfig
from rlc.runtime.refit.fused import ExpertDestination, FusedLoader, build_routes
from rlc.runtime.refit.sources import StackedParts
from rlc.runtime.refit.fused_layout import expert_groups, fuse_specs, parse_fused
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
        keep_weights_awake=False,
        wake_kv_during_transfer=False,
        keep_kv_cache_awake=False,
        zero_copy_experts=False,
        offload_optimizer_for_refit=True,
        offload_params_for_generation=False,
        sync_params_before_refit=True,
        dedupe_mtp_embedding=False,
        per_rank_ipc_metadata=True,
        fp32_params=list(FP32_PATTERNS),
        verify_every=0,
        transport="shm",
        fused_transfer=False,
        direct_export=False,
        zero_copy_views=False,
        replay_load=False,
        keep_buffers_gb=2.0,
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


def _hook(side: str, rank: int, gate_on: tuple[str, int | None] = ("pack_start", 1)):
    """Logs every event; a producer's ``gate_on`` event (any index when it is None) opens the gate."""
    seq, log, gate = _SHARED.get("seq"), _SHARED.get("log"), _SHARED.get("gate")
    if seq is None or log is None or gate is None:
        return None

    def hook(event: str, index: int) -> None:
        with seq.get_lock():
            seq.value += 1
            n = seq.value
        log.put((n, side, rank, event, index))
        if side == "producer" and event == gate_on[0] and gate_on[1] in (None, index):
            gate.set()

    return hook


def ok(result: dict[str, Any]) -> dict[str, Any]:
    """A process entry point's result, or the assertion that shows its error and traceback."""
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{result.get('traceback', '')}"
    return result


def _error(e: BaseException) -> dict[str, Any]:
    return {"ok": False, "error_type": type(e).__name__, "error": str(e), "traceback": traceback.format_exc()}


def producer_main(job: dict[str, Any]) -> dict[str, Any]:
    """Run one producer: prepare, then ``job['steps']`` refits. Returns metrics or the error."""
    from rlc.runtime.refit.buffers import ShmBackend
    from rlc.runtime.refit.producer import RefitProducer

    rank = job["rank"]
    specs = rank_specs(rank)
    if job.get("last"):  # export (and announce) this tensor last
        specs = [s for s in specs if s.name != job["last"]] + [s for s in specs if s.name == job["last"]]
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
            event_hook=_hook("producer", rank, tuple(job.get("gate_on", ("pack_start", 1)))),
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
                if job.get("gate_on_tensor") in {name for name, _ in weights}:
                    # Do not return (-> no ack for this bucket) until the producer's gate event (its End).
                    result["gate_opened"] = _SHARED["gate"].wait(timeout=5)
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


# --------------------------------------------------------------------------- a tiny MoE, fused or per expert

MOE_EXPERTS, MOE_INTER, MOE_HIDDEN, MOE_VOCAB = 8, 16, 32, 64
#: The consumer side's engine layout: tensor-parallel rank 1 of 2 (half of the intermediate dimension) and,
#: per MoE layer, the global experts its slots hold (layer 1: every other expert, in vLLM's round-robin way);
#: layer 2 holds its experts in FP8, which the direct copies do not cover.
MOE_TP_RANK, MOE_TP_SIZE = 1, 2
MOE_LOCAL_EXPERTS = {0: tuple(range(8)), 1: (1, 3, 5, 7), 2: tuple(range(8))}
MOE_FP8_LAYERS = {2}
_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def moe_specs() -> list[TensorSpec]:
    """A tiny MoE's export list, per expert as Megatron-Bridge exports it (router bias in fp32)."""
    h, i = MOE_HIDDEN, MOE_INTER
    specs = [TensorSpec("model.embed_tokens.weight", (MOE_VOCAB, h), "bfloat16")]
    for layer in sorted(MOE_LOCAL_EXPERTS):
        p = f"model.layers.{layer}"
        specs += [TensorSpec(f"{p}.self_attn.o_proj.weight", (h, h), "bfloat16"),
                  TensorSpec(f"{p}.mlp.gate.weight", (MOE_EXPERTS, h), "bfloat16"),
                  TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (MOE_EXPERTS,), "float32")]
        for e in range(MOE_EXPERTS):
            specs += [TensorSpec(f"{p}.mlp.experts.{e}.gate_proj.weight", (i, h), "bfloat16"),
                      TensorSpec(f"{p}.mlp.experts.{e}.up_proj.weight", (i, h), "bfloat16"),
                      TensorSpec(f"{p}.mlp.experts.{e}.down_proj.weight", (h, i), "bfloat16")]
    specs.append(TensorSpec("lm_head.weight", (MOE_VOCAB, h), "bfloat16"))
    return specs


def moe_export(fused: bool, step: int):
    """The export stream of :func:`moe_specs`, per expert or fused (layer 0's experts as separate parameters
    stacked by the producer, the others as already stacked tensors). Same values either way."""
    specs = moe_specs()
    if not fused:
        return specs, ((s.name, synthetic_tensor(s, step)) for s in specs)
    by_name = {s.name: s for s in specs}
    groups, refused = expert_groups(specs)
    assert not refused, refused
    wire = fuse_specs(specs, groups.values())

    def part(prefix: str, e: int, proj: str) -> torch.Tensor:
        return synthetic_tensor(by_name[f"{prefix}.{e}.{proj}.weight"], step)

    def gen():
        for s in wire:
            parsed = parse_fused(s.name)
            if parsed is None:
                yield s.name, synthetic_tensor(s, step)
                continue
            prefix, kind = parsed
            if kind == "fused_w13":
                parts = [torch.cat([part(prefix, e, "gate_proj"), part(prefix, e, "up_proj")])
                         for e in range(MOE_EXPERTS)]
            else:
                parts = [part(prefix, e, "down_proj") for e in range(MOE_EXPERTS)]
            yield s.name, (StackedParts(parts) if ".layers.0." in prefix else torch.stack(parts))

    return wire, gen()


class TinyMoeEngine:
    """The generation side of the tiny MoE in the layout vLLM holds it: fused ``w13_weight`` / ``w2_weight`` per
    layer (this rank's slice and experts), everything else as exported. ``load_weights`` follows vLLM's
    ``FusedMoE.weight_loader`` for per-expert tensors (gate -> first half of w13, up -> second half, this
    rank's rows; down -> this rank's columns; experts not held are skipped) and copies the rest by name."""

    def __init__(self) -> None:
        h, part = MOE_HIDDEN, MOE_INTER // MOE_TP_SIZE
        self.params: dict[str, torch.Tensor] = {}
        for s in moe_specs():
            if not _PER_EXPERT.match(s.name):
                self.params[s.name] = torch.zeros(s.shape, dtype=getattr(torch, s.dtype))
        for layer, local in MOE_LOCAL_EXPERTS.items():
            dtype = torch.float8_e4m3fn if layer in MOE_FP8_LAYERS else torch.bfloat16
            p = f"model.layers.{layer}.mlp.experts"
            self.params[f"{p}.w13_weight"] = torch.zeros((len(local), 2 * part, h), dtype=dtype)
            self.params[f"{p}.w2_weight"] = torch.zeros((len(local), h, part), dtype=dtype)

    def named_parameters(self):  # what the replayed load reads of a model (as of a torch module)
        return iter(self.params.items())

    def named_buffers(self):
        return iter(())

    def destinations(self) -> dict[str, ExpertDestination]:
        out = {}
        for layer, local in MOE_LOCAL_EXPERTS.items():
            p = f"model.layers.{layer}.mlp.experts"
            out[p] = ExpertDestination(p, self.params[f"{p}.w13_weight"], self.params[f"{p}.w2_weight"], MOE_EXPERTS,
                                       local, MOE_TP_RANK, MOE_TP_SIZE)
        return out

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        part = MOE_INTER // MOE_TP_SIZE
        rows = slice(MOE_TP_RANK * part, (MOE_TP_RANK + 1) * part)
        for name, t in weights:
            m = _PER_EXPERT.match(name)
            if m is None:
                self.params[name].copy_(t)  # KeyError for a name the engine does not know (a fused one)
                continue
            layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
            local = MOE_LOCAL_EXPERTS[layer]
            if expert not in local:
                continue
            slot = local.index(expert)
            p = f"model.layers.{layer}.mlp.experts"
            if proj == "down_proj":
                self.params[f"{p}.w2_weight"][slot].copy_(t[:, rows])
            else:
                half = 0 if proj == "gate_proj" else part
                self.params[f"{p}.w13_weight"][slot, half:half + part].copy_(t[rows])


def shm_segment(specs: list[TensorSpec], label: str) -> tuple[Any, list[torch.Tensor]]:
    """One shared-memory segment holding a tensor per spec (views of it, 256-byte aligned, values unset): memory the
    shm backend can share with a consumer, as CUDA IPC shares any storage on the GPU."""
    from rlc.runtime.refit.buffers import ShmBackend

    offsets, end = [], 0
    for s in specs:
        end = align_up(end, 256)
        offsets.append(end)
        end += s.nbytes
    segment, _ = ShmBackend("trainer").allocate(end, label)
    return segment, [segment.tensor[o:o + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
                     for s, o in zip(specs, offsets)]


class ShmTrainerParams:
    """A synthetic trainer's parameters held the way Megatron's DDP holds them: views of a few contiguous buffers,
    here shared-memory segments (which the shm backend can share with a consumer, as CUDA IPC shares any storage
    on the GPU). ``step`` writes a refit's values in place (an optimizer step); ``move`` puts parameters into a new
    buffer (an offload and reload)."""

    def __init__(self, specs: list[TensorSpec], buffers: int = 2) -> None:
        self.specs = specs
        self.params: dict[str, torch.Tensor] = {}
        self.segments: list[Any] = []
        for i in range(buffers):
            self._place([s for n, s in enumerate(specs) if n % buffers == i])

    def _place(self, specs: list[TensorSpec]) -> None:
        segment, views = shm_segment(specs, f"trainer buffer {len(self.segments)}")
        self.segments.append(segment)
        for s, view in zip(specs, views):
            old = self.params.get(s.name)
            self.params[s.name] = view
            if old is not None:
                view.copy_(old)

    def step(self, step: int) -> None:
        for s in self.specs:
            self.params[s.name].copy_(synthetic_tensor(s, step))

    def move(self, names: set[str]) -> None:
        self._place([s for s in self.specs if s.name in names])

    def export(self):
        for s in self.specs:
            yield s.name, self.params[s.name]

    def close(self) -> None:
        self.params = {}
        for segment in self.segments:
            segment.close()


class ShmMoeTrainer:
    """The tiny MoE's trainer with every parameter in shared buffers (:class:`ShmTrainerParams`): the tensors that
    are not experts as exported, each layer's experts as one ``[gate; up]`` and one ``down`` parameter per expert
    (as Megatron's grouped GEMM holds them), exported stacked (:class:`StackedParts`) for fused transfer. Same
    values as :func:`moe_export`."""

    def __init__(self) -> None:
        specs = moe_specs()
        self.by_name = {s.name: s for s in specs}
        groups, refused = expert_groups(specs)
        assert not refused, refused
        self.wire = fuse_specs(specs, groups.values())
        params = []
        for s in self.wire:
            params += [s] if parse_fused(s.name) is None else [TensorSpec(f"{s.name}.{e}", s.shape[1:], s.dtype)
                                                                for e in range(s.shape[0])]
        self.params = ShmTrainerParams(params)

    def step(self, step: int) -> None:
        for s in self.wire:
            parsed = parse_fused(s.name)
            if parsed is None:
                self.params.params[s.name].copy_(synthetic_tensor(s, step))
                continue
            prefix, kind = parsed
            for e in range(s.shape[0]):
                per = [self.by_name[f"{prefix}.{e}.{proj}.weight"]
                       for proj in (("gate_proj", "up_proj") if kind == "fused_w13" else ("down_proj",))]
                self.params.params[f"{s.name}.{e}"].copy_(torch.cat([synthetic_tensor(p, step) for p in per]))

    def export(self):
        for s in self.wire:
            if parse_fused(s.name) is None:
                yield s.name, self.params.params[s.name]
            else:
                yield s.name, StackedParts([self.params.params[f"{s.name}.{e}"] for e in range(s.shape[0])])

    def close(self) -> None:
        self.params.close()


def model_producer_main(job: dict[str, Any]) -> dict[str, Any]:
    """A producer streaming a tiny model for ``job['steps']`` refits: ``job['model']`` ``moe`` (``job['fused']``:
    fused or per expert) or ``dense``. With ``job['zero_copy']`` the model's parameters live in the trainer's
    shared buffers (:class:`ShmTrainerParams`; the MoE's fused: :class:`ShmMoeTrainer`) and every tensor exported as
    it is stored, or stacked from such parts, is read in place by the consumer (``refit.zero_copy_views``);
    ``job['move_at']`` maps a step to parameters moved to a new buffer before it, ``job['keep_storages']`` (default
    True) whether the consumer keeps its mappings between refits."""
    from rlc.runtime.refit.buffers import ShmBackend
    from rlc.runtime.refit.producer import RefitProducer

    def export(step: int):
        return moe_export(job["fused"], step) if job["model"] == "moe" else dense_export(step)

    producer = None
    try:
        producer = RefitProducer(refit_config(**job.get("cfg", {})), session=job["session"], rank=0, world_size=1,
                                 export_dtype="bfloat16", backend=ShmBackend(f"shm-{job['model']}"),
                                 free_bytes=job.get("free_bytes", 1 << 20), timeout_s=job.get("timeout_s", 20.0),
                                 keep_shared_storages=job.get("keep_storages", True))
        producer.zero_copy_bucket_bytes = job.get("zero_copy_bucket_bytes", producer.zero_copy_bucket_bytes)
        wire, _ = export(0)
        if not job.get("zero_copy"):
            producer.prepare(wire)
            metrics = [producer.send(export(step)[1]).to_dict() for step in range(job.get("steps", 1))]
            return {"ok": True, "metrics": metrics, "num_specs": len(wire)}
        trainer: Any = ShmMoeTrainer() if job["model"] == "moe" else ShmTrainerParams(wire)
        try:
            producer.prepare(wire, zero_copy=[s.name for s in wire])
            metrics = []
            for step in range(job.get("steps", 1)):
                if step in job.get("move_at", {}):
                    trainer.move(set(job["move_at"][step]))
                trainer.step(step)
                metrics.append(producer.send(trainer.export()).to_dict())
        finally:
            trainer.close()
        return {"ok": True, "metrics": metrics, "num_specs": len(wire), "zero_copy": sorted(producer.zero_copy_names)}
    except BaseException as e:
        return _error(e)
    finally:
        if producer is not None:
            producer.close()


class ReplayedLoad:
    """The replayed load across a consumer's refits, as the vLLM worker runs it: the first refit recorded, every
    later one checked and replayed (``rlc.runtime.refit.replay``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.table: Any = None
        self.stats: list[dict[str, int]] = []

    def loader(self, consumer: Any) -> Any:
        from rlc.runtime.refit.replay import RecordingLoader, ReplayLoader

        if self.table is None:
            return RecordingLoader(self.engine.load_weights, self.engine)
        self.table.check(consumer.expected, self.engine)
        return ReplayLoader(self.engine.load_weights, self.table)

    def done(self, loader: Any, consumer: Any) -> None:
        """After the refit ``loader`` loaded: the table once recorded, the counts of a replayed refit."""
        from rlc.runtime.refit.replay import RecordingLoader

        if isinstance(loader, RecordingLoader):
            self.table = loader.table(consumer.expected)
        else:
            self.stats.append(loader.stats.to_dict())

    def summary(self) -> dict[str, Any] | None:
        return None if self.table is None else {**self.table.summary(), "not_replayed": dict(self.table.not_replayed)}


def moe_consumer_main(job: dict[str, Any]) -> dict[str, Any]:
    """The consumer into :class:`TinyMoeEngine`: with ``job['fused']`` through the direct-copy table (built at the
    first refit, checked at every later one), else through the engine's ``load_weights`` alone; with
    ``job['replay']`` the loader's part recorded at the first refit and replayed after. Returns the engine's tensors
    after the last refit (CPU copies) and the loaders' counts."""
    from rlc.runtime.refit.buffers import ShmBackend
    from rlc.runtime.refit.consumer import RefitConsumer

    consumer = None
    try:
        engine = TinyMoeEngine()
        consumer = RefitConsumer(session=job["session"], backend=ShmBackend("shm-moe"),
                                 timeout_s=job.get("timeout_s", 20.0))
        consumer.prepare()
        table = None
        replay = ReplayedLoad(engine) if job.get("replay") else None
        stats = []
        for _ in range(job.get("steps", 1)):
            rest: Any = engine.load_weights if replay is None else replay.loader(consumer)
            loader: Any = rest
            if job["fused"]:
                if table is None:
                    table = build_routes(consumer.expected, engine.destinations())
                else:
                    table.check(consumer.expected, engine.destinations())
                loader = FusedLoader(rest, table)
            consumer.receive(loader)
            if isinstance(loader, FusedLoader):
                stats.append(loader.stats.to_dict())
            if replay is not None:
                replay.done(rest, consumer)
        return {"ok": True, "params": {n: t.clone() for n, t in engine.params.items()}, "stats": stats,
                "table": None if table is None else {**table.summary(), "uncovered": dict(table.uncovered)},
                "replay_stats": [] if replay is None else replay.stats,
                "replay": None if replay is None else replay.summary()}
    except BaseException as e:
        return _error(e)
    finally:
        if consumer is not None:
            consumer.close()


# --------------------------------------------------------------------------- a tiny dense model, replayed load

DENSE_HIDDEN, DENSE_HEADS, DENSE_KV_HEADS, DENSE_HEAD_DIM, DENSE_INTER, DENSE_VOCAB = 32, 4, 2, 8, 48, 64
#: The engine's tensor-parallel rank and size: each fused projection holds this rank's rows of every shard.
DENSE_TP_RANK, DENSE_TP_SIZE = 1, 2
_STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def dense_specs(layers: int = 2) -> list[TensorSpec]:
    """A tiny dense model's HF export list (Qwen3-like: separate q/k/v and gate/up; an fp32 router-style bias)."""
    h, q, kv, i = DENSE_HIDDEN, DENSE_HEADS * DENSE_HEAD_DIM, DENSE_KV_HEADS * DENSE_HEAD_DIM, DENSE_INTER
    specs = [TensorSpec("model.embed_tokens.weight", (DENSE_VOCAB, h), "bfloat16")]
    for n in range(layers):
        p = f"model.layers.{n}"
        specs += [TensorSpec(f"{p}.input_layernorm.weight", (h,), "bfloat16"),
                  TensorSpec(f"{p}.self_attn.q_proj.weight", (q, h), "bfloat16"),
                  TensorSpec(f"{p}.self_attn.k_proj.weight", (kv, h), "bfloat16"),
                  TensorSpec(f"{p}.self_attn.v_proj.weight", (kv, h), "bfloat16"),
                  TensorSpec(f"{p}.self_attn.o_proj.weight", (h, q), "bfloat16"),
                  TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "bfloat16"),
                  TensorSpec(f"{p}.mlp.gate_proj.weight", (i, h), "bfloat16"),
                  TensorSpec(f"{p}.mlp.up_proj.weight", (i, h), "bfloat16"),
                  TensorSpec(f"{p}.mlp.down_proj.weight", (h, i), "bfloat16"),
                  TensorSpec(f"{p}.mlp.router_bias", (8,), "float32")]
    specs += [TensorSpec("model.norm.weight", (h,), "bfloat16"),
              TensorSpec("lm_head.weight", (DENSE_VOCAB, h), "bfloat16"),
              TensorSpec("model.rotary_emb.inv_freq", (DENSE_HEAD_DIM // 2,), "float32")]
    return specs


class TinyDenseEngine(torch.nn.Module):
    """The generation side of the tiny dense model as vLLM holds it at tensor-parallel rank 1 of 2: fused
    ``qkv_proj`` and ``gate_up_proj`` (this rank's rows of each shard), column-split ``o_proj`` / ``down_proj``,
    a vocabulary-split embedding and LM head. ``load_weights`` does what vLLM's weight loaders do: map the HF
    name to the parameter (and shard), narrow the parameter to the shard and the tensor to this rank's part,
    copy. Three tensors load differently, as some of vLLM's loaders do: ``model.norm.weight`` is stored as
    ``1 + w`` (a computed value), a layer's fp32 ``router_bias`` goes through an fp32 temporary, and the rotary
    ``inv_freq`` is skipped (vLLM computes it)."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        h, t = DENSE_HIDDEN, DENSE_TP_SIZE
        q, kv, i = DENSE_HEADS * DENSE_HEAD_DIM, DENSE_KV_HEADS * DENSE_HEAD_DIM, DENSE_INTER
        self.sizes = {"q": q // t, "k": kv // t, "v": kv // t}
        self.offsets = {"q": 0, "k": q // t, "v": (q + kv) // t}
        self.params: dict[str, torch.nn.Parameter] = {}

        def add(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> None:
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            self.register_parameter(name.replace(".", "__"), p)
            self.params[name] = p

        add("model.embed_tokens.weight", (DENSE_VOCAB // t, h))
        for n in range(layers):
            p = f"model.layers.{n}"
            add(f"{p}.input_layernorm.weight", (h,))
            add(f"{p}.self_attn.qkv_proj.weight", ((q + 2 * kv) // t, h))
            add(f"{p}.self_attn.o_proj.weight", (h, q // t))
            add(f"{p}.post_attention_layernorm.weight", (h,))
            add(f"{p}.mlp.gate_up_proj.weight", (2 * i // t, h))
            add(f"{p}.mlp.down_proj.weight", (h, i // t))
            add(f"{p}.mlp.router_bias", (8,), torch.float32)
        add("model.norm.weight", (h,))
        add("lm_head.weight", (DENSE_VOCAB // t, h))

    def load_weights(self, weights: Any) -> set[str]:
        r, t = DENSE_TP_RANK, DENSE_TP_SIZE
        loaded = set()
        for name, w in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            module, _, leaf = name.rpartition(".")
            module, _, proj = module.rpartition(".")
            target = name
            if proj in _STACKED:
                fused, shard = _STACKED[proj]
                target = f"{module}.{fused}.{leaf}"
                param = self.params[target]
                if isinstance(shard, str):
                    size, offset = self.sizes[shard], self.offsets[shard]
                else:
                    size = DENSE_INTER // t
                    offset = shard * size
                param.data.narrow(0, offset, size).copy_(w.narrow(0, r * size, size))
            elif name == "model.norm.weight":
                self.params[name].data.copy_(w + 1)
            elif name.endswith("router_bias"):
                self.params[name].data.copy_(w.to(torch.float64))
            else:
                param = self.params[name]
                if proj in ("o_proj", "down_proj"):  # row-parallel: this rank's columns
                    cols = param.shape[1]
                    param.data.copy_(w.narrow(1, r * cols, cols))
                elif name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocabulary-parallel rows
                    rows = param.shape[0]
                    param.data.copy_(w.narrow(0, r * rows, rows))
                else:
                    param.data.copy_(w)
            loaded.add(target)  # as vLLM's loaders: the parameter names written
        return loaded

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Dotted names, as vLLM's model has them (torch modules cannot register a dotted name)."""
        return iter(self.params.items())

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}


def dense_export(step: int, layers: int = 2):
    specs = dense_specs(layers)
    return specs, ((s.name, synthetic_tensor(s, step)) for s in specs)


def dense_consumer_main(job: dict[str, Any]) -> dict[str, Any]:
    """The consumer into :class:`TinyDenseEngine`: with ``job['replay']`` the first refit recorded and every later
    one replayed (``rlc.runtime.refit.replay``), else the engine's ``load_weights`` every refit. Returns the
    engine's parameters after each refit and the replay table's summary."""
    from rlc.runtime.refit.buffers import ShmBackend
    from rlc.runtime.refit.consumer import RefitConsumer

    consumer = None
    try:
        engine = TinyDenseEngine()
        consumer = RefitConsumer(session=job["session"], backend=ShmBackend("shm-dense"),
                                 timeout_s=job.get("timeout_s", 20.0))
        consumer.prepare(mapped_during_refit=job.get("mapped_during_refit", 0))
        replay = ReplayedLoad(engine) if job["replay"] else None
        params, metrics = [], []
        kept: list[torch.Tensor] = []
        began: list[int] = []  # at each refit's on_begin: how many tensors this refit had loaded by then
        for _ in range(job.get("steps", 1)):
            loader = engine.load_weights if replay is None else replay.loader(consumer)
            before = engine.snapshot()

            def keeping(weights: Any, load: Any = loader) -> Any:  # a loader that keeps what it is handed
                weights = list(weights)
                kept.extend(t for _, t in weights)
                return load(weights)

            def on_begin(before: dict[str, torch.Tensor] = before) -> None:
                now = engine.snapshot()
                began.append(sum(not torch.equal(now[n], before[n]) for n in now))

            metrics.append(consumer.receive(keeping if job.get("keep_views") else loader,
                                            on_begin=on_begin if job.get("on_begin") else None).to_dict())
            if replay is not None:
                replay.done(loader, consumer)
            params.append(engine.snapshot())
        return {"ok": True, "params": params, "stats": [] if replay is None else replay.stats,
                "table": None if replay is None else replay.summary(), "metrics": metrics, "began": began}
    except BaseException as e:
        return _error(e)
    finally:
        if consumer is not None:
            consumer.close()


def export_writer_main(job: dict[str, Any]) -> dict[str, Any]:
    """A trainer rank's side of the streamed ``refit.verify_every`` check: write :func:`dense_export` in shards
    (``job['fail_after']``: the export stream raises after that many tensors)."""
    from dataclasses import asdict

    from rlc.runtime.refit.verify_stream import ShardFiles, write_export_shards

    _, stream = dense_export(job.get("step", 0), job["layers"])

    def export():
        for n, item in enumerate(stream):
            if n == job.get("fail_after"):
                raise RuntimeError("the export stopped: a gather failed on another rank")
            yield item

    try:
        written = write_export_shards(ShardFiles(job["dir"], 0), export(), shard_bytes=job["shard_bytes"],
                                      max_pending=job.get("max_pending", 2), wait_s=job.get("wait_s", 20.0))
        return {"ok": True, **asdict(written)}
    except BaseException as e:
        return _error(e)


def verify_reader_main(job: dict[str, Any]) -> dict[str, Any]:
    """The vLLM worker's side: a :class:`TinyDenseEngine` holding the refit of ``job['step']`` (then changed as
    ``job`` asks: ``flip`` a bit of a parameter, ``round_bias`` a layer's fp32 bias to bf16, ``foreign``: its loader
    also reports writing a parameter of another layer; ``fail_at_layer``: its loader raises there) checks the writer's
    shards as they come."""
    from rlc.runtime.refit.verify_stream import ShardFiles, check_streamed

    layers = job["layers"]
    engine = TinyDenseEngine(layers)
    _, stream = dense_export(job.get("step", 0), layers)
    engine.load_weights(stream)  # what a correct refit leaves
    with torch.no_grad():
        if job.get("flip"):
            engine.params[job["flip"]].data.view(torch.int16).view(-1)[3] ^= 1
        if job.get("round_bias") is not None:
            bias = engine.params[f"model.layers.{job['round_bias']}.mlp.router_bias"]
            bias.data.copy_(bias.data.to(torch.bfloat16).to(torch.float32))

    def load(items: list[tuple[str, torch.Tensor]]) -> set[str]:
        if job.get("fail_at_layer") is not None and any(f".layers.{job['fail_at_layer']}." in n for n, _ in items):
            raise RuntimeError("vLLM's weight loader raised")
        written = engine.load_weights(items)
        if job.get("foreign") and any(".layers.1." in n for n, _ in items):
            written.add(job["foreign"])
        return written

    try:
        report = check_streamed(engine, ShardFiles(job["dir"], 0), load, wait_s=job.get("wait_s", 20.0))
        model_bytes = sum(p.numel() * p.element_size() for p in engine.params.values())
        return {"ok": True, "report": report, "model_bytes": model_bytes, "left": sorted(os.listdir(job["dir"]))}
    except BaseException as e:
        return _error(e)
