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
                "container": {"image": "nvcr.io/nvidia/nemo-rl:v0.6.0", "mounts": ["/data:/data:ro"]}},
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
    """With a full backup (torch_memory_saver, as slime and vime offload) the grad buffers are copied to host memory."""
    backup = "training.offload_copies_gradients=true"
    on, off = plan(tmp_path, True, backup).host, plan(tmp_path, False, backup).host
    grads_on, grads_off = on.item_gib("Megatron grads (offloaded)"), off.item_gib("Megatron grads (offloaded)")
    assert grads_off > 0
    assert grads_on == pytest.approx(2 * grads_off)
    assert on.used_gib - off.used_gib == pytest.approx(grads_off)


def test_megatrons_own_offload_frees_the_grads(tmp_path):
    """Megatron-core's buffer offload (the bundled runtime, NeMo-RL, verl) resizes the grad storage to 0 and
    zeroes it on reload: no host copy, so the host plan holds none, and the GPU plan is the same either way."""
    freed, copied = plan(tmp_path, True), plan(tmp_path, True, "training.offload_copies_gradients=true")
    assert freed.host.item_gib("Megatron grads (offloaded)") in (None, 0, 0.0)
    assert copied.host.used_gib - freed.host.used_gib == pytest.approx(
        copied.host.item_gib("Megatron grads (offloaded)"))
    assert freed.refit.free_at_refit == copied.refit.free_at_refit


def test_the_cpu_optimizer_keeps_fp32_gradient_copies_in_host_memory(tmp_path):
    """Megatron's HybridDeviceOptimizer copies each offloaded shard's gradient to a host tensor of the fp32
    master's size and keeps it between steps: counted with optimizer_cpu_offload, at its offload fraction."""
    half = plan(tmp_path, True, "training.optimizer_cpu_offload=true", "training.optimizer_offload_fraction=0.5")
    none = plan(tmp_path, True)
    master = half.host.item_gib("optimizer fp32 master (offloaded)")
    assert master > 0
    assert half.host.item_gib("CPU optimizer's fp32 gradients") == pytest.approx(master / 2)
    assert none.host.item_gib("CPU optimizer's fp32 gradients") == 0


def test_a_full_backup_compiles_and_says_the_bundled_runtime_frees_the_grads(tmp_path):
    """The bundled runtime frees the grad buffers (they are dead between the optimizer step and the next
    zero_grad), so it runs a recipe that plans slime's or vime's backup; validate says by how much less host memory."""
    from rlc.compiler.bundle import build_bundle
    from rlc.compiler.runtime_support import runtime_gaps

    recipe = copy.deepcopy(DSV3)
    path = tmp_path / "backup.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    fits = "refit.buffer_memory_ratio=0.4"  # the layout's refit buffer at 0.3 is too small (RLC210)
    result = api.check(str(path), [fits, "training.offload_copies_gradients=true"])
    assert result.ok and not runtime_gaps(result.recipe)
    assert "RLC311" not in {d.rule for d in result.diagnostics}
    grads = result.plan.host.item_gib("Megatron grads (offloaded)")
    [info] = [d for d in result.diagnostics if d.rule == "RLC219" and d.severity == "info"]
    assert info.path == "training.offload_copies_gradients" and f"{grads:.1f} GiB" in info.message and grads > 1
    build_bundle(result, tmp_path / "bundle")
    assert (tmp_path / "bundle" / "runtime.yaml").exists()
    plain = api.check(str(path), [fits])
    assert not [d for d in plain.diagnostics if d.rule == "RLC219" and d.severity == "info"]
