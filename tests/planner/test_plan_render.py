"""to_text / to_json / to_svg of the plan, the Nemotron-3-Ultra recipe, recipe files, import hygiene."""
from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

from rlc.compiler import api

from planner_helpers import BASE, RECIPES, SEED000, ULTRA


def test_text_has_a_table_per_phase_and_the_refit_math(capsys):
    plan = api.check(str(SEED000["defaults"])).plan
    text = plan.to_text()
    for title in ("train step", "generation (vLLM awake)", "refit (before the IPC buffer)", "export staging site",
                  "refit math", "cheapest fixes"):
        assert title in text
    assert "buffer check       FAIL" in text and "8589934592 bytes" in text
    assert "enforce_eager: true (costs ~30–40% generation throughput): frees ≈ 7.8 GiB" in text
    assert "sleep_level: 2" not in text  # frees nothing at the refit: the weights are woken first
    assert "generation EP 128 halves the expert shard" in text
    from rlc.compiler.cli import main

    main(["plan", str(SEED000["defaults"])])  # what `rlc plan` prints is this text
    assert text in capsys.readouterr().out


def test_json_is_plain_data():
    plan = api.check(str(SEED000["ep128"])).plan
    data = json.loads(json.dumps(plan.to_json()))
    assert data["refit"]["largest"] == 8589934592 and data["checks"]["buffer"]["ok"] is True
    assert data["phases"]["stack"]["request"]["label"].startswith("torch.stack")
    assert (
        data["refit"]["per_side"] == plan.refit.per_side and data["refit"]["free_at_refit"] == plan.refit.free_at_refit
    )
    assert set(data["phases"]) == set(plan.phases) and set(data["checks"]) == set(plan.checks)


def test_svg_is_well_formed_with_limit_and_segments():
    plan = api.check(str(SEED000["ratio05"])).plan
    root = ET.fromstring(plan.to_svg())
    ns = "{http://www.w3.org/2000/svg}"
    texts = " ".join(t.text or "" for t in root.iter(f"{ns}text"))
    assert "GPU limit 79.11 GiB" in texts and "stack check: FAIL" in texts
    segments = [r for r in root.iter(f"{ns}rect") if r.find(f"{ns}title") is not None]
    assert len(segments) >= sum(len(p.items) for p in plan.phases.values())


def test_ultra_recipe_refuses_to_compile_on_unknown_facts_and_still_renders_its_plan():
    result = api.check(str(ULTRA))
    # the facts Nemotron-3-Ultra's catalog entry lacks are one error naming the keys to set (it used to compile
    # with warnings: a missing fact made rlc more permissive)
    assert not result.ok and [d.rule for d in result.errors] == ["RLC216"]
    assert "model.overrides" in result.errors[0].hint and "num_hidden_layers" in result.errors[0].message
    infos = {d.rule for d in result.diagnostics if d.severity == "info"}
    assert {"RLC104", "RLC203", "RLC204"} <= infos
    assert result.decisions["refit.per_rank_ipc_metadata"][0] is True
    assert "*e_score_correction_bias*" in result.decisions["refit.fp32_params"][0]
    text = result.plan.to_text()
    assert "unknown" in text and "refit math: unknown" in text
    ET.fromstring(result.plan.to_svg())


def test_recipe_files_have_the_schema_header_and_version():
    for path in [BASE, ULTRA, *SEED000.values()]:
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# yaml-language-server: $schema=")
        schema = (path.parent / lines[0].split("$schema=", 1)[1]).resolve()
        assert schema == (RECIPES.parent / "schemas" / "recipe.schema.json").resolve()
        assert "version: 1" in lines


def test_compiler_modules_import_no_heavy_runtime_libraries():
    code = ("import sys; import rlc.compiler.catalog, rlc.compiler.model, rlc.compiler.planner, rlc.compiler.rules;"
            "from rlc.compiler.rules import all_rules; all_rules();"
            "bad=[m for m in ('torch','ray','vllm','megatron','numpy') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_plan_text_names_expert_parallelism_only_for_models_with_experts():
    dense = api.check(RECIPES / "tiny-qwen3-1gpu.yaml").plan.to_text()
    moe = api.check(RECIPES / "tiny-moe-mtp-4gpu.yaml").plan.to_text()
    layout = lambda text: text.split("\n\n")[0].lower()  # noqa: E731
    assert "expert" not in layout(dense) and " ep" not in layout(dense) and "etp" not in layout(dense)
    assert "expert dp" in layout(moe) and "experts split 2 ways" in layout(moe) and " ep2" in layout(moe)
