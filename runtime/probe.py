"""Checks of the job's Ray cluster, run inside the job by the bundle's ``node.sh``.

``python -m rlc.runtime --probe runtime.yaml`` (:func:`main`): connect to Ray, assert that
``cluster.nodes`` nodes are alive with ``cluster.gpus_per_node`` GPUs each (``world_size`` in
all), run one task per node that takes all of its GPUs and reports where it ran, which rlc it
imported (it must be the bundle's own copy) and whether the job's paths (:func:`job_paths`: data,
a local checkpoint, the checkpoint and metrics folders) are there, inside its container (a
missing mount shows here, in seconds, instead of at the start of training); print a summary,
return 0 or 1.

``python -m rlc.runtime.probe --wait [--deadline EPOCH] runtime.yaml`` (:func:`wait_for_cluster`):
wait until every node and GPU has joined, printing progress every 30 s; fail with a message that
names the missing nodes once the deadline (default: now + ``cluster.ray.join_timeout_s``) passes.

Ray nodes started by the bundle carry a resource ``rlc_node_<i>`` (``i`` = the node's index in the
allocation, ``RLC_NODES`` lists the names), which is how missing nodes are named and how the probe
places one task on each node. Ray is imported only inside the functions.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlc.contract.job_paths import is_local, kwarg_paths
from rlc.contract.runtime_config import RuntimeConfigError, load_runtime_config
from rlc.runtime.ray_auth import join_address, refused_message, token_refused

NODE_RESOURCE = "rlc_node_{}"
PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class Expected:
    """What the cluster must look like, from runtime.yaml."""

    nodes: int
    gpus_per_node: int
    world_size: int
    address: str
    namespace: str
    join_timeout_s: int


@dataclass(frozen=True)
class NodeView:
    """One alive Ray node."""

    index: int | None  # from its rlc_node_<i> resource (None: not started by the bundle)
    address: str
    gpus: float
    cpus: float


@dataclass(frozen=True)
class JobPath:
    """A path the job opens (from runtime.yaml), by the recipe key that names it."""

    key: str
    path: str
    writes: bool  # the job writes there (a folder it may create); else it reads it
    is_file: bool  # a file, else a folder


def job_paths(runtime_yaml: str | Path) -> list[JobPath]:
    """The paths the job opens, from ``runtime.yaml`` (the compiler checked the same ones against the
    container's mounts: :mod:`rlc.contract.job_paths`); Hub ids and relative paths are left out."""
    cfg = load_runtime_config(runtime_yaml)
    found = [JobPath("data.train", cfg.data.train_path, False, True)]
    if cfg.data.val_path:
        found.append(JobPath("data.val", cfg.data.val_path, False, True))
    for key, ref in (("model.checkpoint", cfg.model.checkpoint), ("model.tokenizer", cfg.model.tokenizer)):
        if is_local(ref) and all(p.path != ref for p in found):
            found.append(JobPath(key, ref, False, False))
    if cfg.checkpointing.enabled:
        found.append(JobPath("checkpointing.dir", cfg.checkpointing.dir, True, False))
    found.append(JobPath("logging.dir", cfg.logging.dir, True, False))
    found += [JobPath(key, path, False, True) for key, path in kwarg_paths(cfg.reward.kwargs)]
    return [p for p in found if os.path.isabs(os.path.expanduser(p.path))]


def path_problems(paths: list[JobPath]) -> list[str]:
    """What is wrong with each path here (this node, inside its container): a file or folder the job
    reads that is missing or unreadable, a folder it writes whose nearest existing folder it cannot
    write. Nothing is created."""
    problems = []
    for jp in paths:
        path = os.path.expanduser(jp.path)
        if not jp.writes:
            kind = "file" if jp.is_file else "folder"
            if not os.path.exists(path):
                problems.append(f"{jp.key}: {path} does not exist here (a missing mount?)")
            elif jp.is_file != os.path.isfile(path) or not os.access(path, os.R_OK | (0 if jp.is_file else os.X_OK)):
                problems.append(f"{jp.key}: {path} is not a readable {kind}")
            continue
        existing = path
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            problems.append(f"{jp.key}: cannot write {path} here ({existing} is not a folder this user can "
                            "write; a missing or read-only mount?)")
    return problems


def expected_from(runtime_yaml: str | Path) -> Expected:
    """Read the expected shape from ``runtime.yaml``."""
    cfg = load_runtime_config(runtime_yaml)
    c = cfg.cluster
    return Expected(c.nodes, c.gpus_per_node, c.world_size, c.ray.address, c.ray.namespace, c.ray.join_timeout_s)


def node_names() -> list[str]:
    """SLURM node names by index (``RLC_NODES``, set by launch.sbatch); empty outside a job."""
    return os.environ.get("RLC_NODES", "").split()


def _name(index: int | None) -> str:
    names = node_names()
    if index is not None and 0 <= index < len(names):
        return names[index]
    return f"node #{index}" if index is not None else "unknown node"


def alive_nodes(ray: Any) -> list[NodeView]:
    """The alive nodes Ray reports."""
    views = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        index = next((int(k.rsplit("_", 1)[1]) for k in res if k.startswith("rlc_node_")
                      and k.rsplit("_", 1)[1].isdigit()), None)
        views.append(NodeView(index, node.get("NodeManagerAddress", "?"), float(res.get("GPU", 0)),
                              float(res.get("CPU", 0))))
    return sorted(views, key=lambda v: (v.index is None, v.index or 0))


def _connect(ray: Any, exp: Expected) -> None:
    ray.init(address=exp.address, namespace=exp.namespace, logging_level=logging.WARNING,
             log_to_driver=False)


def _missing(exp: Expected, nodes: list[NodeView]) -> list[str]:
    present = {n.index for n in nodes}
    return [_name(i) for i in range(exp.nodes) if i not in present]


def wait_for_cluster(exp: Expected, deadline: float, out: Callable[[str], None] = print,
                     interval_s: float = PROGRESS_EVERY_S, poll_s: float = 1.0) -> int:
    """Wait until ``exp.nodes`` nodes and ``exp.world_size`` GPUs are alive; 0 when they are, 1 at
    the deadline. Prints progress every ``interval_s`` seconds."""
    import ray  # noqa: PLC0415

    start = last = time.time()
    connected, error = False, ""
    nodes: list[NodeView] = []
    address = join_address(exp.address)
    while True:
        if not connected:
            refused = token_refused(address)  # a refused token is final: no waiting for the deadline
            if refused:
                out(f"[rlc] ERROR: {refused_message(address or exp.address, refused)}")
                return 1
            try:
                _connect(ray, exp)
                connected = True
            except (ConnectionError, RuntimeError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        if connected:
            nodes = alive_nodes(ray)
            gpus = sum(n.gpus for n in nodes)
            if len(nodes) >= exp.nodes and gpus >= exp.world_size:
                out(f"[rlc] Ray cluster ready after {time.time() - start:.0f}s: {len(nodes)}/{exp.nodes} "
                    f"nodes, {gpus:g}/{exp.world_size} GPUs")
                ray.shutdown()
                return 0
        now = time.time()
        gpus = sum(n.gpus for n in nodes)
        if now >= deadline:
            missing = _missing(exp, nodes)
            where = os.environ.get("RLC_JOB_DIR", "the job's log folder")
            out(f"[rlc] ERROR: the Ray cluster is incomplete after {now - start:.0f}s "
                f"(cluster.ray.join_timeout_s={exp.join_timeout_s}): {len(nodes)}/{exp.nodes} nodes and "
                f"{gpus:g}/{exp.world_size} GPUs joined"
                + (f"; missing: {', '.join(missing)}" if missing else "")
                + ("" if connected else f"; could not reach the Ray head ({error})")
                + f". See the ray-head.log / ray-worker-<node>.log files in {where}; raise "
                "cluster.ray.join_timeout_s if the nodes are only slow to start.")
            if connected:
                ray.shutdown()
            return 1
        if now - last >= interval_s:
            last = now
            state = (f"{len(nodes)}/{exp.nodes} nodes, {gpus:g}/{exp.world_size} GPUs joined" if connected
                     else f"head not reachable yet ({error})")
            out(f"[rlc] waiting for Ray after {now - start:.0f}s: {state} "
                f"(timeout in {deadline - now:.0f}s)")
        time.sleep(poll_s)


def _where_task(ray: Any, index: int, gpus: int, paths: list[JobPath]) -> Any:
    @ray.remote(num_cpus=0)
    def where(paths: list[JobPath]) -> dict[str, Any]:
        import socket  # noqa: PLC0415

        import rlc  # noqa: PLC0415
        from rlc.runtime.probe import path_problems  # noqa: PLC0415

        return {"slurm_node": os.environ.get("SLURMD_NODENAME", "?"), "host": socket.gethostname(),
                "rlc": rlc.__file__, "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "python": sys.executable, "path_problems": path_problems(paths)}

    return where.options(num_gpus=gpus, resources={NODE_RESOURCE.format(index): 0.01}).remote(paths)


def _hold() -> None:
    """Keep the cluster up ``RLC_PROBE_HOLD_S`` seconds, or until ``$RLC_JOB_DIR/probe.release``."""
    hold = os.environ.get("RLC_PROBE_HOLD_S", "")
    if not hold.isdigit() or int(hold) == 0:
        return
    release = Path(os.environ.get("RLC_JOB_DIR", ".")) / "probe.release"
    print(f"[rlc] probe: holding the cluster up to {hold}s (touch {release} to release)", flush=True)
    end = time.time() + int(hold)
    while time.time() < end and not release.exists():
        time.sleep(0.5)


def probe(exp: Expected, out: Callable[[str], None] = print, paths: list[JobPath] | None = None) -> int:
    """Check the connected cluster against ``exp``, and on every node that the job's ``paths`` are
    there (inside the container); 0 if all is well, 1 if not."""
    import ray  # noqa: PLC0415

    problems: list[str] = []
    nodes = alive_nodes(ray)
    gpus = sum(n.gpus for n in nodes)
    out(f"[rlc] probe: Ray at {os.environ.get('RAY_ADDRESS', exp.address)}, namespace {exp.namespace}")
    if len(nodes) != exp.nodes:
        problems.append(f"{len(nodes)} alive Ray nodes, runtime.yaml expects cluster.nodes={exp.nodes}")
    if gpus != exp.world_size:
        problems.append(f"{gpus:g} GPUs in the cluster, runtime.yaml expects world_size={exp.world_size}")
    for n in nodes:
        if n.gpus != exp.gpus_per_node:
            problems.append(f"{_name(n.index)} offers {n.gpus:g} GPUs, expected {exp.gpus_per_node}")
    bundle = os.environ.get("RLC_BUNDLE_MNT")
    tasks = {n.index: _where_task(ray, n.index, exp.gpus_per_node, list(paths or [])) for n in nodes
             if n.index is not None and n.gpus >= exp.gpus_per_node}
    out(f"  {'node':<12} {'address':<16} {'GPUs':>4} {'CPUs':>4}  task: gpu ids, rlc imported from")
    for n in nodes:
        info = "-"
        if n.index in tasks:
            try:
                r = ray.get(tasks[n.index], timeout=120)
            except Exception as exc:  # noqa: BLE001 - any task failure is a probe failure
                problems.append(f"the task on {_name(n.index)} failed: {type(exc).__name__}: {exc}")
                r = None
            if r is not None:
                info = f"{','.join(r['gpu_ids'])}  {r['rlc']}"
                if len(r["gpu_ids"]) != exp.gpus_per_node:
                    problems.append(f"the task on {_name(n.index)} got {len(r['gpu_ids'])} GPUs")
                if bundle and not r["rlc"].startswith(bundle.rstrip("/") + "/rlc_pkg/"):
                    problems.append(f"Ray workers on {_name(n.index)} import rlc from {r['rlc']}, "
                                    f"not from the bundle ({bundle}/rlc_pkg)")
                problems += [f"on {_name(n.index)}: {p}" for p in r["path_problems"]]
        out(f"  {_name(n.index):<12} {n.address:<16} {n.gpus:>4g} {n.cpus:>4g}  {info}")
    if problems:
        for p in problems:
            out(f"[rlc] probe FAILED: {p}")
        return 1
    checked = f", {len(paths)} job paths on every node" if paths else ""
    out(f"[rlc] probe OK: {len(nodes)}/{exp.nodes} nodes, {gpus:g}/{exp.world_size} GPUs{checked}")
    return 0


def main(runtime_yaml_path: str | Path) -> int:
    """``python -m rlc.runtime --probe runtime.yaml``: connect, check, print; 0 or 1."""
    import ray  # noqa: PLC0415

    exp = expected_from(runtime_yaml_path)
    address = join_address(exp.address)
    refused = token_refused(address)
    if refused:
        print(f"[rlc] probe FAILED: {refused_message(address or exp.address, refused)}", flush=True)
        return 1
    try:
        _connect(ray, exp)
    except (ConnectionError, RuntimeError) as exc:
        print(f"[rlc] probe FAILED: cannot connect to Ray ({exp.address}): {exc}", flush=True)
        return 1
    try:
        rc = probe(exp, lambda s: print(s, flush=True), job_paths(runtime_yaml_path))
        if rc == 0:
            _hold()
        return rc
    finally:
        ray.shutdown()


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlc.runtime.probe")
    parser.add_argument("--wait", action="store_true", help="wait until every node and GPU has joined")
    parser.add_argument("--deadline", type=float, help="give up at this Unix time (default: now + join timeout)")
    parser.add_argument("runtime_yaml")
    args = parser.parse_args(argv)

    try:
        exp = expected_from(args.runtime_yaml)
    except RuntimeConfigError as exc:
        print(f"[rlc] probe: {args.runtime_yaml}: {exc}", flush=True)
        return 1
    except OSError as exc:
        print(f"[rlc] probe: cannot read {args.runtime_yaml}: {exc.strerror or exc}", flush=True)
        return 2
    if not args.wait:
        return main(args.runtime_yaml)
    deadline = args.deadline if args.deadline else time.time() + exp.join_timeout_s
    return wait_for_cluster(exp, deadline, out=lambda s: print(s, flush=True))


if __name__ == "__main__":
    sys.exit(_cli())
