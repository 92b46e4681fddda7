"""generation.backend: megatron with a trainer in another layout than the inference model: the layouts the
bundled runtime reshards into (and those it refuses, RLC311, with the key and the fix), the two shipped two-GPU
recipes from recipe to runtime.yaml, and the memory plan of the inference model in its own layout."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api
from rlc.compiler.planner.mcore_memory import inference_layout, inference_shard
from rlc.compiler.resolve import resolve_runtime_config
from rlc.compiler.runtime_support import reshard_gaps

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "rlc" / "recipes"
TP = RECIPES / "tiny-qwen3-2gpu-megatron-tp2-tp1.yaml"
EP = RECIPES / "tiny-glm-moe-2gpu-megatron-ep2-ep1.yaml"
DENSE_1GPU = RECIPES / "tiny-qwen3-1gpu-megatron.yaml"


def check(path: Path, *sets: str) -> api.CheckResult:
    return api.check(str(path), list(sets))


def diags(result, severity: str) -> list[tuple[str, str | None, str]]:
    return [(d.path, d.rule, d.message) for d in result.diagnostics if d.severity == severity]


@pytest.mark.parametrize("path, train, differs", [
    (TP, (2, 1, 1), "TP 2 -> 1"),
    (EP, (1, 1, 2), "EP 2 -> 1"),
])
def test_the_two_gpu_recipes_compile_to_a_dedicated_model_resharded_every_step(path, train, differs):
    result = check(path)
    assert result.ok and diags(result, "warning") == [], diags(result, "error") + diags(result, "warning")
    cfg = resolve_runtime_config(result)
    assert cfg.cluster.world_size == 2
    assert (cfg.train_parallel.tp, cfg.train_parallel.pp, cfg.train_parallel.ep) == train
    g = cfg.generation_parallel
    assert (g.tp, g.pp, g.ep, g.dp) == (1, 1, 1, 2)  # one inference replica per GPU
    m = cfg.generation.megatron
    assert cfg.generation.backend == "megatron" and m.mode == "dedicated" and m.refit_backend == "nccl"
    assert cfg.refit.decisions["generation.megatron.mode"] == (
        f"RLC403: auto -> dedicated: the inference model differs from the training model ({differs})")
    assert cfg.refit.decisions["weight_sync"].startswith("RLC403: megatron-core swap_model_weights")
    assert cfg.grpo.max_steps == 200


def test_the_dense_recipe_pads_the_vocabulary_so_the_trainer_can_split_it():
    assert check(TP).facts.vocab == 32
    refused = check(DENSE_1GPU, "cluster.gpus_per_node=2", "parallelism.train.tp=2")
    assert ("parallelism.train.tp", "RLC105") in [(p, r) for p, r, _ in diags(refused, "error")]
    message = next(m for p, r, m in diags(refused, "error") if r == "RLC105")
    assert "vocabulary of 23 tokens does not split over trainer TP2" in message


@pytest.mark.parametrize("path, sets, key, needles", [
    (TP, ("parallelism.generation.tp=2",), "parallelism.generation",
     ("TP2 PP1 EP1", "data-parallel inference coordinator")),
    (EP, ("parallelism.generation.ep=2",), "parallelism.generation", ("TP1 PP1 EP2",)),
    (TP, ("parallelism.train.tp=1", "parallelism.train.pp=2"), "parallelism.train.pp",
     ("pipeline-parallel trainer (PP2)", "MTP layer's embedding replica")),
    (TP, ("parallelism.train.tp=1", "parallelism.train.cp=2", "training.sequence_packing.enabled=true"),
     "parallelism.train.cp", ("context-parallel trainer (CP2)",)),
    (EP, ("parallelism.train.ep=1", "parallelism.train.etp=2"), "parallelism.train.etp",
     ("ETP2", "partition_stride 1")),
])
def test_layouts_the_runtime_does_not_reshard_into_are_refused_with_the_fix(path, sets, key, needles, tmp_path):
    result = check(path, *sets)
    hits = [(p, m) for p, r, m in diags(result, "warning") if r == "RLC311" and p == key]
    assert hits, diags(result, "warning")
    assert all(n in hits[0][1] for n in needles), hits[0][1]
    gap = next(g for g in reshard_gaps(result.recipe) if g.key == key)
    assert gap.hint and ("generation.backend: vllm" in gap.hint)
    from rlc.compiler.cli import main

    assert main(["compile", str(path), "-o", str(tmp_path / "b"), *[w for s in sets for w in ("--set", s)]]) == 1


def test_shared_mode_on_a_model_parallel_trainer_is_refused():
    """The engine would run on the trainer's TP2 model: a model-parallel engine the runtime does not run."""
    result = check(TP, "parallelism.generation.tp=2", "generation.megatron.mode=shared")
    assert ("parallelism.generation", "RLC311") in [(p, r) for p, r, _ in diags(result, "warning")]


def test_the_trainers_layout_on_one_gpu_is_unchanged():
    assert reshard_gaps(check(DENSE_1GPU).recipe) == []
    assert check(DENSE_1GPU, "generation.megatron.mode=dedicated").ok


# --------------------------------------------------------------------------- the memory plan


@pytest.mark.parametrize("path, remote", [(TP, 0.5), (EP, 0.5)])
def test_the_plan_counts_the_inference_model_in_its_own_layout(path, remote):
    result = check(path)
    il = inference_layout(result.recipe)
    assert (il.tp, il.pp, il.ep, il.etp, il.cp, il.vpp, il.sequence_parallel) == (1, 1, 1, 1, 1, 1, False)
    shard = inference_shard(result.recipe, result.facts, 2)
    assert shard.resharded and shard.remote_fraction == remote and shard.layout == "TP1 PP1 EP1"
    mcore = result.plan.mcore["inference_model"]
    assert mcore["weights_bytes"] == shard.params_bytes and mcore["swap_staging_bytes"] == shard.params_bytes // 2
    # the whole model on each GPU: more than the trainer's shard of it
    train_params = max(f["params_bytes"] for f in result.plan.stages)
    assert shard.params_bytes > train_params
    items = {i.label: i for i in result.plan.phases["generate"].items}
    assert "TP1 PP1 EP1" in items["inference model weights (dedicated)"].note
    refit = {i.label for i in result.plan.phases["refit"].items}
    assert "swap staging (upper bound)" in refit


def test_the_trainers_layout_plans_no_staging():
    result = check(DENSE_1GPU, "generation.megatron.mode=dedicated")
    shard = inference_shard(result.recipe, result.facts, 2)
    assert not shard.resharded and shard.staging_bytes == 0
    assert shard.params_bytes == max(f["params_bytes"] for f in result.plan.stages)
    assert "swap staging" in {i.label for i in result.plan.phases["refit"].items}
