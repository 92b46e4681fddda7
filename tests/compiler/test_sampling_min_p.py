"""``generation.sampling.min_p``: one declaration, and the code that uses it (vLLM's sampling parameters, the
logprobs vLLM reports, the Megatron engine's refusal at compile and at run time)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from rlc.compiler import api, resolve
from rlc.compiler.bundle.build import runtime_yaml
from rlc.contract.runtime_config import RuntimeConfigError, load_runtime_config, runtime_config_from_dict
from rlc.runtime.generation.megatron_sampling import MegatronSamplingError, sampling_params_kwargs
from rlc.runtime.generation.sampling import logprobs_mode, sampling_kwargs

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "rlc" / "recipes" / "tiny-qwen3-1gpu.yaml"


def _runtime(tmp_path, *sets):
    result = api.check(TINY, list(sets))
    assert result.ok, [d.message for d in result.errors]
    target = tmp_path / "runtime.yaml"
    target.write_text(runtime_yaml(resolve.to_runtime_config(result)))
    return load_runtime_config(target)


def test_min_p_reaches_vllm_and_its_logprobs_describe_the_truncated_distribution(tmp_path):
    off = _runtime(tmp_path).generation.sampling
    assert off.min_p == 0.0 and "min_p" not in sampling_kwargs(off, 4)  # unchanged engine call by default
    assert logprobs_mode(off) == "raw_logprobs"
    on = _runtime(tmp_path, "generation.sampling.min_p=0.05").generation.sampling
    assert sampling_kwargs(on, 4)["min_p"] == 0.05
    assert logprobs_mode(on) == "processed_logprobs"


def test_min_p_out_of_range_is_refused_in_the_recipe_and_in_runtime_yaml(tmp_path):
    bad = api.check(TINY, ["generation.sampling.min_p=1.5"])
    assert [(d.path, d.message) for d in bad.errors] == [
        ("generation.sampling.min_p", "1.5 is out of range: allowed 0 to 1")]
    data = resolve.to_runtime_config(api.check(TINY))
    edited = copy.deepcopy(data)
    edited["generation"]["sampling"]["min_p"] = -0.1
    with pytest.raises(RuntimeConfigError, match=r"generation\.sampling\.min_p: -0\.1 is out of range"):
        runtime_config_from_dict(edited)
    stale = copy.deepcopy(data)
    del stale["generation"]["sampling"]["min_p"]  # a runtime.yaml from before the key: recompile
    with pytest.raises(RuntimeConfigError, match=r"generation\.sampling\.min_p: missing"):
        runtime_config_from_dict(stale)


def test_the_megatron_engine_refuses_min_p_at_compile_and_at_run_time(tmp_path):
    recipe = ROOT / "rlc" / "recipes" / "tiny-qwen3-1gpu-megatron.yaml"
    assert api.check(recipe).ok
    from rlc.compiler.runtime_support import runtime_gaps

    result = api.check(recipe, ["generation.sampling.min_p=0.1"])
    gaps = runtime_gaps(result.recipe)
    assert [g.key for g in gaps] == ["generation.sampling.min_p"] and gaps[0].fix == "generation.sampling.min_p: 0.0"
    on = _runtime(tmp_path, "generation.sampling.min_p=0.1").generation.sampling
    with pytest.raises(MegatronSamplingError, match="generation.sampling.min_p 0.1"):
        sampling_params_kwargs(on, 2)
