"""Model facts from the checkpoint itself: its folder's config.json (also through a container mount), the
Hugging Face cache, the Hub (a real HTTP server on loopback, never the internet); a fact the plan needs that no
source states is an error naming the fact, where rlc looked and the override.

The three checkpoint configs under checkpoints/ are the public config.json values of models outside the shipped
catalog (checkpoints/SOURCES.md says where each came from); no test downloads anything.
"""
from __future__ import annotations

import http.server
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from rlc.compiler import api, catalog
from rlc.compiler.catalog import sources

from planner_helpers import ULTRA

CHECKPOINTS = Path(__file__).parent / "checkpoints"

RECIPE = """\
version: 1
name: checkpoint-facts
model:
  id: {model_id}
  checkpoint: {checkpoint}
cluster:
  nodes: 1
  gpus_per_node: 8
  gpu: h100-80gb
  container: {{runtime: none}}
parallelism:
  train: {{tp: {tp}}}
  generation: {{tp: {tp}}}
colocated: true
refit: {{offload_optimizer_for_refit: true}}
generation:
  max_model_len: 4096
  gpu_memory_utilization: 0.5
  sampling: {{max_tokens: 3072}}
training:
  micro_batch_size: 1
  global_batch_size: 256
  use_distributed_optimizer: true
grpo: {{prompts_per_step: 32, generations_per_prompt: 8, max_steps: 10}}
data: {{train: /data/train.jsonl, max_prompt_length: 1024}}
reward: {{function: math}}
"""


def _recipe(tmp_path: Path, model_id: str, checkpoint: str, tp: int = 1, extra: str = "") -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.format(model_id=model_id, checkpoint=checkpoint, tp=tp) + extra)
    return path


#: (model id, fixture folder, TP, published total parameters in billions, the planner's own total within 2 %)
MODELS = [
    ("Qwen/Qwen2.5-1.5B-Instruct", "Qwen2.5-1.5B-Instruct", 1, 1.54),
    ("meta-llama/Llama-3.2-1B-Instruct", "Llama-3.2-1B-Instruct", 1, 1.24),
    ("Qwen/Qwen3.5-9B", "Qwen3.5-9B", 4, None),
]


@pytest.mark.parametrize("model_id,folder,tp,billions", MODELS, ids=[m[1] for m in MODELS])
def test_a_model_plans_from_its_checkpoint_folder_before_the_catalog(tmp_path, model_id, folder, tp, billions):
    checkpoint = tmp_path / "ckpt" / folder
    shutil.copytree(CHECKPOINTS / folder, checkpoint)
    result = api.check(_recipe(tmp_path, model_id, str(checkpoint), tp))
    assert result.ok, [(d.rule, d.message) for d in result.errors]
    facts = result.facts
    assert facts.source == f"checkpoint folder {checkpoint / 'config.json'}"
    assert facts.unknown == () and result.plan.unknown == []
    if billions is not None:
        total = facts.param_counts()["total"]
        assert total == pytest.approx(billions * 1e9, rel=0.02)
    # without the folder: a model outside the shipped catalog has nothing to plan from, and the error says where rlc
    # looked (broken-then-fixed); a catalogued one plans from the catalog's copy of the same config.json
    shutil.rmtree(checkpoint)
    result = api.check(_recipe(tmp_path, model_id, str(checkpoint), tp))
    if model_id not in catalog.model_ids():
        errors = [d for d in result.errors if d.rule == "RLC001"]
        assert errors and f"checkpoint folder {checkpoint}: not on this machine" in errors[0].message
        assert "HF_HUB_OFFLINE" in errors[0].message and "catalog: no entry" in errors[0].message
    else:
        assert result.ok and result.facts.source.startswith("catalog ")
        assert result.facts.param_counts()["total"] == facts.param_counts()["total"]


def test_qwen35_9b_is_a_dense_hybrid_with_one_mtp_block():
    facts = catalog.model_facts("Qwen/Qwen3.5-9B", CHECKPOINTS, config="Qwen3.5-9B/config.json")
    assert facts.family == "qwen3_5" and facts.num_experts == 0 and facts.dense_intermediate == 12288
    assert facts.layer_types.count("linear_attention") == 24 and facts.layer_types.count("full_attention") == 8
    assert facts.mtp_num_layers == 1 and facts.mtp_layer_kinds == (("full_attention", "dense"),)
    assert facts.mtp_shared_embedding is True and facts.tied_embeddings is False
    # about 9B parameters in the language model (the vision tower is not counted)
    assert 8.5e9 < facts.param_counts()["total_without_mtp"] < 9.5e9


def test_the_hugging_face_cache_is_read_offline(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    repo = cache / "models--meta-llama--Llama-3.2-1B-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("4e20de362430cd3b72f300e6b0f18e50e7166e08")
    snapshot = repo / "snapshots" / "4e20de362430cd3b72f300e6b0f18e50e7166e08"
    snapshot.mkdir(parents=True)
    shutil.copy(CHECKPOINTS / "Llama-3.2-1B-Instruct" / "config.json", snapshot / "config.json")
    stale = repo / "snapshots" / "0000"  # an older snapshot of another shape is not the one refs/main names
    stale.mkdir()
    (stale / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    facts = catalog.model_facts("meta-llama/Llama-3.2-1B-Instruct", tmp_path)
    assert facts.source == f"Hugging Face cache {snapshot / 'config.json'}" and facts.num_layers == 16
    # HF_HOME/hub is the cache when HF_HUB_CACHE is unset
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert catalog.model_facts("meta-llama/Llama-3.2-1B-Instruct", tmp_path).num_layers == 16


def test_a_container_path_is_read_through_its_mount(tmp_path):
    host = tmp_path / "host-models"
    shutil.copytree(CHECKPOINTS / "Qwen2.5-1.5B-Instruct", host / "qwen")
    path = _recipe(tmp_path, "Qwen/Qwen2.5-1.5B-Instruct", "/models/qwen")
    text = path.read_text().replace("container: {runtime: none}",
                                    f"container: {{runtime: none, mounts: ['{host}:/models:ro']}}")
    path.write_text(text)
    result = api.check(path)
    assert result.ok, [(d.rule, d.message) for d in result.errors]
    assert result.facts.source == f"checkpoint folder {host / 'qwen' / 'config.json'}"


class _Hub(http.server.BaseHTTPRequestHandler):
    configs: dict[str, bytes] = {}
    seen: list[str] = []
    delay = 0.0

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).seen.append(self.path)
        time.sleep(type(self).delay)
        body = type(self).configs.get(self.path)
        self.send_response(200 if body else 404)
        self.end_headers()
        if body:
            try:
                self.wfile.write(body)
            except BrokenPipeError:  # the client gave up waiting (the timeout test)
                pass

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(monkeypatch):
    _Hub.configs, _Hub.seen, _Hub.delay = {}, [], 0.0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    yield _Hub
    server.shutdown()


def test_the_hub_is_asked_only_for_a_model_nothing_local_describes(tmp_path, hub, monkeypatch):
    hub.configs["/Qwen/Qwen2.5-1.5B-Instruct/resolve/main/config.json"] = \
        (CHECKPOINTS / "Qwen2.5-1.5B-Instruct" / "config.json").read_bytes()
    facts = catalog.model_facts("Qwen/Qwen2.5-1.5B-Instruct", tmp_path)
    assert facts.source.startswith("the Hub http://127.0.0.1:") and facts.num_layers == 28
    # a complete catalog entry answers without the network
    hub.seen.clear()
    assert catalog.model_facts("Qwen/Qwen3-8B", tmp_path).num_layers == 36 and hub.seen == []
    # HF_HUB_OFFLINE: not asked, and the error says so
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(catalog.CatalogError, match="not asked, HF_HUB_OFFLINE is set"):
        catalog.model_facts("Qwen/Qwen2.5-1.5B-Instruct", tmp_path)
    assert hub.seen == []


def test_a_hub_request_is_bounded_in_time_and_reports_why_it_gave_nothing(hub):
    hub.delay = 2.0
    hub.configs["/org/slow/resolve/main/config.json"] = b"{}"
    start = time.monotonic()
    config, why = sources.fetch_from_hub("org/slow", timeout=0.3)
    assert config is None and "unreachable" in why and time.monotonic() - start < 1.5
    hub.delay = 0.0
    config, why = sources.fetch_from_hub("org/missing")
    assert config is None and "HTTP 404" in why


def test_the_nemotron_super_entry_states_every_fact_the_plan_needs():
    facts = catalog.model_facts("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B", CHECKPOINTS)
    assert facts.unknown == () and facts.tied_embeddings is False


def test_the_ultra_recipe_refuses_to_compile_without_its_checkpoint_config():
    result = api.check(ULTRA)
    assert not result.ok
    errors = result.errors
    assert [d.rule for d in errors] == ["RLC216"]
    message, hint = errors[0].message, errors[0].hint
    for fact, key in (("num_layers", "num_hidden_layers"), ("vocab", "vocab_size"),
                      ("layer_kinds", "hybrid_override_pattern")):
        assert f"{fact} ({key})" in message and f"{key}: ..." in hint
    assert "no config.json for nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16" in message  # the cache
    assert "catalog nvidia__NVIDIA-Nemotron-3-Ultra-550B-A55B.json" in message
    assert "HF_HUB_OFFLINE is set" in message and "model.overrides" in hint


def test_a_missing_fact_is_an_error_until_model_overrides_supplies_it(tmp_path):
    config = json.loads((CHECKPOINTS / "Qwen2.5-1.5B-Instruct" / "config.json").read_text())
    del config["intermediate_size"]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    result = api.check(_recipe(tmp_path, "Qwen/Qwen2.5-1.5B-Instruct", str(folder)))
    assert [d.rule for d in result.errors] == ["RLC216"]
    assert "dense_intermediate (intermediate_size)" in result.errors[0].message
    assert f"checkpoint folder {folder / 'config.json'}: used" in result.errors[0].message
    fixed = _recipe(tmp_path, "Qwen/Qwen2.5-1.5B-Instruct", str(folder), extra="")
    fixed.write_text(fixed.read_text().replace(f"  checkpoint: {folder}\n",
                                               f"  checkpoint: {folder}\n  overrides: {{intermediate_size: 8960}}\n"))
    assert api.check(fixed).ok


def test_a_real_config_without_tie_word_embeddings_loads_untied_as_transformers_does(tmp_path):
    config = json.loads((CHECKPOINTS / "Qwen2.5-1.5B-Instruct" / "config.json").read_text())
    del config["tie_word_embeddings"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    facts = catalog.model_facts("x/y", tmp_path, config=str(path))
    assert facts.tied_embeddings is False and any("default of the qwen2 config class" in n for n in facts.notes)
