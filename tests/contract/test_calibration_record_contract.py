"""The calibration record: what the runtime's own code writes, the compiler's parser reads."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from rlc.compiler.planner.calibration import CalibrationError, parse_record
from rlc.contract.calibration_record import (PHASES, STEP_MEMORY_PHASES, CalibrationRecord,
                                             CalibrationRecordError, memory_metric_key)
from rlc.contract.runtime_config import load_runtime_config
from rlc.runtime.recorder import Recorder
from rlc.runtime.worker_api import Memory

ROOT = Path(__file__).resolve().parents[2]
TINY_RUN_RECORDS = ROOT / "docs/results/tiny-qwen3-h200-grpo/calibration.jsonl"
TINY_RUNTIME_YAML = ROOT / "tests/gpu/tiny_runtime.yaml"
MEMORY = {"free_gib": 123.7662, "used_gib": 16.0345, "total_gib": 139.8007,
          "torch_allocated_gib": 13.7223, "torch_reserved_gib": 13.7344}


def _recorder(tmp_path):
    cfg = load_runtime_config(TINY_RUNTIME_YAML)
    logging_cfg = type(cfg.logging)(dir=str(tmp_path), jsonl=True, tensorboard=False, progress_bar=False)
    cfg = type(cfg)(**{**cfg.__dict__, "logging": logging_cfg})
    record = Recorder(cfg)
    record.versions = {"torch": "2.11.0", "vllm": "0.22.0"}
    return record


def test_records_the_driver_writes_are_read_by_the_compiler(tmp_path):
    record = _recorder(tmp_path)
    record.started("vllm_started", Memory(**MEMORY))
    record.calibrate(1, "after_sleep", Memory(**MEMORY))
    record.calibrate(1, "refit_free", Memory(free_gib=135.7, used_gib=4.1, total_gib=139.8),
                     extra={"half_gib": 0.25, "offload_optimizer": True})
    record.close()
    lines = (tmp_path / "calibration.jsonl").read_text().splitlines()
    records = [parse_record(line) for line in lines]
    assert [r.phase for r in records] == ["vllm_started", "after_sleep", "refit_free"]
    first = records[0]
    assert first.gpu_type == record.cfg.cluster.gpu_type and first.versions["vllm"] == "0.22.0"
    assert first.used_gib == MEMORY["used_gib"] and first.torch_allocated_gib == MEMORY["torch_allocated_gib"]
    assert first.sleep_level == record.cfg.refit.sleep_level
    assert first.enforce_eager is record.cfg.generation.enforce_eager
    assert records[2].extra == {"half_gib": 0.25, "offload_optimizer": True}
    assert records[2].torch_allocated_gib is None


def test_records_of_the_recorded_h200_run_parse():
    lines = TINY_RUN_RECORDS.read_text().splitlines()
    records = [parse_record(line) for line in lines if line.strip()]
    assert len(records) == len([x for x in lines if x.strip()]) > 0
    assert {r.gpu_type for r in records} == {"h200-141gb"}
    assert {r.phase for r in records} <= set(PHASES)
    assert {"after_sleep", "refit_free", "after_wake"} <= {r.phase for r in records}


def test_json_round_trip_is_lossless():
    rec = CalibrationRecord.from_memory("refit_free", MEMORY, step=3, sleep_level=2, enforce_eager=False,
                                        gpu_type="h100-80gb", versions={"vllm": "0.17.1"}, worker="rank0",
                                        weights_awake=True, extra={"half_gib": 1.5})
    line = rec.to_json()
    assert json.loads(line)["weights_awake"] is True
    assert json.loads(line)["kind"] == "calibration" and json.loads(line)["half_gib"] == 1.5
    assert parse_record(line) == rec
    assert parse_record(rec.to_dict()) == rec


def _phases_named_in(method_names: set[str]) -> set[str]:
    """String literal phases passed to the given recorder methods anywhere in the driver's and the recorder's
    source."""
    found = set()
    for module in ("driver", "recorder", "weight_sync"):
        tree = ast.parse((ROOT / f"rlc/runtime/{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in method_names:
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found.add(arg.value)
    return found


def test_every_phase_the_driver_names_is_in_the_contract():
    written = _phases_named_in({"calibrate", "started"})
    sampled = _phases_named_in({"memory"})
    assert written and sampled
    assert written <= set(PHASES), written - set(PHASES)
    assert sampled <= set(STEP_MEMORY_PHASES), sampled - set(STEP_MEMORY_PHASES)


@pytest.mark.parametrize("change,needle", [
    ({"kind": "metrics"}, "kind"),
    ({"phase": "warmup"}, "phase 'warmup'"),
    ({"sleep_level": 3}, "sleep_level"),
    ({"free_gib": "35"}, "free_gib"),
    ({"used_gib": -1}, "used_gib"),
    ({"enforce_eager": 1}, "enforce_eager"),
    ({"weights_awake": "yes"}, "weights_awake"),
    ({"versions": {"vllm": 17}}, "versions"),
    ({"step": True}, "step"),
])
def test_bad_records_name_the_key(change, needle):
    good = json.loads(TINY_RUN_RECORDS.read_text().splitlines()[0])
    with pytest.raises(CalibrationError, match=needle):
        parse_record({**good, **change})


@pytest.mark.parametrize("key", ["gpu_type", "phase", "free_gib", "versions"])
def test_missing_key_is_named(key):
    good = json.loads(TINY_RUN_RECORDS.read_text().splitlines()[0])
    del good[key]
    with pytest.raises(CalibrationError, match=key):
        parse_record(good)


def test_writer_refuses_a_phase_outside_the_contract():
    with pytest.raises(CalibrationRecordError, match="phase"):
        CalibrationRecord.from_memory("warmup", MEMORY, step=0, sleep_level=1, enforce_eager=True,
                                      gpu_type="h200-141gb", versions={})
    with pytest.raises(CalibrationRecordError, match="memory phase"):
        memory_metric_key("warmup", "used_gib")
    assert memory_metric_key("train", "used_gib") == "memory/train/used_gib"


def test_contract_imports_neither_side_nor_gpu_libraries():
    import subprocess
    import sys

    code = ("import sys, rlc.contract.runtime_config, rlc.contract.calibration_record, rlc.contract.refit_buffer\n"
            "import rlc.contract.sequence_packing\n"
            "import rlc.contract.host_blocks\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'vllm', 'megatron', 'yaml')\n"
            "       or m.startswith(('rlc.compiler', 'rlc.runtime'))]\n"
            "print(','.join(sorted(bad)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == ""
