"""The IPC halves ``refit.keep_buffers_gb`` keeps between refits are on the trainer's side in every phase."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api
from rlc.contract.refit_buffer import GIB, halves_kept

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny-moe-mtp-2gpu-ep2.yaml")
LABEL = "IPC buffer kept between refits (2 halves)"
PHASES = ("train", "generate", "logprob")


def _kept(plan, phase: str) -> list[float]:
    return [i.gib for i in plan.phases[phase].items if i.label == LABEL]


def test_halves_within_keep_buffers_gb_are_counted_in_every_phase_but_the_refits():
    kept = api.check(RECIPE, ["refit.buffer_gb=2"]).plan  # two 1 GiB halves, within the default 2 GiB
    freed = api.check(RECIPE, ["refit.buffer_gb=2", "refit.keep_buffers_gb=0"]).plan
    for phase in PHASES:
        assert _kept(kept, phase) == [pytest.approx(2.0)], phase
        assert _kept(freed, phase) == []
        assert kept.phases[phase].used_gib == pytest.approx(freed.phases[phase].used_gib + 2.0)
    # at the refit the halves are the IPC buffer itself, counted once
    assert kept.phases["refit"].items == freed.phases["refit"].items
    assert kept.phases["stack"].used_gib == pytest.approx(freed.phases["stack"].used_gib)


def test_halves_larger_than_keep_buffers_gb_are_allocated_per_refit():
    plan = api.check(RECIPE, ["refit.buffer_gb=2.5"]).plan  # 2.5 GiB > 2 GiB: not kept
    assert all(_kept(plan, phase) == [] for phase in PHASES)


def test_the_boundary_is_the_runtimes():
    assert halves_kept(GIB, 2 * GIB) and not halves_kept(GIB + 1, 2 * GIB)
    assert not halves_kept(1, 0)


def test_a_phase_they_tip_over_names_keep_buffers_gb_in_its_hint():
    squeezed = ["refit.buffer_memory_ratio=0.02", "training.grad_reduce_in_fp32=false",
                "training.optimizer_cpu_offload=false", "training.sequence_packing.train_mb_tokens=4096",
                "cluster.env.NCCL_NVLS_ENABLE='0'"]
    slime = str(Path(__file__).resolve().parents[2] / "tests" / "validation" / "recipes"
                / "slime-grpo-qwen3-30ba3b-1n8g.yaml")
    result = api.check(slime, squeezed)
    assert not result.plan.checks["train_fit"].ok  # 0.9 GiB of kept halves tip the train step over
    hints = [d.hint for d in result.diagnostics if d.rule == "RLC215"]
    assert hints == ["raise PP / EP or DP; refit.keep_buffers_gb: 0 frees the 0.90 GiB of IPC halves kept between "
                     "refits"], hints
    assert api.check(slime, [*squeezed, "refit.keep_buffers_gb=0"]).plan.checks["train_fit"].ok
