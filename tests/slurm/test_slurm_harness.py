"""The harness itself: nodes and fake GPUs as asked, impossible requests refused at submit."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slurm


def _script(tmp_path, *header):
    path = tmp_path / "job.sbatch"
    path.write_text("#!/bin/bash\n" + "".join(f"#SBATCH {h}\n" for h in header) + "true\n")
    return path


def test_shape_and_fake_gpus(slurm, tmp_path):
    slurm.shape(nodes=3, gpus=4, gpu_type="h100")
    nodes = slurm.run("sinfo", "-h", "-N", "-o", "%N %t %G").stdout.split("\n")
    assert sorted(n for n in nodes if n) == [f"node{i} idle gpu:h100:4" for i in (1, 2, 3)]
    out = tmp_path / "out.txt"
    script = _script(tmp_path, "--nodes=3", "--gpus-per-node=h100:4", f"--output={out}")
    script.write_text(script.read_text().replace(
        "true\n", 'srun --ntasks-per-node=1 bash -c \'echo "$SLURMD_NODENAME $CUDA_VISIBLE_DEVICES"\'\n'))
    end = slurm.wait(slurm.sbatch(script), timeout=60)
    assert (end.state, end.exit_code) == ("COMPLETED", "0:0")
    assert sorted(out.read_text().split("\n")[:-1]) == [f"node{i} 0,1,2,3" for i in (1, 2, 3)]


@pytest.mark.parametrize("header,error", [
    (("--nodes=4", "--gpus-per-node=h100:4"), "Node count specification invalid"),
    (("--nodes=1", "--gpus-per-node=h100:5"), "Requested node configuration is not available"),
    (("--nodes=1", "--gpus-per-node=a100:1"), "Requested node configuration is not available"),
])
def test_impossible_requests_fail_at_submit(slurm, tmp_path, header, error):
    slurm.shape(nodes=3, gpus=4, gpu_type="h100")
    proc = slurm.run("sbatch", "--test-only", str(_script(tmp_path, *header)), check=False)
    assert proc.returncode != 0 and error in proc.stderr
