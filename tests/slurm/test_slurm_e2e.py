"""Real jobs: a 2-node bundle runs under SLURM with a real Ray cluster (host Python, no container).

- probe job: Ray head and worker start on the two fake nodes, the driver runs
  ``python -m rlc.runtime --probe`` (nodes, GPUs, one task per node importing the bundle's rlc),
  the job ends COMPLETED 0, logs are where README.txt says, nothing is left running;
  while it runs, clients without the job's token are refused by its Ray cluster;
- a failing driver ends the job FAILED with the driver's exit code.
"""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from slurm_jobs import JOB_ENV, compile_e2e, leftovers, reseal, wait_for_text

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# A Ray client: prints whether it got into the cluster at argv[1] and what it saw there.
CLIENT = """
import json, sys
import ray
try:
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    print(json.dumps({"connected": True, "nodes": len(nodes), "gpus": ray.cluster_resources().get("GPU")}))
except Exception as exc:
    print(json.dumps({"connected": False, "error": type(exc).__name__ + ": " + str(exc)[:200]}))
"""


def readme_log_paths(bundle: Path, job_id: str) -> list[Path]:
    """The concrete log files README.txt promises for this job."""
    paths = []
    for line in (bundle / "README.txt").read_text().splitlines():
        m = re.match(r"\s+(/\S+)", line)
        if m and "<jobid>" in m.group(1) or (m and m.group(1).endswith(".out")):
            path = m.group(1).replace("<jobid>", job_id)
            if "<node>" in path:
                nodes = ["node2"] if "worker" in path else ["node1", "node2"]
                paths += [Path(path.replace("<node>", n)) for n in nodes]
            else:
                paths.append(Path(path))
    return paths


def test_probe_job_end_to_end_with_token_auth(slurm, ray_python, tmp_path):
    slurm.shape(nodes=2, gpus=2, cpus=4)
    bundle = compile_e2e(tmp_path, ray_python)
    job_id = slurm.sbatch(bundle / "launch.sbatch",
                          env={**JOB_ENV, "RLC_DRIVER_MODE": "probe", "RLC_PROBE_HOLD_S": "150"})
    job_dir = tmp_path / "logs" / job_id
    wait_for_text(job_dir / "driver.log", "probe: holding the cluster", slurm, job_id)

    # The job's secret: fresh, 0600 in a 0700 folder, inside the job's own 0700 folder.
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700 and job_dir.stat().st_uid == os.getuid()
    token_file = job_dir / "ray-auth" / "token"
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert re.fullmatch(r"[0-9a-f]{64}\n", token_file.read_text())
    wrong = tmp_path / "wrong-token"
    wrong.write_text(os.urandom(32).hex() + "\n")
    address = "127.0.0.1:23379"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLC_", "SLURM_"))}
    base["HOME"] = str(tmp_path)  # no ~/.ray token from elsewhere
    clients = {
        "job token": {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)},
        "wrong token": {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)},
        "no token": base,
    }
    procs = {name: subprocess.Popen([ray_python, "-c", CLIENT, address], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
             for name, env in clients.items()}
    said = {name: json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for name, p in procs.items()}
    (job_dir / "probe.release").touch()

    assert said["job token"] == {"connected": True, "nodes": 2, "gpus": 4.0}
    assert said["wrong token"]["connected"] is False and said["wrong token"]["error"].startswith("ConnectionError")
    assert said["no token"]["connected"] is False

    end = slurm.wait(job_id, timeout=120)
    assert (end.state, end.exit_code) == ("COMPLETED", "0:0"), (job_dir.parent / f"slurm-{job_id}.out").read_text()

    driver = (job_dir / "driver.log").read_text()
    assert "[rlc] probe OK: 2/2 nodes, 4/4 GPUs" in driver
    for node in ("node1", "node2"):  # one task per node, each importing the bundle's own rlc
        assert re.search(rf"^  {node} .* {re.escape(str(bundle))}/rlc_pkg/rlc/__init__\.py$", driver, re.M), driver
    batch_log = (tmp_path / "logs" / f"slurm-{job_id}.out").read_text()
    assert "waiting for 2 node(s) and 4 GPU(s)" in batch_log and "Ray cluster ready" in batch_log
    for path in readme_log_paths(bundle, job_id):
        assert path.exists(), f"README.txt promises {path}"
    assert (job_dir / "ray-logs" / "node2" / "raylet.out").exists()
    assert not token_file.parent.exists()  # the secret is removed at teardown
    assert leftovers(job_id) == []


def test_failing_driver_fails_the_job_with_its_exit_code(slurm, ray_python, tmp_path):
    slurm.shape(nodes=2, gpus=2, cpus=4)
    bundle = compile_e2e(tmp_path, ray_python)
    # The job runs the bundle's own rlc: make its driver fail the way a real one would.
    (bundle / "rlc_pkg" / "rlc" / "runtime" / "__main__.py").write_text(
        "import sys\nprint('driver: failing on purpose', flush=True)\nsys.exit(7)\n")
    reseal(bundle)
    job_id = slurm.sbatch(bundle / "launch.sbatch", env=JOB_ENV)
    end = slurm.wait(job_id, timeout=180)
    batch_log = (tmp_path / "logs" / f"slurm-{job_id}.out").read_text()
    assert (end.state, end.exit_code) == ("FAILED", "7:0"), batch_log
    assert "driver: failing on purpose" in (tmp_path / "logs" / job_id / "driver.log").read_text()
    assert "driver failed with exit code 7" in batch_log and "Ray cluster ready" in batch_log
    assert leftovers(job_id) == []


def test_a_ray_port_held_on_the_host_fails_the_job_naming_the_port(slurm, ray_python, tmp_path):
    """The flaky-start cause, made deterministic: a connection holding the second node's fixed Ray
    port (two SLURM nodes share this host, so node2 listens on the recipe's ports + 8) made its
    raylet abort at start. Now node.sh checks the ports first and the job says which one."""
    import socket

    slurm.shape(nodes=2, gpus=2, cpus=4)
    bundle = compile_e2e(tmp_path, ray_python)
    held_port = 23400 + 8  # node2's node manager port
    server = socket.create_server(("127.0.0.1", 0))
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", held_port))  # an outgoing connection's source port, as the kernel picks them
    except OSError:
        pytest.skip(f"port {held_port} is already taken on this host")
    holder.connect(server.getsockname())
    try:
        job_id = slurm.sbatch(bundle / "launch.sbatch", env=JOB_ENV)
        end = slurm.wait(job_id, timeout=120)
    finally:
        holder.close()
        server.close()
    log = (tmp_path / "logs" / f"slurm-{job_id}.out").read_text()
    worker_log = (tmp_path / "logs" / job_id / "ray-worker-node2.log").read_text()
    assert end.state == "FAILED", log
    assert f"port(s) {held_port} already in use on this host, so Ray cannot start here" in worker_log, worker_log
    assert "a Ray worker step exited" in log and "Ray cluster ready" not in log
    assert leftovers(job_id) == []


def _other_user() -> str:
    """An unprivileged second user on this host (made once, like the hostile tester had)."""
    name = "rlc-intruder"
    if subprocess.run(["id", "-u", name], capture_output=True, check=False).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
    return name


def test_a_job_folder_another_user_made_first_fails_the_job_before_ray_starts(slurm, ray_python, tmp_path):
    """A shared log folder lets anyone make <log_dir>/<jobid>/ before the job starts and plant a
    Ray token in it. The job makes its private folder itself and refuses one it did not make."""
    import shutil
    import tempfile

    slurm.shape(nodes=2, gpus=2, cpus=4)
    intruder = _other_user()
    shared = Path(tempfile.mkdtemp(prefix="rlc-shared-logs-", dir="/tmp"))
    try:
        shared.chmod(0o777)  # a team's shared log folder, no sticky bit
        bundle = compile_e2e(tmp_path, ray_python, f"cluster.log_dir={shared}")
        job_id = slurm.sbatch(bundle / "launch.sbatch", "--hold", env=JOB_ENV)
        planted = "0" * 64 + "\n"
        subprocess.run(
            [
                "runuser",
                "-u",
                intruder,
                "--",
                "bash",
                "-c",
                f'umask 000; mkdir "$1/{job_id}" "$1/{job_id}/ray-auth" && '
                f'printf "%s" "$2" >"$1/{job_id}/ray-auth/token"',
                "bash",
                str(shared),
                planted,
            ],
            check=True,
            capture_output=True,
        )
        slurm.run("scontrol", "release", job_id)
        end = slurm.wait(job_id, timeout=120)
        log = (shared / f"slurm-{job_id}.out").read_text()
        assert end.state == "FAILED", log
        assert f"the job folder {shared}/{job_id} already exists and belongs to user {intruder}" in log, log
        assert "starting the Ray head" not in log
        assert (shared / job_id / "ray-auth" / "token").read_text() == planted  # never used, never written
        assert leftovers(job_id) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_bundle_recompiled_while_the_job_waits_fails_the_job_at_once(slurm, ray_python, tmp_path):
    """SLURM keeps its own copy of launch.sbatch: after `rlc compile --force` of the queued job's
    bundle, the job would pair the old script with the new runtime.yaml. It refuses instead."""
    from rlc.compiler.api import check
    from rlc.compiler.bundle import build_bundle
    from slurm_jobs import RECIPE

    slurm.shape(nodes=2, gpus=2, cpus=4)
    bundle = compile_e2e(tmp_path, ray_python)
    job_id = slurm.sbatch(bundle / "launch.sbatch", "--hold", env=JOB_ENV)
    result = check(RECIPE, [f"cluster.log_dir={tmp_path}/logs", f"cluster.container.python={ray_python}",
                            "grpo.max_steps=5"])
    build_bundle(result, bundle, force=True)
    slurm.run("scontrol", "release", job_id)
    end = slurm.wait(job_id, timeout=120)
    log = (tmp_path / "logs" / f"slurm-{job_id}.out").read_text()
    assert end.state == "FAILED", log
    assert f"the bundle {bundle} is not the one this job was submitted with" in log
    assert not (tmp_path / "logs" / job_id).exists() and "starting the Ray head" not in log


def test_a_file_added_to_the_bundle_after_submitting_fails_the_job_before_it_runs(slurm, ray_python, tmp_path):
    """A sitecustomize.py dropped into the bundle's rlc_pkg/ would run in every Python of the job; the
    job's own check lists the bundle's tree and refuses it before any step starts (it used to pass:
    the check hashed only the files it knew)."""
    slurm.shape(nodes=2, gpus=2, cpus=4)
    bundle = compile_e2e(tmp_path, ray_python)
    job_id = slurm.sbatch(bundle / "launch.sbatch", "--hold", env=JOB_ENV)
    marker = tmp_path / "sitecustomize-ran"
    (bundle / "rlc_pkg" / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    slurm.run("scontrol", "release", job_id)
    end = slurm.wait(job_id, timeout=120)
    log = (tmp_path / "logs" / f"slurm-{job_id}.out").read_text()
    assert end.state == "FAILED", log
    assert f"the bundle {bundle} is not the one this job was submitted with" in log
    assert not marker.exists() and "starting the Ray head" not in log
