"""The driver's typed view of worker answers, its phase timer and its exit codes (CPU)."""
from __future__ import annotations

import pytest

from rlc.runtime.driver import EXIT_GEN_KL, EXIT_RUN_FAILED, EXIT_WORKER_FAILED, exit_code_for
from rlc.runtime.metrics import PhaseTimer
from rlc.runtime.worker_api import Memory, RefitSent, TrainBatch
from rlc.runtime.workers import WorkerFailure


def test_memory_keeps_optional_figures_optional():
    full = {"free_gib": 120.5, "used_gib": 19.3, "total_gib": 139.8, "torch_allocated_gib": 13.7,
            "torch_reserved_gib": 13.8}
    assert Memory(**full).as_dict() == full
    device_only = Memory(free_gib=1.0, used_gib=2.0, total_gib=3.0)
    assert device_only.torch_reserved_gib is None and "torch_reserved_gib" not in device_only.as_dict()


def test_refit_sent_reads_the_producers_figures_and_keeps_the_rest():
    raw = {"bytes": 799744, "gbps": 0.07, "num_buckets": 2, "num_tensors": 25, "half_bytes": 799744,
           "free_before_bytes": 145 << 30, "min_free_bytes": 144 << 30, "fixes": ["per_rank_ipc_metadata"]}
    sent = RefitSent.of(raw)
    assert sent.num_tensors == 25 and sent.free_before_bytes == 145 << 30 and sent.raw["fixes"] == raw["fixes"]
    with pytest.raises(KeyError, match="min_free_bytes"):
        RefitSent.of({k: v for k, v in raw.items() if k != "min_free_bytes"})


def test_a_batch_hands_the_trainer_the_fields_it_has():
    torch = pytest.importorskip("torch")

    batch = TrainBatch(tokens=torch.zeros(2, 4), mask=torch.ones(2, 3), gen_logprobs=torch.zeros(2, 3),
                       advantages=torch.zeros(2), lengths=torch.tensor([4, 3]), routes=torch.zeros(2, 3, 1, 1))
    assert batch.size == 2
    assert set(batch.tensors()) == {"tokens", "mask", "gen_logprobs", "advantages", "lengths", "routed_experts"}


def test_phase_timer_accumulates_nested_phases_until_drained():
    timer = PhaseTimer()
    with timer("refit"):
        with timer("refit_transfer"):
            pass
        with timer("refit_transfer"):
            pass
    assert timer.seconds("refit") >= timer.seconds("refit_transfer") > 0
    drained = timer.drain()
    assert set(drained) == {"timing/refit_s", "timing/refit_transfer_s"}
    assert timer.seconds("refit") == 0.0 and timer.drain() == {}


def test_exit_codes_are_chosen_by_exception_class():
    from rlc.runtime.grpo.loss import GenKLExceeded

    assert exit_code_for(WorkerFailure("policy worker 0 on 10.0.0.1 (GPU 0) died in train_step")) == EXIT_WORKER_FAILED
    assert exit_code_for(GenKLExceeded("gen-KL 0.5 > 0.02")) == EXIT_GEN_KL

    class GenKLExceededLookalike(RuntimeError):  # same name, other class: not a gen-KL stop
        pass

    GenKLExceededLookalike.__name__ = "GenKLExceeded"
    assert exit_code_for(GenKLExceededLookalike("x")) == EXIT_RUN_FAILED
