"""What ``refit_at_scale.py`` measures and how it judges it (pure Python; torch only inside functions).

Everything here runs without a GPU and is tested on CPU (``tests/benchmarks/test_refit_at_scale.py``):

- ``load_hf_config`` / ``ModelBytes``: parameter bytes of a Qwen3 / Qwen3-MoE shape from its HF config,
  split into expert and non-expert weights (what each trainer rank and vLLM worker holds);
- ``Layout`` / ``memory_budget``: the per-GPU memory budget of one colocated case, checked before
  anything starts;
- ``spot_checks`` / ``spot_check_verdict``: which exported HF tensors are checked bit for bit after
  the last refit (expert, attention, router, norm, embedding) and the verdict over the workers;
- ``summarize_refits``: the per-refit records turned into the time breakdown (median, min, max);
- ``tiny_step_overhead``: refit + sleep as a fraction of the step, from a GRPO ``metrics.jsonl``;
- ``Goal`` / ``evaluate_goals``: the stated goals and the verdict ``--check`` exits on.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

GIB = 1 << 30
BENCH_DIR = Path(__file__).resolve().parent
MODELS_DIR = BENCH_DIR / "models"
#: Shapes the benchmark knows (HF ``config.json`` copies, see ``models/``).
MODELS = {"qwen3-30b-a3b": MODELS_DIR / "qwen3-30b-a3b.json", "qwen3-8b": MODELS_DIR / "qwen3-8b.json"}
BF16_BYTES = 2
#: One CUDA context (+ NCCL / cuBLAS workspaces) per process on a GPU, a conservative figure.
CUDA_CONTEXT_BYTES = 1 * GIB
#: What vLLM keeps on the GPU after ``sleep(level=2)`` with ``enforce_eager`` (measured: 0.8 GiB).
VLLM_SLEEP_RESIDUE_BYTES = 1 * GIB
#: Share of the GPU the budget may plan for; the rest absorbs allocator fragmentation.
USABLE_FRACTION = 0.95


class BenchmarkInputError(ValueError):
    """A benchmark argument or model config cannot be used (the message names the fix)."""


# --------------------------------------------------------------------------- model shape


def load_hf_config(model: str) -> dict[str, Any]:
    """The HF config of a known shape (``qwen3-30b-a3b``, ``qwen3-8b``) or of a ``config.json`` path."""
    path = MODELS.get(model, Path(model))
    if not path.is_file():
        raise BenchmarkInputError(
            f"model {model!r}: not one of {', '.join(MODELS)} and not a config.json file; pass a known name or a path"
        )
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_")}


def _need(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise BenchmarkInputError(f"HF config of model_type {cfg.get('model_type')!r} has no {key!r}")
    return cfg[key]


def is_moe(cfg: dict[str, Any]) -> bool:
    return int(cfg.get("num_experts") or 0) > 0


def _check_family(cfg: dict[str, Any]) -> None:
    if cfg.get("model_type") not in ("qwen3", "qwen3_moe"):
        raise BenchmarkInputError(
            f"model_type {cfg.get('model_type')!r}: the benchmark's parameter accounting and vLLM spot checks "
            "know qwen3 and qwen3_moe only"
        )
    if is_moe(cfg) and (cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1):
        raise BenchmarkInputError("qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step) is not modelled")


@dataclass(frozen=True)
class ModelBytes:
    """bf16 parameter bytes of a model, split the way the parallel layouts shard them."""

    embedding: int  # input embedding + untied LM head
    attention: int  # q/k/v/o projections of every layer
    dense_mlp: int  # dense MLPs (0 for an all-MoE model)
    experts: int  # routed experts of every layer
    router: int  # router (gate) weights
    norms: int  # layer norms, q/k norms, final norm (replicated everywhere)
    num_tensors: int  # HF tensors the exporter yields (one per expert and projection)
    largest_tensor: int  # bytes of the largest exported HF tensor

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.dense_mlp + self.experts + self.router + self.norms

    @property
    def non_expert(self) -> int:
        return self.total - self.experts

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def model_bytes(cfg: dict[str, Any]) -> ModelBytes:
    """Parameter bytes of a Qwen3 / Qwen3-MoE config in bf16 (matches the exporter's tensor list)."""
    _check_family(cfg)
    h = int(_need(cfg, "hidden_size"))
    layers = int(_need(cfg, "num_hidden_layers"))
    heads = int(_need(cfg, "num_attention_heads"))
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    vocab = int(_need(cfg, "vocab_size"))
    tied = bool(cfg.get("tie_word_embeddings", False))
    b = BF16_BYTES
    embed_one = vocab * h * b
    embedding = embed_one * (1 if tied else 2)
    q_o = 2 * h * heads * hd
    k_v = 2 * h * kv * hd
    attention = layers * (q_o + k_v) * b
    norms = (layers * (2 * h + 2 * hd) + h) * b
    per_layer_tensors = 4 + 2 + 2  # q, k, v, o; q_norm, k_norm; two layer norms
    if is_moe(cfg):
        experts_n = int(cfg["num_experts"])
        inter = int(_need(cfg, "moe_intermediate_size"))
        experts = layers * experts_n * 3 * h * inter * b
        router = layers * experts_n * h * b
        dense_mlp = 0
        per_layer_tensors += 1 + 3 * experts_n
        largest_mlp = h * inter * b
    else:
        inter = int(_need(cfg, "intermediate_size"))
        experts = router = 0
        dense_mlp = layers * 3 * h * inter * b
        per_layer_tensors += 3
        largest_mlp = h * inter * b
    num_tensors = layers * per_layer_tensors + 1 + 1 + (0 if tied else 1)
    largest = max(embed_one, h * heads * hd * b, largest_mlp)
    return ModelBytes(embedding, attention, dense_mlp, experts, router, norms, num_tensors, largest)


# --------------------------------------------------------------------------- layouts and memory


@dataclass(frozen=True)
class Layout:
    """One benchmark case: the model, how many GPUs, the trainer's and vLLM's parallelism."""

    name: str
    model: str
    gpus: int
    train_tp: int = 1
    train_ep: int = 1
    train_etp: int = 1
    gen_tp: int = 1
    vllm_util: float = 0.4
    buffer_gb: float = 2.0
    #: ``refit.keep_weights_awake``: only vLLM's KV cache sleeps; the refit writes into the resident weights
    weights_awake: bool = False
    #: ``refit.direct_export``: views (or one row gather) of the trainer's parameters instead of Bridge's conversion
    direct_export: bool = False
    #: ``refit.replay_load``: vLLM's first load recorded as copies, replayed at every later refit
    replay_load: bool = False
    #: ``refit.zero_copy_views``: the direct export's views read by vLLM where the trainer holds them
    zero_copy_views: bool = False
    #: ``refit.wake_kv_during_transfer``: vLLM's KV cache mapped back while the weights arrive
    wake_kv_during_transfer: bool = False
    #: ``refit.keep_kv_cache_awake``: vLLM's KV cache stays mapped too (the engine never sleeps)
    kv_cache_awake: bool = False
    #: ``refit.zero_copy_experts``: the fused transfer's stacked experts read in place too, expert by expert
    zero_copy_experts: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_awake and not self.weights_awake:
            raise BenchmarkInputError(f"case {self.name}: the KV cache is kept awake only with the weights")
        if self.train_tp * 1 > self.gpus or self.gpus % self.train_tp:
            raise BenchmarkInputError(f"case {self.name}: trainer TP {self.train_tp} does not divide {self.gpus} GPUs")
        if self.gpus % (self.train_ep * self.train_etp):
            raise BenchmarkInputError(
                f"case {self.name}: trainer EP {self.train_ep} x ETP {self.train_etp} does not divide {self.gpus} GPUs"
            )
        if self.gpus % self.gen_tp:
            raise BenchmarkInputError(f"case {self.name}: vLLM TP {self.gen_tp} does not divide {self.gpus} GPUs")
        if not 0 < self.vllm_util < 1:
            raise BenchmarkInputError(
                f"case {self.name}: vLLM gpu_memory_utilization {self.vllm_util} must be in (0, 1)"
            )
        if self.buffer_gb <= 0:
            raise BenchmarkInputError(f"case {self.name}: refit buffer_gb {self.buffer_gb} must be > 0")

    @property
    def train_dp(self) -> int:
        return self.gpus // self.train_tp

    @property
    def expert_dp(self) -> int:
        return self.gpus // (self.train_ep * self.train_etp)

    def describe(self) -> str:
        par = f"TP={self.train_tp}" + (f" EP={self.train_ep}" if self.train_ep > 1 else "") + (
            f" ETP={self.train_etp}" if self.train_etp > 1 else "")
        awake = "; vLLM's weights kept awake (only its KV cache sleeps)" if self.weights_awake else ""
        if self.kv_cache_awake:
            awake = "; vLLM kept awake (weights and KV cache: the engine never sleeps)"
        direct = "".join(part for on, part in ((self.direct_export, "; direct export"),
                                               (self.zero_copy_views, "; zero-copy views"),
                                               (self.zero_copy_experts, "; experts read in place"),
                                               (self.wake_kv_during_transfer, "; KV cache woken during the transfer"),
                                               (self.replay_load, "; replayed load")) if on)
        return f"{self.model} on {self.gpus} GPU(s): trainer {par}, vLLM TP={self.gen_tp}{awake}{direct}"


#: The cases ``--cases`` can name (besides ``engine`` and ``tiny``), with the defaults the goals refer to.
def default_layouts(moe_util: float = 0.4, dense_util: float = 0.3, buffer_gb: float = 2.0,
                    moe_one_gpu_util: float = 0.48) -> dict[str, Layout]:
    return {
        "dense-8b": Layout("dense-8b", "qwen3-8b", 1, vllm_util=dense_util, buffer_gb=buffer_gb),
        # The whole 30B-A3B on one GPU twice (trainer + vLLM, 57 GiB each): the same bytes as the two-GPU
        # cases, moved by one producer and one consumer; vLLM's share must hold its weights and a KV cache
        # yet leave the trainer's weights room (0.43 <= util <= 0.51 on an H200).
        "moe-1gpu": Layout("moe-1gpu", "qwen3-30b-a3b", 1, vllm_util=moe_one_gpu_util, buffer_gb=buffer_gb),
        # the same two cases with refit.keep_weights_awake (the refit skips re-mapping vLLM's weights)
        "dense-8b-awake": Layout("dense-8b-awake", "qwen3-8b", 1, vllm_util=dense_util, buffer_gb=buffer_gb,
                                 weights_awake=True),
        "moe-1gpu-awake": Layout("moe-1gpu-awake", "qwen3-30b-a3b", 1, vllm_util=moe_one_gpu_util,
                                 buffer_gb=buffer_gb, weights_awake=True),
        # and with refit.direct_export and refit.replay_load on top (no per-tensor conversion or loader Python),
        # both or one of them (which part of a change, or of a failure, is whose)
        "dense-8b-direct": Layout("dense-8b-direct", "qwen3-8b", 1, vllm_util=dense_util, buffer_gb=buffer_gb,
                                  weights_awake=True, direct_export=True, replay_load=True),
        "dense-8b-export": Layout("dense-8b-export", "qwen3-8b", 1, vllm_util=dense_util, buffer_gb=buffer_gb,
                                  weights_awake=True, direct_export=True),
        "dense-8b-replay": Layout("dense-8b-replay", "qwen3-8b", 1, vllm_util=dense_util, buffer_gb=buffer_gb,
                                  weights_awake=True, replay_load=True),
        "moe-1gpu-direct": Layout("moe-1gpu-direct", "qwen3-30b-a3b", 1, vllm_util=moe_one_gpu_util,
                                  buffer_gb=buffer_gb, weights_awake=True, direct_export=True, replay_load=True),
        # and with refit.zero_copy_views: the direct export's views cross in one copy (no pack, no one-off buffer)
        "dense-8b-zero-copy": Layout("dense-8b-zero-copy", "qwen3-8b", 1, vllm_util=dense_util, buffer_gb=buffer_gb,
                                     weights_awake=True, direct_export=True, replay_load=True, zero_copy_views=True),
        "moe-1gpu-zero-copy": Layout("moe-1gpu-zero-copy", "qwen3-30b-a3b", 1, vllm_util=moe_one_gpu_util,
                                     buffer_gb=buffer_gb, weights_awake=True, direct_export=True, replay_load=True,
                                     zero_copy_views=True),
        # and the KV cache's wake-up off the critical path (refit.wake_kv_during_transfer): every switch at once
        "dense-8b-overlap": Layout("dense-8b-overlap", "qwen3-8b", 1, vllm_util=dense_util, buffer_gb=buffer_gb,
                                   weights_awake=True, direct_export=True, replay_load=True, zero_copy_views=True,
                                   wake_kv_during_transfer=True),
        # and vLLM's KV cache kept mapped too (refit.keep_kv_cache_awake): no wake-up, no sleep, the memory counted
        "dense-8b-resident": Layout("dense-8b-resident", "qwen3-8b", 1, vllm_util=dense_util, buffer_gb=buffer_gb,
                                    weights_awake=True, direct_export=True, replay_load=True, zero_copy_views=True,
                                    kv_cache_awake=True),
        # and the stacked experts read in place too (refit.zero_copy_experts): one copy of the experts' bytes
        "moe-1gpu-zero-copy-experts": Layout("moe-1gpu-zero-copy-experts", "qwen3-30b-a3b", 1,
                                             vllm_util=moe_one_gpu_util, buffer_gb=buffer_gb, weights_awake=True,
                                             direct_export=True, replay_load=True, zero_copy_views=True,
                                             zero_copy_experts=True),
        "moe-1gpu-resident": Layout("moe-1gpu-resident", "qwen3-30b-a3b", 1, vllm_util=moe_one_gpu_util,
                                    buffer_gb=buffer_gb, weights_awake=True, direct_export=True, replay_load=True,
                                    zero_copy_views=True, kv_cache_awake=True),
        "moe-ep2": Layout("moe-ep2", "qwen3-30b-a3b", 2, train_ep=2, gen_tp=2, vllm_util=moe_util, buffer_gb=buffer_gb),
        "moe-tp2": Layout("moe-tp2", "qwen3-30b-a3b", 2, train_tp=2, train_etp=2, gen_tp=2, vllm_util=moe_util,
                          buffer_gb=buffer_gb),
    }


@dataclass(frozen=True)
class MemoryBudget:
    """Per-GPU memory of one case at its two peaks (bytes); ``problems`` empty when it fits."""

    layout: str
    gpu_bytes: int
    trainer_weights: int
    vllm_weights: int
    vllm_reserved: int  # gpu_memory_utilization x GPU: weights + KV cache + activations while awake
    refit_buffers: int  # both ping-pong halves
    export_working_set: int  # the largest exported tensor, gathered and converted (x2)
    contexts: int  # CUDA contexts of the processes on one GPU
    at_refit: int  # trainer + vLLM weights (woken) + buffers + exporter + residue + contexts (+ the KV cache woken
    # during the transfer)
    at_generation: int  # trainer + vLLM's reservation + buffers (kept between refits) + contexts
    problems: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return not self.problems

    def rows(self) -> list[tuple[str, float]]:
        g = float(GIB)
        return [
            ("trainer weights (bf16, no optimizer, no grads)", self.trainer_weights / g),
            ("vLLM weights (TP shard)", self.vllm_weights / g),
            ("vLLM reservation (gpu_memory_utilization x GPU)", self.vllm_reserved / g),
            ("refit buffers (both halves)", self.refit_buffers / g),
            ("exporter working set (largest tensor x 2)", self.export_working_set / g),
            ("CUDA contexts", self.contexts / g),
            ("peak at refit (vLLM weights awake, KV freed)", self.at_refit / g),
            ("peak at generation (vLLM awake)", self.at_generation / g),
            ("GPU memory", self.gpu_bytes / g),
        ]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fits": self.fits}


def trainer_bytes(mb: ModelBytes, layout: Layout) -> int:
    """Weights one trainer rank holds: non-expert weights over TP (norms replicated), experts over EP x ETP."""
    sharded = mb.embedding + mb.attention + mb.dense_mlp
    return sharded // layout.train_tp + mb.experts // (layout.train_ep * layout.train_etp) + mb.router + mb.norms


def memory_budget(mb: ModelBytes, layout: Layout, gpu_bytes: int) -> MemoryBudget:
    """The per-GPU budget of ``layout`` and what does not fit (no optimizer: the benchmark builds none)."""
    trainer = trainer_bytes(mb, layout)
    vllm_weights = mb.total // layout.gen_tp
    reserved = int(layout.vllm_util * gpu_bytes)
    buffers = int(layout.buffer_gb * GIB)
    export_ws = 2 * mb.largest_tensor
    procs = 3 if layout.gen_tp > 1 else 2  # trainer rank, vLLM worker, (+ the engine actor on GPU 0 at TP > 1)
    contexts = procs * CUDA_CONTEXT_BYTES
    # refit.wake_kv_during_transfer / keep_kv_cache_awake: vLLM's KV cache (its reservation less its weights) is
    # mapped during the refit
    kv_during_refit = max(reserved - vllm_weights, 0) if layout.wake_kv_during_transfer or layout.kv_cache_awake else 0
    at_refit = trainer + vllm_weights + buffers + export_ws + VLLM_SLEEP_RESIDUE_BYTES + contexts + kv_during_refit
    at_generation = trainer + reserved + buffers + contexts
    usable = int(USABLE_FRACTION * gpu_bytes)
    problems = []
    if reserved < vllm_weights + 2 * GIB:
        problems.append(
            f"vLLM gpu_memory_utilization {layout.vllm_util:g} reserves {reserved / GIB:.1f} GiB but its weights alone "
            f"are {vllm_weights / GIB:.1f} GiB (+ 2 GiB for KV cache and activations); raise it"
        )
    for what, need in (("at refit", at_refit), ("at generation", at_generation)):
        if need > usable:
            problems.append(
                f"peak {what} {need / GIB:.1f} GiB exceeds {USABLE_FRACTION:.0%} of the GPU ({usable / GIB:.1f} GiB); "
                "lower the vLLM gpu_memory_utilization or the refit buffer, or use more GPUs"
            )
    return MemoryBudget(layout.name, gpu_bytes, trainer, vllm_weights, reserved, buffers, export_ws, contexts,
                        at_refit, at_generation, tuple(problems))


# --------------------------------------------------------------------------- bit-exact spot checks


@dataclass(frozen=True)
class SpotCheck:
    """One exported HF tensor and the vLLM parameter it is loaded into (fused / TP-sliced by vLLM)."""

    kind: str  # embedding | attention | norm | router | router_bias | expert | mlp
    hf_name: str
    vllm_name: str


def spot_checks(cfg: dict[str, Any]) -> tuple[list[SpotCheck], list[str]]:
    """The tensors checked bit for bit after the last refit, chosen from the HF config, and notes on
    kinds the family lacks.

    MoE: experts 0 and E-1 (on different EP ranks of the trainer) of the last layer, its router, the
    attention projections and q-norm of the middle layer, embedding, LM head, the final norm. The
    check reloads these HF tensors through vLLM's own ``load_weights`` and compares the named vLLM
    parameters with their values after the refit (``rlc.runtime.refit.verify.verify_by_reload``), so
    vLLM's fusing and tensor-parallel slicing are its own, not assumed here.
    """
    _check_family(cfg)
    layers = int(cfg["num_hidden_layers"])
    mid, last = layers // 2, layers - 1
    att = f"model.layers.{mid}.self_attn"
    checks = [SpotCheck("embedding", "model.embed_tokens.weight", "model.embed_tokens.weight")]
    checks += [SpotCheck("attention", f"{att}.{p}_proj.weight", f"{att}.qkv_proj.weight") for p in "qkv"]
    checks += [
        SpotCheck("attention", f"{att}.o_proj.weight", f"{att}.o_proj.weight"),
        SpotCheck("norm", f"{att}.q_norm.weight", f"{att}.q_norm.weight"),
        SpotCheck("norm", "model.norm.weight", "model.norm.weight"),
    ]
    if not cfg.get("tie_word_embeddings", False):
        checks.append(SpotCheck("embedding", "lm_head.weight", "lm_head.weight"))
    notes = []
    if cfg.get("attention_bias"):
        notes.append("attention bias present but not checked (Qwen3 shapes have none)")
    if is_moe(cfg):
        mlp = f"model.layers.{last}.mlp"
        checks.append(SpotCheck("router", f"{mlp}.gate.weight", f"{mlp}.gate.weight"))
        for e in sorted({0, int(cfg["num_experts"]) - 1}):
            checks += [
                SpotCheck("expert", f"{mlp}.experts.{e}.gate_proj.weight", f"{mlp}.experts.w13_weight"),
                SpotCheck("expert", f"{mlp}.experts.{e}.up_proj.weight", f"{mlp}.experts.w13_weight"),
                SpotCheck("expert", f"{mlp}.experts.{e}.down_proj.weight", f"{mlp}.experts.w2_weight"),
            ]
        notes.append(f"{cfg['model_type']}: the router has no bias (no e_score_correction_bias), nothing to check")
    else:
        mlp = f"model.layers.{mid}.mlp"
        checks += [SpotCheck("mlp", f"{mlp}.{p}_proj.weight", f"{mlp}.gate_up_proj.weight") for p in ("gate", "up")]
        checks.append(SpotCheck("mlp", f"{mlp}.down_proj.weight", f"{mlp}.down_proj.weight"))
    return checks, notes


def spot_check_verdict(checks: Sequence[SpotCheck], reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pass when every vLLM worker compared every checked parameter and all are bit-exact.

    ``reports``: one ``verify_by_reload`` result per vLLM worker (``device_key``, ``mismatches``,
    ``not_loaded``, ``missing_params``, ``params_compared``).
    """
    want = sorted({c.vllm_name for c in checks})
    problems = []
    if not reports:
        problems.append("no vLLM worker reported")
    for i, r in enumerate(reports):
        who = f"vLLM worker {i} (GPU {r.get('device_key', '?')})"
        if r.get("missing_params"):
            problems.append(f"{who}: no parameter(s) {', '.join(r['missing_params'])}")
        if r.get("not_loaded"):
            problems.append(f"{who}: the reload did not write {', '.join(r['not_loaded'])}")
        for m in r.get("mismatches", []):
            problems.append(f"{who}: {m['name']} differs in {m['elements_differing']} element(s), "
                            f"max |diff| {m['max_abs_diff']:.3g}")
        if r.get("params_compared", 0) != len(want) - len(r.get("missing_params", [])) - len(r.get("not_loaded", [])):
            problems.append(f"{who}: compared {r.get('params_compared', 0)} of {len(want)} parameters")
    kinds = sorted({c.kind for c in checks})
    return {"passed": not problems, "kinds": kinds, "tensors": len(checks), "params": want,
            "workers": len(reports), "problems": problems}


# --------------------------------------------------------------------------- timing breakdown

#: Producer fields that add up to the producer's wall time (the rest is "other": ZMQ, planning, manifest).
PRODUCER_PARTS = ("export_seconds", "pack_seconds", "zero_copy_seconds", "alloc_seconds", "wait_ack_seconds",
                  "done_wait_seconds")


def _stats(values: Sequence[float]) -> dict[str, float]:
    vals = [float(v) for v in values]
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def refit_row(rec: dict[str, Any]) -> dict[str, float]:
    """One refit's breakdown: the slowest producer rank's parts, the slowest consumer's, sleep/wake."""
    prods = rec["producers"]
    cons = rec["consumers"]
    if not prods or not cons:
        raise BenchmarkInputError("a refit record needs producer and consumer metrics")
    p = max(prods, key=lambda m: m["seconds"])
    c = max(cons, key=lambda m: m["seconds"])
    row = {
        "total_refit_s": rec["wake_weights_s"] + rec["transfer_s"] + rec["wake_kv_s"]
        + rec.get("reset_prefix_cache_s", 0.0),
        "transfer_s": rec["transfer_s"],
        "sleep_s": rec["sleep_s"],
        "wake_weights_s": rec["wake_weights_s"],
        "wake_kv_s": rec["wake_kv_s"],
        "reset_prefix_cache_s": rec.get("reset_prefix_cache_s", 0.0),
        "producer_s": p["seconds"],
        "export_s": p["export_seconds"],
        "pack_s": p["pack_seconds"],
        "zero_copy_s": p.get("zero_copy_seconds", 0.0),
        "alloc_s": p["alloc_seconds"],
        "wait_consumer_s": p["wait_ack_seconds"],
        "wait_done_s": p.get("done_wait_seconds", 0.0),
        "other_s": p["seconds"] - sum(p.get(k, 0.0) for k in PRODUCER_PARTS),
        "load_weights_s": c["load_seconds"] + c.get("sync_seconds", 0.0),
        "consumer_open_s": c["open_seconds"],
        "consumer_wait_s": c["wait_seconds"],
        "bytes_per_gpu": float(p["bytes"]),
        "zero_copy_bytes": float(p.get("zero_copy_bytes", 0)),
        "buckets": float(p["num_buckets"]),
        "buffers_allocated": float(sum(m.get("buffers_allocated", 0) for m in prods)),
        "buffers_opened": float(sum(m.get("consumer", {}).get("buffers_opened", 0) for m in prods)),
        "device_ordered": float(all(m.get("device_ordered", False) for m in prods)),
    }
    row["refit_plus_sleep_s"] = row["total_refit_s"] + row["sleep_s"]
    return row


#: Rows of the printed breakdown: (key, label).
BREAKDOWN_ROWS = (
    ("total_refit_s", "total refit = wake-ups + transfer + prefix-cache reset"),
    ("transfer_s", "  transfer (trainer export -> vLLM load, both sides)"),
    ("export_s", "    export (Bridge's conversion, or views), slowest rank"),
    ("pack_s", "    packing into the IPC buffers"),
    ("zero_copy_s", "    describing zero-copy views (read in place)"),
    ("wait_consumer_s", "    waiting for vLLM (load not hidden behind export)"),
    ("wait_done_s", "    waiting for vLLM's last loads and manifest check"),
    ("alloc_s", "    buffer allocation / IPC handles"),
    ("other_s", "    handshake, planning, manifest"),
    ("load_weights_s", "  vLLM load (load_weights or replayed copies, + sync)"),
    ("consumer_open_s", "  vLLM opening IPC handles"),
    ("wake_weights_s", "  wake_up(weights)"),
    ("wake_kv_s", "  wake_up(kv_cache)"),
    ("reset_prefix_cache_s", "  prefix-cache reset"),
    ("sleep_s", "sleep (level 2; KV cache only with the weights awake; none kept awake)"),
    ("refit_plus_sleep_s", "refit + sleep"),
)


def summarize_refits(records: Sequence[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Median / min / max of every breakdown row over the measured refits (after ``warmup``)."""
    if warmup < 0 or warmup >= len(records):
        raise BenchmarkInputError(f"{len(records)} refit record(s) leave none to measure after {warmup} warm-up")
    rows = [refit_row(r) for r in records[warmup:]]
    keys = rows[0].keys()
    return {"refits": len(rows), "warmup": warmup, **{k: _stats([r[k] for r in rows]) for k in keys}}


def tiny_step_overhead(metrics_path: str | Path, skip_first: int = 1) -> dict[str, Any]:
    """Refit + sleep as a fraction of the step, median over a GRPO ``metrics.jsonl`` (first step skipped)."""
    path = Path(metrics_path)
    if not path.is_file():
        raise BenchmarkInputError(f"--tiny-metrics {path}: no such file (a GRPO run's metrics.jsonl)")
    steps = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind") or "timing/step_s" not in rec:
            continue  # calibration or other records
        steps.append(rec)
    steps = steps[skip_first:]
    if not steps:
        raise BenchmarkInputError(f"--tiny-metrics {path}: no step records with timing/step_s after the first")
    missing = [k for k in ("timing/refit_s", "timing/sleep_s") if k not in steps[0]]
    if missing:
        raise BenchmarkInputError(f"--tiny-metrics {path}: step records lack {', '.join(missing)}")
    frac = [(s["timing/refit_s"] + s["timing/sleep_s"]) / s["timing/step_s"] for s in steps]
    return {
        "metrics": str(path),
        "steps": len(steps),
        "step_s": statistics.median(s["timing/step_s"] for s in steps),
        "refit_s": statistics.median(s["timing/refit_s"] for s in steps),
        "sleep_s": statistics.median(s["timing/sleep_s"] for s in steps),
        "overhead_fraction": statistics.median(frac),
    }


# --------------------------------------------------------------------------- goals and verdict


@dataclass(frozen=True)
class Goal:
    name: str
    description: str
    limit: float
    at_most: bool  # True: value <= limit; False: value >= limit
    value: float | None = None  # None: not measured in this run

    @property
    def measured(self) -> bool:
        return self.value is not None and not math.isnan(self.value)

    @property
    def met(self) -> bool | None:
        if not self.measured:
            return None
        assert self.value is not None
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def line(self) -> str:
        op = "<=" if self.at_most else ">="
        if not self.measured:
            return f"{self.name}: not measured in this run (goal {op} {self.limit:g}; {self.description})"
        verdict = "MET" if self.met else "NOT MET"
        return f"{self.name}: {self.value:.4g} {op} {self.limit:g}? {verdict} ({self.description})"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "measured": self.measured, "met": self.met}


#: Qwen3-30B-A3B total refit: median and slowest of the measured refits (a refit is on every step's critical path,
#: so its spread counts too). 61 GB at the two-copy bound of an H200 (pack + load) is ~0.064 s.
MOE_TOTAL_REFIT_S = 0.5
MOE_MAX_REFIT_S = 1.0
#: Qwen3-8B total refit, median (16.4 GB: ~0.017 s at the two-copy bound).
DENSE_TOTAL_REFIT_S = 0.05
ENGINE_RATIO = 0.4
TINY_OVERHEAD = 0.15


def evaluate_goals(results: dict[str, Any]) -> list[Goal]:
    """The stated goals from a results dict (``cases`` keyed by case name, ``engine``, ``tiny``)."""
    goals = []
    cases = results.get("cases", {})
    for name in sorted(n for n in cases if n.startswith("moe")):
        summary = cases[name].get("summary")
        what = f"Qwen3-30B-A3B, {cases[name].get('describe', name)}"
        goals.append(Goal(f"{name} total refit (s)", f"{what}; median of the measured refits", MOE_TOTAL_REFIT_S,
                          True, summary["total_refit_s"]["median"] if summary else None))
        goals.append(Goal(f"{name} slowest refit (s)", f"{what}; max of the measured refits", MOE_MAX_REFIT_S,
                          True, summary["total_refit_s"]["max"] if summary else None))
    for name in sorted(n for n in cases if n.startswith("dense-8b")):
        summary = cases[name].get("summary")
        goals.append(Goal(f"{name} total refit (s)", f"Qwen3-8B, {cases[name].get('describe', name)}; "
                          "median of the measured refits", DENSE_TOTAL_REFIT_S, True,
                          summary["total_refit_s"]["median"] if summary else None))
    engine = results.get("engine") or {}
    goals.append(Goal("engine ratio at 2 GiB", "refit bandwidth / same-run device-to-device copy",
                      ENGINE_RATIO, False, engine.get("ratio")))
    tiny = results.get("tiny") or {}
    goals.append(Goal("tiny-run (refit + sleep) / step", "median over the GRPO run's steps",
                      TINY_OVERHEAD, True, tiny.get("overhead_fraction")))
    return goals


def check_exit_code(goals: Iterable[Goal], errors: Sequence[str]) -> tuple[int, str]:
    """``--check``: 1 when a case failed, a measured goal is missed, or nothing was measured."""
    goals = list(goals)
    if errors:
        return 1, f"{len(errors)} case(s) failed: " + "; ".join(errors)
    measured = [g for g in goals if g.measured]
    if not measured:
        return 1, "no goal was measured in this run"
    missed = [g.name for g in measured if not g.met]
    if missed:
        return 1, "goal(s) not met: " + ", ".join(missed)
    return 0, f"all {len(measured)} measured goal(s) met"


# --------------------------------------------------------------------------- printed report


def render_plan(plans: dict[str, Any]) -> str:
    """The memory budget and spot checks of every GPU case (``plans`` from ``refit_at_scale.plan``)."""
    lines = []
    for name, p in plans.items():
        lay, mb, budget = p["layout"], p["model_bytes"], p["budget"]
        lines.append(f"case {name}: {lay.describe()}; {mb.total / 1e9:.2f} GB bf16 in {mb.num_tensors} HF tensors "
                     f"(experts {mb.experts / 1e9:.2f} GB); vLLM gpu_memory_utilization {lay.vllm_util:g}, "
                     f"refit.buffer_gb {lay.buffer_gb:g}")
        lines.append(f"| {'memory per GPU (no optimizer is built)':<52} | {'GiB':>7} |")
        lines.append(f"|{'-' * 54}|{'-' * 9}|")
        for label, gib in budget.rows():
            lines.append(f"| {label:<52} | {gib:>7.1f} |")
        lines.append("budget: fits" if budget.fits else "budget: DOES NOT FIT: " + "; ".join(budget.problems))
        half = lay.buffer_gb * GIB / 2
        if mb.largest_tensor > half:
            lines.append(
                f"note: the largest tensor ({mb.largest_tensor / GIB:.2f} GiB, the embedding) is larger than a "
                f"ping-pong half ({half / GIB:.2f} GiB): such tensors travel in one-off buffers allocated "
                "every refit"
            )
        kinds = sorted({c.kind for c in p["checks"]})
        lines.append(f"bit-exact spot checks: {len(p['checks'])} tensors ({', '.join(kinds)})"
                     + (f"; {'; '.join(p['notes'])}" if p["notes"] else ""))
        lines.append("")
    return "\n".join(lines)


def _fmt(stats: dict[str, float], scale: float = 1.0) -> str:
    return f"{stats['median'] * scale:>9.4f} | {stats['min'] * scale:>9.4f} | {stats['max'] * scale:>9.4f}"


def _ordering(summary: dict[str, Any]) -> str:
    """How the measured refits ordered their buckets (results recorded before it was measured say nothing)."""
    ordered = summary.get("device_ordered")
    if ordered is None:
        return ""
    if ordered["min"] == ordered["max"]:
        return "; buckets ordered by device events" if ordered["min"] else "; a device wait per bucket"
    return "; buckets ordered by device events in some refits only"


#: Parts of a refit set against the two-copy bound: (summary key, label).
BOUND_PARTS = (
    ("total_refit_s", "total refit"),
    ("export_s", "export"),
    ("pack_s", "packing"),
    ("load_weights_s", "vLLM load"),
    ("wake_weights_s", "wake weights"),
    ("wake_kv_s", "wake KV"),
)


def two_copy_bound_s(nbytes: float, copy_gbps: float, read_in_place: float = 0.0) -> float:
    """Seconds to copy ``nbytes`` twice (pack, load) at the device-to-device copy rate ``copy_gbps``; the
    ``read_in_place`` bytes of them (zero-copy views) only once (load)."""
    return (2 * nbytes - read_in_place) / (copy_gbps * 1e9)


def bound_lines(summary: dict[str, Any], copy_gbps: float) -> list[str]:
    """Each part's median as a multiple of the case's copy bound at the same run's device copy rate: every byte
    copied twice (pack, load), those read in place (zero-copy views) once."""
    in_place = summary.get("zero_copy_bytes", {}).get("median", 0.0)
    bound = two_copy_bound_s(summary["bytes_per_gpu"]["median"], copy_gbps, in_place)
    parts = ", ".join(f"{label} {summary[key]['median']:.4f} s ({summary[key]['median'] / bound:.1f}x)"
                      for key, label in BOUND_PARTS if key in summary)
    what = "two-copy bound (pack + load" if not in_place else \
        f"copy bound (pack + load; the {in_place / 1e9:.2f} GB read in place once"
    return [f"{what} at this run's {copy_gbps:.0f} GB/s device copy): {bound:.4f} s; {parts}"]


def direct_lines(case: dict[str, Any]) -> list[str]:
    """What the direct export (prepare) and the replayed load (the last refit) did, where a case had them on."""
    lines = []
    producers = case.get("prepare", {}).get("producers") or []
    d = producers[0].get("direct_export") if producers else None
    if d and d.get("on"):
        lines.append(f"direct export: {d['tensors']} tensors ({d['views']} views, {d['row_gathers']} row gathers), "
                     f"{d['bridge_tasks']} conversion tasks left to Bridge")
    elif d and d.get("reason", "off") != "off":
        lines.append(f"direct export {d['reason']}")
    refits = case.get("refits") or []
    z = producers[0].get("zero_copy_views") if producers else None
    if z and z.get("on"):
        last = (refits[-1].get("producers") or [{}])[0] if refits else {}
        lines.append(f"zero-copy views: {z['tensors']} tensors read in place by vLLM; last refit "
                     f"{last.get('zero_copy_tensors', 0)} tensors, {last.get('zero_copy_bytes', 0) / 1e9:.2f} GB, "
                     f"{last.get('storages_shared', 0)} trainer storages shared anew")
    elif z and z.get("reason", "off") != "off":
        lines.append(f"zero-copy views {z['reason']}")
    replay = (refits[-1].get("consumers") or [{}])[0].get("replay") if refits else None
    if replay:
        kept = "; ".join(f"{k}: {v}" for k, v in list(replay.get("not_replayed_examples", {}).items())[:2])
        lines.append(f"replayed load (last refit): {replay.get('direct_tensors', 0)} tensors as "
                     f"{replay.get('direct_copies', 0)} copies, {replay.get('loader_tensors', 0)} through "
                     f"load_weights; table {replay['replayed']} replayed, {replay['not_replayed']} not"
                     + (f" ({kept})" if kept else ""))
    return lines


def render_case(name: str, case: dict[str, Any], copy_gbps: float | None = None) -> str:
    """One GPU case: the breakdown table (seconds), the parts against the two-copy bound (when the run measured
    the device copy), export alone, bytes, spot checks, or its error."""
    lines = [f"## {name}: {case.get('describe', '')}"]
    if "error" in case:
        lines.append(f"FAILED: {case['error'][:2000]}")
    summary = case.get("summary")
    if summary:
        lines.append(f"median / min / max over {summary['refits']} refits (+{summary['warmup']} warm-up), seconds")
        lines.append(f"| {'part':<58} | {'median':>9} | {'min':>9} | {'max':>9} |")
        lines.append(f"|{'-' * 60}|{'-' * 11}|{'-' * 11}|{'-' * 11}|")
        for key, label in BREAKDOWN_ROWS:
            if key in summary:  # results recorded before a row existed lack it
                lines.append(f"| {label:<58} | {_fmt(summary[key])} |")
        gb = summary["bytes_per_gpu"]["median"] / 1e9
        lines.append(f"bytes per GPU {gb:.2f} GB in {summary['buckets']['median']:.0f} buckets; "
                     f"transfer rate {gb / summary['transfer_s']['median']:.1f} GB/s per GPU; buffers allocated per "
                     f"refit {summary['buffers_allocated']['median']:.0f}, IPC handles opened "
                     f"{summary['buffers_opened']['median']:.0f}{_ordering(summary)}")
        if copy_gbps:
            lines += bound_lines(summary, copy_gbps)
    lines += direct_lines(case)
    alone = case.get("export_alone")
    if alone:
        slowest = max(alone, key=lambda r: r["seconds"])
        lines.append(f"Bridge export alone (no transfer): {slowest['seconds']:.3f} s, {slowest['tensors']} tensors, "
                     f"{slowest['bytes'] / 1e9:.2f} GB on the slowest rank")
        stream = max((r["stream"] for r in alone if "stream" in r), key=lambda r: r["seconds"], default=None)
        if stream is not None:
            calls = [c for c in stream.get("profile_top", []) if not c["function"].startswith("refit_at_scale.py:")]
            lines.append(f"what a refit sends, alone: {stream['seconds']:.3f} s, {stream['tensors']} tensors; "
                         "slowest calls (cumulative s): "
                         + ", ".join(f"{c['function']} {c['cumulative_s']:.3f}" for c in calls[:5]))
    checks = case.get("spot_checks")
    if checks:
        lines.append(f"bit-exact spot checks ({', '.join(checks['kinds'])}; {checks['tensors']} HF tensors into "
                     f"{len(checks['params'])} vLLM parameters on {checks['workers']} worker(s)) -> "
                     f"{'PASSED' if checks['passed'] else 'FAILED'}")
        lines += [f"  {p}" for p in checks["problems"][:8]]
    return "\n".join(lines)


def render_report(results: dict[str, Any], goals: Sequence[Goal]) -> str:
    """Everything a run measured, then the goals (what ``refit_at_scale.txt`` holds)."""
    lines = [f"# refit at scale: {results.get('command', '')}",
             f"machine: {results.get('machine', {}).get('hostname', '?')}; GPUs: "
             f"{'; '.join(results.get('machine', {}).get('gpus', [])) or '?'}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in sorted(results.get("versions", {}).items())), ""]
    engine = results.get("engine")
    for key, title in (("engine", "engine"), ("engine_zero_copy", "engine, zero-copy")):
        e = results.get(key)
        if e:
            what = ("every tensor read in place: one copy, the bound is 1.0" if key == "engine_zero_copy" else
                    f"{e['bytes'] / GIB:.2f} GiB, {e['buckets']} buckets")
            lines += [f"## {title}: {e['command']}",
                      f"refit {e['refit_gbps']:.1f} GB/s vs device-to-device copy {e['copy_gbps']:.1f} GB/s "
                      f"-> ratio {e['ratio']:.3f} ({what})", ""]
    tiny = results.get("tiny")
    if tiny:
        lines.append(f"## tiny GRPO run: {tiny['metrics']}")
        lines.append(f"median over {tiny['steps']} steps: step {tiny['step_s']:.3f} s, refit {tiny['refit_s']:.3f} s, "
                     f"sleep {tiny['sleep_s']:.3f} s -> (refit + sleep) / step {tiny['overhead_fraction']:.3f}")
        lines.append("")
    copy_gbps = (engine or {}).get("copy_gbps")
    for name, case in results.get("cases", {}).items():
        lines.append(render_case(name, case, copy_gbps))
        lines.append("")
    if results.get("errors"):
        lines.append("errors: " + "; ".join(results["errors"]))
    lines.append("goals:")
    lines += [f"  {g.line()}" for g in goals]
    return "\n".join(lines)


def _cell(summary: dict[str, Any], key: str) -> str:
    s = summary[key]
    return f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"


def docs_rows(results: dict[str, Any], goals: Sequence[Goal]) -> str:
    """The result rows of ``docs/refit.md`` (median (min–max) seconds) from a run's JSON."""
    lines = ["| case | total refit (s) | transfer (s) | Bridge export (s) | packing (s) | waiting for vLLM (s) | "
             "vLLM `load_weights` (s) | wake weights / KV (s) | sleep (s) | spot checks |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, case in results.get("cases", {}).items():
        summary = case.get("summary")
        if not summary:
            lines.append(f"| `{name}` | failed: {case.get('error', 'no refit finished')[:120]} |||||||||")
            continue
        checks = case.get("spot_checks") or {}
        verdict = "passed" if checks.get("passed") else "FAILED" if checks else "not run"
        wake = f"{summary['wake_weights_s']['median']:.3f} / {summary['wake_kv_s']['median']:.3f}"
        lines.append(
            f"| `{name}` | {_cell(summary, 'total_refit_s')} | {_cell(summary, 'transfer_s')} | "
            f"{_cell(summary, 'export_s')} | {_cell(summary, 'pack_s')} | {_cell(summary, 'wait_consumer_s')} | "
            f"{_cell(summary, 'load_weights_s')} | {wake} | {_cell(summary, 'sleep_s')} | {verdict} |"
        )
    lines += ["", "| goal | measured | verdict |", "|---|---|---|"]
    for g in goals:
        measured = f"{g.value:.4g}" if g.measured else "not measured"
        verdict = "met" if g.met else "not met" if g.measured else ""
        lines.append(f"| {g.name} ({'≤' if g.at_most else '≥'} {g.limit:g}) | {measured} | {verdict} |")
    return "\n".join(lines)
