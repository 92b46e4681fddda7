"""Failure messages produced by rlc's runtime code paths themselves (not copied strings), each
wrapped the way a run's log ends (``rlc.runtime.driver.stop_report``). ``rlc doctor`` must name the
right rule for every one of them."""
from __future__ import annotations

from rlc.runtime.refit.bucket_planner import plan_refit, size_buffers
from rlc.runtime.refit.errors import RefitManifestError, RefitPlanError
from rlc.runtime.refit.manifest import ManifestTracker
from rlc.runtime.refit.protocol import BucketMeta, EntryMeta
from rlc.runtime.refit.specs import TensorSpec

GIB = 1 << 30
#: Qwen3.5-397B's fused expert stack: 512 × 2 × 1024 × 4096 × 2 B = 8 GiB
FUSED = TensorSpec("model.language_model.layers.0.mlp.experts.gate_up_proj", (512, 2048, 4096), "bfloat16")
FREE_AT_REFIT = 10 * GIB


def _log(exc: BaseException) -> str:
    from rlc.runtime.driver import stop_report

    return "2026-11-30 22:10:01 rlc.runtime.driver ERROR run failed\n" + stop_report(exc)


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the point is the exception
        return exc
    raise AssertionError(f"{fn} did not raise")


def refit_plan_error() -> tuple[BaseException, str]:
    """A fused tensor larger than a half, with no room for a one-off buffer (bucket planner)."""
    specs = [TensorSpec("model.embed_tokens.weight", (1024, 4096), "bfloat16"), FUSED]
    exc = _raised(lambda: plan_refit(specs, FREE_AT_REFIT, buffer_memory_ratio=0.3, buffer_gb=None,
                                     alignment_bytes=256))
    assert isinstance(exc, RefitPlanError)
    return exc, _log(exc)


def buffer_gb_over_free() -> tuple[BaseException, str]:
    exc = _raised(lambda: size_buffers(12 * GIB, buffer_memory_ratio=None, buffer_gb=16, alignment=256))
    assert isinstance(exc, RefitPlanError)
    return exc, _log(exc)


def _meta(producer_rank: int, names: list[str], refit_id: int = 1, index: int = 0) -> BucketMeta:
    entries, offset = [], 0
    for name in names:
        entries.append(EntryMeta(name, offset, [16, 32], "bfloat16", 16 * 32 * 2))
        offset += 1024
    return BucketMeta(refit_id=refit_id, index=index, slot=0, producer_rank=producer_rank,
                      device_key=f"GPU-{producer_rank}", buffer_bytes=4096, entries=entries)


def _specs(rank: int) -> list[TensorSpec]:
    return [TensorSpec(f"layers.{rank}.experts.{e}.w", (16, 32), "bfloat16") for e in range(2)]


def foreign_metadata() -> tuple[BaseException, str]:
    """The consumer of rank 1 gets rank 0's slicing metadata (per-rank metadata off)."""
    tracker = ManifestTracker(_specs(1), 1, "GPU-1", 1)
    exc = _raised(lambda: tracker.check_bucket(_meta(0, [s.name for s in _specs(0)]), 4096))
    assert isinstance(exc, RefitManifestError)
    return exc, _log(exc)


def unannounced_tensor() -> tuple[BaseException, str]:
    """Metadata that claims this GPU's producer but names another rank's tensors."""
    tracker = ManifestTracker(_specs(1), 1, "GPU-1", 1)
    exc = _raised(lambda: tracker.check_bucket(_meta(1, [s.name for s in _specs(0)]), 4096))
    assert isinstance(exc, RefitManifestError)
    return exc, _log(exc)


def duplicate_tensor() -> tuple[BaseException, str]:
    """The same tensor delivered in two buckets of one refit."""
    specs = _specs(1)
    tracker = ManifestTracker(specs, 1, "GPU-1", 1)
    tracker.check_bucket(_meta(1, [specs[0].name]), 4096)
    exc = _raised(lambda: tracker.check_bucket(_meta(1, [specs[0].name], index=1), 4096))
    assert isinstance(exc, RefitManifestError)
    return exc, _log(exc)


def multiple_owners() -> tuple[BaseException, str]:
    """The MTP-replicated embedding owned by pipeline stages 0 and 3 (the check the trainer runs)."""
    from rlc.runtime.policy.refit_source import MTP_SHARED_EMBEDDING, find_multiple_owners, multiple_owners_error

    emb = f"language_model.{MTP_SHARED_EMBEDDING}"
    owned = [[emb, "decoder.layers.0.mlp.w"], ["decoder.layers.1.mlp.w"], ["decoder.layers.2.mlp.w"],
             ["decoder.layers.3.mlp.w", emb]]
    exc = multiple_owners_error(find_multiple_owners(owned))
    return exc, _log(exc)


def gen_kl_exceeded() -> tuple[BaseException, str]:
    import torch

    from rlc.runtime.grpo.loss import check_gen_kl, gen_kl_metrics

    gen = torch.full((2, 8), -1.0)
    train = gen + torch.tensor([0.0, 1.5]).unsqueeze(1)  # the second sample's weights are off
    kl = gen_kl_metrics(gen, train, torch.ones(2, 8))
    exc = _raised(lambda: check_gen_kl(kl["gen_kl"], step=7, threshold=0.05, detail=kl))
    return exc, _log(exc)


def dynamic_sampling_exhausted() -> tuple[BaseException, str]:
    from rlc.runtime.grpo.dynamic_sampling import DynamicSampler

    lines: list[str] = []
    sampler: DynamicSampler[int] = DynamicSampler(prompts_per_step=8, enabled=True, max_gen_batches=2,
                                                  batch_multiplier=1.0, logger=lines.append)
    sampler.start_step(4)
    mixed, same = [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]
    sampler.add_batch(list(range(8)), [mixed, same, same, same, mixed, same, same, same])
    exc = _raised(lambda: sampler.add_batch(list(range(8)), [mixed, same, same, same, same, same, same, same]))
    return exc, "\n".join(lines) + "\n" + _log(exc)


def worker_died() -> tuple[BaseException, str]:
    from rlc.runtime.workers import WorkerInfo, worker_failure

    info = WorkerInfo("policy", 3, node_ip="10.0.4.17", hostname="gpu-node-017", pid=159258, gpu_ids=[3],
                      gpu_uuid="GPU-3f0c", bundle=3)
    ray_text = ("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
                "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR")
    exc = worker_failure(info, True, "refit", ray_text)
    return exc, _log(exc)


def packed_sequence_too_long() -> tuple[BaseException, str]:
    """A rollout longer than the train pass's packing budget (the trainer's bin packing)."""
    from rlc.runtime.policy.bin_packing import PackingError, pack

    exc = _raised(lambda: pack([900, 5000, 1200], 4096, "modified_first_fit_decreasing",
                               budget_key="training.sequence_packing.train_mb_tokens"))
    assert isinstance(exc, PackingError)
    return exc, _log(exc)


ALL = {
    "RLC210": refit_plan_error,
    "RLC315": packed_sequence_too_long,
    "RLC210/buffer_gb": buffer_gb_over_free,
    "RLC203/foreign": foreign_metadata,
    "RLC203/unannounced": unannounced_tensor,
    "RLC201/duplicate": duplicate_tensor,
    "RLC201/owners": multiple_owners,
    "RLC306": gen_kl_exceeded,
    "dynamic-sampling": dynamic_sampling_exhausted,
    "worker-lost": worker_died,
}


def refit_not_bit_exact(rounded: bool) -> tuple[BaseException, str]:
    """The stop of ``refit.verify_every``: the real comparison and message (fp32 bias sent as bf16, or a
    bf16 tensor with one flipped bit)."""
    import torch

    from rlc.runtime.refit.verify import RefitVerifyError, compare_parameters, verify_error_text

    name = "model.layers.1.mlp.gate.e_score_correction_bias" if rounded else "model.embed_tokens.weight"
    ref = ((30 + 0.05 * torch.randn(8, generator=torch.Generator().manual_seed(0))).float() if rounded
           else torch.ones(4, 4, dtype=torch.bfloat16))
    got = ref.to(torch.bfloat16).to(torch.float32) if rounded else ref.clone()
    if not rounded:
        got.view(torch.int16)[1, 2] ^= 1
    report = compare_parameters({name: got}, {name: ref})
    exc = RefitVerifyError(verify_error_text(4, [report.to_dict()]))
    return exc, _log(exc)


ALL["RLC204/verify"] = lambda: refit_not_bit_exact(rounded=True)
ALL["RLC306/verify"] = lambda: refit_not_bit_exact(rounded=False)


def megatron_request_failed() -> tuple[BaseException, str]:
    """A request megatron-core's engine refused (the KV pool cannot hold it), as the worker reports it."""
    from types import SimpleNamespace

    from rlc.runtime.generation.megatron_sampling import parse_request

    error = type("BlockOverflowError", (Exception,), {})("request 17")
    req = SimpleNamespace(request_id=17, status=SimpleNamespace(name="FAILED"), prompt_tokens=list(range(3900)),
                          events=[SimpleNamespace(payload=error)], generated_tokens=[], generated_log_probs=None)
    exc = _raised(lambda: parse_request(req, eos_token_id=2, max_tokens=8192, decode=str))
    return exc, _log(exc)


ALL["RLC406"] = megatron_request_failed


def stopped_by_sigterm() -> tuple[BaseException, str]:
    """The driver's closing lines after a SIGTERM (``rlc.runtime.termination``)."""
    from rlc.runtime.termination import TerminationWatch

    watch = TerminationWatch()
    watch.received = "SIGTERM"
    text = "2026-11-30 22:10:01 rlc.runtime.driver INFO [dynamic-sampling] step 94: off\n" + watch.report()
    return KeyboardInterrupt(watch.received), text


ALL["stopped-by-signal"] = stopped_by_sigterm
