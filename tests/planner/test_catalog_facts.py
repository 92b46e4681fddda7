"""The shipped catalog: ids, provenance, local configs, GPUs."""
from __future__ import annotations

import json

import pytest

from rlc.compiler import catalog
from rlc.compiler.catalog.models import MODELS_DIR

from planner_helpers import RECIPES

def test_catalog_lists_every_shipped_model():
    ids = catalog.model_ids()
    assert len(ids) == len(list(MODELS_DIR.glob("*.json"))) >= 14
    assert "Qwen/Qwen3.5-397B-A17B" in ids and "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B" in ids


def test_every_catalog_config_carries_its_provenance():
    for path in MODELS_DIR.glob("*.json"):
        provenance = json.loads(path.read_text())["_provenance"]
        assert provenance.get("type") and provenance.get("sources"), path.name
        assert all(isinstance(src, str) and src.strip() for src in provenance["sources"]), path.name


@pytest.mark.parametrize("name", ["Qwen/Qwen3.5-397B-A17B", "qwen/qwen3.5-397b-a17b", "Qwen3.5-397B-A17B"])
def test_model_lookup_by_id_case_or_short_name(name):
    facts = catalog.model_facts(name, RECIPES)
    assert facts.model_id == "Qwen/Qwen3.5-397B-A17B"
    assert "catalog Qwen__Qwen3.5-397B-A17B.json" in facts.source


def test_unknown_model_lists_close_ids():
    with pytest.raises(catalog.CatalogError) as err:
        catalog.model_facts("Qwen/Qwen3.5-397B", RECIPES)
    assert "Qwen/Qwen3.5-397B-A17B" in str(err.value) and "model.config" in str(err.value)


def test_local_config_overrides_catalog(tmp_path):
    facts = catalog.model_facts("rlc/tiny-qwen3", RECIPES, config="models/tiny-qwen3/config.json")
    assert (facts.num_layers, facts.hidden, facts.vocab, facts.num_experts) == (2, 128, 23, 0)
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "made_up"}')
    with pytest.raises(catalog.CatalogError, match="made_up"):
        catalog.model_facts("x", tmp_path, config=str(bad))
    with pytest.raises(catalog.CatalogError, match="cannot read"):
        catalog.model_facts("x", tmp_path, config="missing.json")


def test_gpu_specs():
    h100 = catalog.gpu_spec("h100-80gb")
    assert h100.memory_gib == pytest.approx(79.11) and h100.measured
    assert catalog.gpu_spec("h200-141gb").memory_gib > 139
    assert set(catalog.gpu_names()) >= {"h100-80gb", "h200-141gb", "b200-180gb", "a100-40gb", "l40s-48gb"}
    with pytest.raises(catalog.CatalogError, match="h100-80gb"):
        catalog.gpu_spec("h100")


def test_gpu_catalog_covers_schema_enum():
    schema = json.loads((RECIPES.parent / "schemas" / "recipe.schema.json").read_text())
    enum = schema["properties"]["cluster"]["properties"]["gpu"]["enum"]
    assert set(enum) <= set(catalog.gpu_names())


@pytest.mark.parametrize("model", ["Qwen/Qwen3-30B-A3B", "Qwen/Qwen3.5-35B-A3B"])
def test_expert_count_as_transformers_5_writes_it(model, tmp_path):
    """A config saved by transformers 5 names the routed experts ``num_local_experts``: same facts as the Hub's."""
    hub = json.loads((MODELS_DIR / (model.replace("/", "__") + ".json")).read_text(encoding="utf-8"))
    saved = json.loads(json.dumps(hub))
    where = saved.get("text_config", saved) if "num_experts" not in saved else saved
    where["num_local_experts"] = where.pop("num_experts")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved), encoding="utf-8")
    facts = catalog.model_facts(model, tmp_path, config=str(path))
    assert facts.num_experts == catalog.model_facts(model, RECIPES).num_experts > 0
    assert not facts.unknown


@pytest.mark.parametrize("model_id, total, tied", [
    ("meta-llama/Llama-3.2-1B-Instruct", 1_235_814_400, True),
    ("meta-llama/Llama-3.2-3B-Instruct", 3_212_749_824, True),
    ("Qwen/Qwen2.5-7B-Instruct", 7_615_716_864, False),
    ("Qwen/Qwen3-32B", 32_762_123_264, False),
])
def test_dense_models_of_public_grpo_recipes_plan_their_published_size(model_id, total, tied):
    """NeMo-RL's default model (Llama-3.2-1B-Instruct) and the dense models of its public recipes: the planner's
    parameter count from the shipped config.json (published: 1.24B, 3.21B, 7.61B, 32.8B)."""
    facts = catalog.model_facts(model_id, RECIPES)
    assert facts.param_counts()["total"] == total and facts.tied_embeddings is tied


def test_qwen2_attention_carries_the_biases_its_config_does_not_state():
    assert catalog.model_facts("Qwen/Qwen2.5-7B-Instruct", RECIPES).attention_bias is True
    assert catalog.model_facts("meta-llama/Llama-3.2-1B-Instruct", RECIPES).attention_bias is False


def test_a_base_checkpoint_of_a_catalogued_qwen3_5_dense_model_plans_as_its_variant():
    facts = catalog.model_facts("Qwen/Qwen3.5-9B-Base", RECIPES)
    assert facts.model_id == "Qwen/Qwen3.5-9B" and facts.num_layers == 32 and facts.mtp_num_layers == 1
