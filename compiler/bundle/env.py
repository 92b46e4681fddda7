"""The job's environment: ``env.sh``, sourced by ``node.sh`` in every task (Ray head, workers,
the join wait and the driver), inside the container.

Three parts, in this order:

1. bundle defaults the recipe may override (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` etc.);
2. ``cluster.env`` from the recipe, each value quoted by :func:`rlc.compiler.shell.quote`;
3. what the bundle owns: ``PYTHONPATH`` (the bundle's rlc first, then a ``PYTHONPATH`` from the
   recipe, then the container's) and Ray token authentication.

Keys the bundle owns (``RAY_ADDRESS``, ``RAY_AUTH_*``, ``RLC_*``, ``SLURM_*``) are rejected in
``cluster.env`` with a message naming the key.

References to other variables are expanded when the job starts, on each node, as a shell would:
``PATH: /opt/conda/bin:$PATH`` (or ``${PATH}``) prepends to the container's ``PATH`` (an unset
variable is empty); ``$$`` is a literal ``$``. Nothing else is expanded: ``$(...)``, backticks,
quotes and every other character stay literal text (see :func:`env_word`).
"""
from __future__ import annotations

import re
from typing import Any

from rlc.compiler.bundle.errors import BundleError, Problems
from rlc.compiler.shell import Quoted, quote

#: Defaults written before the recipe's env (the recipe may override them).
DEFAULTS: tuple[tuple[str, str], ...] = (
    ("PYTHONUNBUFFERED", "1"),
    ("RAY_USAGE_STATS_ENABLED", "0"),
    ("RAY_DEDUP_LOGS", "0"),
    ("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0"),  # teardown at once (Ray 2.60 drains 30 s)
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
)
_RESERVED = {
    "RAY_ADDRESS": "the bundle points every task at the job's own Ray head",
    "RAY_AUTH_MODE": "the bundle always runs Ray with token authentication",
    "RAY_AUTH_TOKEN": "the bundle generates a fresh Ray token for each job",
    "RAY_AUTH_TOKEN_PATH": "the bundle generates a fresh Ray token for each job",
}
_RESERVED_PREFIXES = {
    "RLC_": "RLC_* variables are set by the bundle's scripts",
    "SLURM_": "SLURM_* variables are set by SLURM and change how srun behaves",
    "RAY_AUTH_": "the bundle always runs Ray with token authentication",
}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REFERENCE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def env_word(value: str, key: str) -> Quoted:
    """``value`` as one bash word: literal text single-quoted, each ``$NAME``/``${NAME}`` a quoted
    expansion of that variable at job start (``$$`` a literal ``$``)."""
    parts: list[str] = []
    pos = 0
    for m in _REFERENCE.finditer(value):
        if m.start() > pos:
            parts.append(quote(value[pos:m.start()], key))
        name = m.group(1) or m.group(2)
        parts.append(f'"${{{name}-}}"' if name else "'$'")
        pos = m.end()
    if pos < len(value) or not parts:
        parts.append(quote(value[pos:], key))
    return Quoted("".join(parts))


def env_text(value: Any) -> str:
    """A recipe env value as text (booleans as 1/0, like ``rlc.compiler.resolve``)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def check_env(env: dict[str, Any], key: str = "cluster.env", problems: Problems | None = None) -> None:
    """Reject names the bundle owns and values that cannot live in a shell variable; every entry
    is checked, each problem added to ``problems`` (or the first raised when it is ``None``)."""
    found = Problems() if problems is None else problems
    for name, value in env.items():
        found.attempt(_check_entry, name, value, f"{key}.{name}")
    if problems is None:
        found.raise_first()


def _check_entry(name: str, value: Any, k: str) -> None:
    if not _NAME.fullmatch(name):
        raise BundleError(f"{k}: {name!r} is not a valid environment variable name", k)
    why = _RESERVED.get(name) or next(
        (w for p, w in _RESERVED_PREFIXES.items() if name.startswith(p)), None)
    if why:
        raise BundleError(f"{k}: {name} cannot be set in a recipe ({why}); remove it", k)
    if not isinstance(value, (str, int, float, bool)):
        raise BundleError(f"{k}: expected a string, number or boolean", k)
    if "\x00" in env_text(value):
        raise BundleError(f"{k}: the value contains a NUL byte, which no environment "
                          "variable can hold; remove it", k)


def env_lines(env: dict[str, Any], key: str = "cluster.env") -> list[Quoted]:
    """The ``export`` lines of ``env.sh`` (already quoted); raises :class:`BundleError` for the
    first bad entry (:func:`check_env`)."""
    check_env(env, key)
    lines: list[Quoted] = [Quoted("# bundle defaults (a recipe's cluster.env may override them)")]
    user = {k: env_text(v) for k, v in env.items()}
    for name, value in DEFAULTS:
        if name not in user:
            lines.append(Quoted(f"export {name}={quote(value, name)}"))
    lines.append(Quoted("# cluster.env"))
    for name in sorted(user):
        if name == "PYTHONPATH":
            continue
        lines.append(Quoted(f"export {name}={env_word(user[name], f'{key}.{name}')}"))
    lines.append(Quoted("# owned by the bundle: its own rlc first on PYTHONPATH, Ray token authentication"))
    extra = ""
    if user.get("PYTHONPATH"):
        extra = ":" + env_word(user["PYTHONPATH"], f"{key}.PYTHONPATH")
    lines.append(Quoted(f'export PYTHONPATH="$RLC_BUNDLE_MNT/rlc_pkg"{extra}${{PYTHONPATH:+":$PYTHONPATH"}}'))
    lines.append(Quoted("export RAY_AUTH_MODE=token"))
    lines.append(Quoted('export RAY_AUTH_TOKEN_PATH="$RLC_JOB_DIR/ray-auth/token"'))
    return lines
