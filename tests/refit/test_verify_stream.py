"""``refit.verify_every`` at model size: the trainer's export crosses to the vLLM worker in shards checked one at a
time (``rlc.runtime.refit.verify_stream``), each side in its own process, as on a GPU node."""
from __future__ import annotations

import os
import time

import pytest
import torch

from rlc.contract.verify_check import layer_of
from rlc.runtime.refit.verify_stream import (ExportStreamError, ShardFiles, gather_export_shards, read_export_shards,
                                             verify_streamed, write_export_shards)
from tests.refit import harness as H

LAYERS = 8
LAYER_BYTES = 15_000  # about one layer of the tiny dense model (bf16 projections, an fp32 bias)


def _check(pool, tmp_path, writer: dict | None = None, reader: dict | None = None) -> tuple[dict, dict]:
    job = {"dir": str(tmp_path / "verify"), "layers": LAYERS}
    fr = pool.submit(H.verify_reader_main, {**job, **(reader or {})})
    fw = pool.submit(H.export_writer_main, {**job, "shard_bytes": LAYER_BYTES, **(writer or {})})
    return fw.result(60), fr.result(60)


def test_a_correct_refit_is_bit_exact_shard_by_shard_holding_a_fraction_of_the_model(pool, tmp_path):
    written, read = _check(pool, tmp_path)
    H.ok(written)
    r = H.ok(read)["report"]
    assert r["bit_exact"] and not r["mismatches"] and not r["unchecked"], r
    engine = H.TinyDenseEngine(LAYERS)
    assert r["params_compared"] == len(engine.params)  # every parameter, each counted once
    assert r["not_loaded"] == []
    assert r["exported_tensors"] == written["tensors"] == len(H.dense_specs(LAYERS))
    assert r["shards"] == written["shards"] >= LAYERS // 2
    assert written["most_pending"] <= 2  # disk: at most max_pending shards at once
    # host memory of the check: a shard, its snapshot and reference, not the export and two copies of the model
    whole_model_check = written["bytes"] + 2 * read["model_bytes"]
    assert r["peak_host_bytes"] * 4 < whole_model_check
    assert read["left"] == []  # every shard and marker removed


def test_a_flipped_bit_and_a_bias_rounded_to_bf16_are_named(pool, tmp_path):
    flip = "model.layers.5.self_attn.qkv_proj.weight"
    _, read = _check(pool, tmp_path, reader={"flip": flip, "round_bias": 6})
    r = H.ok(read)["report"]
    assert not r["bit_exact"]
    by_name = {m["name"]: m for m in r["mismatches"]}
    assert by_name.keys() == {flip, "model.layers.6.mlp.router_bias"}
    assert by_name[flip]["elements_differing"] == 1
    assert by_name["model.layers.6.mlp.router_bias"]["rounded_to_bf16"]
    assert by_name["model.layers.6.mlp.router_bias"]["mantissa_bits_lost"] == 16


@pytest.mark.parametrize("shard_bytes,shards", [(1, LAYERS + 2), (LAYER_BYTES, LAYERS + 1), (1 << 40, 1)])
def test_shards_are_cut_between_layers_once_they_hold_shard_bytes(tmp_path, shard_bytes, shards):
    files = ShardFiles(str(tmp_path), 0)
    written = write_export_shards(files, H.dense_export(0, LAYERS)[1], shard_bytes=shard_bytes, max_pending=1 << 20)
    layers = [[layer_of(n) for n in shard] for shard in read_export_shards(files, wait_s=5)]
    assert written.shards == len(layers) == shards
    runs = [k for shard in layers for k in dict.fromkeys(shard) if k is not None]
    assert runs == list(range(LAYERS))  # each layer whole, in one shard
    assert os.listdir(tmp_path) == []


def test_a_layer_split_across_shards_is_still_compared_whole():
    """An export that gives a layer's tensors in two places (two shards): each shard compares what it loaded, the
    part of a fused parameter it did not load is unchanged on both sides."""
    engine = H.TinyDenseEngine(LAYERS)
    engine.load_weights(H.dense_export(0, LAYERS)[1])
    qkv = "model.layers.2.self_attn.qkv_proj.weight"
    engine.params[qkv].data.view(torch.int16).view(-1)[-1] ^= 1  # in v's rows
    exported = dict(H.dense_export(0, LAYERS)[1])
    first = {n: t for n, t in exported.items() if n.endswith(("q_proj.weight", "k_proj.weight"))}
    rest = {n: t for n, t in exported.items() if n not in first}
    report = verify_streamed(engine, [first, rest])
    assert [m["name"] for m in report["mismatches"]] == [qkv]
    assert report["mismatches"][0]["elements_differing"] == 1
    assert report["params_compared"] == len(engine.params) and report["shards"] == 2


def test_a_load_outside_the_shards_layers_is_not_called_bit_exact(pool, tmp_path):
    _, read = _check(pool, tmp_path, reader={"foreign": "model.layers.4.mlp.down_proj.weight"})
    r = H.ok(read)["report"]
    assert r["unchecked"] == ["model.layers.4.mlp.down_proj.weight"] and not r["mismatches"]
    assert not r["bit_exact"]


def test_the_exports_failure_reaches_the_reader_at_once(pool, tmp_path):
    t0 = time.monotonic()
    written, read = _check(pool, tmp_path, writer={"fail_after": 30, "wait_s": 30}, reader={"wait_s": 30})
    assert not written["ok"] and "a gather failed" in written["error"]
    assert not read["ok"] and read["error_type"] == "ExportStreamError"
    assert "trainer rank 0's export failed" in read["error"] and "a gather failed" in read["error"]
    assert time.monotonic() - t0 < 20  # not after the reader's 30 s wait


def test_the_readers_failure_reaches_the_writer_at_once(pool, tmp_path):
    """The vLLM worker's loader raises on layer 2: the trainer rank, waiting for room on disk (one shard at a time
    here), stops with the worker's reason instead of after its 30 s wait."""
    t0 = time.monotonic()
    written, read = _check(pool, tmp_path, writer={"max_pending": 1, "wait_s": 30},
                           reader={"fail_at_layer": 2, "wait_s": 30})
    assert not read["ok"] and "vLLM's weight loader raised" in read["error"]
    assert not written["ok"] and written["error_type"] == "ExportStreamError"
    assert "stopped checking after" in written["error"] and "vLLM's weight loader raised" in written["error"]
    assert time.monotonic() - t0 < 20
    assert not os.path.exists(ShardFiles(str(tmp_path / "verify"), 0).failed)  # the writer did not fail on its own


def test_a_writer_without_a_reader_stops_with_the_reason(tmp_path):
    files = ShardFiles(str(tmp_path), 0)
    _, stream = H.dense_export(0, 4)
    with pytest.raises(ExportStreamError, match="read no export shard for 0 s"):
        write_export_shards(files, stream, shard_bytes=1, max_pending=1, wait_s=0.2)
    assert os.path.exists(files.failed)  # and the reader, if it comes, is told


def test_a_reader_without_a_writer_stops_with_the_reason(tmp_path):
    with pytest.raises(ExportStreamError, match="wrote no export shard"):
        list(read_export_shards(ShardFiles(str(tmp_path), 3), wait_s=0.2))


def test_a_shard_missing_before_the_last_is_an_error(tmp_path):
    files = ShardFiles(str(tmp_path), 0)
    _, stream = H.dense_export(0, 2)
    written = write_export_shards(files, stream, shard_bytes=1, max_pending=100)
    os.remove(files.shard(1))
    shards = read_export_shards(files, wait_s=5)
    next(shards)
    with pytest.raises(ExportStreamError, match=f"shard 1 of {written.shards} .* is missing"):
        next(shards)


def test_layer_of_reads_the_decoder_layer_index():
    assert layer_of("model.layers.12.mlp.experts.w13_weight") == 12
    assert layer_of("backbone.layers.3.mixer.in_proj.weight") == 3
    assert layer_of("model.language_model.layers.0.self_attn.qkv_proj.weight") == 0
    assert layer_of("model.embed_tokens.weight") is None and layer_of("lm_head.weight") is None
    assert layer_of("model.sublayers.2.x") is None


def test_a_loader_that_names_nothing_still_compares_the_shards_layers():
    """``load_weights`` that returns no names: every parameter of the shard's layers is compared (a loaded one
    that differs is still caught); nothing can be called not loaded."""
    engine = H.TinyDenseEngine(2)
    engine.load_weights(H.dense_export(0, 2)[1])
    engine.params["model.layers.1.self_attn.o_proj.weight"].data.view(torch.int16).view(-1)[0] ^= 1
    _, stream = H.dense_export(0, 2)
    report = verify_streamed(engine, [dict(stream)], load=lambda items: (engine.load_weights(items), None)[1])
    assert [m["name"] for m in report["mismatches"]] == ["model.layers.1.self_attn.o_proj.weight"]
    assert report["not_loaded"] == [] and report["params_compared"] == len(engine.params)


def test_an_fp8_engine_gathers_every_shard_and_a_gathering_failure_reaches_the_writer(tmp_path):
    files = ShardFiles(str(tmp_path / "ok"), 0)
    write_export_shards(files, H.dense_export(0, 4)[1], shard_bytes=1, max_pending=1 << 20)
    exported = gather_export_shards(files, wait_s=5)
    want = dict(H.dense_export(0, 4)[1])
    assert exported.keys() == want.keys() and all(torch.equal(exported[n], want[n]) for n in want)
    assert os.listdir(files.directory) == []
    stalled = ShardFiles(str(tmp_path / "stalled"), 0)
    with pytest.raises(ExportStreamError):
        gather_export_shards(stalled, wait_s=0.2)
    assert os.path.exists(stalled.reader_failed)
