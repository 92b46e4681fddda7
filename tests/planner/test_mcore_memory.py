"""The memory plan with generation.backend: megatron: what the engine holds per phase instead of vLLM's pool,
sleep residue and IPC buffer (a fixed KV pool, the dedicated model's weights, the swap's peak)."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api
from rlc.compiler.planner.plan import GIB

ROOT = Path(__file__).resolve().parents[2]
DENSE = ROOT / "rlc" / "recipes" / "tiny-qwen3-1gpu-megatron.yaml"
MOE = ROOT / "rlc" / "recipes" / "tiny-glm-moe-1gpu-megatron.yaml"
POOL = "KV pool (generation.kv_cache_memory_bytes)"
INFERENCE = "inference model weights (dedicated)"
G = "generation.megatron"


def plan(path: Path, *sets: str):
    result = api.check(str(path), list(sets))
    assert result.plan is not None, [d.message for d in result.diagnostics]
    return result.plan


def labels(p, phase: str) -> dict[str, float | None]:
    return {i.label: i.gib for i in p.phases[phase].items}


def test_no_vllm_item_anywhere_and_no_ipc_math():
    p = plan(DENSE)
    assert p.backend == "megatron" and p.refit is None and p.vllm_weights_gib is None
    for phase in p.phases.values():
        assert not [i.label for i in phase.items if "vLLM" in i.label or i.owner == "vllm"], phase.name
    assert "buffer" not in p.checks and "stack" not in p.checks
    assert {"train_fit", "mcore_generate_fit"} <= set(p.checks)


def test_the_pool_is_exactly_kv_cache_memory_bytes_while_generating():
    p = plan(DENSE, "generation.kv_cache_memory_bytes=268435456")
    assert labels(p, "generate")[POOL] == pytest.approx(0.25)
    assert p.mcore["kv_pool"]["bytes"] == 268435456 and p.mcore["kv_pool"]["blocks"] == 2048


@pytest.mark.parametrize("mode, in_train", [("recompute", False), ("offload", False), ("persist", True)])
def test_the_pool_is_in_the_train_step_only_when_it_persists(mode, in_train):
    p = plan(DENSE, f"{G}.kv_cache={mode}")
    assert (POOL in labels(p, "train")) is in_train
    host = {i.label for i in p.host.items}
    assert ("KV pool backup (kv_cache: offload)" in host) is (mode == "offload")


def test_persist_costs_the_train_step_the_pool():
    recompute, persist = plan(DENSE), plan(DENSE, f"{G}.kv_cache=persist")
    grew = persist.phases["train"].used_gib - recompute.phases["train"].used_gib
    assert grew == pytest.approx(536870912 / GIB)


def test_shared_mode_generates_on_the_trainers_parameters_and_has_no_swap():
    p = plan(MOE)
    gen = labels(p, "generate")
    params = p.stages[0]["params_bytes"] / GIB
    assert gen["Megatron params (bf16)"] == pytest.approx(params)
    assert INFERENCE not in gen and "refit" not in p.phases and "mcore_swap_fit" not in p.checks


def test_dedicated_mode_counts_both_copies_at_the_swap_and_the_inference_shard_while_generating():
    p = plan(MOE, f"{G}.mode=dedicated")
    params = p.stages[0]["params_bytes"] / GIB
    assert labels(p, "generate")[INFERENCE] == pytest.approx(params)
    swap = labels(p, "refit")
    assert swap[INFERENCE] == pytest.approx(params) and swap["Megatron params (bf16)"] == pytest.approx(params)
    assert labels(p, "train")[INFERENCE] == 0.0  # the runtime frees the storage after each rollout
    assert "mcore_swap_fit" in p.checks


def test_dedicated_mode_with_the_parameter_offload_drops_the_trainers_copy_while_generating():
    on = plan(MOE, f"{G}.mode=dedicated", "refit.offload_params_for_generation=true")
    off = plan(MOE, f"{G}.mode=dedicated")
    params = on.stages[0]["params_bytes"] / GIB
    assert labels(on, "generate")["Megatron params (bf16)"] == 0.0
    assert off.phases["generate"].used_gib - on.phases["generate"].used_gib == pytest.approx(params)
    assert any(i.label == "Megatron params (offloaded for generation)" for i in on.host.items)


def test_engine_activations_scale_with_max_tokens():
    small, large = plan(DENSE, f"{G}.max_tokens=4096"), plan(DENSE)  # the recipe: 32768
    a, b = labels(small, "generate")["engine activations (one step)"], labels(large, "generate")[
        "engine activations (one step)"]
    assert b == pytest.approx(8 * a)


def test_a_pool_that_overfills_the_gpu_is_an_error_with_the_plan():
    result = api.check(str(DENSE), [f"generation.kv_cache_memory_bytes={150 * (1 << 30)}"])
    [d] = [d for d in result.errors if d.rule == "RLC407"]
    assert d.path == "generation.kv_cache_memory_bytes" and "of 139.80 GiB" in d.message


def test_the_plan_text_speaks_of_the_engine_not_of_vllm():
    text = plan(MOE, f"{G}.mode=dedicated").to_text()
    assert "refit (swap_model_weights into the inference model)" in text
    assert "KV pool" in text and "4096 blocks of 256 tokens" in text
    assert "IPC" not in text and "vLLM weight shard" not in text
    assert plan(DENSE).to_json()["megatron"]["mode"] == "shared"
