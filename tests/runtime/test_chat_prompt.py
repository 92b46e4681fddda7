"""The prompt's token ids with and without a chat template (``data.chat_template``): the toy character tokenizer
(real ``transformers``), a chat template written in its own characters, and the ids each rendering must give,
spelled out independently (``toy.char_ids``)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from rlc.contract.runtime_config import load_runtime_config
from rlc.runtime import toy
from rlc.runtime.grpo.chat_prompt import ChatTemplateError, PromptEncoder

transformers = pytest.importorskip("transformers")

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
#: A chat template in the toy vocabulary: "##" opens the system turn, "#" the user's, "==" the assistant's, and
#: ".." marks thinking turned off.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}##{% else %}#{% endif %}{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}=={% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}..{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = toy.build_tokenizer(tmp_path_factory.mktemp("tok"))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def data(**changes):
    base = load_runtime_config(ROOT / "tests" / "gpu" / "tiny_runtime.yaml").data
    return dataclasses.replace(base, **changes)


def test_without_a_template_the_text_is_tokenized_as_it_is(tokenizer):
    assert PromptEncoder(tokenizer, data())("1+2=") == toy.char_ids("1+2=")  # <bos> from the tokenizer


def test_a_template_renders_the_conversation_and_opens_the_assistants_turn(tokenizer):
    encode = PromptEncoder(tokenizer, data(chat_template=TEMPLATE))
    assert encode.render("1+2=") == "#1+2=\n=="
    assert encode("1+2=") == toy.char_ids("#1+2=\n==", add_bos=False)  # the template writes the special tokens
    with_system = PromptEncoder(tokenizer, data(chat_template=TEMPLATE, system_prompt="0",
                                                chat_template_kwargs={"enable_thinking": False}))
    assert with_system("1+2=") == toy.char_ids("##0\n#1+2=\n==..", add_bos=False)


def test_default_is_the_tokenizers_own_template(tokenizer, tmp_path):
    directory = toy.build_tokenizer(tmp_path / "tok")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    own = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert PromptEncoder(own, data(chat_template="default"))("7") == toy.char_ids("#7\n==", add_bos=False)
    with pytest.raises(ChatTemplateError, match="data.chat_template: default, but the tokenizer .* has no chat "
                                                "template"):
        PromptEncoder(tokenizer, data(chat_template="default"))


@pytest.mark.parametrize("changes,key", [(dict(system_prompt="0"), "data.system_prompt"),
                                         (dict(chat_template_kwargs={"enable_thinking": False}),
                                          "data.chat_template_kwargs")])
def test_a_system_prompt_or_template_arguments_without_a_template_are_refused(tokenizer, changes, key):
    with pytest.raises(ChatTemplateError, match=f"{key} needs a chat template"):
        PromptEncoder(tokenizer, data(**changes))
