"""How a prompt's text becomes the token ids the engines generate from (``data.chat_template``,
``data.chat_template_kwargs``, ``data.system_prompt``).

Without a chat template the text is tokenized as it is, with the tokenizer's special tokens (a base model's
completion). With one, the text is the user's turn of a conversation (after the system turn, if any), rendered with
the assistant's turn opened (``add_generation_prompt``) and tokenized without adding special tokens: the chat template
writes them, as NeMo-RL's ``math_hf_data_processor`` does. ``default`` is the tokenizer's own template; any other text
is a Jinja chat template.
"""
from __future__ import annotations

from typing import Any

from rlc.contract.chat_template import TOKENIZER_TEMPLATE
from rlc.contract.runtime_config import DataConfig


class ChatTemplateError(ValueError):
    """``data.chat_template`` cannot be used with this tokenizer; the message names the key and the fix."""


class PromptEncoder:
    """``encoder(text) -> token ids`` for ``data``'s chat settings and ``tokenizer`` (a ``transformers`` tokenizer)."""

    def __init__(self, tokenizer: Any, data: DataConfig) -> None:
        self.tokenizer = tokenizer
        self.template = data.chat_template
        self.kwargs = dict(data.chat_template_kwargs)
        self.system = data.system_prompt
        if self.template is None and (self.system or self.kwargs):
            key = "data.system_prompt" if self.system else "data.chat_template_kwargs"
            raise ChatTemplateError(f"{key} needs a chat template to go into, and data.chat_template is null; set "
                                    f"data.chat_template: {TOKENIZER_TEMPLATE} (the tokenizer's) or drop {key}")
        if self.template == TOKENIZER_TEMPLATE and not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"data.chat_template: {TOKENIZER_TEMPLATE}, but the tokenizer "
                f"{getattr(tokenizer, 'name_or_path', '') or ''} has no chat template; set data.chat_template to a "
                "Jinja chat template, or null to send the prompt text as it is")

    def render(self, text: str) -> str:
        """The text the tokenizer encodes: ``text`` itself, or its conversation through the chat template."""
        if self.template is None:
            return text
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": text}]
        template = None if self.template == TOKENIZER_TEMPLATE else self.template
        rendered: str = self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                           add_generation_prompt=True, **self.kwargs)
        return rendered

    def __call__(self, text: str) -> list[int]:
        if self.template is None:
            return list(self.tokenizer(text)["input_ids"])
        return list(self.tokenizer(self.render(text), add_special_tokens=False)["input_ids"])


__all__ = ["ChatTemplateError", "PromptEncoder", "TOKENIZER_TEMPLATE"]
