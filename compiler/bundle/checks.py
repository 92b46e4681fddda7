"""The bundle stage's checks as diagnostics, for every command (``rlc.compiler.api.check``).

``rlc validate``, ``lint``, ``plan`` and ``compile`` all report what would stop ``rlc compile``
from writing the bundle (Ray port clashes, bad mounts, variables the bundle owns in
``cluster.env``, managed ``#SBATCH`` flags in ``extra_flags``, values no script line can hold),
all at once, next to the schema's and the rules' findings. The checks themselves are the bundle
writer's own (:func:`rlc.compiler.bundle.context.build_context`), run without an output folder.
"""
from __future__ import annotations

import os
from typing import Any

from rlc.compiler.bundle.context import build_context
from rlc.compiler.bundle.errors import Problems
from rlc.compiler.bundle.jobpaths import check_job_paths, job_paths, parsed_mounts
from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.recipe_types import (
    CheckpointingSection,
    ClusterSection,
    DataSection,
    LoggingSection,
    ModelSection,
    RewardSection,
)

#: Recipe keys the bundle checks read: they run when the schema found nothing wrong below these.
KEYS_READ = ("cluster", "name")
#: Recipe keys the check of the job's paths against the container's mounts reads (same rule).
PATH_KEYS_READ = ("cluster", "name", "data", "model", "reward", "checkpointing", "logging")


def absolute_log_dir(cluster: ClusterSection) -> str:
    """``cluster.log_dir`` made absolute the way the resolver does (against the current folder)."""
    return os.path.abspath(cluster.log_dir)


def _strip_key(message: str, key: str | None) -> str:
    prefix = f"{key}: " if key else ""
    return message[len(prefix):] if prefix and message.startswith(prefix) else message


def bundle_diagnostics(cluster: ClusterSection, name: str, version: str) -> list[Diagnostic]:
    """Every bundle-stage error and warning of a recipe's ``cluster`` section and ``name``, unplaced."""
    problems = Problems()
    context = build_context(cluster, name, None, absolute_log_dir(cluster), version, problems)
    diags = [Diagnostic("error", _strip_key(str(p), p.key), path=p.key or "") for p in problems]
    for warning in context.warnings:
        key, sep, rest = warning.partition(": ")
        diags.append(Diagnostic("warning", rest if sep else warning, path=key if sep else ""))
    return diags


def job_path_problems(cluster: ClusterSection, data: DataSection, model: ModelSection, reward: RewardSection,
                      checkpointing: CheckpointingSection, logging: LoggingSection, name: str) -> Problems:
    """Every path the job uses that the container would not have (:mod:`rlc.compiler.bundle.jobpaths`);
    none with ``cluster.container.runtime: none`` (the job sees the host's files)."""
    problems = Problems()
    if cluster.container.runtime == "none":
        return problems
    paths = job_paths(cluster, data, model, reward, checkpointing, logging, name)
    check_job_paths(paths, parsed_mounts(cluster.container.mounts), list(cluster.container.image_paths),
                    absolute_log_dir(cluster), problems)
    return problems


def job_path_diagnostics(*sections: Any) -> list[Diagnostic]:
    """:func:`job_path_problems` as unplaced error diagnostics."""
    return [Diagnostic("error", _strip_key(str(p), p.key), path=p.key or "") for p in job_path_problems(*sections)]
