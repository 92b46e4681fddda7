"""Bucket planner and wire-dtype selection (pure Python; no torch needed)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlc.contract.refit_buffer import align_down
from rlc.contract.runtime_config import RefitConfig
from rlc.runtime.refit.bucket_planner import (
    SLOT_ONEOFF,
    BucketPacker,
    effective_alignment,
    plan_from_config,
    plan_refit,
    size_buffers,
)
from rlc.runtime.refit.errors import RefitPlanError
from rlc.runtime.refit.specs import TensorSpec, wire_dtype, wire_specs

GIB = 1 << 30
FUSED = TensorSpec("model.language_model.layers.0.mlp.experts.gate_up_proj", (512, 2048, 4096), "bfloat16")  # 8 GiB
LEVERS = (
    "refit.buffer_memory_ratio",
    "refit.buffer_gb",
    "refit.sleep_level",
    "generation EP",
    "refit.offload_optimizer_for_refit",
)


def _flat(plan):
    return [e for b in plan.buckets for e in b.entries]


def _mixed_specs():
    return [
        TensorSpec("embed", (700, 64), "bfloat16"),
        TensorSpec("ln", (3,), "bfloat16"),  # odd size -> padding before the next tensor
        TensorSpec("bias", (5,), "float32"),
        TensorSpec("q", (300, 64), "bfloat16"),
        TensorSpec("counts", (7,), "int64"),
        TensorSpec("k", (300, 64), "bfloat16"),
        TensorSpec("v", (300, 64), "bfloat16"),
        TensorSpec("o", (64, 300), "bfloat16"),
    ]


def test_packs_in_export_order_aligned_and_alternating_halves():
    specs = _mixed_specs()
    plan = plan_refit(specs, 10 * GIB, buffer_memory_ratio=None, buffer_gb=200_000 / GIB, alignment_bytes=256)
    half = plan.sizing.half_bytes
    assert half == align_down(100_000, 256) and half % 256 == 0
    assert [e.spec.name for e in _flat(plan)] == [s.name for s in specs]  # order kept, each once
    assert len(plan.buckets) >= 3
    regular = [b for b in plan.buckets if b.slot != SLOT_ONEOFF]
    assert [b.slot for b in regular] == [i % 2 for i in range(len(regular))]
    assert [b.index for b in plan.buckets] == list(range(len(plan.buckets)))
    for b in plan.buckets:
        prev_end = 0
        for e in b.entries:
            assert e.offset % 256 == 0
            assert e.offset >= prev_end
            assert e.end <= half
            prev_end = e.end
    assert plan.total_bytes == sum(s.nbytes for s in specs)
    assert plan.peak_buffer_bytes == 2 * half


def test_half_is_free_times_ratio_over_two():
    # NeMo-RL #2471 failure 2: ratio 0.3 of ~41.7 GB free -> a 6.26 GB half, not 12.5 GB.
    free = 41_750_000_000
    sizing = size_buffers(free, buffer_memory_ratio=0.3, buffer_gb=None, alignment=256)
    assert sizing.half_bytes == align_down(int(free * 0.3) // 2, 256)
    assert 6.25e9 < sizing.half_bytes < 6.27e9


def test_halves_are_capped_to_the_export_size():
    specs = [TensorSpec("w", (1000,), "bfloat16")]
    plan = plan_refit(specs, 80 * GIB, buffer_memory_ratio=0.3, buffer_gb=None, alignment_bytes=256)
    assert plan.sizing.half_bytes == 2048  # 2000 bytes aligned up, not 12 GiB
    assert plan.sizing.configured_half_bytes > 10 * GIB
    assert len(plan.buckets) == 1 and plan.peak_buffer_bytes == 2048


def test_tensor_exactly_half_fits_a_half():
    spec = TensorSpec("w", (512,), "float32")  # 2048 bytes
    packer = BucketPacker(2048, 256)
    step = packer.add(spec)
    assert step.placement.slot == 0 and step.placement.offset == 0 and step.closed is None
    assert not packer.is_oneoff(spec)


def test_oversized_tensor_gets_a_one_off_buffer_when_memory_allows():
    small = [TensorSpec(f"layers.{i}.w", (1024, 1024), "bfloat16") for i in range(3)]
    specs = [small[0], FUSED, small[1], small[2]]
    free = 41_750_000_000  # NeMo-RL #2471: 6.26 GB halves, 8 GiB fused tensor; 2 x 6.26 + 8.59 < 41.7
    plan = plan_refit(specs, free, buffer_memory_ratio=0.3, buffer_gb=None, alignment_bytes=256)
    assert FUSED.nbytes == 8 * GIB
    slots = [(b.slot, b.names) for b in plan.buckets]
    assert slots == [
        (0, [small[0].name]),  # flushed before the one-off so order is kept
        (SLOT_ONEOFF, [FUSED.name]),
        (1, [small[1].name, small[2].name]),  # alternation of the halves continues
    ]
    oneoff = plan.buckets[1]
    assert oneoff.buffer_bytes == 8 * GIB and oneoff.entries[0].offset == 0
    assert plan.peak_buffer_bytes == 2 * plan.sizing.half_bytes + 8 * GIB
    assert plan.num_oneoff == 1 and any("one-off" in w for w in plan.warnings)


def test_oversized_tensor_fails_before_transfer_naming_tensor_size_free_and_levers():
    free = 41_750_000_000
    with pytest.raises(RefitPlanError) as exc:
        # 24 GiB kept free for the exporter (all-gather + torch.stack of the fused tensor) -> no room
        plan_refit([FUSED], free, buffer_memory_ratio=0.3, buffer_gb=None, alignment_bytes=256, reserve_bytes=24 * GIB)
    msg = str(exc.value)
    assert FUSED.name in msg
    assert "8.00 GiB" in msg  # the tensor
    assert "38.88 GiB free" in msg  # the free memory (41.75 GB)
    for lever in LEVERS:
        assert lever in msg
    assert "buffer_memory_ratio to >= 0.41" in msg  # NeMo-RL #2471's corrected threshold: 16 GiB / free


def test_oversized_tensor_when_no_ratio_can_help():
    with pytest.raises(RefitPlanError) as exc:
        plan_refit([FUSED], 10 * GIB, buffer_memory_ratio=0.3, buffer_gb=None, alignment_bytes=256)
    msg = str(exc.value)
    assert "no refit.buffer_memory_ratio can hold it" in msg and "refit.sleep_level: 2" in msg


def test_fixed_buffer_gb_larger_than_free_memory_fails():
    with pytest.raises(RefitPlanError, match=r"refit.buffer_gb=16 asks for 16.00 GiB.*only 10.00 GiB is free"):
        plan_refit([FUSED], 10 * GIB, buffer_memory_ratio=None, buffer_gb=16, alignment_bytes=256)


def test_buffer_gb_sizes_the_halves():
    plan = plan_refit([FUSED], 40 * GIB, buffer_memory_ratio=None, buffer_gb=16, alignment_bytes=256)
    assert plan.sizing.half_bytes == 8 * GIB and plan.num_oneoff == 0


@pytest.mark.parametrize("ratio,gb", [(None, None), (0.3, 4.0)])
def test_exactly_one_sizing_knob(ratio, gb):
    with pytest.raises(RefitPlanError, match="exactly one of refit.buffer_memory_ratio and refit.buffer_gb"):
        size_buffers(GIB, buffer_memory_ratio=ratio, buffer_gb=gb, alignment=256)


def test_fp32_params_stay_fp32_on_the_wire():
    patterns = ["*.mlp.gate.e_score_correction_bias", "*.expert_bias"]
    specs = [
        TensorSpec("model.layers.3.mlp.gate.e_score_correction_bias", (512,), "float32"),
        TensorSpec("model.layers.3.mlp.expert_bias", (512,), "bfloat16"),  # matched -> fp32 even if exported 16-bit
        TensorSpec("model.layers.3.mlp.gate.weight", (512, 64), "float32"),  # fp32 master but not matched
        TensorSpec("model.layers.3.mlp.tokens_per_expert", (512,), "int64"),
        TensorSpec("model.layers.3.mask", (4,), "bool"),
    ]
    wire = wire_specs(specs, "bfloat16", patterns)
    assert [w.dtype for w in wire] == ["float32", "float32", "bfloat16", "int64", "bool"]
    assert wire[0].nbytes == 2048 and wire[2].nbytes == 512 * 64 * 2
    plan = plan_refit(wire, GIB, buffer_memory_ratio=0.5, buffer_gb=None, alignment_bytes=256)
    assert {e.spec.name: e.spec.dtype for e in _flat(plan)}[specs[0].name] == "float32"
    assert plan.total_bytes == sum(w.nbytes for w in wire)
    # without the pattern the bias is squeezed into the export dtype (the SkyRL #1816 bug)
    assert wire_dtype(specs[0].name, "float32", "bfloat16", []) == "bfloat16"


def test_duplicate_export_names_are_rejected():
    spec = TensorSpec("model.embed_tokens.weight", (8, 8), "bfloat16")
    with pytest.raises(RefitPlanError, match="dedupe_mtp_embedding"):
        wire_specs([spec, spec], "bfloat16", [])


def test_alignment_must_be_power_of_two_and_is_raised_to_the_element_size():
    with pytest.raises(RefitPlanError, match="power of two"):
        effective_alignment(96)
    specs = [TensorSpec("a", (3,), "bfloat16"), TensorSpec("b", (3,), "float32"), TensorSpec("c", (1,), "int64")]
    assert effective_alignment(1, specs) == 8
    plan = plan_refit(specs, GIB, buffer_memory_ratio=None, buffer_gb=1024 / GIB, alignment_bytes=1)
    for e in _flat(plan):
        assert e.offset % e.spec.itemsize == 0  # every typed view is aligned
    assert [e.offset for e in _flat(plan)] == [0, 8, 24]


def test_zero_size_tensor_is_packed():
    specs = [TensorSpec("empty", (0, 16), "bfloat16"), TensorSpec("w", (4,), "bfloat16")]
    plan = plan_refit(specs, GIB, buffer_memory_ratio=0.1, buffer_gb=None, alignment_bytes=256)
    assert [e.spec.name for e in _flat(plan)] == ["empty", "w"]


def test_plan_from_runtime_config():
    cfg = RefitConfig(
        buffer_memory_ratio=0.39,
        buffer_gb=None,
        alignment_bytes=256,
        sleep_level=2,
        keep_weights_awake=False,
        wake_kv_during_transfer=False,
        keep_kv_cache_awake=False,
        zero_copy_experts=False,
        offload_optimizer_for_refit=True,
        offload_params_for_generation=False,
        sync_params_before_refit=True,
        dedupe_mtp_embedding=True,
        per_rank_ipc_metadata=True,
        fp32_params=["*e_score_correction_bias"],
        verify_every=0,
        transport="cuda_ipc",
        fused_transfer=False,
        direct_export=False,
        zero_copy_views=False,
        replay_load=False,
        keep_buffers_gb=2.0,
        decisions={},
    )
    plan = plan_from_config([FUSED], 44 * GIB, cfg)
    assert plan.num_oneoff == 0  # 0.39 x 44 GiB / 2 = 8.58 GiB holds the 8 GiB tensor (NeMo-RL #2471 final config)
    assert "refit.buffer_memory_ratio=0.39" in plan.sizing.source


spec_strategy = st.builds(
    TensorSpec,
    name=st.just("x"),
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from(["bfloat16", "float32", "int64", "uint8", "float16"]),
)


@settings(max_examples=150, deadline=None)
@given(raw=st.lists(spec_strategy, min_size=1, max_size=30), half_units=st.integers(1, 40), align_pow=st.integers(3, 8))
def test_packer_invariants(raw, half_units, align_pow):
    alignment = 1 << align_pow
    specs = [TensorSpec(f"t{i}", s.shape, s.dtype) for i, s in enumerate(raw)]
    half = half_units * alignment
    packer = BucketPacker(half, alignment)
    buckets = []
    for s in specs:
        step = packer.add(s)
        buckets += [b for b in (step.flushed, step.closed) if b is not None]
    last = packer.finish()
    if last is not None:
        buckets.append(last)
    assert [e.spec.name for b in buckets for e in b.entries] == [s.name for s in specs]
    assert [b.index for b in buckets] == list(range(len(buckets)))
    regular = [b for b in buckets if b.slot != SLOT_ONEOFF]
    assert [b.slot for b in regular] == [i % 2 for i in range(len(regular))]
    for b in buckets:
        if b.slot == SLOT_ONEOFF:
            assert len(b.entries) == 1 and b.entries[0].spec.nbytes > half
            assert b.buffer_bytes >= b.entries[0].spec.nbytes and b.buffer_bytes % alignment == 0
            continue
        end = 0
        for e in b.entries:
            assert e.offset % alignment == 0 and e.offset >= end and e.end <= half
            end = e.end


def test_planner_and_manifest_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['zmq'] = None\n"
        "import rlc.runtime.refit.bucket_planner, rlc.runtime.refit.manifest, rlc.runtime.refit\n"
        "assert 'torch' not in {k for k, v in sys.modules.items() if v is not None}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kept_halves_are_reused_while_they_fit_the_plan():
    specs = [TensorSpec(f"w{i}", (1024,), "bfloat16") for i in range(8)] + [TensorSpec("big", (3000,), "bfloat16")]
    knobs = dict(buffer_memory_ratio=0.5, buffer_gb=None, alignment_bytes=256)
    fresh = plan_refit(specs, 32768, **knobs)
    assert fresh.sizing.half_bytes == 8192 and fresh.num_oneoff == 0
    kept = plan_refit(specs, 32768, **knobs, keep_half_bytes=6144)  # smaller kept halves, still no one-off
    assert (
        kept.sizing.half_bytes == 6144 and kept.num_oneoff == 0 and "kept from the previous refit" in kept.sizing.source
    )
    assert _flat(kept) and [e.spec.name for e in _flat(kept)] == [s.name for s in specs]
    # kept halves too small for "big" (6000 bytes) would add a one-off buffer: plan fresh halves instead
    assert plan_refit(specs, 32768, **knobs, keep_half_bytes=4096).sizing.half_bytes == 8192
    # kept halves bigger than the knobs allow now (less free memory): plan fresh, smaller halves
    assert plan_refit(specs, 24576, **knobs, keep_half_bytes=8192).sizing.half_bytes == 6144


def test_a_previous_plan_is_reused_only_for_the_same_halves_and_when_its_one_offs_still_fit():
    specs = [TensorSpec(f"w{i}", (1024,), "bfloat16") for i in range(8)] + [TensorSpec("big", (6000,), "bfloat16")]
    knobs = dict(buffer_memory_ratio=None, buffer_gb=8192 / GIB, alignment_bytes=256)
    first = plan_refit(specs, 65536, **knobs)
    assert first.num_oneoff == 1 and first.sizing.half_bytes == 4096
    again = plan_refit(specs, 60000, **knobs, previous=first)
    assert again.buckets is first.buckets and again.sizing.free_bytes == 60000  # same buckets, new sizing
    bigger = plan_refit(specs, 65536, **{**knobs, "buffer_gb": 16384 / GIB}, previous=first)
    assert bigger.buckets is not first.buckets and bigger.sizing.half_bytes == 8192
    assert [b.names for b in bigger.buckets] == [
        b.names for b in plan_refit(specs, 65536, **{**knobs, "buffer_gb": 16384 / GIB}).buckets
    ]
    with pytest.raises(RefitPlanError, match="'big'"):  # the one-off no longer fits: the full check names it
        plan_refit(specs, 8192 + 12000, **knobs, previous=first)
