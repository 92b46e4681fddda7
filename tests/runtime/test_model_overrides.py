"""``model.overrides`` reach the model the job builds: runtime.yaml carries them, and the trainer's config and vLLM's
config are the checkpoint's ``config.json`` with them, read the same way (real Transformers configs)."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from rlc.compiler import api
from rlc.compiler.resolve import to_runtime_config
from rlc.contract.model_overrides import apply_overrides, engine_overrides
from rlc.contract.runtime_config import runtime_config_from_dict
from rlc.runtime.generation.engine_args import engine_kwargs
from rlc.runtime.model_config import EngineConfig, overridden_config

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "rlc" / "recipes"
TINY_CONFIG = REPO / "rlc" / "recipes" / "models" / "tiny-qwen3" / "config.json"

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------------------- the contract's reading

def test_a_mapping_merges_into_a_mapping_and_anything_else_replaces():
    config = {"hidden_size": 64, "rope_scaling": {"rope_type": "default", "mrope_section": [1, 2]}, "layers": [1, 2]}
    out = apply_overrides(config, {"hidden_size": 32, "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
                                   "layers": [3]})
    assert out == {"hidden_size": 32, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mrope_section": [1, 2]},
                   "layers": [3]}
    assert config["rope_scaling"] == {"rope_type": "default", "mrope_section": [1, 2]}  # the input is not changed


def test_a_nested_language_model_config_gets_the_keys_and_keeps_the_rest():
    config = {"model_type": "vl", "tie_word_embeddings": False,
              "text_config": {"hidden_size": 64, "router_aux_loss_coef": 0.001, "mtp_num_hidden_layers": 1}}
    out = apply_overrides(config, {"text_config": {"router_aux_loss_coef": 0.0}, "mtp_num_hidden_layers": 0})
    assert out["text_config"] == {"hidden_size": 64, "router_aux_loss_coef": 0.0, "mtp_num_hidden_layers": 0}
    assert out["mtp_num_hidden_layers"] == 0 and out["model_type"] == "vl"


def test_rope_keys_go_where_the_config_keeps_its_rope_settings():
    saved = {"model_type": "qwen3", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    assert apply_overrides(saved, {"rope_theta": 500.0}) == {
        "model_type": "qwen3", "rope_parameters": {"rope_theta": 500.0, "rope_type": "default"}}
    yarn = apply_overrides(saved, {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert yarn["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 2.0}
    assert "rope_scaling" not in yarn
    legacy = {"model_type": "qwen3", "rope_theta": 10000.0}
    assert apply_overrides(legacy, {"rope_theta": 500.0}) == {"model_type": "qwen3", "rope_theta": 500.0}
    per_kind = {"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    assert apply_overrides(per_kind, {"rope_theta": 5.0})["rope_parameters"] == {
        "full_attention": {"rope_theta": 5.0}, "sliding_attention": {"rope_theta": 5.0}}


def test_the_engine_keeps_the_checkpoints_mtp_blocks():
    overrides = {"num_nextn_predict_layers": 0, "text_config": {"mtp_num_hidden_layers": 0}, "rope_theta": 1.0}
    assert engine_overrides(overrides) == {"rope_theta": 1.0}
    assert engine_overrides({"mtp_num_hidden_layers": 0}) == {}


# ---------------------------------------------------------------------------- real Transformers configs

def _checkpoint(tmp_path: Path, config: dict) -> str:
    folder = tmp_path / "ckpt"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(folder)


def _tiny_saved_by_transformers(tmp_path: Path) -> str:
    """The tiny Qwen3's config as Transformers writes it (RoPE under ``rope_parameters``)."""
    raw = {k: v for k, v in json.loads(TINY_CONFIG.read_text(encoding="utf-8")).items() if not k.startswith("_")}
    folder = tmp_path / "saved"
    transformers.AutoConfig.for_model(raw.pop("model_type"), **raw).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("saved", [True, False], ids=["rope_parameters", "legacy rope_theta"])
def test_trainer_and_engine_read_one_config(tmp_path, saved):
    ckpt = _tiny_saved_by_transformers(tmp_path) if saved else _checkpoint(tmp_path, json.loads(
        TINY_CONFIG.read_text(encoding="utf-8")))
    loaded = transformers.AutoConfig.from_pretrained(ckpt)
    overrides = {"rope_theta": 500.0, "max_position_embeddings": 512}
    trainer = overridden_config(loaded, ckpt, overrides)
    engine = EngineConfig(ckpt, overrides)(transformers.AutoConfig.from_pretrained(ckpt))
    for config in (trainer, engine):
        assert config.rope_parameters["rope_theta"] == 500.0 and config.max_position_embeddings == 512
        assert config.hidden_size == loaded.hidden_size and type(config) is type(loaded)
    assert loaded.rope_parameters["rope_theta"] == 10000.0
    assert overridden_config(loaded, ckpt, {}) is loaded


def test_a_nested_config_and_mtp_blocks_on_both_sides(tmp_path):
    text = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "router_aux_loss_coef": 0.001, "mtp_num_hidden_layers": 1, "vocab_size": 64}
    config = transformers.Qwen3_5MoeConfig(text_config=text).to_dict()
    ckpt = _checkpoint(tmp_path, config)
    overrides = {"text_config": {"router_aux_loss_coef": 0.0}, "mtp_num_hidden_layers": 0}
    loaded = transformers.AutoConfig.from_pretrained(ckpt)
    trainer = overridden_config(loaded, ckpt, overrides)
    engine = EngineConfig(ckpt, overrides)(loaded)
    assert trainer.text_config.router_aux_loss_coef == 0.0 and engine.text_config.router_aux_loss_coef == 0.0
    assert trainer.text_config.mtp_num_hidden_layers == 0
    assert engine.text_config.mtp_num_hidden_layers == 1  # vLLM's drafter loads the checkpoint's block
    assert trainer.text_config.hidden_size == 64 and engine.vision_config.to_dict() == loaded.vision_config.to_dict()


def test_engine_config_travels_to_vllms_engine_process(tmp_path):
    ckpt = _checkpoint(tmp_path, json.loads(TINY_CONFIG.read_text(encoding="utf-8")))
    fn = pickle.loads(pickle.dumps(EngineConfig(ckpt, {"rope_theta": 7.0}, {"quantization_config": {"a": 1}})))
    out = fn(transformers.AutoConfig.from_pretrained(ckpt))
    assert out.rope_parameters["rope_theta"] == 7.0 and out.quantization_config == {"a": 1}
    # vLLM calls it on a placeholder config to learn the model type (the checkpoint's, as overridden)
    assert fn(transformers.PretrainedConfig(model_type="dummy_qwen3")).model_type == "qwen3"


# ---------------------------------------------------------------------------- from the recipe to vLLM's arguments

def _runtime(tmp_path: Path, *sets: str):
    ckpt = _checkpoint(tmp_path, json.loads(TINY_CONFIG.read_text(encoding="utf-8")))
    result = api.check(str(RECIPES / "tiny-qwen3-1gpu.yaml"), [f"model.checkpoint={ckpt}", *sets])
    assert result.ok, [(d.rule, d.message) for d in result.errors]
    return runtime_config_from_dict(to_runtime_config(result))


def test_runtime_yaml_carries_the_overrides_to_vllm(tmp_path):
    cfg = _runtime(tmp_path, "model.overrides.rope_theta=500.0",
                   "generation.vllm_kwargs.hf_overrides={use_sliding_window: false}")
    assert cfg.model.overrides == {"rope_theta": 500.0}
    fn = engine_kwargs(cfg, 0, distributed=False)["hf_overrides"]
    assert isinstance(fn, EngineConfig)
    out = fn(transformers.AutoConfig.from_pretrained(cfg.model.checkpoint))
    assert out.rope_parameters["rope_theta"] == 500.0 and out.use_sliding_window is False


def test_without_overrides_vllm_reads_the_checkpoint_as_it_is(tmp_path):
    cfg = _runtime(tmp_path)
    assert cfg.model.overrides == {} and "hf_overrides" not in engine_kwargs(cfg, 0, distributed=False)
    only_mtp = _runtime(tmp_path, "model.overrides.num_nextn_predict_layers=0")
    assert "hf_overrides" not in engine_kwargs(only_mtp, 0, distributed=False)


def test_the_fp8_engines_quantization_config_joins_the_overrides(tmp_path):
    cfg = _runtime(tmp_path, "model.overrides.rope_theta=500.0", "generation.precision=fp8",
                   "generation.fp8.scales=tensor")
    kw = engine_kwargs(cfg, 0, distributed=False)
    assert kw["quantization"] == "fp8_per_tensor" and isinstance(kw["hf_overrides"], EngineConfig)
