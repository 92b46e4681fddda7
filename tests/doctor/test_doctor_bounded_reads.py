"""`rlc doctor` reads within bounds: a FIFO or a device named as the log is refused at once, stdin is
read up to a limit, and a log larger than the limit is read at its start and end (where runs print
their settings and where they fail), in bounded time and memory.

Before: a FIFO hung doctor, `/dev/zero` (as the log or as stdin) ended in a MemoryError, and a 500 MB
log took 2.59 GB and 102 s."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlc.compiler.doctor import logs as L

REPO = Path(__file__).resolve().parents[2]
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
       "79.10 GiB of which 1.20 GiB is free.\n")


def doctor(*argv: str, stdin=subprocess.DEVNULL, memory_mb: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:
        if memory_mb:
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "rlc.compiler.cli", "doctor", *argv], capture_output=True, text=True,
                          env=env, stdin=stdin, timeout=120, check=False, preexec_fn=limit)


def test_a_fifo_as_the_log_is_refused_at_once(tmp_path):
    fifo = tmp_path / "job.log"
    os.mkfifo(fifo)
    run = doctor(str(fifo))
    assert run.returncode == 2 and "a FIFO, not a regular file" in run.stderr, run.stderr


def test_a_fifo_in_a_log_folder_is_passed_over(tmp_path):
    os.mkfifo(tmp_path / "stuck.log")
    (tmp_path / "driver.log").write_text(OOM)
    run = doctor(str(tmp_path))
    assert run.returncode == 0 and "CUDA out of memory" in run.stdout, run.stderr


def test_a_device_as_the_log_is_refused_without_reading_it():
    run = doctor("/dev/zero")
    assert run.returncode == 2 and "a character device, not a regular file" in run.stderr, run.stderr


def test_an_endless_stdin_is_read_up_to_the_limit_in_bounded_memory():
    with open("/dev/zero", "rb") as zero:
        start = time.monotonic()
        run = doctor("-", stdin=zero, memory_mb=1024)
    assert run.returncode == 1, run.stderr  # nothing recognised, no MemoryError
    assert f"stdin: stopped after {L.STDIN_BYTES >> 20} MiB" in run.stderr
    assert time.monotonic() - start < 60


def test_a_log_larger_than_the_limit_is_read_at_its_start_and_end(tmp_path, monkeypatch):
    """The failure at the end of a long log is found; the middle is left out, and doctor says so."""
    monkeypatch.setattr(L, "LOG_BYTES", 1 << 20)
    monkeypatch.setattr(L, "LOG_HEAD_BYTES", 1 << 18)
    log = tmp_path / "job.log"
    line = "2026-01-01 INFO step loss 0.123 some text of a healthy log line\n"
    log.write_text("vLLM version 0.22.0 starting\n" + line * 100_000 + OOM)
    notes: list[str] = []
    [(name, text)] = L.read_logs(str(log), notes)
    assert text.startswith("vLLM version 0.22.0") and text.endswith(OOM)
    assert len(text.encode()) <= 1 << 20
    assert notes and "in the middle not read" in notes[0]

    from rlc.compiler.doctor.scan import scan

    assert [f.pattern for f in scan(text)] == ["cuda-oom"]


def test_a_folder_of_logs_is_read_up_to_the_total(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "TOTAL_BYTES", 3000)
    for i in range(5):
        (tmp_path / f"node{i}.log").write_text("x" * 1000 + "\n")
    notes: list[str] = []
    read = L.read_logs(str(tmp_path), notes)
    assert [name for name, _ in read] == ["node0.log", "node1.log", "node2.log"]
    assert any("node3.log and later files not read" in n for n in notes)


def test_a_line_without_breaks_is_cut_to_the_longest_line_scanned(tmp_path):
    log = tmp_path / "binary.log"
    log.write_bytes(b"\x01" * (3 * L.MAX_LINE) + b"\n" + OOM.encode())
    [(_, text)] = L.read_logs(str(log))
    assert max(len(line) for line in text.split("\n")) <= L.MAX_LINE and text.endswith(OOM)


@pytest.mark.slow
def test_a_200_mb_log_takes_seconds_not_minutes(tmp_path):
    log = tmp_path / "big.log"
    line = b"2026-01-01 INFO step 17 loss 0.12345 vllm engine text with nothing wrong in it\n"
    chunk = line * ((1 << 20) // len(line))
    with open(log, "wb") as fh:
        for _ in range(200):
            fh.write(chunk)
        fh.write(OOM.encode())
    start = time.monotonic()
    run = doctor(str(log), memory_mb=2048)
    assert run.returncode == 0 and "CUDA out of memory" in run.stdout, run.stderr
    assert time.monotonic() - start < 30
