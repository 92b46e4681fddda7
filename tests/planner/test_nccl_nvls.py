"""NCCL's NVLS buffers: first principles from NCCL's nvls.cc, per communicator of each process."""
from __future__ import annotations

import pytest

from rlc.compiler import api
from rlc.compiler.planner.layout import generation_layout, train_layout
from rlc.compiler.planner.parts import NVLS_SOURCE
from rlc.compiler.planner.nccl import (Communicator, NvlsSettings, generation_communicators, nvls_memory,
                                       nvls_settings, trainer_communicators)

from planner_helpers import GIB, ROOT, SEED000, load

MIB = 1 << 20
ON = NvlsSettings(True, 128 * 1024, None)
DSV3 = ROOT / "tests" / "validation" / "recipes" / "nemo-rl-grpo-deepseek-v3-32n8g.yaml"


def comm(local: int, nodes: int = 1) -> Communicator:
    return Communicator("g", local * nodes, local, nodes)


def test_buffer_size_follows_nccl():
    # channels x 2 x chunk (128 KiB) x NCCL_STEPS (8) x heads (GPUs of the communicator on the node)
    assert nvls_memory([comm(8)], "hopper", True, ON).bytes == 16 * 2 * 128 * 1024 * 8 * 8 == 256 * MIB
    assert nvls_memory([comm(4)], "hopper", True, ON).bytes == 128 * MIB
    assert nvls_memory([comm(4)], "blackwell", True, ON).bytes == 24 * 2 * MIB * 4  # one node: 24 channels
    assert nvls_memory([comm(4, nodes=2)], "blackwell", True, ON).bytes == 32 * 2 * MIB * 4  # across nodes: 32


def test_no_nvls_for_two_local_gpus_or_without_multicast():
    assert nvls_memory([comm(2, nodes=4)], "hopper", True, ON).bytes == 0  # NCCL: gpuCount <= 2
    assert nvls_memory([comm(3)], "hopper", True, ON).bytes == 48 * 2 * MIB
    assert nvls_memory([comm(8)], "ampere", False, ON).bytes == 0


def test_environment_turns_it_off_and_says_what_it_saves():
    off = nvls_settings({"NCCL_NVLS_ENABLE": "0"})
    mem = nvls_memory([comm(8), comm(8)], "hopper", True, off)
    assert mem.bytes == 0 and "NCCL_NVLS_ENABLE=0" in mem.note and "2 communicators × 256 MiB" in mem.note
    assert nvls_settings({"NCCL_NVLS_ENABLE": 1}).enabled
    assert nvls_settings({}).enabled
    smaller = nvls_settings({"NCCL_NVLS_CHUNKSIZE": str(64 * 1024), "NCCL_NVLS_NCHANNELS": "8"})
    assert nvls_memory([comm(8)], "hopper", True, smaller).bytes == 8 * 2 * 64 * 1024 * 8 * 8


def test_the_calibration_reference_layout_has_six_nvls_communicators():
    """NeMo-RL #2471: trainer TP8/PP8/EP32 and vLLM TP16/EP64 on 32 x 8 H100, NVLS at NCCL's default."""
    recipe = load(SEED000["ratio05"])[0]
    trainer = trainer_communicators(train_layout(recipe), 8, distributed_optimizer=True)
    local = {c.name: c.local_ranks for c in trainer}
    assert local == {"world": 8, "TP8": 8, "DP×CP 4": 1, "PP8": 1, "EP32": 8, "optimizer statistics (all ranks)": 8}
    vllm = {c.name: (c.local_ranks, c.nodes) for c in generation_communicators(generation_layout(recipe), 8)}
    assert vllm == {"TP16": (8, 2), "EP64": (8, 8), "DP4": (1, 4)}


def test_megatron_rank_order_places_groups():
    """Order tp-cp-ep-dp-pp: a DP group over TP1 ranks is one node wide; over TP8 it has one GPU per node."""
    recipe = load(DSV3)[0]  # TP1/PP16/EP16, 256 GPUs
    local = {c.name: c.local_ranks for c in trainer_communicators(train_layout(recipe), 8, True)}
    assert local["DP×CP 16"] == 8 and local["PP16"] == 1 and local["EP16"] == 8
    without = {c.name for c in trainer_communicators(train_layout(recipe), 8, distributed_optimizer=False)}
    assert "TP×PP 16" in without and "optimizer statistics (all ranks)" not in without


def _nvls(plan, phase="refit"):
    return sum(i.gib for i in plan.phases[phase].items if i.source == NVLS_SOURCE)


def test_turning_nvls_off_frees_exactly_its_buffers_at_the_refit():
    on = api.check(str(DSV3), ("cluster.env.NCCL_NVLS_ENABLE=1",)).plan
    off = api.check(str(DSV3)).plan  # the published run: NCCL_NVLS_ENABLE=0
    assert _nvls(on) == pytest.approx(1.25)  # trainer 4 + vLLM TP32 1 communicator x 256 MiB
    assert _nvls(off) == 0
    assert off.refit.free_at_refit - on.refit.free_at_refit == pytest.approx(1.25 * GIB, abs=1e6)
    for phase in ("train", "generate", "refit", "stack"):
        assert _nvls(on, phase) == pytest.approx(1.25), phase


def test_nvls_off_is_offered_as_a_fix_where_it_is_on():
    """NeMo-RL's DeepSeek-V3 layout with NVLS on fails RLC210; turning NVLS off (its script's setting) fixes it."""
    result = api.check(str(DSV3), ("cluster.env.NCCL_NVLS_ENABLE=1",))
    assert "RLC210" in {d.rule for d in result.errors}
    fix = next(f for f in result.plan.fixes if f.key == "cluster.env")
    assert fix.value["NCCL_NVLS_ENABLE"] == "0" and fix.sufficient
    assert fix.freed_gib == pytest.approx(1.25, abs=0.01)
    assert not any(f.key == "cluster.env" for f in api.check(str(DSV3)).plan.fixes)  # already off: not offered
