"""Replayed load: the recording of a loader's copies, the replay table, its per-refit check, and a whole refit across
processes replayed vs loaded by the engine's own loader every time.

The reference is :class:`tests.refit.harness.TinyDenseEngine`, whose ``load_weights`` follows vLLM's weight loaders
(fused ``qkv_proj`` / ``gate_up_proj`` shards, this tensor-parallel rank's rows or columns) and has the three kinds
of tensor a replay must leave to the loader: a computed value, a converted temporary, a skipped tensor.
"""
from __future__ import annotations

import uuid

import pytest
import torch

from rlc.runtime.refit.errors import RefitManifestError
from rlc.runtime.refit.replay import RecordingLoader, ReplayLoader
from rlc.runtime.refit.sources import View
from tests.refit import harness as H


def _export(step: int) -> list[tuple[str, torch.Tensor]]:
    return list(H.dense_export(step)[1])


def _buckets(weights: list, size: int) -> list[list]:
    return [weights[i:i + size] for i in range(0, len(weights), size)]


def _record(engine: H.TinyDenseEngine, step: int = 0, bucket: int = 5):
    recording = RecordingLoader(engine.load_weights, engine)
    for b in _buckets(_export(step), bucket):
        recording(b)
    return recording.table(H.dense_specs())


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


def test_a_replayed_refit_equals_the_loader_and_leaves_computed_tensors_to_it():
    engine, reference = H.TinyDenseEngine(), H.TinyDenseEngine()
    table = _record(engine)
    reference.load_weights(_export(0))
    assert _equal(engine.snapshot(), reference.snapshot()) == []  # the recorded refit is the loader's own
    assert set(table.not_replayed) == {"model.norm.weight", "model.layers.0.mlp.router_bias",
                                       "model.layers.1.mlp.router_bias", "model.rotary_emb.inv_freq"}
    assert "computed or converted" in table.not_replayed["model.norm.weight"]
    assert "no copy" in table.not_replayed["model.rotary_emb.inv_freq"]
    assert len(table.routes) == len(H.dense_specs()) - 4
    for step in (1, 2, 3):  # new values every refit, in buckets cut differently from the recorded refit's
        loader = ReplayLoader(engine.load_weights, table)
        for b in _buckets(_export(step), 7):
            loader(b)
        reference.load_weights(_export(step))
        assert _equal(engine.snapshot(), reference.snapshot()) == [], step
        assert loader.stats.direct_tensors == len(table.routes)
        assert loader.stats.loader_tensors == 4  # only the tensors the loader computes, converts or skips


def test_the_recorded_copies_are_this_ranks_shards():
    table = _record(H.TinyDenseEngine())
    q = H.DENSE_HEADS * H.DENSE_HEAD_DIM // H.DENSE_TP_SIZE
    k_route = table.routes["model.layers.0.self_attn.k_proj.weight"]
    (copy,) = k_route.copies
    assert copy.dst.offset == q * H.DENSE_HIDDEN  # rows after this rank's q rows of the fused qkv_proj
    half = H.DENSE_KV_HEADS * H.DENSE_HEAD_DIM // 2
    assert copy.src.offset == H.DENSE_TP_RANK * half * H.DENSE_HIDDEN and copy.src.size == (half, H.DENSE_HIDDEN)
    (o_copy,) = table.routes["model.layers.0.self_attn.o_proj.weight"].copies
    assert o_copy.src.stride == (q * 2, 1) and o_copy.src.offset == q  # this rank's columns: a strided view


def test_a_moved_parameter_or_a_new_export_list_stops_the_refit():
    engine = H.TinyDenseEngine()
    table = _record(engine)
    table.check(H.dense_specs(), engine)  # unchanged: fine
    name = "model.layers.1.self_attn.qkv_proj.weight"
    engine.params[name].data = torch.zeros_like(engine.params[name].data)  # vLLM re-allocated the weight
    with pytest.raises(RefitManifestError, match="not where the replay table points"):
        table.check(H.dense_specs(), engine)
    other = H.TinyDenseEngine()
    table = _record(other)
    with pytest.raises(RefitManifestError, match="not the one the replay table was recorded for"):
        table.check(H.dense_specs()[:-1], other)


def test_tensors_written_twice_or_held_by_the_loader_keep_the_loader():
    class Overlapping(H.TinyDenseEngine):
        """Writes the LM head into the embedding too (a tied copy made by the loader)."""

        def load_weights(self, weights):
            held = []
            for name, w in weights:
                if name == "lm_head.weight":
                    held.append(w)  # loaded after the last tensor, like a loader that waits for a pair
                    continue
                super().load_weights([(name, w)])
            for w in held:
                rows = self.params["lm_head.weight"].shape[0]
                self.params["lm_head.weight"].data.copy_(w.narrow(0, H.DENSE_TP_RANK * rows, rows))
                self.params["model.embed_tokens.weight"].data.copy_(w.narrow(0, H.DENSE_TP_RANK * rows, rows))
            return set()

    engine = Overlapping()
    table = _record(engine, bucket=100)
    assert "while loading another tensor" in table.not_replayed["lm_head.weight"]
    assert "also written by another tensor" in table.not_replayed["model.embed_tokens.weight"]


def test_a_loader_that_writes_into_its_input_or_fills_a_parameter_keeps_the_loader():
    class Scribbling(H.TinyDenseEngine):
        def load_weights(self, weights):
            for name, w in weights:
                if name == "model.layers.0.mlp.down_proj.weight":
                    w.mul_(1)  # in place on the tensor it was handed
                elif name == "model.layers.1.input_layernorm.weight":
                    self.params[name].data.fill_(0)  # padding-style fill before the copy
                super().load_weights([(name, w)])
            return set()

    class Hoarding(H.TinyDenseEngine):
        def load_weights(self, weights):
            return super().load_weights(list(weights))  # reads every tensor before it writes any

    table = _record(Scribbling(), bucket=100)
    assert "writes into the tensor it loads (mul_)" in table.not_replayed["model.layers.0.mlp.down_proj.weight"]
    assert "with fill_ (not a plain copy)" in table.not_replayed["model.layers.1.input_layernorm.weight"]
    assert "model.layers.0.input_layernorm.weight" in table.routes
    # which tensor a computed write belongs to is unknown once the loader has read them all: nothing is replayed
    hoarded = _record(Hoarding(), bucket=100)
    assert hoarded.routes == {} and len(hoarded.not_replayed) == len(H.dense_specs())


def test_view_extent_and_rebuild():
    base = torch.arange(60.0).reshape(6, 10)
    view = base[1:5, 2:8:2]
    v = View.of(view, base)
    assert torch.equal(v.on(base), view)
    assert v.extent() == (12, 12 + 3 * 10 + 2 * 2 + 1)
    assert View(3, (0, 4), (4, 1)).extent() == (3, 3)


def _run(pool, replay: bool, steps: int) -> dict:
    s = uuid.uuid4().hex[:10]
    fc = pool.submit(H.dense_consumer_main, {"session": s, "replay": replay, "steps": steps})
    fp = pool.submit(H.model_producer_main, {"model": "dense", "session": s, "steps": steps})
    H.ok(fp.result(60))
    return H.ok(fc.result(60))


def test_refits_over_shared_memory_replayed_equal_the_loader_bit_for_bit(pool):
    loaded, replayed = _run(pool, False, 3), _run(pool, True, 3)
    for step, (want, got) in enumerate(zip(loaded["params"], replayed["params"])):
        assert _equal(want, got) == [], step
    assert replayed["params"][2]["lm_head.weight"].float().abs().sum() > 0
    assert replayed["params"][2]["model.layers.0.mlp.router_bias"].dtype == torch.float32
    table = replayed["table"]
    assert table["not_replayed"].keys() == {"model.norm.weight", "model.layers.0.mlp.router_bias",
                                            "model.layers.1.mlp.router_bias", "model.rotary_emb.inv_freq"}
    # refits 2 and 3 replayed every other tensor (no view of the buffers kept: the consumer checks it)
    assert [s["direct_tensors"] for s in replayed["stats"]] == [table["replayed"]] * 2
    assert all(s["loader_tensors"] == 4 for s in replayed["stats"])

