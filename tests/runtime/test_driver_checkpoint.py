"""Driver-state checkpoints: atomic save, completeness marker, latest/load, pruning, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlc.runtime import checkpoint as C
from rlc.contract.runtime_config import CheckpointConfig


def _cfg(root, enabled=True, resume=True, changed=False) -> CheckpointConfig:
    return CheckpointConfig(enabled=enabled, dir=str(root), every_steps=5, keep_last=2, resume=resume,
                            resume_changed_recipe=changed)


def test_round_trip(tmp_path) -> None:
    state = {"step": 10, "data": {"epoch": 1, "position": 3}, "rng": [1, 2, 3], "lr": 1e-6, "note": None}
    d = C.save(tmp_path, 10, state)
    assert d == tmp_path / "step_000010"
    assert (d / "driver_state.json").is_file() and (d / "COMPLETE").is_file()
    assert C.latest(tmp_path) == 10
    ck = C.load(tmp_path)
    assert ck.step == 10 and ck.state == state and ck.path == d
    assert C.load(tmp_path, 10).state == state
    # no temporary files left behind
    assert sorted(p.name for p in d.iterdir()) == ["COMPLETE", "driver_state.json"]


def test_interrupted_checkpoint_is_ignored(tmp_path) -> None:
    C.save(tmp_path, 5, {"step": 5})
    # step 10 interrupted: workers wrote shards and the driver state, but not the marker
    d = C.begin(tmp_path, 10)
    (d / "model").mkdir()
    (d / "model" / "shard0.pt").write_bytes(b"x")
    (d / "driver_state.json").write_text(json.dumps({"format": 1, "step": 10, "state": {"step": 10}}))
    # step 15 interrupted even earlier: only a temp file
    (tmp_path / "step_000015").mkdir()
    (tmp_path / "step_000015" / ".driver_state.json.tmp-1").write_text("{")
    assert C.latest(tmp_path) == 5
    assert C.list_complete(tmp_path) == [5] and C.list_incomplete(tmp_path) == [10, 15]
    with pytest.raises(C.CheckpointError, match="incomplete"):
        C.load(tmp_path, 10)
    warnings: list[str] = []
    ck = C.resume_from_latest(_cfg(tmp_path), warn=warnings.append)
    assert ck is not None and ck.step == 5
    assert len(warnings) == 1 and "step_000010" in warnings[0] and "step_000015" in warnings[0]


def test_begin_clears_interrupted_folder_and_save_keeps_worker_shards(tmp_path) -> None:
    stale = tmp_path / "step_000003"
    stale.mkdir(parents=True)
    (stale / "old_shard").write_text("stale")
    d = C.begin(tmp_path, 3)
    assert not (d / "old_shard").exists()
    (d / "optimizer").mkdir()
    (d / "optimizer" / "rank0.pt").write_text("new")
    C.save(tmp_path, 3, {"a": 1})
    assert (d / "optimizer" / "rank0.pt").read_text() == "new"
    with pytest.raises(C.CheckpointError, match="already complete"):
        C.begin(tmp_path, 3)
    with pytest.raises(C.CheckpointError, match="already complete"):
        C.save(tmp_path, 3, {"a": 2})
    assert C.load(tmp_path).state == {"a": 1}


def test_keep_last_pruning(tmp_path) -> None:
    for step in (1, 2, 3):
        C.save(tmp_path, step, {"s": step})
    (tmp_path / "step_000000").mkdir()  # old interrupted leftover
    C.begin(tmp_path, 5)  # newer, in progress
    C.save(tmp_path, 4, {"s": 4}, keep_last=2)
    assert C.list_complete(tmp_path) == [3, 4]
    assert not (tmp_path / "step_000000").exists()
    assert (tmp_path / "step_000005").exists()  # an in-progress save is left alone
    assert C.prune(tmp_path, 0) == []  # 0 keeps everything
    assert C.prune(tmp_path, 1) == [3]


def test_unserialisable_state_names_the_key(tmp_path) -> None:
    with pytest.raises(C.CheckpointError, match=r"data\.cursor \(set\)"):
        C.save(tmp_path, 1, {"data": {"cursor": {1, 2}}})
    with pytest.raises(C.CheckpointError, match=r"metrics\[1\] \(non-finite"):
        C.save(tmp_path, 1, {"metrics": [1.0, float("nan")]})
    assert C.latest(tmp_path) is None  # nothing half-written counts


def test_corrupt_and_mismatched_state(tmp_path) -> None:
    d = C.save(tmp_path, 7, {"x": 1})
    (d / "driver_state.json").write_text("{not json")
    with pytest.raises(C.CheckpointError, match="corrupt"):
        C.load(tmp_path, 7)
    (d / "driver_state.json").write_text(json.dumps({"format": 1, "step": 8, "state": {}}))
    with pytest.raises(C.CheckpointError, match="records step 8"):
        C.load(tmp_path, 7)
    (d / "driver_state.json").write_text(json.dumps({"format": 99, "step": 7, "state": {}}))
    with pytest.raises(C.CheckpointError, match="format 99"):
        C.load(tmp_path, 7)


def test_resume_switches_and_empty_dir(tmp_path) -> None:
    assert C.resume_from_latest(_cfg(tmp_path / "none")) is None
    C.save(tmp_path, 2, {"x": 2})
    assert C.resume_from_latest(_cfg(tmp_path, resume=False)) is None
    assert C.resume_from_latest(_cfg(tmp_path, enabled=False)) is None
    assert C.resume_from_latest(_cfg(tmp_path)).state == {"x": 2}
    with pytest.raises(C.CheckpointError, match="no complete checkpoint"):
        C.load(tmp_path / "none")


def test_should_save() -> None:
    assert [s for s in range(1, 13) if C.should_save(5, s, 12)] == [5, 10, 12]
    assert [s for s in range(1, 4) if C.should_save(0, s, 3)] == [3]


def test_step_dir_format_sorts(tmp_path) -> None:
    for step in (9, 10, 100):
        C.save(tmp_path, step, {})
    assert C.list_complete(tmp_path) == [9, 10, 100]
    assert C.step_dir(tmp_path, 10).name == "step_000010"
    with pytest.raises(ValueError):
        C.step_dir(tmp_path, -1)


# ------------------------------------------------------------------ experiments never share state

TINY = Path(__file__).resolve().parents[2] / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml"


def _runtime_config(*sets: str):
    """The runtime config rlc compiles for the tiny recipe with ``sets`` (as the job reads it)."""
    from rlc.compiler.api import check
    from rlc.compiler.resolve import to_runtime_config
    from rlc.contract.runtime_config import runtime_config_from_dict

    result = check(TINY, list(sets))
    assert result.ok, result.errors
    return runtime_config_from_dict(to_runtime_config(result))


def _saved_by(root, config) -> None:
    C.save(root, 4, {"step": 4, C.EXPERIMENT_STATE_KEY: C.experiment(config)})


def test_a_checkpoint_of_another_experiment_is_refused_naming_the_keys_and_the_way_out(tmp_path) -> None:
    """Two recipes that share a checkpoint folder and differ only in lr (or the KL penalty)."""
    first = _runtime_config("training.optimizer.lr=1.0e-6")
    second = _runtime_config("training.optimizer.lr=3.0e-6", "loss.kl_penalty=0.01")
    _saved_by(tmp_path, first)
    with pytest.raises(C.CheckpointError) as err:
        C.resume_from_latest(_cfg(tmp_path), current=C.experiment(second))
    message = str(err.value)
    assert "was written by a different experiment, refusing to resume from it" in message
    assert "training.optimizer.lr: 1e-06 -> 3e-06" in message and "loss.kl_penalty: 0.0 -> 0.01" in message
    assert "checkpointing.resume_changed_recipe: true" in message and "own `name`" in message
    # on purpose: resumes, and says what changed
    warnings: list[str] = []
    found = C.resume_from_latest(_cfg(tmp_path, changed=True), warn=warnings.append, current=C.experiment(second))
    assert found is not None and found.step == 4
    assert any("training.optimizer.lr: 1e-06 -> 3e-06" in w for w in warnings)


def test_keys_that_may_change_between_restarts_do_not_block_a_resume(tmp_path) -> None:
    first = _runtime_config()
    _saved_by(tmp_path, first)
    later = _runtime_config("grpo.max_steps=500", "checkpointing.every_steps=7", "refit.sleep_level=2",
                            "generation.gpu_memory_utilization=0.5", "training.micro_batch_size=1")
    assert C.experiment(later) == C.experiment(first)
    assert C.resume_from_latest(_cfg(tmp_path), current=C.experiment(later)).step == 4


def test_a_checkpoint_without_a_recorded_experiment_is_not_trusted(tmp_path) -> None:
    C.save(tmp_path, 3, {"step": 3})
    with pytest.raises(C.CheckpointError, match="records no experiment"):
        C.resume_from_latest(_cfg(tmp_path), current=C.experiment(_runtime_config()))
