"""The learning-rate warm-up starts from training.lr_schedule.warmup_start_lr (NeMo-RL / Megatron lr_warmup_init),
as the imported NeMo-RL configs say; 0 keeps the warm-up from zero."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.contract.runtime_config import load_runtime_config, runtime_config_from_dict, runtime_config_to_dict
from rlc.runtime.policy.megatron_setup import lr_at

TINY = Path(__file__).resolve().parents[1] / "gpu" / "tiny_runtime.yaml"


def _cfg(warmup_steps: int, start: float):
    d = runtime_config_to_dict(load_runtime_config(TINY))
    d["training"]["optimizer"]["lr"] = 5.0e-6
    d["training"]["lr_schedule"] = {"name": "constant", "warmup_steps": warmup_steps, "warmup_start_lr": start}
    return runtime_config_from_dict(d)


def test_warmup_rises_from_the_start_lr_to_the_peak():
    cfg = _cfg(13, 5.0e-7)  # NeMo-RL's grpo_math_1B.yaml: lr 5e-6, lr_warmup_iters 13, lr_warmup_init 5e-7
    lrs = [lr_at(step, cfg, 100) for step in range(1, 16)]
    assert lrs[0] == pytest.approx(5.0e-7 + (5.0e-6 - 5.0e-7) / 13)
    assert lrs[12] == pytest.approx(5.0e-6) and lrs[14] == pytest.approx(5.0e-6)
    assert all(a < b for a, b in zip(lrs[:12], lrs[1:13]))
    assert lr_at(1, _cfg(13, 0.0), 100) == pytest.approx(5.0e-6 / 13)  # from zero, as before the key existed
