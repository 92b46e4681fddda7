"""CPU parts of ``benchmarks/kv_wake.py``: argument errors that name the flag, the 2 MiB allocation sizes, the
summary statistics, the table, and ``--dry-run`` as a script (no torch, no vLLM)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import kv_wake as K

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


# --------------------------------------------------------------------------- arguments


def test_defaults_and_lists_are_parsed():
    a = K.parse_args([])
    assert (a.pool_bytes, a.allocation_list, a.gap_list, a.repeats) == (40 << 30, [1, 36, 288], [0.0, 0.5], 10)
    a = K.parse_args(["--pool-gib", "2", "--allocations", " 4, 8 ,", "--gaps", "0.25", "--repeats", "3"])
    assert (a.allocation_list, a.gap_list) == ([4, 8], [0.25])
    assert [(c["allocations"], c["gap_s"]) for c in K.configurations(a)] == [(4, 0.25), (8, 0.25)]


@pytest.mark.parametrize(("argv", "flag"), [
    (["--allocations", "0"], "--allocations"),
    (["--allocations", "1,x"], "--allocations"),
    (["--allocations", ","], "--allocations"),
    (["--allocations", "5000"], "--allocations"),  # 8 MiB pieces: PyTorch would share segments
    (["--gaps", "0,-0.5"], "--gaps"),
    (["--gaps=-1"], "--gaps"),
    (["--gaps", "nan"], "--gaps"),
    (["--pool-gib", "0"], "--pool-gib"),
    (["--pool-gib", "0.001"], "--pool-gib"),
    (["--repeats", "0"], "--repeats"),
    (["--timeout-s", "0"], "--timeout-s"),
])
def test_a_bad_value_exits_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        K.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag}" in err and "Traceback" not in err


# --------------------------------------------------------------------------- allocation sizes


@pytest.mark.parametrize(("pool", "n"), [(40 << 30, 1), (40 << 30, 36), (40 << 30, 288), (K.pool_bytes(7.3), 13),
                                         (6 * MIB, 3), (2 * MIB, 1)])
def test_sizes_sum_to_the_pool_in_2_mib_steps(pool, n):
    sizes = K.allocation_sizes(pool, n)
    assert len(sizes) == n and sum(sizes) == pool
    assert all(s > 0 and s % (2 * MIB) == 0 for s in sizes)
    assert max(sizes) - min(sizes) <= 2 * MIB


def test_the_pool_is_rounded_down_to_2_mib_and_impossible_splits_are_refused():
    assert K.pool_bytes(40) == 40 << 30 and K.pool_bytes(0.0025) == 2 * MIB  # 2.56 MiB -> 2 MiB
    with pytest.raises(ValueError, match="at least 6 MiB"):
        K.allocation_sizes(4 * MIB, 3)
    with pytest.raises(ValueError, match="multiple of 2 MiB"):
        K.allocation_sizes(3 * MIB, 1)
    with pytest.raises(ValueError, match="at least 1"):
        K.allocation_sizes(4 * MIB, 0)


# --------------------------------------------------------------------------- summary and table


def test_summary_statistics():
    assert K.summarise([0.03, 0.01, 0.02, 0.05]) == {"median": 0.025, "min": 0.01, "max": 0.05, "n": 4}
    assert K.summarise([0.2]) == {"median": 0.2, "min": 0.2, "max": 0.2, "n": 1}
    with pytest.raises(ValueError):
        K.summarise([])
    r = {"pool_bytes": 40 * 10**9, "wake_s": [0.02, 0.04, 0.08], "sleep_s": [0.01, 0.01, 0.03],
         "after_wake": ["zero", "zero", "kept"]}
    s = K.summarise_result(r)
    assert s["wake_s"]["median"] == 0.04 and s["sleep_s"]["max"] == 0.03
    assert s["wake_gb_per_s"] == pytest.approx(1000.0)  # 40 GB in 0.04 s
    assert s["after_wake"] == {"zero": 2, "kept": 1}


def test_the_table_has_a_row_per_configuration_and_shows_failures():
    pool = 40 << 30
    results = [{"allocations": n, "gap_s": g, "pool_bytes": pool, "driver_allocations": n,
                "wake_s": [0.015 * (i + 1) for i in range(3)], "sleep_s": [0.005, 0.006, 0.007],
                "after_wake": ["zero"] * 3} for n in (1, 36) for g in (0.0, 0.5)]
    results[1]["driver_allocations"] = 2
    results.append({"allocations": 288, "gap_s": 0.5, "pool_bytes": pool,
                    "error": "Traceback ...\nRuntimeError: the GPU has 3.0 GiB free\n"})
    text = K.table_text(results)
    lines = text.splitlines()
    assert "wake s: median (min-max)" in lines[0] and "sleep s: median (min-max)" in lines[0]
    assert len(lines) == 2 + len(results)
    for line, r in zip(lines[2:], results, strict=True):
        assert line.split()[:2] == [str(r["allocations"]), f"{r['gap_s']:g}"]
    assert "0.0300 (0.0150-0.0450)" in lines[2] and "0.0060 (0.0050-0.0070)" in lines[2]
    assert f"{pool / 0.03 / 1e9:.0f}" in lines[2] and "zero 3/3" in lines[2]
    assert "(2 driver allocations)" in lines[3]
    assert lines[-1].endswith("FAILED: RuntimeError: the GPU has 3.0 GiB free")


# --------------------------------------------------------------------------- the script


def test_dry_run_lists_every_configuration_without_torch_or_vllm():
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "benchmarks" / "kv_wake.py"), "--dry-run",
                           "--pool-gib", "40", "--allocations", "1,36,288", "--gaps", "0,0.5"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pool: 40 GiB" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("allocations")]
    assert [(r[1], r[3]) for r in rows] == [(n, g) for n in ("1", "36", "288") for g in ("0", "0.5")]
    assert "each 40960 MiB" in proc.stdout and "each 142-144 MiB" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "vllm"}


def test_a_run_writes_the_json_and_a_failed_configuration_does_not_stop_the_others(tmp_path, capsys):
    # Without a GPU and vLLM each measuring process fails at its first GPU import; the parent records the error
    # and goes on. (With them, this small pool is simply measured.)
    out = tmp_path / "kv_wake.json"
    code = K.main(["--pool-gib", "0.05", "--allocations", "1,2", "--gaps", "0", "--repeats", "2", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["command"] == "python benchmarks/kv_wake.py --pool-gib 0.05 --allocations 1,2 --gaps 0 --repeats 2 " \
                              f"--json {out}"
    assert {"host", "cpu", "python", "platform"} <= set(data["machine"]) and data["commit"]
    assert [c["allocations"] for c in data["configurations"]] == [1, 2]
    for c in data["configurations"]:
        measured = len(c.get("wake_s", [])) == len(c.get("sleep_s", [])) == 2
        assert c.get("error") or (measured and c["driver_allocations"] == c["allocations"])
    assert code == (1 if any(c.get("error") for c in data["configurations"]) else 0)
    assert data["table"] in capsys.readouterr().out
