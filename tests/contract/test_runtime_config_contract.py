"""The compiler→runtime contract: every shipped recipe resolves into a runtime.yaml the runtime accepts."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from rlc import RUNTIME_CONFIG_VERSION
from rlc.compiler import api, resolve
from rlc.compiler.bundle.build import runtime_yaml
from rlc.contract.runtime_config import (
    RuntimeConfigError,
    load_runtime_config,
    runtime_config_from_dict,
    runtime_config_to_dict,
)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "rlc" / "recipes").rglob("*.yaml"))


def _compilable():
    out = []
    for path in SHIPPED:
        result = api.check(path)
        if result.ok:
            out.append((path, result))
    return out


COMPILABLE = _compilable()


#: Shipped recipes whose model facts only the checkpoint's own config.json has (no public copy for the catalog):
#: offline, with an empty Hugging Face cache (the test run's), they refuse with RLC216 alone.
FACTS_FROM_CHECKPOINT = {"nemotron3-ultra-grpo-64xh200.yaml"}


def test_every_shipped_recipe_compiles():
    # (the field report's must-fail steps are test fixtures, in tests/recipes/nemo-rl-2471/)
    failing = {p.name for p in SHIPPED} - {p.name for p, _ in COMPILABLE}
    assert failing == FACTS_FROM_CHECKPOINT
    for path in SHIPPED:
        if path.name in FACTS_FROM_CHECKPOINT:
            assert {d.rule for d in api.check(path).errors} == {"RLC216"}, path.name


@pytest.mark.parametrize("path,result", COMPILABLE, ids=[p.name for p, _ in COMPILABLE])
def test_resolved_config_round_trips_through_the_runtime_dataclasses(path, result, tmp_path):
    data = resolve.to_runtime_config(result)
    target = tmp_path / "runtime.yaml"
    target.write_text(runtime_yaml(data))  # the text the compiler writes into a bundle
    cfg = load_runtime_config(target)  # the runtime's reader
    assert runtime_config_to_dict(cfg) == data
    # Derived sizes are consistent with the layout.
    tp = cfg.train_parallel
    assert tp.tp * tp.pp * tp.cp * tp.dp == cfg.cluster.world_size
    gp = cfg.generation_parallel
    assert gp.tp * gp.pp * gp.dp == cfg.cluster.world_size
    # Every auto switch was decided by a named rule (or set in the recipe), never left open.
    for switch in ("sync_params_before_refit", "dedupe_mtp_embedding", "per_rank_ipc_metadata", "fp32_params"):
        reason = cfg.refit.decisions[switch]
        assert reason == "set in recipe" or reason.startswith("RLC"), (switch, reason)


def test_final_qwen_recipe_turns_on_the_seed_fixes():
    path = ROOT / "tests/recipes/nemo-rl-2471/qwen35-397b-nemo-rl-2471-4-final.yaml"
    cfg = runtime_config_from_dict(resolve.to_runtime_config(api.check(path)))
    assert cfg.refit.dedupe_mtp_embedding is True  # MTP shares the embedding and PP8 (NeMo-RL #2471)
    assert cfg.refit.per_rank_ipc_metadata is True  # EP32 / PP8 (SkyRL #1816)
    assert cfg.refit.sleep_level == 2 and cfg.generation.enforce_eager is True
    assert cfg.generation_parallel.ep == 256 and cfg.generation_parallel.dp == 16


def test_overlap_param_gather_turns_on_the_pre_refit_sync():
    path = ROOT / "tests/recipes/nemo-rl-2471/qwen35-397b-nemo-rl-2471-4-final.yaml"
    result = api.check(path, ["training.overlap_param_gather=true", "training.use_distributed_optimizer=true"])
    assert result.ok, [d.message for d in result.errors]
    cfg = runtime_config_from_dict(resolve.to_runtime_config(result))
    assert cfg.refit.sync_params_before_refit is True
    assert cfg.refit.decisions["sync_params_before_refit"].startswith("RLC202")


def test_resolve_refuses_a_recipe_with_errors():
    result = api.check(ROOT / "tests/recipes/nemo-rl-2471/qwen35-397b-nemo-rl-2471-1-defaults.yaml")
    assert not result.ok
    with pytest.raises(resolve.ResolveError):
        resolve.to_runtime_config(result)


@pytest.fixture()
def tiny_config():
    return resolve.to_runtime_config(api.check(ROOT / "rlc/recipes/tiny-qwen3-1gpu.yaml"))


def test_unknown_key_names_its_path(tiny_config):
    bad = copy.deepcopy(tiny_config)
    bad["refit"]["sleep_levle"] = 2
    with pytest.raises(RuntimeConfigError, match=r"refit\.sleep_levle"):
        runtime_config_from_dict(bad)


def test_missing_key_names_its_path(tiny_config):
    bad = copy.deepcopy(tiny_config)
    del bad["grpo"]["dynamic_sampling"]["max_gen_batches"]
    with pytest.raises(RuntimeConfigError, match=r"grpo\.dynamic_sampling\.max_gen_batches: missing"):
        runtime_config_from_dict(bad)


def test_wrong_type_names_its_path(tiny_config):
    bad = copy.deepcopy(tiny_config)
    bad["train_parallel"]["tp"] = "2"
    with pytest.raises(RuntimeConfigError, match=r"train_parallel\.tp: expected int"):
        runtime_config_from_dict(bad)


def test_other_version_is_refused(tiny_config):
    bad = dict(tiny_config, version=RUNTIME_CONFIG_VERSION + 1)
    with pytest.raises(RuntimeConfigError, match="recompile the bundle"):
        runtime_config_from_dict(bad)


def _flatten(node, prefix=""):
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: node}


def test_shipped_tiny_recipe_compiles_to_the_configuration_the_gpu_run_used():
    """The GPU learning run (docs/gpu-results.md) read tests/gpu/tiny_runtime.yaml, written by hand
    before the compiler existed. The shipped recipe must compile to the same run: every key equal,
    except ones that cannot change what the runtime does on this model, each checked here."""
    compiled = _flatten(resolve.to_runtime_config(api.check(ROOT / "rlc/recipes/tiny-qwen3-1gpu.yaml")))
    ran = _flatten(yaml.safe_load((ROOT / "tests/gpu/tiny_runtime.yaml").read_text()))
    differing = {k for k in compiled.keys() | ran.keys() if compiled.get(k, "<absent>") != ran.get(k, "<absent>")}
    inert = {
        "cluster.gpu_memory_gib",  # informational (the planner's usable capacity); the runtime measures
        "cluster.ray.address", "cluster.ray.namespace", "cluster.ray.join_timeout_s",  # by hand: local cluster
        "grpo.dynamic_sampling.max_gen_batches",  # dynamic sampling is off in both
        "refit.dedupe_mtp_embedding",  # no MTP layer in the model
        "refit.sync_params_before_refit",  # a no-op unless overlap_param_gather is on
        "refit.fp32_params",  # Qwen3 has no router bias: no parameter matches either list
    }
    assert {k for k in differing if not k.startswith("refit.decisions.")} <= inert
    assert compiled["model.mtp_num_layers"] == 0
    assert compiled["training.overlap_param_gather"] is False and ran["training.overlap_param_gather"] is False
    assert compiled["grpo.dynamic_sampling.enabled"] is False and ran["grpo.dynamic_sampling.enabled"] is False
    assert compiled["cluster.ray.address"] == "auto"  # joins the job's head under sbatch, local by hand


def test_every_builtin_reward_name_is_accepted_by_the_schema():
    from rlc.runtime.grpo.rewards import BUILTIN_REWARDS

    assert "gsm8k" in BUILTIN_REWARDS
    for name in sorted(BUILTIN_REWARDS):
        result = api.check(ROOT / "rlc/recipes/tiny-qwen3-1gpu.yaml", [f"reward.function={name}"])
        assert result.ok, (name, [d.message for d in result.errors])
        assert runtime_config_from_dict(resolve.to_runtime_config(result)).reward.function == name


def _schema_default(*path):
    from rlc.compiler.schema import load_schema

    node = load_schema()
    for key in path:
        node = node["properties"][key]
    return node["default"]


def test_loss_and_reward_failure_defaults_are_recorded_in_runtime_yaml(tiny_config):
    cfg = runtime_config_from_dict(tiny_config)
    assert cfg.loss.clip_ratio_c is None and _schema_default("loss", "clip_ratio_c") is None  # dual-clip off
    assert cfg.loss.max_log_ratio == _schema_default("loss", "max_log_ratio") == 20.0
    assert cfg.reward.failure_reward == _schema_default("reward", "failure_reward") == 0.0
    for key in ("clip_ratio_c", "max_log_ratio"):
        assert key in tiny_config["loss"]  # written explicitly: the runtime reads no default of its own


def test_loss_options_reach_the_runtime():
    result = api.check(ROOT / "rlc/recipes/tiny-qwen3-1gpu.yaml",
                       ["loss.clip_ratio_c=3.0", "loss.max_log_ratio=10", "reward.failure_reward=-1"])
    assert result.ok, [d.message for d in result.errors]
    cfg = runtime_config_from_dict(resolve.to_runtime_config(result))
    assert (cfg.loss.clip_ratio_c, cfg.loss.max_log_ratio, cfg.reward.failure_reward) == (3.0, 10.0, -1.0)
    bad = api.check(ROOT / "rlc/recipes/tiny-qwen3-1gpu.yaml", ["loss.clip_ratio_c=1.0"])
    assert not bad.ok and [d.path for d in bad.errors] == ["loss.clip_ratio_c"]


@pytest.mark.parametrize("sets,expected", [
    (["generation.speculative_decoding.method=mtp", "generation.speculative_decoding.num_speculative_tokens=1"],
     {"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
    (["generation.speculative_decoding.method=ngram", "generation.speculative_decoding.num_speculative_tokens=4",
      "generation.speculative_decoding.prompt_lookup_max=6"],
     {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 6}),
    ([], None),
], ids=["mtp", "ngram", "off"])
def test_speculative_decoding_round_trips_through_runtime_yaml(sets, expected, tmp_path):
    result = api.check(ROOT / "rlc/recipes/tiny-moe-mtp-2gpu-pp2.yaml", ["refit.sleep_level=1", *sets])
    assert result.ok, [d.message for d in result.errors]
    data = resolve.to_runtime_config(result)
    assert data["generation"]["speculative_decoding"] == expected
    target = tmp_path / "runtime.yaml"
    target.write_text(runtime_yaml(data))
    cfg = load_runtime_config(target)
    assert runtime_config_to_dict(cfg) == data
    spec = cfg.generation.speculative_decoding
    assert (spec is None) == (expected is None) and (spec is None or spec.method == expected["method"])


@pytest.mark.parametrize("recipe,overrides,expected", [
    ("rlc/recipes/tiny-qwen3-1gpu.yaml", [], True),  # the schema default: the runtime's GPU-proven behaviour
    ("rlc/recipes/qwen35-397b-grpo-32xh100.yaml", [], False),  # replays NeMo-RL #2471 (NeMo-RL's default)
    ("rlc/recipes/tiny-qwen3-1gpu.yaml", ["training.grad_reduce_in_fp32=false"], False),
])
def test_grad_reduce_in_fp32_reaches_the_runtime_config(recipe, overrides, expected, tmp_path):
    result = api.check(ROOT / recipe, overrides)
    assert result.ok, [d.message for d in result.errors]
    target = tmp_path / "runtime.yaml"
    target.write_text(runtime_yaml(resolve.to_runtime_config(result)))
    assert load_runtime_config(target).training.grad_reduce_in_fp32 is expected


@pytest.mark.parametrize("overrides,logprob_batch,offload", [
    ([], 2048, False),  # unset: the micro batch (the tiny recipe's 2048)
    (["training.logprob_batch_size=64"], 64, False),
    (["loss.kl_penalty=0.01", "training.offload_reference_policy=true"], 2048, True),
])
def test_logprob_batch_and_reference_offload_reach_the_runtime_config(overrides, logprob_batch, offload, tmp_path):
    """schema -> typed recipe -> runtime.yaml -> the runtime's config: the two keys the policy worker reads."""
    result = api.check(ROOT / "rlc/recipes/tiny-qwen3-1gpu.yaml", overrides)
    assert result.ok, [d.message for d in result.errors]
    assert result.recipe.logprob_batch_size == logprob_batch
    data = resolve.to_runtime_config(result)
    target = tmp_path / "runtime.yaml"
    target.write_text(runtime_yaml(data))
    training = load_runtime_config(target).training
    assert (training.logprob_batch_size, training.offload_reference_policy) == (logprob_batch, offload)
    for key in ("logprob_batch_size", "offload_reference_policy"):  # a stale runtime.yaml without it is refused
        stale = copy.deepcopy(data)
        del stale["training"][key]
        with pytest.raises(RuntimeConfigError, match=f"training.{key}"):
            runtime_config_from_dict(stale)


@pytest.mark.parametrize("key, value, shown", [
    ("refit.sleep_level", 7, "refit.sleep_level: 7 is not allowed; choose one of: 1, 2"),
    ("refit.sleep_level", True, "refit.sleep_level: True is not allowed; choose one of: 1, 2"),
    ("refit.transport", "tcp", "refit.transport: 'tcp' is not allowed; choose one of: 'cuda_ipc', 'shm'"),
    ("loss.kl_estimator", "k9", "loss.kl_estimator: 'k9' is not allowed; choose one of: 'k1', 'k2', 'k3'"),
    ("generation.fp8.scales", "auto", "generation.fp8.scales: 'auto' is not allowed; choose one of: 'block', 'tensor'"),
    ("training.activation_checkpointing", "some", "training.activation_checkpointing: 'some' is not allowed"),
])
def test_a_value_outside_a_keys_choices_is_refused_naming_the_key(tiny_config, key, value, shown):
    """A hand-edited runtime.yaml: every key with a fixed set of values takes only those (the recipe's choices,
    ``auto`` left out where the compiler settles it)."""
    bad = copy.deepcopy(tiny_config)
    *parents, leaf = key.split(".")
    node = bad
    for part in parents:
        node = node[part]
    node[leaf] = value
    with pytest.raises(RuntimeConfigError) as err:
        runtime_config_from_dict(bad)
    assert str(err.value).startswith(shown)


def test_the_runtime_reads_only_the_declared_choices(tiny_config):
    from rlc.contract.declare import leaves
    from rlc.contract.runtime_config import RuntimeConfig

    literal = [path for path, tp, _ in leaves(RuntimeConfig) if "Literal" in str(tp)]
    assert len(literal) >= 20  # every enum of the recipe that reaches runtime.yaml
    cfg = runtime_config_from_dict(tiny_config)
    assert cfg.refit.transport == "cuda_ipc" and cfg.refit.sleep_level in (1, 2)
