"""Recipe + runtime config -> the values the bundle templates print, every one already quoted.

The templates receive only :class:`rlc.compiler.shell.Quoted` strings and ints (the renderer
refuses anything else), so all quoting decisions live here and in ``rlc.compiler.shell``.
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlc.compiler.bundle.env import check_env, env_lines
from rlc.compiler.bundle.errors import BundleError, Problems
from rlc.compiler.bundle.mounts import BUNDLE_MOUNT, Mount, check_mounts
from rlc.compiler.recipe_types import ClusterSection, RaySection
from rlc.compiler.shell import Quoted, UnsafeValue, quote

#: ``#SBATCH`` options the bundle sets from dedicated recipe keys; extra_flags may not repeat them.
MANAGED_FLAGS = {
    "job-name": "cluster.slurm.job_name", "nodes": "cluster.nodes", "ntasks": "cluster.nodes",
    "ntasks-per-node": "(always 1: one Ray node per SLURM node)", "gpus-per-node": "cluster.gpus_per_node",
    "gpus": "cluster.gpus_per_node", "cpus-per-task": "cluster.cpus_per_node",
    "mem": "cluster.mem_per_node", "time": "cluster.slurm.time", "partition": "cluster.slurm.partition",
    "account": "cluster.slurm.account", "qos": "cluster.slurm.qos",
    "reservation": "cluster.slurm.reservation", "exclusive": "cluster.slurm.exclusive",
    "requeue": "cluster.slurm.requeue", "no-requeue": "cluster.slurm.requeue",
    "output": "cluster.log_dir", "error": "cluster.log_dir", "wrap": "(the bundle is the batch script)",
}


@dataclass
class BundleContext:
    """Everything the templates need, plus what the writer reports."""

    values: dict[str, Any]
    mounts: list[Mount]
    log_dir: str
    warnings: list[str] = field(default_factory=list)


def _q(value: Any, key: str, context: str = "shell") -> Quoted:
    try:
        return quote(value, key, context)
    except UnsafeValue as exc:
        raise BundleError(str(exc), exc.key) from None


def log_dir_warnings(cluster: ClusterSection, log_dir: str) -> list[str]:
    """A relative ``cluster.log_dir`` was taken from the folder ``rlc compile`` ran in (by
    ``rlc.compiler.resolve``); say where it went, since every node must see it."""
    raw = cluster.log_dir
    if posixpath.isabs(raw):
        return []
    return [f"cluster.log_dir: relative path {raw!r} resolved against the current folder: "
            f"{log_dir} (it must be on a filesystem every node sees)"]


def _extra_flag(flag: Any, key: str) -> Quoted:
    if not isinstance(flag, str) or not flag.startswith("--") or len(flag) < 3:
        raise BundleError(f"{key}: expected `--flag` or `--flag=value`, got {flag!r}", key)
    name, eq, value = flag[2:].partition("=")
    if name in MANAGED_FLAGS:
        raise BundleError(f"{key}: --{name} is set by the bundle from {MANAGED_FLAGS[name]}; "
                          "set it there instead of in extra_flags", key)
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", name):
        raise BundleError(f"{key}: {flag!r} is not `--flag` or `--flag=value`", key)
    return Quoted(f"--{name}={_q(value, key, 'sbatch')}" if eq else f"--{name}")


def _sbatch_lines(cluster: ClusterSection, name: str, log_dir: str, problems: Problems) -> list[Quoted]:
    slurm = cluster.slurm
    lines: list[Quoted] = []

    def opt(flag: str, value: Any, key: str, ctx: str = "sbatch") -> None:
        quoted = problems.attempt(_q, value, key, ctx)
        if quoted is not None:
            lines.append(Quoted(f"--{flag}={quoted}"))

    if slurm.job_name is not None:
        opt("job-name", slurm.job_name, "cluster.slurm.job_name")
    else:
        opt("job-name", name, "name")
    opt("nodes", cluster.nodes, "cluster.nodes")
    lines.append(Quoted("--ntasks-per-node=1"))
    gpus = cluster.gpus_per_node
    gtype = cluster.gpu_type_gres
    opt("gpus-per-node", f"{gtype}:{gpus}" if gtype else gpus,
        "cluster.gpu_type_gres" if gtype else "cluster.gpus_per_node")
    if cluster.cpus_per_node is not None:
        opt("cpus-per-task", cluster.cpus_per_node, "cluster.cpus_per_node")
    if cluster.mem_per_node is not None:
        opt("mem", cluster.mem_per_node, "cluster.mem_per_node")
    opt("time", slurm.time, "cluster.slurm.time")
    for flag, value in (("partition", slurm.partition), ("account", slurm.account), ("qos", slurm.qos),
                        ("reservation", slurm.reservation)):
        if value is not None:
            opt(flag, value, f"cluster.slurm.{flag}")
    if slurm.exclusive:
        lines.append(Quoted("--exclusive"))
    logs = problems.attempt(_q, log_dir, "cluster.log_dir", "sbatch_path")
    if logs is not None:
        lines.append(Quoted(f"--output={logs}/slurm-%j.out"))
        lines.append(Quoted(f"--error={logs}/slurm-%j.out"))
    if slurm.requeue:  # a requeued job keeps its earlier output
        lines += [Quoted("--requeue"), Quoted("--open-mode=append")]
    else:
        lines.append(Quoted("--no-requeue"))
    for i, flag in enumerate(slurm.extra_flags):
        extra = problems.attempt(_extra_flag, flag, f"cluster.slurm.extra_flags[{i}]")
        if extra is not None:
            lines.append(extra)
    return lines


#: Linux's default ``net.ipv4.ip_local_port_range``: the kernel gives outgoing connections source
#: ports from it, so a port Ray must listen on inside it can be taken by any connection on the node.
EPHEMERAL_PORTS = (32768, 60999)


def _fixed_ports(ray: RaySection) -> dict[str, int]:
    """The Ray ports that must be free on every node, by key (the dashboard's only when it is on)."""
    fixed = {"port": ray.port, "node_manager_port": ray.node_manager_port,
             "object_manager_port": ray.object_manager_port}
    if ray.dashboard_port:
        fixed["dashboard_port"] = ray.dashboard_port
    return fixed


def ephemeral_port_warnings(ray: RaySection) -> list[str]:
    """A warning for each fixed Ray port (and the worker range) inside :data:`EPHEMERAL_PORTS`."""
    lo, hi = EPHEMERAL_PORTS
    found = [(f"cluster.ray.{name}", f"port {port} lies in") for name, port in _fixed_ports(ray).items()
             if lo <= port <= hi]
    if ray.min_worker_port <= hi and ray.max_worker_port >= lo:
        found.append(("cluster.ray.min_worker_port",
                      f"worker ports {ray.min_worker_port}-{ray.max_worker_port} reach into"))
    return [f"{key}: {what} Linux's default range for outgoing connections ({lo}-{hi}, "
            "net.ipv4.ip_local_port_range): any connection on the node can hold such a port when Ray starts, and Ray "
            f"then fails to start there; use ports below {lo} (Ray's defaults are)" for key, what in found]


def _check_ports(ray: RaySection, problems: Problems) -> None:
    lo, hi = ray.min_worker_port, ray.max_worker_port
    if lo > hi:
        problems.append(BundleError("cluster.ray.min_worker_port: larger than cluster.ray.max_worker_port; "
                                    "swap them", "cluster.ray.min_worker_port"))
    seen: dict[int, str] = {}
    for name, port in _fixed_ports(ray).items():
        key = f"cluster.ray.{name}"
        if port in seen:
            problems.append(BundleError(f"{key}: port {port} is also cluster.ray.{seen[port]}; "
                                        "every Ray port must differ", key))
        elif lo <= port <= hi:
            problems.append(BundleError(f"{key}: port {port} lies inside the worker port range {lo}-{hi}; "
                                        "move it or the range", key))
        seen.setdefault(port, name)


def _check_image(runtime: str, image: Any) -> None:
    if not image:
        raise BundleError(f"cluster.container.image: required with cluster.container.runtime: "
                          f"{runtime}; set it or use runtime: none", "cluster.container.image")
    if any(c in image for c in "\n\r\x00"):
        raise BundleError("cluster.container.image: contains a line break or NUL byte; "
                          "write the image reference on one line", "cluster.container.image")
    if runtime == "pyxis" and "," in image:
        raise BundleError("cluster.container.image: Pyxis cannot take an image reference with ','",
                          "cluster.container.image")


def build_context(cluster: ClusterSection, name: str, bundle_dir: Path | None, log_dir: str, version: str,
                  problems: Problems | None = None) -> BundleContext:
    """Check the recipe's cluster section and quote every value the templates print.

    ``cluster`` and ``name`` are the typed recipe's; ``log_dir`` is the absolute log folder that
    ``runtime.yaml`` names (``cluster.log_dir``, made absolute by the resolver). Every check runs:
    each problem is added to ``problems``, or, when that is ``None``, the first one is raised as a
    :class:`BundleError` once all have run. ``bundle_dir`` ``None`` (no output folder yet: the
    checks every command runs) skips the checks of the output folder's path.
    """
    found = Problems() if problems is None else problems
    container = cluster.container
    ray = cluster.ray
    runtime = container.runtime
    image = container.image
    if not posixpath.isabs(log_dir):
        raise BundleError(f"cluster.log_dir: {log_dir!r} must be absolute by now (a bug in rlc's resolver)",
                          "cluster.log_dir")
    warnings: list[str] = []
    _check_ports(ray, found)
    warnings += ephemeral_port_warnings(ray)
    bundle = str(bundle_dir) if bundle_dir is not None else ""

    mounts: list[Mount] = []
    mount_text = ""
    if runtime == "none":
        if container.mounts:
            warnings.append("cluster.container.mounts: ignored with cluster.container.runtime: none")
        if image:
            warnings.append("cluster.container.image: ignored with cluster.container.runtime: none")
        if container.image_paths:
            warnings.append("cluster.container.image_paths: ignored with cluster.container.runtime: none")
    else:
        found.attempt(_check_image, runtime, image)
        if bundle_dir is not None:
            found.attempt(_q, bundle, "-o/--output (the bundle folder, mounted into the container)", "mount")
        found.attempt(_q, log_dir, "cluster.log_dir (mounted into the container)", "mount")
        reserved = {BUNDLE_MOUNT: "the bundle (its own rlc, runtime.yaml, env.sh)",
                    log_dir: "cluster.log_dir (logs and the job's Ray token)"}
        mounts, w = check_mounts(list(container.mounts), list(cluster.shared_fs_roots), reserved, problems=found)
        warnings += w
        mounts = mounts + [Mount(bundle, BUNDLE_MOUNT, "ro"), Mount(log_dir, log_dir, None)]
        mount_text = ",".join(m.spec for m in mounts)
        found.attempt(_q, container.workdir, "cluster.container.workdir", "mount")
    sbatch_lines = _sbatch_lines(cluster, name, log_dir, found)
    check_env(dict(cluster.env), problems=found)
    python = found.attempt(_q, container.python, "cluster.container.python", "word")
    if problems is None:
        found.raise_first()
    if found:  # collecting only: the values below would carry the problems
        return BundleContext(values={}, mounts=mounts, log_dir=log_dir, warnings=warnings)

    values: dict[str, Any] = {
        "version": _q(version, "rlc version"),
        "name": _q(name, "name"),
        "sbatch_lines": sbatch_lines,
        "bundle_dir": _q(bundle, "-o/--output (the bundle folder)"),
        "log_dir": _q(log_dir, "cluster.log_dir"),
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "container_runtime": _q(runtime, "cluster.container.runtime", "word"),
        "image": _q(image or "", "cluster.container.image"),
        "mounts": _q(mount_text, "cluster.container.mounts"),
        "workdir": _q(container.workdir, "cluster.container.workdir"),
        "mount_home": 1 if container.mount_home else 0,
        "python": python,
        "bundle_mount": _q(BUNDLE_MOUNT if runtime != "none" else bundle, "bundle mount"),
        "ray_port": ray.port,
        "ray_node_manager_port": ray.node_manager_port,
        "ray_object_manager_port": ray.object_manager_port,
        "ray_dashboard_port": ray.dashboard_port,
        "ray_min_worker_port": ray.min_worker_port,
        "ray_max_worker_port": ray.max_worker_port,
        "join_timeout_s": ray.join_timeout_s,
        "env_lines": env_lines(dict(cluster.env)),
    }
    return BundleContext(values=values, mounts=mounts, log_dir=log_dir, warnings=warnings)
