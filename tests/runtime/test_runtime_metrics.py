"""Per-step metrics logger: JSONL, progress line, timers, memory sampler, TensorBoard fallback."""

from __future__ import annotations

import importlib.util
import io
import json
import time
import warnings

import pytest
from rlc.contract.runtime_config import LoggingConfig
from rlc.runtime.metrics import MetricsLogger, PhaseTimer, flatten_metrics, format_duration, read_metrics


def _logger(tmp_path, **kw) -> tuple[MetricsLogger, io.StringIO]:
    stream = io.StringIO()
    kw.setdefault("use_tqdm", False)
    return MetricsLogger(tmp_path / "logs", stream=stream, **kw), stream


def test_jsonl_one_flushed_object_per_step_with_scalars_kept(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    m, _ = _logger(tmp_path, total_steps=3, progress_bar=False)
    m.log(
        1,
        {
            "reward": {"mean": torch.tensor(0.5)},
            "dynamic_sampling/num_gen_batches": 3,
            "lr": 1e-6,
            "bad": float("nan"),
            "note": "hi",
        },
    )
    # flushed: readable before close
    rows = read_metrics(tmp_path / "logs" / "metrics.jsonl")
    assert rows[0]["step"] == 1 and rows[0]["reward/mean"] == 0.5
    assert rows[0]["dynamic_sampling/num_gen_batches"] == 3 and isinstance(
        rows[0]["dynamic_sampling/num_gen_batches"], int
    )
    assert rows[0]["bad"] == "nan" and rows[0]["note"] == "hi" and rows[0]["lr"] == 1e-6
    m.log(2, {"x": 1})
    m.close()
    text = (tmp_path / "logs" / "metrics.jsonl").read_text()
    assert "NaN" not in text  # strict JSON
    assert [r["step"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl")] == [1, 2]


def test_resumed_run_appends(tmp_path) -> None:
    for step in (1, 2):
        m, _ = _logger(tmp_path, progress_bar=False)
        m.log(step, {"x": step})
        m.close()
    assert [r["x"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl")] == [1, 2]


def test_timer_accumulates_phases_and_samples_memory(tmp_path) -> None:
    calls = iter(range(100))
    m, _ = _logger(tmp_path, progress_bar=False, memory_sampler=lambda: {"free_gib": float(next(calls))})
    with m.timer("generate"):
        time.sleep(0.02)
    with m.timer("train"):
        pass
    with m.timer("generate"):
        time.sleep(0.01)
    rec = m.log(1, {})
    assert rec["timing/generate_s"] >= 0.03 and rec["timing/train_s"] < rec["timing/generate_s"]
    # sampled at the end of each phase; the last sample of a phase wins
    assert rec["memory/generate/free_gib"] == 2.0 and rec["memory/train/free_gib"] == 1.0
    assert "timing/generate_s" not in m.log(2, {})  # drained per step
    m.close()


def test_timer_records_on_exception_and_broken_sampler_warns_once() -> None:
    def boom():
        raise RuntimeError("no cuda")

    warned: list[str] = []
    t = PhaseTimer(boom, warn=warned.append)
    with pytest.raises(ValueError):
        with t("refit"):
            raise ValueError("x")
    with t("refit"):
        pass
    out = t.drain()
    assert "timing/refit_s" in out and not any(k.startswith("memory/") for k in out)
    assert len(warned) == 1 and "no cuda" in warned[0]


def test_progress_line_with_eta(tmp_path) -> None:
    m, stream = _logger(tmp_path, total_steps=10, jsonl=False)
    m._step_times.extend([2.0, 4.0])  # mean 3 s/step
    line = m.progress_line(4, {"reward/mean": 0.51234, "loss/total": -0.2, "unrelated": 1})
    assert line.startswith("step 4/10 (40%)") and "3.0 s/step" in line and "ETA 18s" in line
    assert "reward/mean=0.5123" in line and "unrelated" not in line
    m.log(5, {"reward/mean": 0.5})
    assert stream.getvalue().startswith("step 5/10 (50%)") and "ETA" in stream.getvalue()
    m.close()
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()


@pytest.mark.skipif(importlib.util.find_spec("tqdm") is None, reason="tqdm not installed")
def test_tqdm_progress_bar(tmp_path) -> None:
    m, stream = _logger(tmp_path, total_steps=4, jsonl=False, use_tqdm=True)
    m.log(1, {"reward/mean": 0.25})
    m.close()
    assert "1/4" in stream.getvalue() and "reward/mean=0.25" in stream.getvalue()


def test_tensorboard_missing_warns_once_and_continues(tmp_path, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = MetricsLogger.from_config(
            LoggingConfig(dir=str(tmp_path / "logs"), jsonl=True, tensorboard=True, progress_bar=False)
        )
        m.log(1, {"x": 1.0})
        m.close()
    msgs = [str(w.message) for w in caught if "tensorboard" in str(w.message)]
    assert len(msgs) == 1 and "logging.tensorboard" in msgs[0]
    assert read_metrics(tmp_path / "logs" / "metrics.jsonl")[0]["x"] == 1.0


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_writes_events(tmp_path) -> None:
    m, _ = _logger(tmp_path, tensorboard=True, progress_bar=False)
    m.log(1, {"x": 1.0, "flag": True, "text": "skip"})
    m.close()
    assert list((tmp_path / "logs" / "tensorboard").glob("events.out.tfevents.*"))


def test_helpers() -> None:
    assert flatten_metrics({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a/b": 1, "a/c/d": 2, "e": 3}
    assert format_duration(3725) == "1h02m05s" and format_duration(65) == "1m05s" and format_duration(9.4) == "9s"
    assert json.dumps(flatten_metrics({"x": [1, 2]})) == '{"x": [1, 2]}'
