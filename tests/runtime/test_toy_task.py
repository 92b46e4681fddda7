"""The toy addition task: dataset, vocabulary, tokenizer."""

from __future__ import annotations

import json

import pytest
from rlc.runtime import toy
from rlc.runtime.grpo.data import load_prompts
from rlc.runtime.grpo.rewards import make_reward_fn


def test_dataset_is_deterministic_and_correct(tmp_path) -> None:
    a = toy.write_dataset(tmp_path / "a" / "train.jsonl", 200, seed=4)
    b = toy.write_dataset(tmp_path / "b.jsonl", 200, seed=4)
    c = toy.write_dataset(tmp_path / "c.jsonl", 200, seed=5)
    assert a.read_text() == b.read_text() != c.read_text()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 200
    for r in rows:
        x, y = r["prompt"].rstrip("=").split("+")
        assert r["prompt"] == f"{x}+{y}=" and r["answer"] == str((int(x) + int(y)) % 10)
    assert len({r["prompt"] for r in rows}) > 50  # covers most of the 100 pairs


def test_dataset_loads_with_the_runtime_loader_and_reward(tmp_path) -> None:
    p = toy.write_dataset(tmp_path / "t.jsonl", 20, seed=0)
    samples = load_prompts(p, prompt_key=toy.PROMPT_KEY, answer_key=toy.ANSWER_KEY)
    reward = make_reward_fn(toy.REWARD_FUNCTION)
    s = samples[0]
    assert reward(s.prompt, s.answer + "<eos>", s.answer) == 1.0
    wrong = str((int(s.answer) + 1) % 10)
    assert reward(s.prompt, wrong, s.answer) == 0.0


def test_vocabulary() -> None:
    assert len(set(toy.VOCAB)) == len(toy.VOCAB) == toy.vocab_size()
    assert toy.VOCAB[:4] == toy.SPECIAL_TOKENS and (toy.PAD_ID, toy.BOS_ID, toy.EOS_ID) == (0, 1, 2)
    for ch in "0123456789+=":
        assert ch in toy.TOKEN_IDS
    assert toy.char_ids("3+9=") == [
        toy.BOS_ID,
        toy.TOKEN_IDS["3"],
        toy.TOKEN_IDS["+"],
        toy.TOKEN_IDS["9"],
        toy.TOKEN_IDS["="],
    ]
    assert toy.char_ids("a", add_bos=False) == [toy.UNK_ID]
    with pytest.raises(ValueError):
        toy.make_example(10, 1)


def test_tokenizer_round_trip(tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    d = toy.build_tokenizer(tmp_path / "tok")
    assert (d / "tokenizer.json").is_file()
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == (toy.EOS, toy.PAD, toy.BOS)
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == toy.vocab_size()
    for text in ["3+9=", "0+0=7", "12 + 3 =\n#5.", "x?"]:
        enc = tok.encode(text)
        assert enc.ids == toy.char_ids(text)  # one token per character, <bos> first
    assert tok.decode(toy.char_ids("3+9=2") + [toy.EOS_ID]) == "3+9=2"  # specials skipped, no spaces
    assert tok.decode(toy.char_ids("3+9="), skip_special_tokens=False) == "<bos>3+9="
    assert tok.encode("7<eos>").ids[-1] == toy.EOS_ID  # special tokens are atomic


def test_tokenizer_loads_with_transformers(tmp_path) -> None:
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    d = toy.build_tokenizer(tmp_path / "tok")
    t = transformers.AutoTokenizer.from_pretrained(str(d))
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (toy.BOS_ID, toy.EOS_ID, toy.PAD_ID)
    assert t("3+9=").input_ids == toy.char_ids("3+9=")
    assert t.decode(toy.char_ids("3+9=2") + [toy.EOS_ID], skip_special_tokens=True) == "3+9=2"


def test_cli_writes_everything(tmp_path) -> None:
    pytest.importorskip("tokenizers")
    assert toy.main([str(tmp_path / "out"), "--train", "8", "--val", "4", "--seed", "1"]) == 0
    assert len((tmp_path / "out" / "train.jsonl").read_text().splitlines()) == 8
    assert len((tmp_path / "out" / "val.jsonl").read_text().splitlines()) == 4
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").is_file()
