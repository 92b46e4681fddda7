"""Sleep level 1's weight copy in host memory: one pinned block per allocation, a power of two each."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api
from rlc.compiler.catalog import model_facts
from rlc.compiler.planner.layout import GenerationLayout
from rlc.compiler.planner.pinned_copy import pinned_copy_bytes, power_of_two_ceil, vllm_stage_tensors

MIB = 1 << 20
GIB = 1 << 30
VIME = Path(__file__).resolve().parents[1] / "validation" / "failures" / "vime-190-glm4.5-air-host-memory.yaml"


def test_pinned_blocks_are_rounded_up_to_a_power_of_two():
    assert [power_of_two_ceil(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]
    # a tensor of 10 MiB or more has a segment of its own (rounded up to 2 MiB), copied into the next power of two
    assert pinned_copy_bytes([704 * MIB], 704 * MIB) == GIB
    assert pinned_copy_bytes([11 * MIB], 11 * MIB) == 16 * MIB  # segment 12 MiB -> 16 MiB block
    # tensors of 1-10 MiB share 20 MiB segments, each copied into a 32 MiB block
    assert pinned_copy_bytes([5 * MIB] * 4, 20 * MIB) == 32 * MIB
    assert pinned_copy_bytes([5 * MIB] * 5, 25 * MIB) == 64 * MIB
    # what the list does not name (norms, routers, scales: 2 MiB segments) is counted at its size
    assert pinned_copy_bytes([704 * MIB], 704 * MIB + 3 * MIB) == GIB + 3 * MIB
    assert pinned_copy_bytes([], 7 * MIB) == 7 * MIB


def test_glm45_air_experts_at_tp2_fp8_are_704_mib_tensors():
    facts = model_facts("zai-org/GLM-4.5-Air", Path("."))
    layout = GenerationLayout(world=16, tp=2, pp=1, ep=1, dp=8)
    tensors = vllm_stage_tensors(facts, layout, [1], 0, linear_bytes=1, dtype_bytes=2)  # layer 1: attention + MoE
    # FusedMoE w13 [128, 2 x 1408 / 2, 4096] and w2 [128, 4096, 1408 / 2] in FP8
    assert 128 * 1408 * 4096 in tensors and 128 * 704 * 4096 in tensors
    assert 128 * 1408 * 4096 == 704 * MIB
    # expert parallelism splits whole experts instead: the same bytes per GPU
    with_ep = vllm_stage_tensors(facts, GenerationLayout(world=16, tp=2, pp=1, ep=2, dp=8), [1], 0, 1, 2)
    assert sorted(with_ep) == sorted(tensors)


def test_the_level_1_copy_matches_the_excess_vime_measured():
    """vime PR #190 / #191: 841 GiB per node at sleep level 1, ~520-550 GiB at level 2 (vime's memory log,
    psutil bytes / 1024**3): the level-1 copy took 291-321 GiB per node. The FP8 shard at TP 2 is 50.4 GiB
    per GPU (201 GiB per node); its pinned copy is the measured excess."""
    level1 = api.check(str(VIME)).plan
    level2 = api.check(str(VIME), ["refit.sleep_level=2"]).plan
    assert level1.vllm_weights_gib == pytest.approx(50.4, abs=0.1)
    excess = level1.host.used_gib - level2.host.used_gib
    assert excess == pytest.approx(level1.host.item_gib("vLLM weight copy (sleep level 1)"))
    assert 291 <= excess <= 321
