"""Where DAPO's overlong penalty applies (``grpo.reward_shaping``), read by the runtime's shaping
(``rlc.runtime.grpo.reward_shaping``) and the compiler's check of it (RLC307). Pure Python."""
from __future__ import annotations

from typing import Any


def overlong_window(shaping: Any, max_tokens: int) -> tuple[int, int]:
    """``(start, limit)`` in response tokens: the penalty is 0 up to ``start`` = ``limit − overlong_buffer_length``
    and reaches ``overlong_buffer_penalty`` at ``limit`` = ``max_response_length`` (null: ``max_tokens``).
    ``shaping``: the recipe's or the runtime config's ``grpo.reward_shaping``."""
    limit = int(shaping.max_response_length) if shaping.max_response_length is not None else int(max_tokens)
    return limit - int(shaping.overlong_buffer_length), limit


__all__ = ["overlong_window"]
