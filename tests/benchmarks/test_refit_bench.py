"""The refit bandwidth benchmark runs end to end on the shm backend (the GPU run uses cuda_ipc)."""
from __future__ import annotations

import pytest

from benchmarks import refit_bandwidth


def test_refit_bandwidth_benchmark_shm(capsys):
    summary = refit_bandwidth.main(["--backend", "shm", "--mib", "4", "--repeats", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    assert "| memcpy (torch copy_), same bytes" in out and "ratio refit/copy = " in out
    assert summary["bytes"] == 4 << 20 and summary["tensors"] == 32
    assert summary["refit_gbps"] > 0 and summary["copy_gbps"] > 0
    assert summary["buckets"] >= 2  # halves are a quarter of the weights each
    # the halves and their handles are made by the first refit and reused by the second
    assert summary["buffers_allocated"] == summary["handles_opened"] == [2, 0]
    for m in summary["refit_metrics"]:
        assert m["bytes"] == 4 << 20 and m["consumer"]["bytes"] == 4 << 20


def test_refit_bandwidth_check_exits_non_zero_below_its_goal(monkeypatch, capsys):
    assert refit_bandwidth.meets_goal(refit_bandwidth.GOAL_RATIO)
    assert not refit_bandwidth.meets_goal(refit_bandwidth.GOAL_RATIO - 1e-9)
    assert not refit_bandwidth.meets_goal(float("nan"))
    monkeypatch.setattr(refit_bandwidth, "GOAL_RATIO", 1e9)  # no machine reaches this: the measured ratio fails
    with pytest.raises(SystemExit) as exc:
        refit_bandwidth.main(["--backend", "shm", "--mib", "2", "--repeats", "1", "--warmup", "0", "--check"])
    assert "below the goal" in str(exc.value.code)
    assert "BELOW the goal" in capsys.readouterr().out


def test_refit_bandwidth_zero_copy_reads_every_tensor_in_place(capsys):
    summary = refit_bandwidth.main(["--backend", "shm", "--mib", "4", "--repeats", "2", "--warmup", "0",
                                    "--zero-copy"])
    out = capsys.readouterr().out
    assert "one-copy bound" in out and "zero-copy: every byte is copied once" in out
    assert "every tensor read in place, no buffer" in out
    assert summary["zero_copy"] and summary["zero_copy_tensors"] == [32, 32]
    assert summary["buffers_allocated"] == [0, 0]  # nothing is packed: no buffer at all
    for m in summary["refit_metrics"]:
        assert m["bytes"] == m["zero_copy_bytes"] == m["consumer"]["bytes"] == 4 << 20


def test_timeline_places_each_event_on_its_refits_clock():
    producer = [(0, "call", -1, 1_000), (0, "send", 0, 3_000), (1, "call", -1, 10_000), (1, "send", 0, 14_000),
                (2, "call", -1, 20_000), (2, "send", 0, 22_000)]
    consumer = [(0, "call", -1, 0), (0, "recv", 0, 5_000), (1, "call", -1, 6_000), (1, "recv", 0, 15_000),
                (2, "call", -1, 16_000), (2, "recv", 0, 26_000)]
    rows = refit_bandwidth.timeline_rows(producer, consumer, warmup=1)
    by_event = {(r["side"], r["event"]): r for r in rows}
    # the warm-up refit is left out; the consumer's own call waits for the producer and has no place on the clock
    assert ("C", "call") not in by_event
    assert by_event["P", "send"]["min_us"] == 2.0 and by_event["P", "send"]["max_us"] == 4.0
    assert by_event["C", "recv"]["median_us"] == 5.5 and by_event["C", "recv"]["refits"] == 2
    assert [r["event"] for r in rows] == ["call", "send", "recv"]  # ordered by median


def test_refit_bandwidth_timeline_records_both_processes(capsys):
    summary = refit_bandwidth.main(["--backend", "shm", "--mib", "2", "--repeats", "2", "--warmup", "1",
                                    "--timeline"])
    assert "timeline: µs after the producer's send began" in capsys.readouterr().out
    events = {(r["side"], r["event"]) for r in summary["timeline"]}
    # the producer's whole refit and the consumer's steps up to Done, two refits each
    assert {("P", "send"), ("P", "end"), ("P", "done"), ("C", "begin"), ("C", "recv"), ("C", "ack"), ("C", "end"),
            ("C", "synced"), ("C", "done")} <= events
    assert all(r["refits"] == 2 for r in summary["timeline"] if r["event"] in ("end", "done"))
    order = {(r["side"], r["event"], r["bucket"]): r["median_us"] for r in summary["timeline"]}
    last = max(r["bucket"] for r in summary["timeline"])
    assert order["C", "done", last] < order["P", "done", last]  # Done is sent before the producer reads it


def test_refit_bandwidth_bucket_knobs_change_the_message_count(capsys):
    """One zero-copy bucket for the whole export instead of one per 1 MiB of views; a single half kept across
    refits when the keep limit holds it, allocated every refit when it does not."""
    base = ["--backend", "shm", "--mib", "4", "--repeats", "2", "--warmup", "0"]
    split = refit_bandwidth.main([*base, "--zero-copy", "--zero-copy-bucket-mib", "1"])
    whole = refit_bandwidth.main([*base, "--zero-copy", "--zero-copy-bucket-mib", "4"])
    assert split["buckets"] == 4 and whole["buckets"] == 1
    assert whole["zero_copy_bucket_bytes"] == 4 << 20
    one = ["--buffer-gb", str(8 / 1024)]  # halves of 4 MiB: the whole export in one bucket
    kept = refit_bandwidth.main([*base, *one, "--keep-gb", str(8 / 1024)])
    freed = refit_bandwidth.main([*base, *one, "--keep-gb", "0"])
    assert kept["buckets"] == freed["buckets"] == 1
    assert kept["buffers_allocated"] == [1, 0] and freed["buffers_allocated"] == [1, 1]
    capsys.readouterr()


def test_only_packed_buckets_are_acked(capsys):
    """A packed bucket is acked (its half is packed again only after the consumer has read it); a bucket of views
    read in place frees no buffer, and the consumer's Done covers its loads: no ack crosses for it."""
    base = ["--backend", "shm", "--mib", "4", "--repeats", "2", "--warmup", "1", "--timeline"]
    packed = refit_bandwidth.main(base)
    in_place = refit_bandwidth.main([*base, "--zero-copy", "--zero-copy-bucket-mib", "1"])
    capsys.readouterr()

    def acked(summary: dict, side: str) -> set[int]:
        return {r["bucket"] for r in summary["timeline"] if (r["side"], r["event"]) == (side, "ack")}

    assert acked(packed, "C") == acked(packed, "P") == set(range(packed["buckets"])) and packed["buckets"] >= 2
    assert in_place["buckets"] == 4 and acked(in_place, "C") == acked(in_place, "P") == set()
    assert all(m["consumer"]["num_buckets"] == 4 for m in in_place["refit_metrics"])


def test_refit_bandwidth_batched_load_lands_the_same_bytes(capsys):
    """The consumer's copies a bucket at a time (as the replayed load issues them) end where one copy per tensor
    does: the benchmark compares a checksum of every destination with the source's and exits on a difference."""
    summary = refit_bandwidth.main(["--backend", "shm", "--mib", "4", "--repeats", "2", "--warmup", "0",
                                    "--batched-load"])
    capsys.readouterr()
    assert summary["batched_load"] and summary["buckets"] >= 2
    assert all(m["consumer"]["bytes"] == 4 << 20 for m in summary["refit_metrics"])
