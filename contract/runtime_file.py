"""Reading ``runtime.yaml``: the bounded reader, safe YAML, and a clean error for each way it fails.

``python -m rlc.runtime`` used to hang on a FIFO named as its ``runtime.yaml`` and to print raw
tracebacks for a YAML syntax error, non-UTF-8 bytes or a ``!!python`` tag. Here the file is read
by :func:`rlc.contract.files.read_capped` (regular files only, size-capped, never blocking), parsed
by PyYAML's safe loader, and bounded like every value rlc resolves (:mod:`rlc.contract.bounds`).

* ``OSError``: the file cannot be read (missing, not a regular file, too large): a usage error.
* :class:`~rlc.contract.errors.RuntimeConfigError`: it is not a ``runtime.yaml`` this
  runtime reads (not UTF-8, not YAML, tags other than plain data, not a mapping): the message
  names the line and never quotes the file's text.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from rlc.contract.bounds import value_problem
from rlc.contract.files import CONFIG_BYTES, read_capped
from rlc.contract.errors import RuntimeConfigError


def parse_runtime_yaml(raw: bytes) -> dict[str, Any]:
    """The mapping in ``raw`` (the bytes of a ``runtime.yaml``); messages name no file (the caller does)."""
    import yaml  # noqa: PLC0415 - the contract imports no third-party module until a file is read

    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise RuntimeConfigError(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
                                 "recompile the bundle") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        if isinstance(exc, yaml.constructor.ConstructorError):
            reason = "a tag that is not plain data (runtime.yaml holds mappings, lists, strings, numbers)"
        else:
            reason = "a YAML syntax error"
        raise RuntimeConfigError(f"{reason}{at}; recompile the bundle") from None
    except yaml.YAMLError:
        raise RuntimeConfigError("not YAML (recompile the bundle)") from None
    except RecursionError:
        raise RuntimeConfigError("nested more deeply than a runtime.yaml is") from None
    if not isinstance(data, dict):
        raise RuntimeConfigError("not a mapping of runtime keys; recompile the bundle")
    too_big = value_problem(data)
    if too_big is not None:
        raise RuntimeConfigError(f"{too_big}")
    return data


def read_runtime_yaml(path: str | Path) -> dict[str, Any]:
    """Read and parse ``runtime.yaml`` (see the module docstring for what is raised)."""
    return parse_runtime_yaml(read_capped(path, CONFIG_BYTES))
