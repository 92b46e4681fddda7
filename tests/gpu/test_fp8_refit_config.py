"""CPU check of the FP8 refit proof's inputs: the runtime configs it starts its engines with load through the
runtime's strict loader for every case and option, so a change to the refit benchmark's config builder fails here
instead of seconds into a GPU call."""
from __future__ import annotations

import pytest

from rlc.contract.runtime_config import runtime_config_from_dict
from tests.gpu.test_fp8_refit import CASES, runtime_configs


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scales, cuda_graphs", [("block", False), ("tensor", True)])
def test_both_precisions_load_as_runtime_configs(tmp_path, case, scales, cuda_graphs):
    model_dir, cfgs = runtime_configs(case, tmp_path, scales, 0.4 if case == "moe-1gpu" else None, cuda_graphs)
    assert (model_dir / "config.json").is_file()
    bf16, fp8 = (runtime_config_from_dict(cfgs[m]) for m in ("bf16", "fp8"))
    assert bf16.generation.precision == "auto" and fp8.generation.precision == "fp8"
    assert fp8.generation.fp8.scales == scales and not fp8.generation.fp8.pow2_scales
    assert bf16.generation.enforce_eager is fp8.generation.enforce_eager is (not cuda_graphs)
    assert not bf16.refit.fused_transfer and bf16.refit.keep_buffers_gb == bf16.refit.buffer_gb
    if case == "moe-1gpu":
        assert fp8.generation.gpu_memory_utilization == 0.4
    else:
        assert fp8.generation.gpu_memory_utilization == bf16.generation.gpu_memory_utilization
