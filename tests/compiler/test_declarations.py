"""One declaration per key: the generated files follow the declarations, every key says what the runtime
does with it, and every dotted key the code names is a real one."""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest

from rlc.compiler import declarations as D
from rlc.compiler import recipe_types as rt
from rlc.contract.declare import COMPILER, EXPERIMENT, Policy, leaves, runtime_class, settings
from rlc.contract.runtime_types import RuntimeConfig

REPO = Path(__file__).resolve().parents[2]


def test_the_generated_files_are_what_the_declarations_give():
    stale = [str(p.relative_to(REPO)) for p in D.stale()]
    assert stale == [], f"stale: {stale}; run `python -m rlc.compiler.declarations`"


def test_the_check_names_a_stale_file_and_writing_fixes_it(tmp_path, monkeypatch, capsys):
    """Broken, then fixed: a schema edited by hand fails the check; the generator writes it back."""
    copy = tmp_path / "recipe.schema.json"
    copy.write_text(D.SCHEMA_PATH.read_text().replace('"default": 0.3', '"default": 0.4', 1))
    monkeypatch.setattr(D, "REPO", tmp_path)
    monkeypatch.setattr(D, "SCHEMA_PATH", copy)
    monkeypatch.setattr(D, "generated", lambda: {copy: D.schema_text()})
    assert D.main(["--check"]) == 1
    assert "recipe.schema.json: stale" in capsys.readouterr().err
    assert D.main([]) == 0 and D.main(["--check"]) == 0
    assert copy.read_text() == D.schema_text()


def test_the_schema_keeps_every_constraint_of_a_declaration():
    node = D.recipe_schema()["properties"]["refit"]["properties"]
    assert node["buffer_memory_ratio"] == {
        "description": node["buffer_memory_ratio"]["description"], "type": "number", "exclusiveMinimum": 0,
        "maximum": 0.9, "default": 0.3}
    assert node["sleep_level"]["enum"] == [1, 2] and node["sleep_level"]["default"] == 1
    assert node["fp32_params"]["oneOf"] == [{"const": "auto"},
                                            {"type": "array", "items": {"type": "string", "minLength": 1}}]
    spec = D.recipe_schema()["properties"]["generation"]["properties"]["speculative_decoding"]
    assert spec["type"] == ["object", "null"] and spec["required"] == ["method", "num_speculative_tokens"]
    top = D.recipe_schema()
    assert top["required"] == ["version", "model", "cluster", "data"]
    assert list(top["properties"])[:4] == ["$schema", "version", "extends", "name"]


def _runtime_sections() -> list[tuple[str, type]]:
    out: list[tuple[str, type]] = []

    def walk(cls: type, path: str) -> None:
        if runtime_class(cls) is not None:
            out.append((path, cls))
        for name, tp, _ in settings(cls):
            for inner in (tp, *typing.get_args(tp)):
                if isinstance(inner, type) and dataclasses.is_dataclass(inner) and typing.get_origin(tp) is not tuple:
                    walk(inner, f"{path}.{name}" if path else name)

    walk(rt.Recipe, "")
    return out


def test_every_key_of_a_section_the_runtime_reads_is_classified():
    unclassified = []
    for path, cls in _runtime_sections():
        for name, tp, meta in settings(cls):
            holds_section = any(isinstance(a, type) and dataclasses.is_dataclass(a) for a in (tp, *typing.get_args(tp)))
            if not holds_section and not isinstance(meta.get("runtime"), Policy):
                unclassified.append(f"{path}.{name}" if path else name)
    assert unclassified == []
    assert len(_runtime_sections()) == 28


def test_every_runtime_yaml_key_is_part_of_the_experiment_or_free_to_change_with_a_reason():
    found = {path: meta["runtime"] for path, _, meta in leaves(RuntimeConfig)}
    assert len(found) > 150
    assert all(p.reaches_runtime and (p.experiment or p.why) for p in found.values())
    assert found["loss.kl_penalty"] == EXPERIMENT and found["cluster.nodes"].why == "where the run runs"
    assert "model.config" not in found and "cluster.ray.port" not in found  # COMPILER keys stay behind


def test_a_key_without_a_policy_stops_the_generator(monkeypatch):
    real = D.settings

    def forgetful(cls):
        return tuple((n, tp, {**meta, "runtime": None} if (cls is rt.LossSection and n == "kl_penalty") else meta)
                     for n, tp, meta in real(cls))

    monkeypatch.setattr(D, "settings", forgetful)
    with pytest.raises(D.DeclarationError, match=r"loss\.kl_penalty: say what the runtime does with it"):
        D.runtime_layout()


def test_compiler_keys_never_reach_runtime_yaml():
    compiler_only = [f"{path}.{name}" if path else name for path, cls in _runtime_sections()
                     for name, _, meta in settings(cls) if meta.get("runtime") == COMPILER]
    sources = {meta.get("recipe") for _, _, meta in leaves(RuntimeConfig)}
    assert "training.offload_copies_gradients" in compiler_only
    assert not set(compiler_only) & sources


def test_the_refit_switches_the_rules_decide_are_the_declared_switches():
    from rlc.compiler.resolve import AUTO_SWITCHES

    assert AUTO_SWITCHES == ("sync_params_before_refit", "dedupe_mtp_embedding", "per_rank_ipc_metadata",
                             "fused_transfer")


def _key_paths(cls: type, prefix: str = "") -> set[str]:
    out = set()
    for name, tp, _ in settings(cls):
        path = f"{prefix}.{name}" if prefix else name
        out.add(path)
        for inner in (tp, *typing.get_args(tp)):
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                out |= _key_paths(inner, path)
    return out


RECIPE_KEYS = _key_paths(rt.Recipe) | set(rt.FILE_KEYS)
RUNTIME_KEYS = _key_paths(RuntimeConfig)
_KEY = re.compile(r"^(model|cluster|parallelism|refit|generation|training|grpo|loss|data|reward|checkpointing|"
                  r"logging|lint|train_parallel|generation_parallel)(\.[a-z0-9_]+)+$")
#: Where a dotted name is not an rlc key: NeMo-RL's own keys (the importer maps them) and tensor names.
_NOT_RLC = ("compiler/importers/",)
_TENSOR = re.compile(r"\.(weight|bias|e_score_correction_bias|gate_up_proj|tokens_per_expert|language_model)$")


def test_every_dotted_key_the_code_names_is_a_real_key():
    """A typo in a key path (``"refit.sleep_levle"``) reads ``None`` or misplaces a message forever; each
    dotted key in the compiler, contract and runtime is a recipe or ``runtime.yaml`` key (or below a
    free-form mapping)."""
    free = tuple(p + "." for p in RECIPE_KEYS | RUNTIME_KEYS
                 if p.endswith(("kwargs", "overrides", "extensions", "env", "decisions")))
    wrong = []
    for folder in ("compiler", "contract", "runtime"):
        for file in sorted((REPO / folder).rglob("*.py")):
            where = str(file.relative_to(REPO))
            if where.startswith(_NOT_RLC):
                continue
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and _KEY.match(node.value):
                    key = node.value
                    if key in RECIPE_KEYS or key in RUNTIME_KEYS or key.startswith(free) or _TENSOR.search(key):
                        continue
                    wrong.append(f"{where}:{node.lineno}: {key}")
    assert wrong == []


def test_the_key_lists_that_remain_name_real_keys():
    from rlc.compiler.bundle.checks import KEYS_READ, PATH_KEYS_READ
    from rlc.compiler.resolve import MEGATRON_DECISIONS
    from rlc.contract.ranges import DERIVED

    assert set(KEYS_READ) <= RECIPE_KEYS and set(PATH_KEYS_READ) <= RECIPE_KEYS
    assert set(MEGATRON_DECISIONS) - {"weight_sync"} <= RECIPE_KEYS | RUNTIME_KEYS
    assert set(DERIVED) <= RUNTIME_KEYS and set(D.DERIVED) <= RUNTIME_KEYS


def test_the_runtime_types_take_the_recipe_literals():
    hints = {path: tp for path, tp, _ in leaves(RuntimeConfig)}
    assert typing.get_args(hints["refit.sleep_level"]) == (1, 2)
    assert typing.get_args(hints["generation.fp8.scales"]) == ("block", "tensor")  # auto is settled
    assert typing.get_args(hints["generation.precision"]) == ("auto", "fp8")  # auto is a runtime value here
    assert hints["refit.dedupe_mtp_embedding"] is bool and hints["model.checkpoint"] is str


def test_the_schema_file_is_the_one_the_compiler_reads():
    from rlc.compiler.schema import load_schema

    assert load_schema() == json.loads(D.schema_text())


def test_declared_classes_are_frozen_dataclasses_that_list_only_their_fields():
    import copy
    import pickle

    from rlc.compiler.schema import with_defaults

    for cls in (rt.RefitSection, RuntimeConfig):
        assert list(typing.get_type_hints(cls)) == [f.name for f in dataclasses.fields(cls)]
    recipe = rt.recipe_from_data(with_defaults({"version": 1, "model": {"id": "x"}, "data": {"train": "/d"},
                                                "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "h100-80gb"}}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.loss.kl_penalty = 1.0  # type: ignore[misc]
    assert copy.deepcopy(recipe) == recipe == pickle.loads(pickle.dumps(recipe))
    assert dataclasses.replace(recipe.loss, kl_penalty=0.5).kl_penalty == 0.5
    with pytest.raises(TypeError, match="missing .*kl_penalty"):
        rt.LossSection(ratio_clip_low=0.2)  # type: ignore[call-arg]
