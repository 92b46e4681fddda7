"""Reading a file a user named (recipe, ``extends:`` parent, ``model.config``, calibration table,
run records, an imported config, a job's log): the one bounded reader the compiler and the runtime
share, :mod:`rlc.contract.files` (regular files only, size-capped, never blocking)."""
from __future__ import annotations

from rlc.contract.files import (
    CONFIG_BYTES,
    FileTooLarge,
    JsonError,
    is_regular_file,
    parse_json,
    read_capped,
    read_head_tail,
    read_text_capped,
    sha256_regular,
)

__all__ = ["CONFIG_BYTES", "FileTooLarge", "JsonError", "is_regular_file", "parse_json", "read_capped",
           "read_head_tail", "read_text_capped", "sha256_regular"]
