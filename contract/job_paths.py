"""Which recipe values name paths the job opens: the compiler checks them against the container's
mounts, the runtime's probe checks them on every node inside the container. One definition for both.

* :func:`is_local` - a model or tokenizer reference that is a path on disk, not a Hugging Face Hub id;
* :func:`kwarg_paths` - the string values of ``reward.kwargs`` that are absolute paths (files the reward
  function opens), with the key of each.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


def is_local(ref: str) -> bool:
    """A model or tokenizer reference that is a path on disk (``/``, ``./``, ``../``, ``~``) rather
    than a Hugging Face Hub id."""
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..")


def kwarg_paths(value: Any, key: str = "reward.kwargs") -> Iterator[tuple[str, str]]:
    """``(key, path)`` for each string in ``value`` (nested mappings and lists too) that is an absolute
    path: starts with ``/``, has more than that, and no whitespace."""
    if isinstance(value, str):
        if value.startswith("/") and len(value) > 1 and not any(c.isspace() for c in value):
            yield key, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from kwarg_paths(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from kwarg_paths(v, f"{key}[{i}]")


__all__ = ["is_local", "kwarg_paths"]
