"""The ``data.chat_template`` value that names the tokenizer's own chat template, shared by the runtime's prompt
encoder, the compiler's rules and the NeMo-RL importer. Pure Python."""
from __future__ import annotations

#: ``data.chat_template`` value for the tokenizer's own template (any other text is a Jinja template).
TOKENIZER_TEMPLATE = "default"

__all__ = ["TOKENIZER_TEMPLATE"]
