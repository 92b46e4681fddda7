"""The checkpoint fingerprint: every runtime.yaml key is classified (part of the experiment, or free
to change between restarts), each experiment key changes the fingerprint, no restart key does, and a
checkpoint written under another tokenizer, context length, fp8 setting, MTP depth or extensions
block is refused."""
from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import pytest

from rlc.contract.runtime_config import CheckpointConfig, RuntimeConfig, runtime_config_to_dict
from rlc.contract.typed_fields import field_types
from rlc.runtime import checkpoint as C

RECIPES = Path(__file__).resolve().parents[2] / "rlc" / "recipes"


def _leaves(cls: type, path: str = "") -> list[str]:
    """Dotted paths of every leaf of the runtime config classes (nested sections opened)."""
    out = []
    for name, tp in field_types(cls).items():
        key = f"{path}.{name}" if path else name
        inner = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        out += _leaves(inner[0], key) if inner else [key]
    return out


def _covers(prefix: str, key: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def test_every_runtime_key_is_either_part_of_the_experiment_or_free_to_change_between_restarts():
    leaves = _leaves(RuntimeConfig)
    classes = [*C.EXPERIMENT_KEYS, *C.RESTART_KEYS]
    unclassified = [k for k in leaves if not any(_covers(p, k) for p in classes)]
    assert unclassified == [], f"declare a policy (runtime=) for: {unclassified}"
    both = [k for k in leaves if any(_covers(p, k) for p in C.EXPERIMENT_KEYS)
            and any(_covers(p, k) for p in C.RESTART_KEYS)]
    assert both == []
    stale = [p for p in classes if not any(_covers(p, k) for k in leaves)]
    assert stale == [], f"entries that name no runtime.yaml key: {stale}"


def _config(recipe: str, *sets: str) -> dict:
    from rlc.compiler.api import check
    from rlc.compiler.resolve import to_runtime_config
    from rlc.contract.runtime_config import runtime_config_from_dict

    result = check(RECIPES / recipe, list(sets))
    assert result.ok, result.errors
    return runtime_config_to_dict(runtime_config_from_dict(to_runtime_config(result)))


def _changed(value):
    """Another value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, value[0] if value else 7]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return "set"  # None


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value and not any(path == p for p in ("env", "extensions")) \
                and not path.endswith(("_kwargs", ".kwargs", ".decisions")):
            out.update(_flat(value, path))
        else:
            out[path] = value
    return out


@pytest.mark.parametrize("recipe", ["tiny-qwen3-1gpu.yaml", "tiny-moe-mtp-2gpu-pp2.yaml"])
def test_each_experiment_key_changes_the_fingerprint_and_no_restart_key_does(recipe):
    base = _config(recipe)
    before = C.experiment(base)["sha256"]
    wrong = []
    for key, value in _flat(base).items():
        data = copy.deepcopy(base)
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = _changed(value)
        moved = C.experiment(data)["sha256"] != before
        if moved != any(_covers(p, key) for p in C.EXPERIMENT_KEYS):
            wrong.append(f"{key}: fingerprint {'changed' if moved else 'unchanged'}")
    assert wrong == []


@pytest.mark.parametrize("recipe, change, shown", [
    ("tiny-qwen3-1gpu.yaml", "model.tokenizer=/data/other-tokenizer", "model.tokenizer"),
    ("tiny-qwen3-1gpu.yaml", "generation.max_model_len=128", "generation.max_model_len: 64 -> 128"),
    ("tiny-qwen3-1gpu.yaml", "training.fp8.enabled=true", "training.fp8.enabled: False -> True"),
    ("tiny-moe-mtp-2gpu-pp2.yaml", "model.overrides.num_nextn_predict_layers=0", "model.mtp_num_layers: 1 -> 0"),
    ("tiny-qwen3-1gpu.yaml", "extensions.reward_model=rm-v2", "extensions.reward_model"),
])
def test_a_checkpoint_written_under_other_settings_that_change_the_experiment_is_refused(tmp_path, recipe, change,
                                                                                         shown):
    first, second = _config(recipe), _config(recipe, change)
    C.save(tmp_path, 4, {"step": 4, C.EXPERIMENT_STATE_KEY: C.experiment(first)})
    cfg = CheckpointConfig(enabled=True, dir=str(tmp_path), every_steps=5, keep_last=2, resume=True,
                           resume_changed_recipe=False)
    with pytest.raises(C.CheckpointError, match="different experiment") as err:
        C.resume_from_latest(cfg, current=C.experiment(second))
    assert shown in str(err.value)


def test_a_checkpoint_from_before_a_key_existed_resumes_while_the_key_keeps_its_default(tmp_path):
    """A key joins rlc with the default that keeps what rlc did before; a checkpoint an older rlc wrote (no
    such key recorded) resumes at that default, and is another experiment's once the key is set."""
    current = C.experiment(_config("tiny-qwen3-1gpu.yaml"))
    older = {"sha256": "written-before-min_p", "values": {k: v for k, v in current["values"].items()
                                                          if k != "generation.sampling.min_p"}}
    assert C.experiment_changes(older, current) == []
    changed = C.experiment(_config("tiny-qwen3-1gpu.yaml", "generation.sampling.min_p=0.05"))
    assert C.experiment_changes(older, changed) == ["generation.sampling.min_p: '(not recorded)' -> 0.05"]
    different = {**older, "values": {**older["values"], "loss.kl_penalty": 0.5}}
    assert C.experiment_changes(different, current) == ["loss.kl_penalty: 0.5 -> 0.0"]


@pytest.mark.parametrize("change", ["grpo.max_steps=40", "checkpointing.every_steps=3", "logging.tensorboard=false",
                                    "refit.verify_every=5", "training.micro_batch_size=1"])
def test_a_restart_that_changes_what_may_change_resumes(tmp_path, change):
    """The usual restarts (run longer, save more often, other memory or refit settings) continue the run."""
    first, second = _config("tiny-qwen3-1gpu.yaml"), _config("tiny-qwen3-1gpu.yaml", change)
    assert first != second
    assert C.experiment_changes(C.experiment(first), C.experiment(second)) == []
