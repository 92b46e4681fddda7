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
