"""Hostile recipe values, really run under SLURM: none of them executes (marker files), each arrives
intact where it is used, or the compiler rejects it with a message naming the key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_jobs import JOB_ENV, RECIPE, compile_e2e, leftovers, reseal

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def hostile(markers: Path) -> str:
    """One string with every way out of a quote: each would create a marker file if run."""
    m = [markers / f"m{i}" for i in range(7)]
    return (f"x\"y'z $(touch {m[0]}) `touch {m[1]}`; touch {m[2]} '; touch {m[3]}; ' "
            f"\"$(touch {m[4]})\" && touch {m[5]} | touch {m[6]} # end")


def assert_no_markers(markers: Path) -> None:
    assert sorted(p.name for p in markers.iterdir()) == [], "a hostile value was executed"


def test_hostile_job_name_and_env_values_run_inert(slurm, ray_python, tmp_path):
    slurm.shape(nodes=2, gpus=2, cpus=4)
    markers = tmp_path / "markers"
    markers.mkdir()
    evil = hostile(markers)
    multiline = f"line1\n$(touch {markers}/n1)\n`touch {markers}/n2`\nline4"
    env = json.dumps({"EVIL": evil, "MULTI": multiline, "SPACES": "  a  b  "})
    job_name = "inj " + evil.replace(str(markers), "/M")[:110]
    bundle = compile_e2e(tmp_path, ray_python, f"cluster.env={env}",
                         f"cluster.slurm.job_name={json.dumps(job_name)}")
    # The driver reports the environment it got (the job runs the bundle's own rlc).
    (bundle / "rlc_pkg" / "rlc" / "runtime" / "__main__.py").write_text(
        "import json, os\n"
        "keys = ['EVIL', 'MULTI', 'SPACES']\n"
        "with open(os.path.join(os.environ['RLC_JOB_DIR'], 'env.json'), 'w') as f:\n"
        "    json.dump({k: os.environ.get(k) for k in keys}, f)\n")
    reseal(bundle)
    job_id = slurm.sbatch(bundle / "launch.sbatch", env=JOB_ENV)
    assert slurm.job_name(job_id) == job_name  # sbatch read the quoted #SBATCH line as one value
    end = slurm.wait(job_id, timeout=180)
    log = (tmp_path / "logs" / f"slurm-{job_id}.out").read_text()
    assert (end.state, end.exit_code) == ("COMPLETED", "0:0"), log
    got = json.loads((tmp_path / "logs" / job_id / "env.json").read_text())
    assert got == {"EVIL": evil, "MULTI": multiline, "SPACES": "  a  b  "}
    assert_no_markers(markers)
    assert leftovers(job_id) == []


def test_hostile_container_image_reaches_srun_as_one_argument(slurm, ray_python, tmp_path):
    """Pyxis is absent here, so srun rejects --container-image: its message shows the exact value it
    received, and the job fails with srun's error instead of running anything."""
    slurm.shape(nodes=2, gpus=2, cpus=4)
    markers = tmp_path / "markers"
    markers.mkdir()
    image = hostile(markers).replace("#", "")
    bundle = compile_e2e(tmp_path, ray_python, "cluster.container.runtime=pyxis",
                         f"cluster.container.image={json.dumps(image)}",
                         f'cluster.container.mounts=["{tmp_path}/data:{tmp_path}/data:ro", '
                         f'"{tmp_path}/model:{tmp_path}/model:ro"]')
    job_id = slurm.sbatch(bundle / "launch.sbatch", env=JOB_ENV)
    end = slurm.wait(job_id, timeout=120)
    log = (tmp_path / "logs" / f"slurm-{job_id}.out").read_text()
    assert end.state == "FAILED" and end.exit_code != "0:0", log
    assert f"unrecognized option '--container-image={image}'" in log
    assert "the Ray cluster did not come up" in log
    assert_no_markers(markers)


@pytest.mark.parametrize("override,message", [
    ('cluster.container.mounts=["/data/$(touch /tmp/x):/data"]',
     "cluster.container.mounts[0]: source mount path '/data/$(touch /tmp/x)' contains the character '$'"),
    ('cluster.container.mounts=["/data:/d;rm -rf ~"]',
     "cluster.container.mounts[0]: destination mount path '/d;rm -rf ~' contains the character ';'"),
    ('cluster.container.mounts=["/a b:/data"]', "cluster.container.mounts[0]: source mount path '/a b' contains"),
    ('cluster.container.mounts=["/data:/x,/etc:/y"]',
     "cluster.container.mounts[0]: '/data:/x,/etc:/y' contains ','; write one mount per list entry"),
    ('cluster.slurm.job_name="ok\\n#SBATCH --uid=0"', "cluster.slurm.job_name: contains a newline"),
    ('cluster.container.image="img\\nid"', "cluster.container.image: contains a line break"),
    ('cluster.env={"X": "a\\u0000b"}', "cluster.env.X: the value contains a NUL byte"),
])
def test_unrepresentable_values_are_rejected_at_compile_time(tmp_path, override, message):
    """Every command's check (validate, lint, plan, compile) rejects them; nothing is written."""
    from rlc.compiler.api import check

    result = check(RECIPE, [f"cluster.log_dir={tmp_path}/logs", "cluster.container.runtime=pyxis",
                            "cluster.container.image=img", override])
    said = [f"{d.path}: {d.message}" for d in result.errors]
    assert not result.ok and any(line.startswith(message) for line in said), said
