"""``rlc submit DIR [--test-only]``: hand a compiled bundle to ``sbatch --parsable``.

:func:`submit` checks the whole bundle against its lock file (every entry's kind, permissions and
bytes), then returns the job id and the log folder (the one the job script, hashed by the lock, names)
or raises :class:`SubmitError` with sbatch's own message. :func:`main` is the command's body for the CLI.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from rlc.compiler.bundle.lock import lock_mismatches, read_lock, script_value


class SubmitError(Exception):
    """The bundle could not be submitted (not a bundle, no sbatch, sbatch refused it)."""


@dataclass(frozen=True)
class SubmitResult:
    """``job_id`` is ``None`` for ``--test-only``; ``message`` is what sbatch said."""

    job_id: str | None
    log_dir: Path
    message: str = ""

    @property
    def output_file(self) -> Path | None:
        """The batch script's log, ``<log_dir>/slurm-<jobid>.out``."""
        return None if self.job_id is None else self.log_dir / f"slurm-{self.job_id}.out"

    @property
    def job_log_dir(self) -> Path | None:
        """The job's own folder, ``<log_dir>/<jobid>/`` (driver.log, ray-head.log, ...)."""
        return None if self.job_id is None else self.log_dir / self.job_id


def _compiled_for(script: Path) -> str | None:
    """The bundle folder that ``launch.sbatch`` names (its ``readonly RLC_BUNDLE=`` line)."""
    return script_value(script, "RLC_BUNDLE")


def submit(bundle_dir: str | Path, test_only: bool = False,
           env: Mapping[str, str] | None = None) -> SubmitResult:
    """Submit ``bundle_dir/launch.sbatch``; ``env`` replaces the environment sbatch sees."""
    bundle = Path(bundle_dir).resolve()
    lock = read_lock(bundle)
    if lock is None:
        raise SubmitError(f"{bundle} is not an rlc bundle (no valid bundle.lock.json); "
                          "make one with `rlc compile RECIPE -o DIR`")
    script = bundle / "launch.sbatch"
    if not script.is_file() or script.is_symlink():
        raise SubmitError(f"{script} is missing (or not a file); recompile the bundle")
    compiled_for = _compiled_for(script)
    if compiled_for is not None and Path(compiled_for).resolve() != bundle:
        raise SubmitError(f"{bundle} was compiled into {compiled_for} and moved or copied since; a bundle runs "
                          "only from the folder it was compiled into (its scripts name it): compile it here "
                          f"with `rlc compile RECIPE -o {shlex.quote(str(bundle))} --force`")
    changed = lock_mismatches(bundle, lock)
    if changed:
        shown = "; ".join(changed[:8]) + (f"; and {len(changed) - 8} more" if len(changed) > 8 else "")
        raise SubmitError(f"{bundle} does not match its bundle.lock.json ({shown}): a bundle is not edited "
                          "after compiling; change the recipe (or --set) and recompile it with --force")
    # The log folder the job uses is the script's (the lock hashes the script; its own log_dir is a copy)
    script_log_dir = script_value(script, "RLC_LOG_ROOT")
    if script_log_dir is None or script_log_dir != lock.get("log_dir"):
        raise SubmitError(f"{bundle}: bundle.lock.json names the log folder {lock.get('log_dir')!r}, launch.sbatch "
                          f"{script_log_dir!r}: the lock was edited; recompile the bundle with --force")
    log_dir = Path(script_log_dir)
    sbatch = shutil.which("sbatch", path=(env or os.environ).get("PATH"))
    if sbatch is None:
        raise SubmitError("sbatch not found on PATH: submit from a SLURM login node")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)  # sbatch writes slurm-<jobid>.out there
    except OSError as exc:
        raise SubmitError(f"cannot create the log folder {log_dir}: {exc.strerror or exc}") from None
    cmd = [sbatch, "--parsable", *(["--test-only"] if test_only else []), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=None if env is None else dict(env),
                          stdin=subprocess.DEVNULL, check=False)
    said = (proc.stderr.strip() + "\n" + proc.stdout.strip()).strip()
    if proc.returncode != 0:
        raise SubmitError(f"sbatch refused {script} (exit code {proc.returncode}): {said}")
    if test_only:
        return SubmitResult(job_id=None, log_dir=log_dir, message=said)
    job_id = proc.stdout.strip().split(";", 1)[0]
    if not job_id.isdigit():
        raise SubmitError(f"sbatch printed no job id: {said!r}")
    return SubmitResult(job_id=job_id, log_dir=log_dir, message=said)


def main(bundle_dir: str | Path, test_only: bool = False) -> int:
    """``rlc submit``: print the job id and where its logs go; 0 ok, 2 on failure."""
    try:
        result = submit(bundle_dir, test_only=test_only)
    except SubmitError as exc:
        print(f"rlc submit: error: {exc}", file=sys.stderr)
        return 2
    if test_only:
        print(result.message or "sbatch --test-only: accepted")
        return 0
    print(f"submitted job {result.job_id}")
    print(f"  batch log: {result.output_file}")
    print(f"  job logs:  {result.job_log_dir}/ (driver.log, ray-head.log, ray-worker-<node>.log)")
    return 0
