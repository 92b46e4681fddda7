"""``rlc import nemo-rl``: NeMo-RL configs the project writes itself (base + parents + child with
interpolations, ``_override_``, Hydra-style overrides) become recipes that validate; nothing is
dropped silently."""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import yaml

from rlc.compiler import api
from rlc.compiler.cli import main
from rlc.compiler.importers.nemo_rl import ImportStopped, NemoRlConfigError, import_nemo_rl, load_nemo_rl_config

CONFIGS = Path(__file__).resolve().parent / "nemo_rl_configs"
LLM = CONFIGS / "recipes" / "llm"
CHILD = LLM / "grpo-qwen3-30ba3b-2n8g-megatron.yaml"
TWO_PARENTS = LLM / "grpo-two-parents.yaml"
PUBLIC_30B = LLM / "grpo-qwen3-30ba3b-8n8g-megatron.yaml"
PUBLIC_397B = LLM / "grpo-qwen3.5-397ba17b-32n8g-megatron.yaml"
GPU = "cluster.gpu=h100-80gb"
IMAGE = "cluster.container.image=nvcr.io/nvidia/nemo-rl:v0.6.0"
#: A container sees only what is mounted: the data and a checkpoint folder (rlc validate names both otherwise).
MOUNTS = ("--set", 'cluster.container.mounts=["/data:/data:ro", "/ckpt:/ckpt"]', "--set", "checkpointing.dir=/ckpt/run")


def rlc(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def mapped(imported) -> dict[str, object]:
    return {v.target: v.value for v in imported.mapping.values}


# --------------------------------------------------------------------------- loading like NeMo-RL

def test_child_inherits_through_two_levels_and_interpolations_follow_the_child():
    cfg = load_nemo_rl_config(CHILD)
    assert [Path(f).name for f in cfg.files] == ["grpo_base.yaml", "megatron_moe.yaml", CHILD.name]
    # the base's ${policy.max_total_sequence_length} picks up the child's 4096
    assert cfg.get("policy.generation.vllm_cfg.max_model_len") == 4096
    assert cfg.get("policy.generation.max_new_tokens") == 4096
    # ${mul:..} resolver, as NeMo-RL registers it
    assert cfg.get("policy.sequence_packing.train_mb_tokens") == 4096 * 1
    assert cfg.get("checkpointing.checkpoint_dir") == "results/Qwen/Qwen3-30B-A3B"
    # the middle parent switched the trainer and nulled the DTensor optimizer
    assert cfg.get("policy.megatron_cfg.enabled") is True and cfg.get("policy.optimizer") is None
    assert cfg.origins["policy.megatron_cfg.tensor_model_parallel_size"].endswith(f"{CHILD.name}:14")
    assert cfg.origins["policy.megatron_cfg.optimizer.adam_beta2"].endswith("grpo_base.yaml:77")


def test_several_parents_merge_left_to_right_and_override_replaces_a_section():
    cfg = load_nemo_rl_config(TWO_PARENTS)
    assert cfg.get("policy.megatron_cfg.enabled") is True  # megatron_moe.yaml after grpo_base.yaml
    assert cfg.get("policy.max_total_sequence_length") == 8192  # long_context.yaml, the last parent
    assert cfg.get("policy.generation.vllm_cfg.max_model_len") == 8192  # interpolation sees it
    assert cfg.get("policy.megatron_cfg.tensor_model_parallel_size") == 4  # the child wins
    # `_override_: true` replaced logger whole: the base's wandb keys are gone, the marker too
    assert cfg.get("logger") == {"log_dir": "logs/long", "tensorboard_enabled": True}


def test_hydra_overrides_apply_before_interpolation():
    cfg = load_nemo_rl_config(CHILD, ["policy.max_total_sequence_length=2048", "+grpo.new_knob=3",
                                      "~logger.wandb", "++policy.megatron_cfg.tensor_model_parallel_size=8"])
    assert cfg.get("policy.generation.vllm_cfg.max_model_len") == 2048
    assert cfg.get("grpo.new_knob") == 3
    assert cfg.get("logger.wandb") is None
    assert cfg.get("policy.megatron_cfg.tensor_model_parallel_size") == 8
    assert cfg.origins["policy.max_total_sequence_length"] == "command line"


@pytest.mark.parametrize("override, needle", [
    ("policy.megatron_cfg.tensor_model_paralel_size=4", "did you mean policy.megatron_cfg.tensor_model_parallel_size"),
    ("grpo.brand_new=1", "+grpo.brand_new=..."),
    ("+grpo.seed=1", "grpo.seed already exists"),
    ("~grpo.nothing_here", "grpo.nothing_here is not in the NeMo-RL config"),
    ("policy.model_name", "expected KEY=VALUE"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(NemoRlConfigError) as info:
        load_nemo_rl_config(CHILD, [override])
    assert needle in str(info.value)


def test_broken_configs_are_clear_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\nx: 1\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\ny: 2\n")
    with pytest.raises(NemoRlConfigError, match="defaults cycle"):
        load_nemo_rl_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("defaults: missing.yaml\n")
    with pytest.raises(NemoRlConfigError, match=r"missing.yaml: no such file \(named in defaults of"):
        load_nemo_rl_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("policy:\n  x: ${nope.not_there}\n")
    with pytest.raises(NemoRlConfigError, match="cannot resolve the interpolation of policy.x"):
        load_nemo_rl_config(tmp_path / "d.yaml")
    code, _, err = rlc("import", "nemo-rl", str(tmp_path / "c.yaml"), "-o", str(tmp_path / "r.yaml"))
    assert code == 2 and "no such file" in err and "Traceback" not in err
    assert not (tmp_path / "r.yaml").exists()


# --------------------------------------------------------------------------- mapping

def test_megatron_child_maps_layout_optimizer_refit_and_lengths():
    got = mapped(import_nemo_rl(str(CHILD)))
    assert got["cluster.nodes"] == 2 and got["cluster.gpus_per_node"] == 8
    assert (got["parallelism.train.tp"], got["parallelism.train.pp"], got["parallelism.train.ep"]) == (4, 2, 8)
    assert got["parallelism.train.sequence_parallel"] is True
    assert got["parallelism.generation.tp"] == 2 and got["generation.gpu_memory_utilization"] == 0.7
    assert got["training.optimizer.lr"] == 3.0e-7 and got["training.optimizer.adam_eps"] == 1e-8
    assert got["training.overlap_param_gather"] is True and got["training.grad_clip"] == 1.0
    assert got["refit.buffer_memory_ratio"] == 0.35  # NRL_REFIT_BUFFER_MEMORY_RATIO in env_vars
    assert got["cluster.env.PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    assert got["grpo.prompts_per_step"] == 32 and got["grpo.leave_one_out"] is True
    assert got["loss.kl_penalty"] == 0.01 and got["reward.function"] == "math"
    # NeMo-RL bounds prompt and response each by 4096; rlc needs their sum within max_model_len
    assert (got["generation.max_model_len"], got["data.max_prompt_length"],
            got["generation.sampling.max_tokens"]) == (4096, 1024, 3072)


def test_every_nemo_rl_key_is_mapped_listed_or_explained():
    for path in (CHILD, TWO_PARENTS, PUBLIC_30B, PUBLIC_397B):
        imported = import_nemo_rl(str(path), accept_loss=True)
        leaves = set(imported.config.leaves())
        sources = {s for v in imported.mapping.values for s in v.sources}
        unmapped = {u.key for u in imported.unmapped}
        implied = set(imported.mapping.implied)
        assert leaves == sources | unmapped | implied, path.name
        assert not (sources & unmapped), path.name
        for key, why in imported.mapping.implied.items():
            assert why, key


def test_unmapped_keys_are_on_screen_and_in_the_recipe(tmp_path):
    out = tmp_path / "r.yaml"
    code, stdout, _ = rlc("import", "nemo-rl", str(PUBLIC_397B), "-o", str(out), "--set", GPU, "--accept-loss")
    text = out.read_text()
    imported = import_nemo_rl(str(PUBLIC_397B), accept_loss=True)
    assert imported.unmapped
    for u in imported.unmapped:
        if u.effect == "default" or u.inactive:  # counted, not listed one by one
            assert f"  {u.key}: " not in stdout and f"#   {u.key}: " not in text, u.key
        else:
            assert f"  {u.key}: " in stdout and f"#   {u.key}: " in text, u.key
    assert "grpo.val_period: 20" in text
    defaults = [u for u in imported.unmapped if u.effect == "default" and not u.inactive]
    assert defaults and f"{len(defaults)} more NeMo-RL key(s) keep NeMo-RL's defaults" in stdout


def test_written_recipe_validates_and_compiles_with_the_sets(tmp_path):
    out = tmp_path / "recipe.yaml"
    code, stdout, err = rlc("import", "nemo-rl", str(PUBLIC_30B), "-o", str(out), "--set", GPU, "--set", IMAGE,
                            "--set", "data.train=/data/math/train.jsonl", *MOUNTS)
    assert code == 0, err
    result = api.check(str(out))
    assert result.errors == [], [d.message for d in result.errors]
    assert "# from --set" in out.read_text()
    code, _, err = rlc("compile", str(out), "-o", str(tmp_path / "bundle"))
    assert code == 0, err
    runtime = yaml.safe_load((tmp_path / "bundle" / "runtime.yaml").read_text())
    assert runtime["train_parallel"]["tp"] == 4 and runtime["train_parallel"]["ep"] == 4


def test_comments_name_the_nemo_rl_key_file_line_and_interpolation(tmp_path):
    out = tmp_path / "r.yaml"
    rlc("import", "nemo-rl", str(CHILD), "-o", str(out), "--set", GPU)
    lines = out.read_text().splitlines()
    (tp,) = [ln for ln in lines if ln.strip().startswith("tp: 4")]
    assert f"policy.megatron_cfg.tensor_model_parallel_size ({os.path.normpath(CHILD)}:14)" in tp
    (ckpt,) = [ln for ln in lines if ln.strip().startswith("dir: results/")]
    assert "checkpointing.checkpoint_dir = results/${policy.model_name}" in ckpt


def test_missing_gpu_fails_validation_naming_the_key_to_set(tmp_path):
    out = tmp_path / "r.yaml"
    code, stdout, err = rlc("import", "nemo-rl", str(CHILD), "-o", str(out))
    assert code == 1
    assert "set cluster.gpu:" in stdout and "--set cluster.gpu=h100-80gb" in stdout
    assert "cluster.gpu: missing required key 'gpu'" in err
    assert "#   cluster.gpu:" in out.read_text()  # the recipe says it too


def test_overrides_after_options_and_existing_output(tmp_path):
    out = tmp_path / "r.yaml"
    code, _, err = rlc("import", "nemo-rl", str(CHILD), "-o", str(out), "--set", GPU,
                       "policy.megatron_cfg.expert_model_parallel_size=16")
    assert code == 1 and "[RLC102]" in err  # EP16 x PP2 does not tile 16 GPUs: the override reached the recipe
    assert "ep: 16" in out.read_text()
    code, _, err = rlc("import", "nemo-rl", str(CHILD), "-o", str(out), "--set", GPU)
    assert code == 2 and "pass --force" in err


def test_bad_set_is_reported_and_writes_nothing(tmp_path):
    out = tmp_path / "r.yaml"
    code, _, err = rlc("import", "nemo-rl", str(CHILD), "-o", str(out), "--set", "cluster.gpuu=h100-80gb")
    assert code == 1 and "cluster.gpuu" in err and not out.exists()


def test_public_397b_recipe_imports_and_rlc_catches_its_refit_failure(tmp_path):
    """The field report's first refit failure (8 GiB fused experts vs a 0.3 ratio buffer) is caught
    by `rlc import` before anything is submitted."""
    out = tmp_path / "r.yaml"
    code, stdout, err = rlc("import", "nemo-rl", str(PUBLIC_397B), "-o", str(out), "--set", GPU,
                            "--set", "data.train=/data/dapo.jsonl", "--accept-loss")
    assert code == 1 and "[RLC210]" in err and "8589934592" in err
    got = mapped(import_nemo_rl(str(PUBLIC_397B), accept_loss=True))
    assert got["parallelism.train.num_layers_in_first_pipeline_stage"] == 6
    assert got["parallelism.generation.ep"] == 64 and got["grpo.dynamic_sampling.batch_multiplier"] == 2
    assert got["loss.ratio_clip_high"] == 0.28 and got["training.activation_checkpointing"] == "full"
    # fixing it the way the report did makes the same import validate
    code, _, err = rlc(
        "import",
        "nemo-rl",
        str(PUBLIC_397B),
        "-o",
        str(out),
        "--force",
        "--accept-loss",
        "--set",
        GPU,
        "--set",
        "data.train=/data/dapo.jsonl",
        "--set",
        "cluster.container.image=nvcr.io/nvidia/nemo-rl:v0.6.0",
        *MOUNTS,
        "--set",
        "refit.sleep_level=2",
        "--set",
        "refit.buffer_memory_ratio=0.39",
        "--set",
        "generation.enforce_eager=true",
        "policy.generation.vllm_cfg.expert_parallel_size=256",
    )
    assert code == 0, err


def test_dtensor_config_maps_its_trainer_layout_with_a_note():
    imported = import_nemo_rl(str(CONFIGS / "grpo_base.yaml"))
    got = mapped(imported)
    assert got["parallelism.train.tp"] == 1 and got["training.optimizer.adam_beta2"] == 0.999
    assert any("DTensor" in n for n in imported.mapping.notes)
    assert all(u.inactive for u in imported.unmapped if u.key.startswith("policy.megatron_cfg."))


def test_engine_options_and_optimizer_keys_map_to_their_typed_rlc_keys(tmp_path):
    child = tmp_path / "grpo-engine-options.yaml"
    child.write_text(yaml.safe_dump({
        "defaults": str(PUBLIC_397B),
        "loss_fn": {"use_importance_sampling_correction": True},
        "policy": {"megatron_cfg": {"optimizer": {"use_precision_aware_optimizer": True},
                                    "moe_token_dispatcher_type": "alltoall"},
                   "generation": {"stop_token_ids": [151645],
                                  "vllm_kwargs": {"kv_cache_memory_bytes": 21474836480, "moe_backend": "triton",
                                                  "speculative_config": {"method": "mtp",
                                                                         "num_speculative_tokens": 1},
                                                  "max_model_len": 8192}}}}), encoding="utf-8")
    imported = import_nemo_rl(child, accept_loss=True)
    got = mapped(imported)
    assert got["training.use_precision_aware_optimizer"] is True
    assert got["loss.importance_sampling_correction"] is True
    assert got["generation.sampling.stop_token_ids"] == [151645]
    assert got["generation.kv_cache_memory_bytes"] == 21474836480
    assert got["generation.vllm_kwargs"] == {"moe_backend": "triton"}
    assert got["generation.speculative_decoding.method"] == "mtp"
    assert got["generation.speculative_decoding.num_speculative_tokens"] == 1
    unmapped = {u.key: u.reason for u in imported.mapping.unmapped}
    assert "generation.max_model_len" in unmapped["policy.generation.vllm_kwargs.max_model_len"]


def test_speculative_config_maps_to_the_typed_block_by_vllm_method(tmp_path):
    """NeMo-RL's DeepSeek-V3 performance recipe names vLLM's per-model MTP method (``deepseek_mtp``, which vLLM
    maps to ``mtp``); ngram keeps its window; a method rlc does not run stays listed, not dropped."""
    def imported(spec):
        child = tmp_path / "grpo-spec.yaml"
        child.write_text(yaml.safe_dump({"defaults": str(PUBLIC_397B), "policy": {"generation": {
            "vllm_kwargs": {"speculative_config": spec}}}}), encoding="utf-8")
        return import_nemo_rl(child, accept_loss=True)

    deepseek = imported({"method": "deepseek_mtp", "num_speculative_tokens": 1})
    got = mapped(deepseek)
    assert got["generation.speculative_decoding.method"] == "mtp"
    assert "generation.vllm_kwargs" not in got
    ngram = mapped(imported({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}))
    assert ngram["generation.speculative_decoding.prompt_lookup_max"] == 5
    assert ngram["generation.speculative_decoding.num_speculative_tokens"] == 3
    eagle = imported({"method": "eagle3", "model": "some/eagle", "num_speculative_tokens": 2})
    assert not any(k.startswith("generation.speculative_decoding") for k in mapped(eagle))
    reasons = {u.key: u.reason for u in eagle.mapping.unmapped}
    assert "mtp or ngram" in reasons["policy.generation.vllm_kwargs.speculative_config.method"]


def test_precision_moe_packing_and_pass_through_options_map_to_their_keys():
    got = mapped(import_nemo_rl(str(PUBLIC_397B), accept_loss=True))
    assert got["training.use_precision_aware_optimizer"] is False
    assert got["training.moe.token_dispatcher"] == "allgather" and got["training.moe.router_dtype"] == "fp64"
    assert got["training.megatron_kwargs.defer_fp32_logits"] is True
    assert got["loss.clip_ratio_c"] == 10 and got["training.sequence_packing.enabled"] is False
    imported = import_nemo_rl(str(CHILD), [
        "++policy.megatron_cfg.fp8_cfg={enabled: true, fp8: hybrid, fp8_recipe: delayed, fp8_param: true}",
        "++policy.generation.vllm_kwargs.max_num_seqs=256",
        "++policy.generation.vllm_kwargs.compilation_config.use_inductor=false",
        "policy.generation.stop_token_ids=[151645]",
        "policy.sequence_packing.enabled=true",
        "++policy.sequence_packing.algorithm=modified_ffd",
    ])
    got = mapped(imported)
    assert (got["training.fp8.enabled"], got["training.fp8.format"], got["training.fp8.recipe"],
            got["training.fp8.param_gather"]) == (True, "hybrid", "delayed", True)
    assert imported.data["generation"]["vllm_kwargs"] == {"max_num_seqs": 256,
                                                          "compilation_config": {"use_inductor": False}}
    assert got["generation.sampling.stop_token_ids"] == [151645]
    assert got["training.sequence_packing.algorithm"] == "modified_first_fit_decreasing"


def test_sequence_packing_is_imported_as_nemo_rl_runs_it_with_its_token_budgets(tmp_path):
    """NeMo-RL packs by default with ``${mul:...}`` token budgets: the recipe packs with the resolved
    budgets (4096 × 1 tokens to train, 4096 × 4 for logprobs here), and validation no longer flags packing (RLC311)."""
    imported = import_nemo_rl(str(CHILD), ["++policy.sequence_packing.algorithm=concatenative",
                                           "++policy.sequence_packing.sequence_length_round=64"])
    got = mapped(imported)
    assert got["training.sequence_packing.enabled"] is True
    assert got["training.sequence_packing.algorithm"] == "concatenative"
    assert got["training.sequence_packing.train_mb_tokens"] == 4096
    assert got["training.sequence_packing.logprob_mb_tokens"] == 4096 * 4  # logprob_batch_size 4
    implied = imported.mapping.implied
    assert "dynamic batching" in implied["policy.sequence_packing.sequence_length_round"]
    assert "2 × CP" in implied["policy.make_sequence_length_divisible_by"]
    out = tmp_path / "r.yaml"
    code, _, err = rlc("import", "nemo-rl", str(CHILD), "-o", str(out), "--set", GPU, "--set", IMAGE, *MOUNTS)
    assert code == 0 and "training.sequence_packing" not in err and "RLC311" not in err, err
    written = yaml.safe_load(out.read_text(encoding="utf-8"))
    assert written["training"]["sequence_packing"] == {"enabled": True, "train_mb_tokens": 4096,
                                                       "logprob_mb_tokens": 16384}
    result = api.check(str(out))
    assert result.recipe is not None and "RLC311" not in {d.rule for d in result.diagnostics}
    assert result.recipe.train_mb_tokens == 4096


def test_packing_off_reads_the_budgets_without_mapping_them():
    imported = import_nemo_rl(str(CHILD), ["policy.sequence_packing.enabled=false"])
    got = mapped(imported)
    assert got["training.sequence_packing.enabled"] is False
    assert not [k for k in got if k.startswith("training.sequence_packing.") and not k.endswith("enabled")]
    assert imported.mapping.implied["policy.sequence_packing.train_mb_tokens"] == "packing is off"


def test_trainer_only_expandable_segments_is_listed_not_applied_to_every_task(tmp_path):
    """NeMo-RL's Megatron env_vars reach only the trainer; in cluster.env expandable segments would also
    reach vLLM, whose sleep-mode pool cannot use them (RLC301), so the import lists it instead."""
    import shutil

    shutil.copytree(CONFIGS, tmp_path / "configs")  # the child with its defaults: chain
    cfg = tmp_path / "configs" / CHILD.relative_to(CONFIGS)
    text = cfg.read_text(encoding="utf-8").replace("expandable_segments:False", "expandable_segments:True")
    assert "expandable_segments:True" in text
    cfg.write_text(text, encoding="utf-8")
    out = import_nemo_rl(str(cfg))
    assert "cluster.env.PYTORCH_CUDA_ALLOC_CONF" not in mapped(out)
    (listed,) = [u for u in out.unmapped if u.key.endswith("env_vars.PYTORCH_CUDA_ALLOC_CONF")]
    assert "RLC301" in listed.reason and listed.value == "expandable_segments:True"


def test_colocated_trainers_move_their_parameters_off_the_gpu_for_generation_as_nemo_rl_does():
    """NeMo-RL's Megatron and DTensor policies move the model to host memory after every refit when generation is
    colocated (offload_after_refit); the recipe says so, and without the distributed optimizer (whose
    parameter buffer the runtime moves) it says why not instead."""
    assert mapped(import_nemo_rl(str(CHILD)))["refit.offload_params_for_generation"] is True
    no_dist = import_nemo_rl(str(CHILD), ["policy.megatron_cfg.optimizer.use_distributed_optimizer=false"])
    assert "refit.offload_params_for_generation" not in mapped(no_dist)
    assert any("distributed optimizer" in n for n in no_dist.mapping.notes)
    split = import_nemo_rl(str(CHILD), ["policy.generation.colocated.enabled=false"])
    assert "refit.offload_params_for_generation" not in mapped(split)
    dtensor = import_nemo_rl(str(CONFIGS / "grpo_base.yaml"))  # FSDP2: the distributed optimizer in rlc
    assert mapped(dtensor)["refit.offload_params_for_generation"] is True
    (value,) = [v for v in dtensor.mapping.values if v.target == "refit.offload_params_for_generation"]
    assert "DTensor" in value.note
    dtensor_split = import_nemo_rl(str(CONFIGS / "grpo_base.yaml"), ["policy.generation.colocated.enabled=false"])
    assert "refit.offload_params_for_generation" not in mapped(dtensor_split)


@pytest.mark.parametrize("override, kept", [
    ("checkpointing.keep_top_k=3", 3),
    ("checkpointing.keep_top_k=null", 100000),  # NeMo-RL: "If None, all checkpoints are kept"
    ("checkpointing.keep_top_k=1000000", 100000),  # NeMo-RL recipes' "never prune"
])
def test_kept_checkpoints_never_fall_to_a_default_that_deletes_what_nemo_rl_keeps(tmp_path, override, kept):
    imported = import_nemo_rl(str(PUBLIC_30B), [override])
    assert mapped(imported)["checkpointing.keep_last"] == kept
    out = tmp_path / "r.yaml"
    code, _, err = rlc("import", "nemo-rl", str(PUBLIC_30B), override, "-o", str(out), "--set", GPU, "--set", IMAGE,
                       "--set", "data.train=/data/math/train.jsonl", *MOUNTS)
    assert code == 0, err  # within the schema's range: the recipe validates


def test_non_colocated_generation_is_refused_with_the_sets_that_plan_the_trainers_share(tmp_path):
    """NeMo-RL's non-colocated generation takes nodes (or GPUs of the one node) of its own; rlc generates colocated
    only: the note names the --set that plans the trainer's share with generation colocated, and it validates."""
    split = import_nemo_rl(str(CHILD), ["policy.generation.colocated.enabled=false",
                                        "policy.generation.colocated.resources.num_nodes=1"])
    (note,) = [n for n in split.mapping.notes if "NeMo-RL generates on" in n]
    assert "1 of the 2 nodes" in note and "--set colocated=true --set cluster.nodes=1" in note and "RLC207" in note
    assert mapped(split)["colocated"] is False
    one_node = import_nemo_rl(str(CONFIGS / "grpo_base.yaml"), [
        "cluster.gpus_per_node=8", "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.gpus_per_node=2"])
    (note,) = [n for n in one_node.mapping.notes if "NeMo-RL generates on" in n]
    assert "2 of the node's 8 GPUs" in note and "--set cluster.gpus_per_node=6" in note
    out = tmp_path / "r.yaml"
    args = ("import", "nemo-rl", str(CHILD), "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.num_nodes=1", "-o", str(out), "--set", GPU, "--set", IMAGE,
            "--set", "data.train=/data/math/train.jsonl", *MOUNTS)
    code, _, err = rlc(*args)
    assert code == 1 and "RLC207" in err
    code, _, err = rlc(*args, "--force", "--set", "colocated=true", "--set", "cluster.nodes=1")
    assert "RLC207" not in err


@pytest.mark.parametrize("section, name", [("dpo", "DPO"), ("sft", "SFT"), ("rm", "reward-model training"),
                                           ("distillation", "distillation")])
def test_a_config_of_another_nemo_rl_algorithm_is_refused_naming_it(tmp_path, section, name):
    """NeMo-RL's DPO, SFT, reward-model and distillation configs share the policy / cluster / data sections with its
    GRPO configs: without the check they would import as a GRPO recipe that lists their own keys as losses."""
    cfg = tmp_path / f"{section}.yaml"
    cfg.write_text(yaml.safe_dump({section: {"max_num_steps": 10}, "policy": {"model_name": "Qwen/Qwen3-8B"},
                                   "cluster": {"num_nodes": 1, "gpus_per_node": 8}}), encoding="utf-8")
    out = tmp_path / "r.yaml"
    code, _, err = rlc("import", "nemo-rl", str(cfg), "-o", str(out), "--accept-loss")
    assert code == 2 and f"is a NeMo-RL {name} config" in err and "GRPO configs only" in err
    assert not out.exists()


def test_truncated_sampling_maps_with_no_note_both_trainers_score_under_the_cuts():
    truncated = import_nemo_rl(str(CHILD), ["policy.generation.top_p=0.9", "policy.generation.top_k=50"])
    assert mapped(truncated)["generation.sampling.top_p"] == 0.9
    assert mapped(truncated)["generation.sampling.top_k"] == 50
    assert not [n for n in truncated.mapping.notes if "top_p" in n or "top_k" in n]


def test_grad_reduce_in_fp32_states_nemo_rls_value_even_where_the_config_leaves_it_out():
    """NeMo-RL's GRPO configs keep bf16 grad buffers (grpo_math_1B.yaml: false); rlc's default is fp32, so
    the recipe states NeMo-RL's value whether the chain sets it, leaves it null or drops it."""
    key = "policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32"
    from_chain = import_nemo_rl(str(PUBLIC_397B), accept_loss=True)
    assert mapped(from_chain)["training.grad_reduce_in_fp32"] is False
    assert from_chain.data["training"]["grad_reduce_in_fp32"] is False
    assert (
        mapped(import_nemo_rl(str(PUBLIC_397B), [f"{key}=true"], accept_loss=True))["training.grad_reduce_in_fp32"]
        is True
    )
    for override in (f"{key}=null", f"~{key}"):
        imported = import_nemo_rl(str(PUBLIC_397B), [override], accept_loss=True)
        assert mapped(imported)["training.grad_reduce_in_fp32"] is False, override
        note = next(v.note for v in imported.mapping.values if v.target == "training.grad_reduce_in_fp32")
        assert "grpo_math_1B.yaml" in note
    assert key not in {u.key for u in from_chain.mapping.unmapped}


def test_logprob_batch_and_the_reference_policy_in_host_memory_map_as_nemo_rl_runs_them(tmp_path):
    """NeMo-RL's policy.logprob_batch_size is training.logprob_batch_size; with a KL penalty NeMo-RL keeps the
    reference policy as a CPU state dict (no key turns that off), so the recipe offloads it; the imported
    recipe compiles and its runtime.yaml carries both."""
    imported = import_nemo_rl(str(PUBLIC_30B))
    got = mapped(imported)
    assert got["training.logprob_batch_size"] == 4 and got["loss.kl_penalty"] == 0.01
    assert got["training.offload_reference_policy"] is True
    note = next(v for v in imported.mapping.values if v.target == "training.offload_reference_policy")
    assert note.sources == ("loss_fn.reference_policy_kl_penalty",) and "host memory" in note.note
    no_kl = import_nemo_rl(str(PUBLIC_30B), ["loss_fn.reference_policy_kl_penalty=0"])
    assert "training.offload_reference_policy" not in mapped(no_kl)
    out = tmp_path / "recipe.yaml"
    code, _, err = rlc("import", "nemo-rl", str(PUBLIC_30B), "-o", str(out), "--set", GPU, "--set", IMAGE,
                       "--set", "data.train=/data/math/train.jsonl", *MOUNTS)
    assert code == 0, err
    code, _, err = rlc("compile", str(out), "-o", str(tmp_path / "bundle"))
    assert code == 0, err
    runtime = yaml.safe_load((tmp_path / "bundle" / "runtime.yaml").read_text())
    assert runtime["training"]["logprob_batch_size"] == 4 and runtime["training"]["offload_reference_policy"] is True


def test_logprob_chunking_is_listed_with_what_bounds_the_logits_instead():
    chunked = import_nemo_rl(str(PUBLIC_30B), ["+policy.logprob_chunk_size=2048"])
    [u] = [u for u in chunked.unmapped if u.key == "policy.logprob_chunk_size"]
    assert u.value == 2048 and "training.logprob_batch_size" in u.reason and "parallelism.train.tp" in u.reason
    off = import_nemo_rl(str(PUBLIC_30B), ["+policy.logprob_chunk_size=null"])
    assert "policy.logprob_chunk_size" in off.mapping.implied
    assert "policy.logprob_chunk_size" not in {u.key for u in off.unmapped}


def test_nemo_rl_fp8_rollouts_map_to_block_scales_and_its_vllm_patches_are_listed():
    """NeMo-RL's FP8 rollouts (grpo_math_8B_megatron_fp8.yaml, the Moonlight / DeepSeek-V3 FP8 recipes) are
    128x128 block scales, the layers it keeps in bf16 generation.fp8.keep_bf16; its vLLM patches have no rlc
    equivalent and are listed unless left at defaults."""
    imported = import_nemo_rl(str(CHILD), [
        "++policy.generation.vllm_cfg.precision=fp8", "++policy.generation.vllm_cfg.use_deep_gemm=true",
        "++policy.generation.vllm_cfg.pow2_weight_scaling_factors=true",
        "++policy.generation.vllm_cfg.num_first_layers_in_bf16=0",
        "++policy.generation.vllm_cfg.quantization_ignored_layer_kws=[a_proj,b_proj]",
        "++policy.megatron_cfg.fp8_cfg={enabled: true, fp8: e4m3, fp8_recipe: blockwise, fp8_param: false}",
    ])
    assert imported.dropped == []  # the layers kept in bf16 are generation.fp8.keep_bf16
    got = mapped(imported)
    assert (got["generation.precision"], got["generation.fp8.scales"], got["generation.fp8.pow2_scales"]) == \
        ("fp8", "block", True)
    assert (got["training.fp8.enabled"], got["training.fp8.recipe"]) == (True, "blockwise")
    unmapped = {u.key: u.reason for u in imported.mapping.unmapped}
    # use_deep_gemm is the environment NeMo-RL sets in vLLM's workers (it used to be listed as a loss)
    assert (got["cluster.env.VLLM_USE_DEEP_GEMM"], got["cluster.env.VLLM_USE_DEEP_GEMM_E8M0"]) == ("1", "0")
    assert "policy.generation.vllm_cfg.use_deep_gemm" not in unmapped
    assert got["generation.fp8.keep_bf16"] == ["a_proj", "b_proj"]
    assert "policy.generation.vllm_cfg.quantization_ignored_layer_kws" not in unmapped
    assert "policy.generation.vllm_cfg.num_first_layers_in_bf16" in imported.mapping.implied
    plain = import_nemo_rl(str(CHILD), ["++policy.generation.vllm_cfg.pow2_weight_scaling_factors=true"])
    assert "generation.fp8.pow2_scales" not in mapped(plain)  # bf16 rollouts: FP8 options are not read
    assert "FP8 rollouts" in plain.mapping.implied["policy.generation.vllm_cfg.pow2_weight_scaling_factors"]


# --------------------------------------------------------------------------- megatron-core generation

MCORE_GEN = LLM / "grpo-qwen3-8b-1n8g-megatron-generation.yaml"


def test_megatron_generation_maps_the_mcore_config_and_leaves_vllm_out(tmp_path):
    imported = import_nemo_rl(str(MCORE_GEN))
    got = mapped(imported)
    assert got["generation.backend"] == "megatron"
    assert got["generation.kv_cache_memory_bytes"] == 10 * (1 << 30)
    assert (got["generation.megatron.block_size_tokens"], got["generation.megatron.max_tokens"],
            got["generation.megatron.kv_cache"], got["generation.megatron.refit_backend"]) == (256, 16384, "persist",
                                                                                               "nccl")
    assert got["generation.enforce_eager"] is True  # cuda_graph_impl "none"
    assert got["parallelism.generation.tp"] == 1  # the trainer's, not vllm_cfg's
    assert "generation.gpu_memory_utilization" not in got and "refit.sleep_level" not in got
    # shared mode generates on the trainer's parameters: NeMo-RL does not offload them, neither does the recipe
    assert "refit.offload_params_for_generation" not in got
    unmapped = {u.key: u for u in imported.unmapped}
    assert unmapped["policy.generation.vllm_cfg.gpu_memory_utilization"].inactive
    assert "eager" in unmapped["policy.generation.mcore_generation_config.num_cuda_graphs"].reason
    assert "chunked prefill" in unmapped["policy.generation.mcore_generation_config.enable_chunked_prefill"].reason
    leaves = set(imported.config.leaves())
    sources = {s for v in imported.mapping.values for s in v.sources}
    assert leaves == sources | set(unmapped) | set(imported.mapping.implied)
    assert not (sources & set(unmapped))
    out = tmp_path / "r.yaml"
    code, _, err = rlc("import", "nemo-rl", str(MCORE_GEN), "-o", str(out), "--set", GPU, "--set", IMAGE, *MOUNTS)
    assert code == 0, err
    code, _, err = rlc("validate", str(out))
    assert code == 0, err


def test_megatron_generation_with_another_layout_is_dedicated_and_offloads_the_trainer():
    got = mapped(import_nemo_rl(str(MCORE_GEN), overrides=[
        "+policy.generation.mcore_generation_config.transformer_impl=inference_optimized"]))
    assert got["generation.megatron.transformer_impl"] == "inference_optimized"
    # NeMo-RL moves the trainer's parameters to host memory after each swap into the dedicated model
    assert got["refit.offload_params_for_generation"] is True


def test_megatron_inference_settings_count_where_the_config_generates_with_megatron_core():
    """With the Megatron backend an mcore_generation_config key rlc has no setting for is read by the engine: it is
    never assumed harmless (a training-side key merged over the inference model's can change the rollouts'
    numerics); layout and copy-service keys are listed as changing nothing; with vLLM generation the whole block is
    NeMo-RL's unused default."""
    key = "policy.generation.mcore_generation_config.attention_softmax_in_fp32"
    with pytest.raises(ImportStopped) as stop:
        import_nemo_rl(str(MCORE_GEN), overrides=[f"+{key}=float32"])
    assert key in {u.key for u in stop.value.dropped}
    layout = import_nemo_rl(str(MCORE_GEN), overrides=[
        "+policy.generation.mcore_generation_config.context_parallel_size=1"])
    (cp,) = [u for u in layout.unmapped if u.key.endswith("mcore_generation_config.context_parallel_size")]
    assert cp.effect == "none"
    vllm = import_nemo_rl(str(CHILD), overrides=[f"+{key}=float32"])
    (listed,) = [u for u in vllm.unmapped if u.key == key]
    assert listed.effect == "none"


@pytest.mark.parametrize("value, rlc", [("float32", "fp32"), ("torch.bfloat16", "bf16"), ("fp16", "fp16")])
def test_mamba_state_dtypes_map_to_the_engine_settings(value, rlc):
    """``mamba_inference_{ssm,conv}_states_dtype`` (NeMo-RL's Nemotron-3 Nano recipes: float32 SSM states) set the
    engine's Mamba state dtypes; a dtype torch has no short name for here is refused, naming the key."""
    prefix = "policy.generation.mcore_generation_config.mamba_inference"
    imported = import_nemo_rl(str(MCORE_GEN), overrides=[f"+{prefix}_ssm_states_dtype={value}",
                                                         f"+{prefix}_conv_states_dtype={value}"])
    got = mapped(imported)
    assert got["generation.megatron.mamba_ssm_states_dtype"] == rlc
    assert got["generation.megatron.mamba_conv_states_dtype"] == rlc
    with pytest.raises(ImportStopped) as stop:
        import_nemo_rl(str(MCORE_GEN), overrides=[f"+{prefix}_ssm_states_dtype=int8"])
    (u,) = stop.value.dropped
    assert u.key == f"{prefix}_ssm_states_dtype" and "not one of float32, bfloat16, float16" in u.reason


def test_megatron_generation_refuses_what_rlc_cannot_express():
    imported = import_nemo_rl(str(MCORE_GEN), overrides=[
        "policy.generation.mcore_generation_config.refit_backend=nvshmem",
        "policy.generation.mcore_generation_config.kv_cache_management_mode=paged"])
    unmapped = {u.key: u.reason for u in imported.unmapped}
    assert "nccl or gloo" in unmapped["policy.generation.mcore_generation_config.refit_backend"]
    assert (
        "persist, offload or recompute"
        in unmapped["policy.generation.mcore_generation_config.kv_cache_management_mode"]
    )
