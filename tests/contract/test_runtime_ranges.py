"""Every number the runtime reads is range-checked where it reads it, with the recipe schema's ranges
(one source) or, for the numbers the compiler derives, the contract's own."""
from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from rlc.contract.ranges import DERIVED, range_of, range_problems
from rlc.contract.runtime_config import RuntimeConfig, RuntimeConfigError, runtime_config_from_dict
from rlc.contract.typed_fields import field_types

REPO = Path(__file__).resolve().parents[2]
GOLDEN = sorted((REPO / "tests" / "bundle" / "golden").glob("*/runtime.yaml"))


def _numeric_fields(cls: type, path: str = "") -> list[str]:
    out = []
    for name, tp in field_types(cls).items():
        key = f"{path}.{name}" if path else name
        args = typing.get_args(tp)
        inner = [a for a in (tp, *args) if dataclasses.is_dataclass(a)]
        if inner:
            out += _numeric_fields(inner[0], key)
        elif typing.get_origin(tp) is list and args and args[0] in (int, float):
            out.append(key + "[]")
        elif {tp, *args} & {int, float}:
            out.append(key)
    return out


def test_every_number_the_runtime_reads_has_a_range():
    fields = _numeric_fields(RuntimeConfig)
    assert len(fields) > 60
    assert [f for f in fields if range_of(f) is None] == [], "give it a schema range or a DERIVED one"
    assert not set(DERIVED) - set(fields), "DERIVED names no runtime.yaml number"


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.parent.name)
def test_compiled_configs_are_in_range(path):
    assert range_problems(yaml.safe_load(path.read_text())) == []


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            yield from _leaves(value, path)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield path


@pytest.mark.parametrize("bad", [-10**12, 10**30, float("nan"), float("inf")])
def test_any_number_far_outside_its_range_is_refused_naming_the_key(bad):
    data = yaml.safe_load((REPO / "tests" / "bundle" / "golden" / "tiny-moe-mtp-4gpu" / "runtime.yaml").read_text())
    leaves = [k for k in _leaves(data) if k != "version"]
    assert len(leaves) > 50
    for key in leaves:
        changed = copy.deepcopy(data)
        node = changed
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = bad if isinstance(node[leaf], float) or not isinstance(bad, int) else int(bad)
        with pytest.raises(RuntimeConfigError) as err:
            runtime_config_from_dict(changed)
        assert key in str(err.value), (key, str(err.value))


def test_free_form_mappings_are_not_range_checked():
    data = yaml.safe_load((REPO / "tests" / "bundle" / "golden" / "tiny-qwen3-1gpu" / "runtime.yaml").read_text())
    data["env"] = {"NCCL_TIMEOUT": -1}
    data["extensions"] = {"anything": {"n": 10**40}}
    data["generation"]["vllm_kwargs"] = {"max_num_seqs": -3}
    assert range_problems(data) == []
    assert isinstance(runtime_config_from_dict(data), RuntimeConfig)
