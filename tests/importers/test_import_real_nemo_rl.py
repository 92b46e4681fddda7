"""`rlc import nemo-rl` on NeMo-RL's own configs (nemo_rl_real/, copied from NVIDIA-NeMo/RL @ 7ea279ab): nothing
that changes the experiment is dropped silently. A setting with an rlc equivalent is mapped with its value; a
non-default setting that changes training and has none stops the import (``--accept-loss`` writes the recipe and
records it); keys at NeMo-RL's defaults are counted in one line."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from rlc.compiler.cli import main
from rlc.compiler.importers.nemo_rl import ImportStopped, import_nemo_rl
from rlc.compiler.importers.nemo_rl.effects import no_effect_reason

REAL = Path(__file__).resolve().parent / "nemo_rl_real" / "examples"
CONFIGS = REAL / "configs"
LLM = CONFIGS / "recipes" / "llm"
BASE = CONFIGS / "grpo_math_1B.yaml"
MEGATRON_BASE = CONFIGS / "grpo_math_1B_megatron.yaml"
COT = (REAL / "prompts" / "cot.txt").read_text()


def rlc(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def mapped(imported) -> dict[str, object]:
    return {v.target: v.value for v in imported.mapping.values}


def dropped(path: Path, overrides: tuple[str, ...] = ()) -> set[str]:
    try:
        import_nemo_rl(str(path), overrides)
    except ImportStopped as stop:
        return {u.key for u in stop.dropped}
    return set()


#: What each real Megatron recipe sets that changes the experiment and rlc cannot express.
RECIPES = {
    "grpo-llama3.2-1b-instruct-1n8g-megatron.yaml": set(),
    "grpo-qwen3-30ba3b-8n8g-megatron.yaml": set(),
    "grpo-qwen3.5-9b-1n8g-megatron.yaml": set(),
    "grpo-dapomath17k-dsv3-megatron.yaml": set(),
    "grpo-qwen3-8b-base-dapo-2n8g-long-megatron-qa-nvfp4-w4a16.yaml":
        {"policy.quant_cfg", "policy.generation.quant_cfg", "policy.generation.real_quant"},
    "grpo-qwen3.5-397ba17b-32n8g-megatron.v2.yaml": set(),
    "grpo-nanov3-30BA3B-4n4g-megatron_colocated_reshard.yaml": set(),
    "grpo-nemotron3-super-120BA12B-16n8g-megatron.yaml": set(),
    "grpo-nemotron3-super-120BA12B-8n4g-megatron.yaml": set(),
    "grpo-nemotron3-super-120BA12B-16n4g-megatron-qa-bf16-300step.yaml": set(),
}


@pytest.mark.parametrize("path", [BASE, MEGATRON_BASE], ids=lambda p: p.name)
def test_the_base_configs_import_whole_with_their_defaults_counted(path):
    imported = import_nemo_rl(str(path))
    assert imported.dropped == []
    defaults = [u for u in imported.unmapped if u.effect == "default" and not u.inactive]
    listed = [u for u in imported.unmapped if u.effect == "none" and not u.inactive]
    # ~190 keys at NeMo-RL's defaults, summarised; the few left are listed with why they change nothing
    assert len(defaults) > 140 and len(listed) < 35
    assert all(u.reason for u in listed)
    got = mapped(imported)
    assert got["loss.kl_estimator"] == "k3" and got["grpo.leave_one_out"] is True
    assert got["data.prompt_template"].format(prompt="2+2?") == COT.format("2+2?")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_real_megatron_recipe_maps_what_it_can_and_stops_on_what_it_cannot(name, tmp_path):
    path = LLM / name
    assert dropped(path) == RECIPES[name]
    imported = import_nemo_rl(str(path), accept_loss=True)
    got = mapped(imported)
    assert got["model.id"] == imported.config.get("policy.model_name")
    assert got["training.lr_schedule.warmup_start_lr"] == imported.config.get("policy.megatron_cfg.scheduler."
                                                                               "lr_warmup_init")
    assert got["training.activation_checkpointing"] == (
        "full" if imported.config.get("policy.megatron_cfg.activation_checkpointing") else "none")
    # every NeMo-RL key is accounted for: mapped, listed with a reason, or counted as default / inactive
    leaves = set(imported.config.leaves())
    sources = {s for v in imported.mapping.values for s in v.sources}
    assert leaves == sources | {u.key for u in imported.unmapped} | set(imported.mapping.implied)
    out = tmp_path / "r.yaml"
    code, stdout, err = rlc("import", "nemo-rl", str(path), "-o", str(out), "--set", "cluster.gpu=h100-80gb")
    if RECIPES[name]:
        assert code == 1 and not out.exists() and "stopped, nothing written" in err and "--accept-loss" in err
        for key in RECIPES[name]:
            assert f"  {key}: " in err
        code, stdout, err = rlc("import", "nemo-rl", str(path), "-o", str(out), "--set", "cluster.gpu=h100-80gb",
                                "--accept-loss")
        text = out.read_text()
        assert "# Dropped (--accept-loss):" in text
        recipe = yaml.safe_load(text)
        assert set(recipe["extensions"]["nemo_rl_import"]["dropped"]) == RECIPES[name]
    else:
        assert out.exists() and "Dropped" not in out.read_text()
    assert "more NeMo-RL key(s) keep NeMo-RL's defaults" in stdout


def test_reference_policy_kl_type_maps_to_the_kl_estimator():
    # used to be listed as "no rlc equivalent" while rlc ran k3: a k2 config trained with another estimator
    for kind in ("k1", "k2", "k3"):
        got = mapped(import_nemo_rl(str(BASE), [f"loss_fn.reference_policy_kl_type={kind}"]))
        assert got["loss.kl_estimator"] == kind
    assert dropped(BASE, ("loss_fn.reference_policy_kl_type=k4",)) == {"loss_fn.reference_policy_kl_type"}


def test_recompute_granularity_selective_maps_to_selective_and_its_modules_pass_through():
    on = "policy.megatron_cfg.activation_checkpointing=true"
    # used to be written as activation_checkpointing: full whatever the granularity
    got = mapped(import_nemo_rl(str(MEGATRON_BASE), [on, "policy.megatron_cfg.recompute_granularity=selective"]))
    assert got["training.activation_checkpointing"] == "selective"
    assert "training.megatron_kwargs.recompute_modules" not in got  # null: Megatron-core's core_attn, as rlc's
    got = mapped(import_nemo_rl(str(MEGATRON_BASE), [on, "policy.megatron_cfg.recompute_granularity=selective",
                                                     "policy.megatron_cfg.recompute_modules=[moe]"]))
    assert got["training.megatron_kwargs.recompute_modules"] == ["moe"]
    got = mapped(import_nemo_rl(str(MEGATRON_BASE), [on]))
    assert got["training.activation_checkpointing"] == "full"
    off = import_nemo_rl(str(MEGATRON_BASE), ["policy.megatron_cfg.recompute_granularity=selective"])
    assert mapped(off)["training.activation_checkpointing"] == "none"
    assert "policy.megatron_cfg.recompute_granularity" in off.mapping.implied


def test_mtp_loss_scale_and_the_trainers_mtp_blocks_are_mapped():
    got = mapped(import_nemo_rl(str(MEGATRON_BASE), ["policy.megatron_cfg.mtp_loss_scaling_factor=0.1"]))
    assert got["training.mtp_loss_scale"] == 0.1  # used to be dropped, leaving rlc's 0
    # NeMo-RL's mtp_num_layers 0 (its default) builds the Qwen3.5 trainer without its MTP block: so does the recipe
    imported = import_nemo_rl(str(LLM / "grpo-qwen3.5-397ba17b-32n8g-megatron.v2.yaml"), accept_loss=True)
    assert mapped(imported)["model.overrides.mtp_num_hidden_layers"] == 0
    one = import_nemo_rl(str(LLM / "grpo-qwen3.5-397ba17b-32n8g-megatron.v2.yaml"),
                         ["policy.megatron_cfg.mtp_num_layers=1"], accept_loss=True)
    assert not any(k.startswith("model.overrides") for k in mapped(one))  # the checkpoint's one block


def test_prompt_file_becomes_the_prompt_template_and_a_missing_one_stops_the_import(tmp_path):
    got = mapped(import_nemo_rl(str(BASE)))
    assert got["data.prompt_template"] == COT.replace("\n{}\n", "\n{prompt}\n")  # NeMo-RL's {} is rlc's {prompt}
    # the config alone, away from its checkout: the file is not found, which would change every prompt
    lone = tmp_path / "grpo_math_1B.yaml"
    lone.write_text(BASE.read_text())
    with pytest.raises(ImportStopped) as stop:
        import_nemo_rl(str(lone))
    (u,) = stop.value.dropped
    assert u.key == "data.default.prompt_file" and "did not find" in u.reason
    # the fix the message names resolves it
    fixed = import_nemo_rl(str(lone), sets=['data.prompt_template="{prompt} Answer"'])
    assert fixed.data["data"]["prompt_template"] == "{prompt} Answer" and fixed.dropped == []
    # a system prompt file becomes data.system_prompt, the conversation's first turn (it used to stop the import)
    system = import_nemo_rl(str(BASE), ["data.default.system_prompt_file=examples/prompts/cot.txt"])
    assert mapped(system)["data.system_prompt"] == COT and system.dropped == []


def test_nvfp4_rollouts_stop_the_import():
    assert {"policy.generation.quant_cfg", "policy.generation.real_quant"} <= \
        dropped(LLM / "grpo-qwen3-8b-base-dapo-2n8g-long-megatron-qa-nvfp4-w4a16.yaml")
    assert dropped(BASE, ("grpo.reward_shaping.enabled=true",)) == set()  # DAPO's overlong penalty is mapped


def test_hf_config_overrides_become_model_overrides():
    """NeMo-RL builds the trainer and vLLM from the checkpoint's config with ``policy.hf_config_overrides``; rlc's
    ``model.overrides`` does the same, so a YaRN ``rope_scaling`` or a nested ``text_config`` entry is mapped."""
    yarn = ("++policy.hf_config_overrides.rope_scaling={rope_type: yarn, factor: 4.0, "
            "original_max_position_embeddings: 32768}",
            "++policy.hf_config_overrides.text_config={router_aux_loss_coef: 0.0}")
    assert dropped(BASE, yarn) == set()
    got = mapped(import_nemo_rl(str(BASE), list(yarn)))
    assert got["model.overrides.rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768}
    assert got["model.overrides.text_config"] == {"router_aux_loss_coef": 0.0}
    real = mapped(import_nemo_rl(str(LLM / "grpo-qwen2.5-1.5B-4n8g-megatron-yarn-256k.yaml")))
    assert real["model.overrides.rope_scaling"]["rope_type"] == "yarn"
    # a disabled block changes nothing, whatever its other keys say
    assert dropped(BASE, ("grpo.reward_shaping.overlong_buffer_length=4096",)) == set()


def test_settings_that_change_nothing_are_listed_not_stopped():
    imported = import_nemo_rl(str(BASE), ["logger.wandb_enabled=true", "grpo.val_period=5",
                                          "policy.megatron_cfg.empty_unused_memory_level=2"])
    listed = {u.key: u for u in imported.unmapped if u.effect == "none"}
    assert {"logger.wandb_enabled", "grpo.val_period", "policy.megatron_cfg.empty_unused_memory_level"} <= set(listed)
    assert imported.dropped == []
    # the Megatron trainer's logprob kernel and attention backend: speed and memory, the same values
    kernels = import_nemo_rl(str(MEGATRON_BASE), ["++policy.megatron_cfg.use_fused_linear_logprobs=true",
                                                  "++policy.megatron_cfg.attention_backend=flash"])
    active = {u.key: u.effect for u in kernels.unmapped if not u.inactive}
    assert active["policy.megatron_cfg.use_fused_linear_logprobs"] == "none"
    assert active["policy.megatron_cfg.attention_backend"] == "none" and kernels.dropped == []


def test_the_colocated_reshard_recipe_validates_with_its_own_inference_router(tmp_path):
    """NeMo-RL's colocated reshard recipe trains with an fp64 router and builds its dedicated, inference-optimized
    generation model with an fp32 one (mcore_generation_config.moe_router_dtype, merged for that model only): the
    import keeps both, so the recipe validates instead of asking the trainer to route in fp32."""
    path = LLM / "grpo-nanov3-30BA3B-4n4g-megatron_colocated_reshard.yaml"
    got = mapped(import_nemo_rl(str(path)))
    assert (got["training.moe.router_dtype"], got["generation.megatron.router_dtype"]) == ("fp64", "fp32")
    out = tmp_path / "r.yaml"
    code, _, err = rlc("import", "nemo-rl", str(path), "-o", str(out), "--set", "cluster.gpu=gb200-186gb",
                       "--set", "cluster.container.image=nvcr.io/nvidia/nemo-rl:v0.6.0",
                       "--set", "data.train=/data/train.jsonl", "--set", 'cluster.container.mounts=["/data:/data:ro"]')
    assert code == 0, err
    assert "router dtype fp64 -> fp32" in err  # auto -> dedicated says why
    # with the trainer's layout and Transformer Engine layers NeMo-RL generates on the training model, which routes
    # as it trains: the inference router dtype is not read there
    shared = import_nemo_rl(str(path), ["policy.generation.mcore_generation_config.transformer_impl=transformer_engine",
                                        "policy.generation.mcore_generation_config.tensor_model_parallel_size=2",
                                        "policy.generation.mcore_generation_config.expert_model_parallel_size=8"])
    assert "generation.megatron.router_dtype" not in mapped(shared)
    assert "policy.generation.mcore_generation_config.moe_router_dtype" in shared.mapping.implied


SUPER = LLM / "grpo-nemotron3-super-120BA12B-16n8g-megatron.yaml"
SUPER_QA = LLM / "grpo-nemotron3-super-120BA12B-16n4g-megatron-qa-bf16-300step.yaml"


def test_nemotron3_super_megatron_options_and_prefix_caching_are_carried():
    """Megatron model options NeMo-RL sets on the provider (the expert-bias router, the repeated MTP layer, detached
    MTP heads) pass through unchanged, and vllm_cfg.enable_prefix_caching reaches vllm.LLM: they used to stop the
    import as losses."""
    got = mapped(import_nemo_rl(str(SUPER)))
    kwargs = {k.split(".", 2)[2]: v for k, v in got.items() if k.startswith("training.megatron_kwargs.")}
    assert kwargs["moe_router_enable_expert_bias"] is True and kwargs["moe_router_bias_update_rate"] == 0.001
    assert kwargs["mtp_use_repeated_layer"] is True and kwargs["mtp_detach_heads"] is True
    assert got["generation.vllm_kwargs"]["enable_prefix_caching"] is False
    assert got["generation.vllm_kwargs"]["mamba_cache_mode"] == "align"
    caching_on = mapped(import_nemo_rl(str(BASE), ["++policy.generation.vllm_cfg.enable_prefix_caching=null"]))
    assert "enable_prefix_caching" not in caching_on.get("generation.vllm_kwargs", {})


def test_nemo_rls_refit_buffers_and_vllm_executor_in_its_vllm_workers_change_nothing():
    imported = import_nemo_rl(str(LLM / "grpo-nemotron3-super-120BA12B-8n4g-megatron.yaml"))
    listed = {u.key: u for u in imported.unmapped}
    for name in ("NRL_REFIT_BUFFER_MEMORY_RATIO", "NRL_REFIT_NUM_BUFFERS"):
        u = listed[f"policy.generation.vllm_cfg.env_vars.{name}"]
        assert u.effect == "none" and "refit buffers" in no_effect_reason(u.key)
    qa = {u.key: u for u in import_nemo_rl(str(SUPER_QA), accept_loss=True).unmapped}
    assert qa["policy.generation.vllm_cfg.env_vars.VLLM_USE_RAY_V2_EXECUTOR_BACKEND"].effect == "none"
    assert qa["policy.generation.real_quant"].effect == "none"  # no quantisation config


def test_the_qa_run_keeps_top_p_tis_and_its_constant_weight_decay():
    imported = import_nemo_rl(str(SUPER_QA), accept_loss=True)
    got = mapped(imported)
    assert got["generation.sampling.top_p"] == 0.95
    assert got["loss.importance_sampling_correction"] is True and got["loss.importance_sampling_cap"] == 2.0
    assert got["training.optimizer.weight_decay"] == 0.1
    implied = imported.mapping.implied
    assert "importance_sampling_cap" in implied["loss_fn.truncated_importance_sampling_type"]
    for end in ("start", "end"):
        assert "constant weight decay" in implied[f"policy.megatron_cfg.scheduler.{end}_weight_decay"]


@pytest.mark.parametrize("overrides,key", [
    (("loss_fn.truncated_importance_sampling_type=icepop", "loss_fn.truncated_importance_sampling_ratio_min=0.5"),
     "loss_fn.truncated_importance_sampling_type"),
    (("loss_fn.truncated_importance_sampling_ratio_min=0.5",), "loss_fn.truncated_importance_sampling_type"),
    (("policy.megatron_cfg.scheduler.weight_decay_incr_style=linear",
      "policy.megatron_cfg.scheduler.start_weight_decay=0.0"), "policy.megatron_cfg.scheduler.start_weight_decay"),
])
def test_importance_sampling_and_weight_decay_schedules_rlc_cannot_run_stop_the_import(overrides, key):
    assert key in dropped(SUPER_QA, overrides)


def test_nemo_rls_kl_term_is_carried_weighted_and_clamped():
    """NeMo-RL weights each token's KL so its gradient includes sampling from the policy (NeMo-RL #2506), on-policy
    with use_on_policy_kl_approximation, and clamps the term at kl_output_clamp_value (10): a recipe without them
    trained with another KL gradient."""
    base = import_nemo_rl(str(BASE))
    got = mapped(base)
    assert got["loss.kl_penalty"] == 0.01 and got["loss.kl_weighting"] == "sampling" and got["loss.kl_clamp"] == 10.0
    assert "20" in base.mapping.implied["loss_fn.kl_input_clamp_value"]
    dsv3 = mapped(import_nemo_rl(str(LLM / "grpo-dapomath17k-dsv3-megatron.yaml")))
    assert dsv3["loss.kl_weighting"] == "on_policy"
    unbounded = mapped(import_nemo_rl(str(BASE), ["loss_fn.kl_output_clamp_value=null"]))
    assert "loss.kl_clamp" not in unbounded
    off = import_nemo_rl(str(BASE), ["loss_fn.reference_policy_kl_penalty=0", "loss_fn.kl_input_clamp_value=5"])
    assert "loss.kl_weighting" not in mapped(off) and "no KL penalty" in off.mapping.implied[
        "loss_fn.kl_input_clamp_value"]
    assert dropped(BASE, ("loss_fn.kl_input_clamp_value=5",)) == {"loss_fn.kl_input_clamp_value"}


def test_dapo_reward_scaling_and_overlong_shaping_are_mapped():
    """The Qwen3.5-397B-A17B v2 recipe scales its 0/1 rewards onto −1/+1 and shapes them with DAPO's overlong penalty
    (a 1024-token buffer before 8192): both used to stop the import."""
    got = mapped(import_nemo_rl(str(LLM / "grpo-qwen3.5-397ba17b-32n8g-megatron.v2.yaml")))
    assert (got["grpo.reward_scaling.enabled"], got["grpo.reward_scaling.target_min"]) == (True, -1.0)
    assert (got["grpo.reward_shaping.enabled"], got["grpo.reward_shaping.overlong_buffer_length"],
            got["grpo.reward_shaping.max_response_length"]) == (True, 1024, 8192)
    assert "grpo.reward_shaping.stop_properly_penalty_coef" not in got  # null: the overlong penalty
    base = import_nemo_rl(str(BASE))
    assert not any(k.startswith("grpo.reward_s") for k in mapped(base))
    assert "the block is off" in base.mapping.implied["grpo.reward_shaping.overlong_buffer_length"]


def test_the_math_processors_chat_template_and_its_arguments_are_carried():
    """NeMo-RL's math data processor renders each prompt with the tokenizer's chat template (the assistant's turn
    opened, no special tokens added): data.chat_template default, the template's arguments (Nemotron-3-Super's QA run
    turns thinking off) and NeMo-RL's passthrough template for chat_template null. The import used to note the
    difference and leave the markup to the user."""
    base = mapped(import_nemo_rl(str(BASE)))
    assert base["data.chat_template"] == "default" and "data.chat_template_kwargs" not in base
    qa = mapped(import_nemo_rl(str(SUPER_QA)))
    assert qa["data.chat_template_kwargs"] == {"enable_thinking": False}
    passthrough = mapped(import_nemo_rl(str(BASE), ["++policy.tokenizer.chat_template=null"]))
    assert passthrough["data.chat_template"] == "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    custom = mapped(import_nemo_rl(str(BASE), ["++policy.tokenizer.chat_template='{{ messages[0].content }}'"]))
    assert custom["data.chat_template"] == "{{ messages[0].content }}"
    other = import_nemo_rl(str(BASE), ["data.default.processor=helpsteer3_data_processor",
                                       "++policy.tokenizer.chat_template_kwargs={enable_thinking: true}"],
                           accept_loss=True)
    assert "data.chat_template" not in mapped(other)
    assert "policy.tokenizer.chat_template_kwargs.enable_thinking" in {u.key for u in other.dropped}


def test_vllm_workers_environment_reaches_vllm_and_nothing_else_is_assumed():
    """vllm_cfg.env_vars are set in NeMo-RL's vLLM workers: vLLM's own variables go to cluster.env (the trainer reads
    none of them); another variable would reach the trainer too in rlc, so it stays a listed loss."""
    imported = import_nemo_rl(str(BASE), ["++policy.generation.vllm_cfg.env_vars={VLLM_USE_FLASHINFER_MOE_FP16: '0', "
                                          "NCCL_P2P_DISABLE: '1'}"], accept_loss=True)
    assert mapped(imported)["cluster.env.VLLM_USE_FLASHINFER_MOE_FP16"] == "0"
    assert "cluster.env.NCCL_P2P_DISABLE" not in mapped(imported)
    assert {u.key for u in imported.dropped} == {"policy.generation.vllm_cfg.env_vars.NCCL_P2P_DISABLE"}


def test_a_forced_on_policy_ratio_is_mapped():
    got = mapped(import_nemo_rl(str(BASE), ["loss_fn.force_on_policy_ratio=true"]))
    assert got["loss.force_on_policy_ratio"] is True  # used to stop the import


def test_freezing_the_vision_tower_is_listed_and_freezing_the_language_model_stops_the_import():
    """Qwen3.5's FP8 recipes freeze the vision tower and its projection: with text prompts they get no gradient, so
    rlc lists the keys instead of stopping; freezing the language model would train nothing rlc trains."""
    path = LLM / "grpo-qwen3.5-9b-1n8g-megatron.yaml"
    freeze = "++policy.megatron_cfg.freeze_config={freeze_vision_model: true, freeze_vision_projection: true, " \
             "freeze_language_model: %s}"
    vision = import_nemo_rl(str(path), [freeze % "false"])
    listed = {u.key: u for u in vision.unmapped}
    assert listed["policy.megatron_cfg.freeze_config.freeze_vision_model"].effect == "none"
    assert "no gradient" in listed["policy.megatron_cfg.freeze_config.freeze_vision_projection"].reason
    assert vision.dropped == [] and "policy.megatron_cfg.freeze_config.freeze_language_model" in vision.mapping.implied
    assert "policy.megatron_cfg.freeze_config.freeze_language_model" in dropped(path, (freeze % "true",))
