"""``python -m rlc.runtime runtime.yaml KEY=VALUE``: dotted overrides of a compiled bundle's config."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api, resolve
from rlc.contract.runtime_config import RuntimeConfigError, runtime_config_to_dict
from rlc.runtime.overrides import load_with_overrides

pytest.importorskip("omegaconf")
RECIPE = Path(__file__).resolve().parents[2] / "rlc" / "recipes" / "tiny-moe-mtp-2gpu-pp2.yaml"


@pytest.fixture(scope="module")
def runtime_yaml(tmp_path_factory) -> Path:
    import yaml

    result = api.check(RECIPE)
    assert result.ok, [d.message for d in result.errors]
    path = tmp_path_factory.mktemp("b") / "runtime.yaml"
    cfg = resolve.to_runtime_config(result)
    path.write_text(yaml.safe_dump(cfg if isinstance(cfg, dict) else runtime_config_to_dict(cfg)), encoding="utf-8")
    return path


def test_no_override_is_the_compiled_config(runtime_yaml):
    cfg, changes = load_with_overrides(runtime_yaml, [])
    assert changes == [] and cfg.refit.dedupe_mtp_embedding is True and cfg.train_parallel.pp == 2


def test_switch_off_list_emptied_and_steps_changed(runtime_yaml):
    cfg, changes = load_with_overrides(runtime_yaml, ["refit.dedupe_mtp_embedding=false", "refit.fp32_params=[]",
                                                      "grpo.max_steps=1", "refit.verify_every=1"])
    assert cfg.refit.dedupe_mtp_embedding is False and cfg.refit.fp32_params == []
    assert cfg.grpo.max_steps == 1 and cfg.refit.verify_every == 1
    assert "refit.dedupe_mtp_embedding: True -> False" in changes
    assert any(c.startswith("refit.fp32_params: ['*e_score_correction_bias*'") and c.endswith("-> []") for c in changes)


@pytest.mark.parametrize("bad, says", [
    (["refit.dedupe_mtp_embeding=false"], "dedupe_mtp_embeding"),  # unknown key, named with its path
    (["grpo.max_steps=ten"], "max_steps"),                        # wrong type
    (["grpo.max_steps"], "KEY=VALUE"),                            # not an assignment
])
def test_bad_overrides_fail_with_the_key(runtime_yaml, bad, says):
    with pytest.raises(RuntimeConfigError, match=says):
        load_with_overrides(runtime_yaml, bad)
