"""JSONL prompt dataset and its resumable cursor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlc.contract.runtime_config import DataConfig
from rlc.runtime.grpo.data import (
    PromptCursor,
    PromptDataError,
    PromptSample,
    epoch_order,
    load_prompts,
    load_prompts_from_config,
)


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def gsm(tmp_path: Path) -> Path:
    return _write(
        tmp_path / "train.jsonl",
        [{"question": f"What is {i}+{i}?", "answer": 2 * i, "level": "easy"} for i in range(10)] + [""],
    )


def test_load_formats_prompts_and_stringifies_answers(gsm: Path) -> None:
    s = load_prompts(gsm, prompt_key="question", answer_key="answer", prompt_template="Q: {prompt} ({level})\nA:")
    assert len(s) == 10
    assert s[3].prompt == "Q: What is 3+3? (easy)\nA:" and s[3].answer == "6"
    assert s[3].source == f"{gsm}:4" and s[3].index == 3


def test_load_from_config(gsm: Path) -> None:
    cfg = DataConfig(
        train_path=str(gsm),
        val_path=None,
        prompt_key="question",
        answer_key="answer",
        prompt_template="{prompt}",
        chat_template=None,
        system_prompt=None,
        max_prompt_length=0,
        shuffle=True,
    )
    assert len(load_prompts_from_config(cfg)) == 10
    assert load_prompts_from_config(cfg, split="val") == []


def test_bad_json_names_file_and_line(tmp_path: Path) -> None:
    p = _write(tmp_path / "d.jsonl", [{"q": "a", "a": "1"}, "", '{"q": "b", "a": 2', {"q": "c", "a": "3"}])
    with pytest.raises(PromptDataError) as err:
        load_prompts(p, prompt_key="q", answer_key="a")
    assert f"{p}:3" in str(err.value) and "invalid JSON" in str(err.value)


def test_missing_key_names_setting_and_alternatives(tmp_path: Path) -> None:
    p = _write(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}, {"problem": "b", "answer": "2"}])
    with pytest.raises(PromptDataError) as err:
        load_prompts(p, prompt_key="question", answer_key="answer")
    msg = str(err.value)
    assert f"{p}:2" in msg and "'question'" in msg and "data.prompt_key" in msg and "'problem'" in msg
    with pytest.raises(PromptDataError, match="data.answer_key"):
        load_prompts(p, prompt_key="question", answer_key="solution")


def test_other_bad_records(tmp_path: Path) -> None:
    with pytest.raises(PromptDataError, match="expected a JSON object"):
        load_prompts(_write(tmp_path / "a.jsonl", [[1, 2]]), prompt_key="q", answer_key="a")
    with pytest.raises(PromptDataError, match="expected a string"):
        load_prompts(_write(tmp_path / "b.jsonl", [{"q": 5, "a": "1"}]), prompt_key="q", answer_key="a")
    with pytest.raises(PromptDataError, match="data.answer_key"):
        load_prompts(_write(tmp_path / "c.jsonl", [{"q": "x", "a": None}]), prompt_key="q", answer_key="a")
    with pytest.raises(PromptDataError, match="empty"):
        load_prompts(_write(tmp_path / "e.jsonl", []), prompt_key="q", answer_key="a")
    with pytest.raises(PromptDataError, match="data.train_path"):
        load_prompts(tmp_path / "missing.jsonl", prompt_key="q", answer_key="a")


def test_template_errors(gsm: Path) -> None:
    with pytest.raises(PromptDataError, match="no {prompt}"):
        load_prompts(gsm, prompt_key="question", answer_key="answer", prompt_template="Solve it")
    with pytest.raises(PromptDataError) as err:
        load_prompts(gsm, prompt_key="question", answer_key="answer", prompt_template="{prompt} {topic}")
    assert "{topic}" in str(err.value) and f"{gsm}:1" in str(err.value)
    with pytest.raises(PromptDataError, match="literal braces"):
        load_prompts(gsm, prompt_key="question", answer_key="answer", prompt_template="{prompt} {")
    # escaped braces and format specs are fine
    s = load_prompts(gsm, prompt_key="question", answer_key="answer", prompt_template="{{x}} {prompt!s}")
    assert s[0].prompt == "{x} What is 0+0?"


def test_max_prompt_length_drops_long_and_reports(tmp_path: Path) -> None:
    p = _write(tmp_path / "d.jsonl", [{"q": "x" * n, "a": "1"} for n in (3, 10, 5, 20)])
    notes: list[str] = []
    s = load_prompts(p, prompt_key="q", answer_key="a", max_prompt_length=5, count_tokens=len, on_filtered=notes.append)
    assert [len(x.prompt) for x in s] == [3, 5] and [x.index for x in s] == [0, 1]
    assert len(notes) == 1 and "2/4" in notes[0] and "data.max_prompt_length=5" in notes[0]
    with pytest.raises(PromptDataError, match="raise data.max_prompt_length"):
        load_prompts(p, prompt_key="q", answer_key="a", max_prompt_length=2, count_tokens=len)
    with pytest.raises(PromptDataError, match="count_tokens"):
        load_prompts(p, prompt_key="q", answer_key="a", max_prompt_length=2)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(0, 10_000), st.integers(0, 5))
def test_epoch_order_is_a_deterministic_permutation(n: int, seed: int, epoch: int) -> None:
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=True)
    assert sorted(order) == list(range(n))
    assert order == epoch_order(n, seed=seed, epoch=epoch, shuffle=True)
    assert epoch_order(n, seed=seed, epoch=epoch, shuffle=False) == list(range(n))


def test_epochs_differ_and_every_prompt_is_seen_once_per_epoch(gsm: Path) -> None:
    s = load_prompts(gsm, prompt_key="question", answer_key="answer")
    cur = PromptCursor(s, seed=3, shuffle=True)
    first = [x.index for x in cur.next_batch(10)]
    second = [x.index for x in cur.next_batch(10)]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # a new permutation per epoch (fixed seed: deterministic)
    assert cur.epoch == 1 and cur.consumed == 20


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=8), st.integers(0, 7), st.integers(0, 100))
def test_cursor_resume_continues_identically(batches: list[int], split: int, seed: int) -> None:
    samples = [PromptSample(index=i, prompt=f"p{i}", answer=str(i), source=f"mem:{i + 1}") for i in range(7)]
    split = min(split, len(batches))
    a = PromptCursor(samples, seed=seed)
    straight = [[x.index for x in a.next_batch(n)] for n in batches]

    b = PromptCursor(samples, seed=seed)
    resumed = [[x.index for x in b.next_batch(n)] for n in batches[:split]]
    state = json.loads(json.dumps(b.state_dict()))  # through JSON, as in the checkpoint
    c = PromptCursor(samples, seed=seed)
    c.load_state_dict(state)
    resumed += [[x.index for x in c.next_batch(n)] for n in batches[split:]]
    assert resumed == straight
    assert c.state_dict() == a.state_dict()


def test_resume_refuses_a_changed_dataset(gsm: Path) -> None:
    s = load_prompts(gsm, prompt_key="question", answer_key="answer")
    state = PromptCursor(s, seed=1).state_dict()
    with pytest.raises(PromptDataError) as err:
        PromptCursor(s[:5], seed=2).load_state_dict(state)
    assert "number of prompts" in str(err.value) and "grpo.seed" in str(err.value)
    with pytest.raises(PromptDataError, match="missing"):
        PromptCursor(s, seed=1).load_state_dict({"epoch": 0})
