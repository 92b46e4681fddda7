"""Megatron's gradient buffers: fp32 with ``training.grad_reduce_in_fp32`` (4 B/param), else the parameter
dtype, in every phase that holds them: the train step, the refit and generation where they stay on the GPU
(``refit.offload_optimizer_for_refit`` off), and host memory where the offload puts them."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from rlc.compiler import api

# DeepSeek-V3 on 32 x 8 H100, TP1/PP16/EP16 + vLLM TP32 (NeMo-RL's grpo-deepseek-v3-32n8g layout)
DSV3 = {
    "version": 1,
    "model": {"id": "deepseek-ai/DeepSeek-V3", "overrides": {"num_nextn_predict_layers": 0}},
    "cluster": {"nodes": 32, "gpus_per_node": 8, "gpu": "h100-80gb",
                "container": {"image": "nvcr.io/nvidia/nemo-rl:v0.6.0"}},
    "parallelism": {"train": {"tp": 1, "pp": 16, "ep": 16, "num_layers_in_first_pipeline_stage": 3,
                              "num_layers_in_last_pipeline_stage": 2},
                    "generation": {"tp": 32}},
    "generation": {"max_model_len": 1536, "sampling": {"max_tokens": 1536}},
    "data": {"train": "/data/train.jsonl", "max_prompt_length": 1536},
    "training": {"use_precision_aware_optimizer": True, "max_sequence_length": 1536},
    "grpo": {"prompts_per_step": 32, "generations_per_prompt": 16},
}


def plan(tmp_path: Path, fp32: bool, *sets: str):
    recipe = copy.deepcopy(DSV3)
    recipe["training"]["grad_reduce_in_fp32"] = fp32
    path = tmp_path / f"recipe-{fp32}.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    result = api.check(str(path), list(sets))
    assert result.plan is not None
    return result.plan


def item(phase, label: str) -> float:
    found = [i.gib for i in phase.items if i.label == label]
    assert len(found) == 1, (label, [i.label for i in phase.items])
    return found[0]


def test_the_default_is_fp32_grad_buffers(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(DSV3), encoding="utf-8")
    assert api.check(str(path)).recipe.training.grad_reduce_in_fp32 is True


def test_train_step_counts_4_bytes_per_parameter_with_fp32_grads(tmp_path):
    on, off = plan(tmp_path, True).phases["train"], plan(tmp_path, False).phases["train"]
    # bf16 model: the grads are the params' bytes without the switch and twice them with it
    assert item(off, "Megatron grads") == pytest.approx(item(off, "Megatron params"))
    assert item(on, "Megatron grads") == pytest.approx(2 * item(on, "Megatron params"))
    assert on.used_gib - off.used_gib == pytest.approx(item(off, "Megatron grads"))
    assert "training.grad_reduce_in_fp32" in next(i.note for i in on.items if i.label == "Megatron grads")


@pytest.mark.parametrize("phase", ["refit", "generate"])
def test_refit_and_generation_hold_the_fp32_grads_only_without_the_offload(tmp_path, phase):
    # with the offload (the default) the grads are not on the GPU: the switch changes nothing there
    on, off = plan(tmp_path, True).phases[phase], plan(tmp_path, False).phases[phase]
    assert "Megatron grads" not in [i.label for i in on.items]
    assert on.used_gib == pytest.approx(off.used_gib)
    kept_on = plan(tmp_path, True, "refit.offload_optimizer_for_refit=false").phases[phase]
    kept_off = plan(tmp_path, False, "refit.offload_optimizer_for_refit=false").phases[phase]
    assert item(kept_on, "Megatron grads") == pytest.approx(2 * item(kept_off, "Megatron grads"))


def test_host_memory_holds_the_offloaded_grads_at_their_gpu_size(tmp_path):
    on, off = plan(tmp_path, True).host, plan(tmp_path, False).host
    grads_on, grads_off = on.item_gib("Megatron grads (offloaded)"), off.item_gib("Megatron grads (offloaded)")
    assert grads_off > 0
    assert grads_on == pytest.approx(2 * grads_off)
    assert on.used_gib - off.used_gib == pytest.approx(grads_off)
