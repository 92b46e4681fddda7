"""Parsing the YAML tables rlc ships or writes (GPU catalog, calibration, host memory, vLLM sleep): plain
YAML 1.1 of mappings, lists and scalars, read with PyYAML's libyaml parser where PyYAML has it (the same
result as its pure-Python one, ten times faster: every command reads four of them)."""
from __future__ import annotations

from typing import Any

import yaml

_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_table(text: str) -> Any:
    """``yaml.safe_load(text)``, with libyaml when available; raises ``yaml.YAMLError`` as it does."""
    return yaml.load(text, Loader=_LOADER)  # noqa: S506  (a safe loader)
