"""rlc.runtime.probe against a real one-node Ray cluster (token auth, like a job's head node):
the join wait reports progress and names the missing node at its deadline; the probe passes when
the cluster matches runtime.yaml and fails, saying why, when it does not."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bundle_helpers import compile_recipe

pytestmark = pytest.mark.slow

PORT = 22479  # away from the SLURM e2e test's Ray ports and below the ports Linux gives outgoing connections


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """One Ray node like a job's head: token auth, resource rlc_node_0, 2 GPUs, 1 CPU."""
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ray is not installed: pip install 'ray[default]==2.60.0'")
        pytest.skip("ray is not installed: pip install 'ray[default]==2.60.0'")
    tmp = tmp_path_factory.mktemp("ray")
    token = tmp / "auth" / "token"
    token.parent.mkdir(mode=0o700)
    token.write_text(os.urandom(32).hex() + "\n")
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLC_"))}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_USAGE_STATS_ENABLED="0",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", HOME=str(tmp))
    temp_dir = f"/tmp/rlc-probe-{os.getpid()}"
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(PORT),
           "--node-ip-address=127.0.0.1", "--node-manager-port=22480", "--object-manager-port=22481",
           "--min-worker-port=22500", "--max-worker-port=22599", "--metrics-export-port=22482",
           "--dashboard-agent-listen-port=22483", "--dashboard-agent-grpc-port=22484",
           "--runtime-env-agent-port=22485", "--include-dashboard=false", "--num-cpus=1", "--num-gpus=2",
           "--object-store-memory=100000000", f"--temp-dir={temp_dir}", '--resources={"rlc_node_0": 1}']
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ready_env = {**env, "RAY_ADDRESS": f"127.0.0.1:{PORT}"}
    one_node = _runtime_yaml(tmp, nodes=1)
    ready = subprocess.run([sys.executable, "-m", "rlc.runtime.probe", "--wait", "--deadline", str(time.time() + 120),
                            str(one_node)], env=ready_env, capture_output=True, text=True, timeout=180, check=False)
    if ready.returncode != 0:
        proc.terminate()
        pytest.fail(f"the test's Ray head did not come up: {ready.stdout}{ready.stderr}")
    yield {**env, "RAY_ADDRESS": f"127.0.0.1:{PORT}", "RLC_NODES": "node1 node2"}
    proc.terminate()
    proc.wait(timeout=60)
    subprocess.run(["rm", "-rf", temp_dir], check=False)


def _runtime_yaml(tmp_path: Path, nodes: int, *extra: str) -> Path:
    recipe = Path(__file__).resolve().parents[1] / "slurm" / "recipes" / "e2e-2node.yaml"
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    out = compile_recipe(recipe, tmp_path / "b", [f"cluster.log_dir={tmp_path}/logs", f"cluster.nodes={nodes}",
                                                  f"data.train={tmp_path}/data/train.jsonl",
                                                  f"model.checkpoint={tmp_path}/data", *extra])
    return out.path / "runtime.yaml"


def _run(code: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_wait_names_the_missing_node_at_the_deadline(ray_head, tmp_path):
    runtime = _runtime_yaml(tmp_path, nodes=2)
    code = ("import sys, time\n"
            "from rlc.runtime.probe import expected_from, wait_for_cluster\n"
            f"exp = expected_from({str(runtime)!r})\n"
            "sys.exit(wait_for_cluster(exp, time.time() + 8, interval_s=2))\n")
    out = _run(code, {**ray_head, "RLC_JOB_DIR": "/logs/7"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[rlc] waiting for Ray after" in out.stdout and "1/2 nodes, 2/4 GPUs joined" in out.stdout
    assert ("ERROR: the Ray cluster is incomplete after" in out.stdout
            and "(cluster.ray.join_timeout_s=120): 1/2 nodes and 2/4 GPUs joined; missing: node2" in out.stdout
            and "ray-worker-<node>.log files in /logs/7" in out.stdout), out.stdout


def test_wait_returns_once_everything_joined(ray_head, tmp_path):
    runtime = _runtime_yaml(tmp_path, nodes=1)
    start = time.time()
    out = _run(f"import sys; from rlc.runtime.probe import _cli; sys.exit(_cli(['--wait', {str(runtime)!r}]))",
               ray_head)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Ray cluster ready after" in out.stdout and "1/1 nodes, 2/2 GPUs" in out.stdout
    assert time.time() - start < 60


def test_probe_passes_on_a_matching_cluster_and_checks_the_bundles_rlc(ray_head, tmp_path):
    runtime = _runtime_yaml(tmp_path, nodes=1)
    bundle = runtime.parent
    env = {**ray_head, "RLC_BUNDLE_MNT": str(bundle), "PYTHONPATH": str(bundle / "rlc_pkg")}
    out = subprocess.run([sys.executable, "-m", "rlc.runtime", "--probe", str(runtime)], env=env,
                         cwd=bundle / "rlc_pkg", capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "probe OK: 1/1 nodes, 2/2 GPUs" in out.stdout
    assert f"{bundle}/rlc_pkg/rlc/__init__.py" in out.stdout


def test_probe_fails_saying_why(ray_head, tmp_path):
    runtime = _runtime_yaml(tmp_path, nodes=2)
    out = _run(f"import sys; from rlc.runtime.probe import main; sys.exit(main({str(runtime)!r}))", ray_head)
    assert out.returncode == 1
    assert "probe FAILED: 1 alive Ray nodes, runtime.yaml expects cluster.nodes=2" in out.stdout
    assert "probe FAILED: 2 GPUs in the cluster, runtime.yaml expects world_size=4" in out.stdout


def _join(env: dict, join_timeout_s: int = 60) -> subprocess.CompletedProcess:
    """``connect()`` to the cluster at RAY_ADDRESS in a fresh process: prints the cluster, or ``FAILED:`` and why."""
    code = ("import types\n"
            "from rlc.runtime.workers import WorkerFailure, connect\n"
            f"cfg = types.SimpleNamespace(address='auto', namespace='rlc', join_timeout_s={join_timeout_s})\n"
            "try:\n    print(connect(cfg, {}))\nexcept WorkerFailure as exc:\n    print('FAILED:', exc)\n")
    return _run(code, env, timeout=join_timeout_s + 30)


def _other_token(ray_head, tmp_path) -> tuple[dict, Path, str]:
    """The head's environment with another token file (a job joining a cluster started with another token)."""
    token = os.urandom(32).hex()
    path = tmp_path / "stale-token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return {**ray_head, "RAY_AUTH_TOKEN_PATH": str(path)}, path, token


def test_join_fails_at_once_on_a_refused_token_naming_the_token_file_and_address(ray_head, tmp_path):
    # connect() used to retry the refusal as "head still starting" for all of join_timeout_s (here 120 s)
    env, path, token = _other_token(ray_head, tmp_path)
    start = time.time()
    out = _join(env, join_timeout_s=120)
    took = time.time() - start
    assert out.returncode == 0 and "FAILED:" in out.stdout, out.stdout + out.stderr
    assert took < 30, f"{took:.0f} s: retried the refused token"
    message = out.stdout
    assert f"the Ray head at 127.0.0.1:{PORT} refused this process's token (InvalidAuthToken" in message, message
    assert f"the token came from the file {path} (RAY_AUTH_TOKEN_PATH), written " in message, message
    assert token not in out.stdout + out.stderr  # never the token itself
    # the job's wait step stops as early, with the same words
    runtime = _runtime_yaml(tmp_path, nodes=1)
    start = time.time()
    out = _run(f"import sys; from rlc.runtime.probe import _cli; sys.exit(_cli(['--wait', {str(runtime)!r}]))", env,
               timeout=150)
    assert out.returncode == 1 and time.time() - start < 30, out.stdout + out.stderr
    assert "refused this process's token (InvalidAuthToken" in out.stdout and str(path) in out.stdout, out.stdout
    assert token not in out.stdout + out.stderr


def test_join_with_the_clusters_token_still_connects(ray_head):
    out = _join(ray_head)
    assert out.returncode == 0 and "2 GPUs, 1 CPUs, 1 nodes" in out.stdout, out.stdout + out.stderr


def test_join_by_address_with_the_token_only_in_rays_default_file_says_to_set_the_auth_mode(ray_head, tmp_path):
    # Ray 2.60 turns token auth on by itself for a head started where ~/.ray/auth_token exists (any earlier
    # local ray.init leaves that file), but a process joining it by address (RAY_ADDRESS included) sends the
    # token only with RAY_AUTH_MODE=token. The refusal names that setting; with it set, the join works.
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(Path(ray_head["RAY_AUTH_TOKEN_PATH"]).read_text())
    env = {k: v for k, v in ray_head.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    env["HOME"] = str(home)
    start = time.time()
    out = _join(env)
    assert "FAILED:" in out.stdout and time.time() - start < 30, out.stdout + out.stderr
    assert f"A Ray head started where {home}/.ray/auth_token exists turns token auth on" in out.stdout, out.stdout
    assert "set RAY_AUTH_MODE=token here" in out.stdout, out.stdout
    out = _join({**env, "RAY_AUTH_MODE": "token"})
    assert out.returncode == 0 and "2 GPUs, 1 CPUs, 1 nodes" in out.stdout, out.stdout + out.stderr


def test_probe_names_each_job_path_missing_on_a_node(ray_head, tmp_path):
    # what a missing mount looks like inside a container: the path is not there on the node
    runtime = _runtime_yaml(tmp_path, 1, f"data.val={tmp_path}/gone/val.jsonl", f"model.tokenizer={tmp_path}/gone/tok",
                            'reward.kwargs={"table": "/nonexistent/table.json"}')
    bundle = runtime.parent
    env = {**ray_head, "RLC_BUNDLE_MNT": str(bundle), "PYTHONPATH": str(bundle / "rlc_pkg")}
    out = subprocess.run([sys.executable, "-m", "rlc.runtime", "--probe", str(runtime)], env=env,
                         cwd=bundle / "rlc_pkg", capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    failed = [line for line in out.stdout.splitlines() if line.startswith("[rlc] probe FAILED: on node1: ")]
    assert [line.split(": ", 2)[2] for line in failed] == [
        f"data.val: {tmp_path}/gone/val.jsonl does not exist here (a missing mount?)",
        f"model.tokenizer: {tmp_path}/gone/tok does not exist here (a missing mount?)",
        "reward.kwargs.table: /nonexistent/table.json does not exist here (a missing mount?)"], out.stdout
