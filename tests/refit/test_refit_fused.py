"""Fused expert transfer: the export list rewrite, the direct-copy table, its per-refit check, the fallback to
the engine's own loader, the buffers kept across refits, and a whole refit across processes fused vs per expert.

The reference for every direct copy is a per-expert load with vLLM's ``FusedMoE.weight_loader`` semantics
(gate -> first half of ``w13``, up -> second half, each this tensor-parallel rank's rows; down -> this rank's
columns of ``w2``; experts not held are skipped): ``tests.refit.harness.TinyMoeEngine`` for the process test,
:func:`_reference_load` here.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from rlc.contract.refit_buffer import fused_transfer_applies
from rlc.runtime.refit.bucket_planner import SLOT_ONEOFF, plan_refit
from rlc.runtime.refit.errors import RefitManifestError
from rlc.runtime.refit.fused import (
    ExpertDestination,
    FusedLoader,
    build_routes,
    unfuse,
)
from rlc.runtime.refit.sources import StackedParts, copy_export
from rlc.runtime.refit.fused_layout import (
    expert_groups,
    fuse_specs,
    parse_fused,
    unfused_names,
)
from rlc.runtime.refit.specs import TensorSpec
from tests.refit import harness as H

E, INTER, HID = 8, 16, 32
P = "model.layers.5.mlp.experts"


def _per_expert(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        out[f"{P}.{e}.gate_proj.weight"] = torch.randn(INTER, HID, generator=g).to(torch.bfloat16)
        out[f"{P}.{e}.up_proj.weight"] = torch.randn(INTER, HID, generator=g).to(torch.bfloat16)
        out[f"{P}.{e}.down_proj.weight"] = torch.randn(HID, INTER, generator=g).to(torch.bfloat16)
    return out


def _fused(per_expert: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w13 = torch.stack([torch.cat([per_expert[f"{P}.{e}.gate_proj.weight"], per_expert[f"{P}.{e}.up_proj.weight"]])
                       for e in range(E)])
    w2 = torch.stack([per_expert[f"{P}.{e}.down_proj.weight"] for e in range(E)])
    return {f"{P}.fused_w13": w13, f"{P}.fused_w2": w2}


def _destination(local: tuple[int, ...], tp_rank: int, tp_size: int, dtype=torch.bfloat16) -> ExpertDestination:
    part = INTER // tp_size
    return ExpertDestination(P, torch.zeros(len(local), 2 * part, HID, dtype=dtype),
                             torch.zeros(len(local), HID, part, dtype=dtype), E, local, tp_rank, tp_size)


def _reference_load(d: ExpertDestination, per_expert: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM's weight_loader makes of the per-expert tensors, into fresh copies of ``d``'s parameters."""
    w13, w2 = torch.zeros_like(d.w13), torch.zeros_like(d.w2)
    part = INTER // d.tp_size
    rows = slice(d.tp_rank * part, (d.tp_rank + 1) * part)
    for slot, e in enumerate(d.local_to_global):
        w13[slot, :part].copy_(per_expert[f"{P}.{e}.gate_proj.weight"][rows])  # w1
        w13[slot, part:].copy_(per_expert[f"{P}.{e}.up_proj.weight"][rows])  # w3
        w2[slot].copy_(per_expert[f"{P}.{e}.down_proj.weight"][:, rows])
    return w13, w2


def _specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.from_tensor(n, t) for n, t in tensors.items()]


# --------------------------------------------------------------------------- the export list


def test_expert_groups_fuse_in_place_and_split_back():
    specs = [TensorSpec("model.embed_tokens.weight", (64, HID), "bfloat16"), *_specs(_per_expert()),
             TensorSpec("model.norm.weight", (HID,), "bfloat16")]
    groups, refused = expert_groups(specs)
    assert refused == {} and list(groups) == [P]
    g = groups[P]
    assert (g.num_experts, g.intermediate, g.hidden, g.layer) == (E, INTER, HID, 5)
    fused = fuse_specs(specs, groups.values())
    assert [s.name for s in fused] == ["model.embed_tokens.weight", f"{P}.fused_w13", f"{P}.fused_w2",
                                       "model.norm.weight"]
    assert fused[1].shape == (E, 2 * INTER, HID) and fused[2].shape == (E, HID, INTER)
    assert sum(s.nbytes for s in fused) == sum(s.nbytes for s in specs)  # the same bytes, 3 x 8 -> 2 tensors
    assert [n for n, *_ in unfused_names(fused[1])] == [n for n in g.per_expert_names() if "down" not in n]
    assert parse_fused(f"{P}.fused_w2") == (P, "fused_w2") and parse_fused(f"{P}.0.down_proj.weight") is None


def test_incomplete_or_uneven_expert_groups_stay_per_expert():
    specs = _specs(_per_expert())
    missing = [s for s in specs if s.name != f"{P}.3.up_proj.weight"]
    groups, refused = expert_groups(missing)
    assert groups == {} and "missing 3.up_proj" in refused[P]
    odd = [TensorSpec(s.name, (INTER + 1, HID), s.dtype) if s.name == f"{P}.2.gate_proj.weight" else s for s in specs]
    groups, refused = expert_groups(odd)
    assert groups == {} and "shapes or dtypes differ" in refused[P]
    assert fuse_specs(missing, groups.values()) == missing


def test_fp8_rollouts_keep_the_per_expert_path_and_say_why():
    assert fused_transfer_applies(True, "bf16")[0] is True
    on, why = fused_transfer_applies(True, "fp8")
    assert on is False and "FP8 rollouts" in why
    assert fused_transfer_applies(False, "bf16") == (False, "off (refit.fused_transfer: off)")


# --------------------------------------------------------------------------- the direct-copy table


def test_one_layer_on_one_gpu_is_one_copy_per_destination_and_equals_the_loader():
    per_expert = _per_expert(1)
    fused = _fused(per_expert)
    d = _destination(tuple(range(E)), 0, 1)
    table = build_routes(_specs(fused), {P: d})
    assert table.uncovered == {}
    assert [len(table.routes[n].ops) for n in fused] == [1, 1]  # w13 in one copy, w2 in one copy
    FusedLoader(lambda ws: pytest.fail(f"loader called with {[n for n, _ in ws]}"), table)(list(fused.items()))
    w13, w2 = _reference_load(d, per_expert)
    assert torch.equal(d.w13, w13) and torch.equal(d.w2, w2)
    assert torch.equal(d.w13[:, :INTER], torch.stack([per_expert[f"{P}.{e}.gate_proj.weight"] for e in range(E)]))


@pytest.mark.parametrize("local,tp_rank,tp_size", [
    ((4, 5, 6, 7), 0, 1),  # expert parallel rank 1 of 2 (linear placement): one run
    ((1, 3, 5, 7), 0, 1),  # round-robin placement: one run per expert
    (tuple(range(E)), 1, 2),  # tensor parallel rank 1 of 2: gate and up slices of w13, a column slice of w2
    ((6, 7, 0, 1), 3, 4),  # both, with a wrap-around in the expert map
])
def test_expert_and_tensor_parallel_slices_match_vllms_weight_loader(local, tp_rank, tp_size):
    per_expert = _per_expert(2)
    fused = _fused(per_expert)
    d = _destination(local, tp_rank, tp_size)
    table = build_routes(_specs(fused), {P: d})
    assert table.uncovered == {}
    FusedLoader(lambda ws: pytest.fail("nothing should reach the loader"), table)(list(fused.items()))
    w13, w2 = _reference_load(d, per_expert)
    assert torch.equal(d.w13, w13) and torch.equal(d.w2, w2)
    part = INTER // tp_size
    e0 = local[0]
    gate_rows = per_expert[f"{P}.{e0}.gate_proj.weight"][tp_rank * part:(tp_rank + 1) * part]
    up_rows = per_expert[f"{P}.{e0}.up_proj.weight"][tp_rank * part:(tp_rank + 1) * part]
    assert torch.equal(d.w13[0, :part], gate_rows) and torch.equal(d.w13[0, part:], up_rows)  # w1 then w3
    runs = sum(1 for j in range(len(local)) if j == 0 or local[j] != local[j - 1] + 1)
    assert len(table.routes[f"{P}.fused_w13"].ops) == runs * (1 if tp_size == 1 else 2)


def test_uncovered_fused_tensors_load_through_the_engine_loader_split_per_expert():
    per_expert = _per_expert(3)
    fused = _fused(per_expert)
    fp8 = _destination(tuple(range(E)), 0, 1, dtype=torch.float8_e4m3fn)
    table = build_routes(_specs(fused), {P: fp8})
    assert table.routes == {}
    assert all("float8_e4m3fn" in why for why in table.uncovered.values())
    table_missing = build_routes(_specs(fused), {})
    assert "no fused MoE layer named" in table_missing.uncovered[f"{P}.fused_w13"]
    quantized = _destination(tuple(range(E)), 0, 1)
    quantized = ExpertDestination(**{**quantized.__dict__, "why_not": "quantized experts (Fp8MoEMethod)"})
    assert build_routes(_specs(fused), {P: quantized}).uncovered[f"{P}.fused_w2"] == "quantized experts (Fp8MoEMethod)"

    got: dict[str, torch.Tensor] = {}

    def loader(weights):
        for n, t in weights:
            got[n] = t.clone()

    other = ("model.norm.weight", torch.ones(HID))
    load = FusedLoader(loader, table)
    load([*fused.items(), other])
    assert set(got) == {*per_expert, "model.norm.weight"}
    assert all(torch.equal(got[n], t) for n, t in per_expert.items())
    assert load.stats.to_dict() == {"direct_tensors": 0, "direct_copies": 0, "direct_bytes": 0, "unfused_tensors": 2,
                                    "loader_tensors": 3 * E + 1, "loader_calls": 1}
    assert [n for n, _ in unfuse(f"{P}.fused_w2", fused[f"{P}.fused_w2"])][:2] == [f"{P}.0.down_proj.weight",
                                                                                   f"{P}.1.down_proj.weight"]


def test_the_per_refit_check_catches_a_changed_mapping():
    fused = _fused(_per_expert())
    d = _destination(tuple(range(E)), 0, 1)
    specs = _specs(fused)
    table = build_routes(specs, {P: d})
    table.check(specs, {P: d})  # unchanged: passes
    moved = ExpertDestination(**{**d.__dict__, "w13": d.w13.clone()})  # vLLM re-allocated the parameter
    with pytest.raises(RefitManifestError, match=f"{P}.*not where the direct-copy table points"):
        table.check(specs, {P: moved})
    remapped = ExpertDestination(**{**d.__dict__, "local_to_global": (1, 0, 2, 3, 4, 5, 6, 7)})
    with pytest.raises(RefitManifestError, match="not where the direct-copy table points"):
        table.check(specs, {P: remapped})
    resized = [TensorSpec(s.name, (E, 2 * INTER, HID + 1) if s.name.endswith("w13") else s.shape, s.dtype)
               for s in specs]
    with pytest.raises(RefitManifestError, match="export list is not the one"):
        table.check(resized, {P: d})
    assert table.fingerprint != build_routes(specs, {P: moved}).fingerprint


def test_stacked_parts_are_stacked_straight_into_the_buffer_view():
    parts = [torch.randn(4, 6).to(torch.bfloat16) for _ in range(3)]
    buf = torch.zeros(3 * 4 * 6 + 8, dtype=torch.bfloat16)
    view = buf[8:].view(3, 4, 6)
    s = StackedParts(parts)
    assert tuple(s.shape) == (3, 4, 6) and s.dtype == torch.bfloat16
    copy_export(view, s)
    assert torch.equal(view, torch.stack(parts)) and torch.equal(buf[:8], torch.zeros(8, dtype=torch.bfloat16))
    wide = torch.zeros(3, 4, 6, dtype=torch.float32)
    copy_export(wide, s)  # another dtype on the wire: stacked, then cast
    assert torch.equal(wide, torch.stack(parts).float())
    with pytest.raises(ValueError, match="shape, dtype and device"):
        StackedParts([parts[0], torch.zeros(5, 6, dtype=torch.bfloat16)])


# --------------------------------------------------------------------------- buckets and buffers


def test_fused_tensors_pack_into_fewer_larger_buckets():
    per_expert = H.moe_specs()
    groups, _ = expert_groups(per_expert)
    fused = fuse_specs(per_expert, groups.values())
    kwargs = dict(buffer_memory_ratio=None, alignment_bytes=256)
    small = plan_refit(per_expert, 1 << 30, buffer_gb=64 * 1024 / (1 << 30), **kwargs)
    assert small.num_oneoff == 0 and len(fused) < len(per_expert) / 4
    few = plan_refit(fused, 1 << 30, buffer_gb=64 * 1024 / (1 << 30), **kwargs)
    large = plan_refit(fused, 1 << 30, buffer_gb=(1 << 20) / (1 << 30), **kwargs)
    assert few.total_bytes == small.total_bytes
    # fewer tensors pad less to the alignment, so the same halves hold the bytes in no more buckets; halves as
    # large as the export hold it in one
    assert len(few.buckets) <= len(small.buckets) and len(large.buckets) == 1 and large.num_oneoff == 0
    tight = plan_refit(fused, 1 << 30, buffer_gb=16 * 1024 / (1 << 30), **kwargs)
    assert tight.num_oneoff == 3 and all(b.slot == SLOT_ONEOFF for b in tight.buckets if len(b.entries) == 1
                                         and b.entries[0].spec.name.endswith("fused_w13"))


@pytest.mark.parametrize("keep_gb,kept", [(16384 / (1 << 30), True), (16383 / (1 << 30), False), (0.0, False)])
def test_buffers_are_kept_across_refits_within_refit_keep_buffers_gb(pool, keep_gb, kept):
    s = uuid.uuid4().hex[:10]
    fc = pool.submit(H.consumer_main, {"session": s, "device": 0, "steps": 3})
    fp = pool.submit(H.producer_main, {"session": s, "rank": 0, "world_size": 1, "steps": 3,
                                       "cfg": {"keep_buffers_gb": keep_gb}})
    p, c = H.ok(fp.result(60)), H.ok(fc.result(60))
    assert c["mismatches"] == []
    assert [m["half_bytes"] for m in p["metrics"]] == [8192] * 3  # both halves together: 16 KiB
    assert [m["buffers_allocated"] for m in p["metrics"]] == ([2, 0, 0] if kept else [2, 2, 2])
    assert [m["buffers_opened"] for m in c["metrics"]] == ([2, 0, 0] if kept else [2, 2, 2])
    assert [m["buffers_kept"] for m in p["metrics"]] == [2 if kept else 0] * 3


def _run_moe(pool, fused: bool, steps: int = 2, replay: bool = False) -> tuple[dict, dict]:
    s = uuid.uuid4().hex[:10]
    fc = pool.submit(H.moe_consumer_main, {"session": s, "fused": fused, "steps": steps, "replay": replay})
    fp = pool.submit(H.model_producer_main, {"model": "moe", "session": s, "fused": fused, "steps": steps})
    return H.ok(fp.result(60)), H.ok(fc.result(60))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_a_refit_with_fused_transfer_leaves_the_engine_bit_identical_to_the_per_expert_refit(pool):
    p_off, c_off = _run_moe(pool, fused=False)
    p_on, c_on = _run_moe(pool, fused=True)
    assert p_off["num_specs"] == 1 + 3 * (3 + 24) + 1 and p_on["num_specs"] == 1 + 3 * (3 + 2) + 1
    off, on = c_off["params"], c_on["params"]
    assert set(off) == set(on)
    for name in off:
        assert off[name].dtype == on[name].dtype, name
        assert torch.equal(_bits(off[name]), _bits(on[name])), name
    # the refits moved something: the last step's values, nonzero everywhere it matters
    for name in ("model.layers.0.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w2_weight",
                 "model.layers.2.mlp.experts.w13_weight", "lm_head.weight"):
        assert on[name].float().abs().sum() > 0, name
    assert on["model.layers.0.mlp.gate.e_score_correction_bias"].dtype == torch.float32  # fp32 stays fp32
    # layers 0 and 1 were copied directly (2 tensors each, every refit), the FP8 layer 2 went through the loader
    table = c_on["table"]
    assert table["routes"] == 4 and set(table["uncovered"]) == {"model.layers.2.mlp.experts.fused_w13",
                                                                "model.layers.2.mlp.experts.fused_w2"}
    assert all("float8_e4m3fn" in why for why in table["uncovered"].values())
    assert [st["direct_tensors"] for st in c_on["stats"]] == [4, 4]
    assert [st["unfused_tensors"] for st in c_on["stats"]] == [2, 2]
    # fewer buckets for the same bytes, and the fused w13 of a layer (16 KiB) travels in a one-off buffer
    assert [m["bytes"] for m in p_on["metrics"]] == [m["bytes"] for m in p_off["metrics"]]
    assert all(m_on["num_buckets"] < m_off["num_buckets"] for m_on, m_off in zip(p_on["metrics"], p_off["metrics"]))
    assert all(m["num_oneoff_buckets"] == 3 for m in p_on["metrics"])


@pytest.mark.parametrize("replay", [False, True], ids=["loader", "replayed"])
def test_stacked_experts_read_in_place_leave_the_engine_where_the_packed_refit_does(pool, replay):
    """``refit.zero_copy_views`` with fused transfer: each layer's experts, separate parameters in the trainer's
    shared buffers, are read part by part where the trainer holds them: the covered layers straight into the
    fused parameters (this rank's experts, its tensor-parallel slice), the FP8 layer split back per expert for the
    engine's loader; the engine must end bit for bit where the packed fused refit ends, with nothing packed."""
    steps = 3
    _, packed = _run_moe(pool, fused=True, steps=steps, replay=replay)
    s = uuid.uuid4().hex[:10]
    fc = pool.submit(H.moe_consumer_main, {"session": s, "fused": True, "steps": steps, "replay": replay})
    fp = pool.submit(H.model_producer_main, {"model": "moe", "session": s, "fused": True, "steps": steps,
                                             "zero_copy": True, "cfg": {"fp32_params": ["*e_score_correction_bias"]}})
    p_zc, c_zc = H.ok(fp.result(60)), H.ok(fc.result(60))
    for name in packed["params"]:
        assert torch.equal(_bits(packed["params"][name]), _bits(c_zc["params"][name])), name
    stacks = [n for n in p_zc["zero_copy"] if parse_fused(n) is not None]
    assert len(stacks) == 6 and len(p_zc["zero_copy"]) == p_zc["num_specs"]  # every tensor read in place
    for step, m in enumerate(p_zc["metrics"]):
        assert m["zero_copy_tensors"] == p_zc["num_specs"] and m["num_oneoff_buckets"] == 0
        assert m["storages_shared"] == (2 if step == 0 else 0)  # the trainer's two buffers, shared once
    # the covered layers' experts copied part by part from the trainer's memory (one copy per expert and slice,
    # where the packed refit copies runs of experts out of its buffer), the FP8 layer split back for the loader
    assert [st["direct_tensors"] for st in c_zc["stats"]] == [4] * steps
    assert all(z["direct_copies"] > p["direct_copies"] for z, p in zip(c_zc["stats"], packed["stats"]))
    assert [st["unfused_tensors"] for st in c_zc["stats"]] == [2] * steps


def test_fused_transfer_with_the_replayed_load_equals_the_per_expert_refit(pool):
    """Both direct-copy paths at once, as the vLLM worker composes them: the fused tensors' routes first, the rest
    (and the FP8 layer's experts split back per expert) recorded at the first refit and replayed after."""
    _, c_off = _run_moe(pool, fused=False, steps=3)
    _, c_on = _run_moe(pool, fused=True, steps=3, replay=True)
    for name in c_off["params"]:
        assert torch.equal(_bits(c_off["params"][name]), _bits(c_on["params"][name])), name
    replay = c_on["replay"]
    assert replay["not_replayed"] == {}  # every tensor the loader got was a plain copy (FP8: a converting one)
    # the embedding, each layer's o_proj, router and fp32 router bias, the LM head, and the FP8 layer's 8 experts'
    # gate, up and down (split back out of its two stacked tensors: the route table does not cover FP8)
    assert replay["replayed"] == 1 + 3 * 3 + 1 + 8 * 3
    assert [s["direct_tensors"] for s in c_on["replay_stats"]] == [replay["replayed"]] * 2
    assert all(s["loader_tensors"] == 0 for s in c_on["replay_stats"])


def test_the_trainer_reads_in_place_only_the_stacks_of_contiguous_experts_it_holds_alone():
    """``FusedExport.in_place_stacks``: a layer's experts held as separate contiguous parameters (Megatron's grouped
    GEMM weights, here stand-ins with its attribute names) on this rank alone can be read in place; a layer with a
    part that is not one byte range, in another dtype, or gathered over expert parallelism is packed."""
    from types import SimpleNamespace

    from rlc.runtime.policy.fused_export import FusedExport
    from rlc.runtime.refit.fused_layout import ExpertGroup

    def experts(parts_fc1, parts_fc2, ep=1):
        def linear(parts):
            return SimpleNamespace(**{f"weight{i}": p for i, p in enumerate(parts)})
        group = SimpleNamespace(size=lambda: ep) if ep > 1 else None
        return SimpleNamespace(ep_group=group, num_local_experts=len(parts_fc1), linear_fc1=linear(parts_fc1),
                               linear_fc2=linear(parts_fc2))

    def bf16(*shape):
        return torch.zeros(*shape, dtype=torch.bfloat16)

    e, inter, hid = 2, 4, 6
    w13 = [bf16(2 * inter, hid) for _ in range(e)]
    w2 = [bf16(hid, inter) for _ in range(e)]
    modules = {0: experts(w13, w2), 1: experts(w13, [bf16(inter, hid).t() for _ in range(e)]),
               2: experts(w13, [torch.zeros(hid, inter) for _ in range(e)]), 3: experts(w13, w2, ep=2)}
    groups = {n: ExpertGroup(f"model.layers.{n}.mlp.experts", e, inter, hid, "bfloat16") for n in modules}
    export = FusedExport(modules, groups, bridge_tasks=[])
    assert export.in_place_stacks() == [
        "model.layers.0.mlp.experts.fused_w13", "model.layers.0.mlp.experts.fused_w2",  # all contiguous bf16
        "model.layers.1.mlp.experts.fused_w13",  # its down_proj parts are transposed views
        "model.layers.2.mlp.experts.fused_w13",  # its down_proj parts are fp32, the wire carries bf16
    ]  # layer 3's experts are gathered over expert parallelism
