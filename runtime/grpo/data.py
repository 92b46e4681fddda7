"""The JSONL prompt dataset and its resumable cursor.

Each non-blank line of ``data.train_path`` is one JSON object; ``data.prompt_key`` and
``data.answer_key`` name its prompt and ground-truth answer. The prompt shown to the model is
``data.prompt_template.format(prompt=<prompt>, **<the record's other fields>)``.

``PromptCursor`` walks the dataset in epochs; with ``data.shuffle`` each epoch is a permutation fixed
by ``(seed, epoch)``, so the order is the same on every run and after a resume. Its ``state_dict()``
goes into the driver checkpoint; ``load_state_dict()`` continues at the same sample.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlc.contract.files import JsonError, parse_json, read_capped

#: Largest prompt file read (it is held in memory whole).
DATA_BYTES = 1 << 34


class PromptDataError(ValueError):
    """The prompt dataset (file, keys, template) cannot be read as configured."""


@dataclass(frozen=True)
class PromptSample:
    """One prompt of the dataset."""

    index: int  # position in the file's records (after filtering, stable for a given file + config)
    prompt: str  # formatted with data.prompt_template
    answer: str  # ground truth, as a string
    source: str  # "path:line" for error messages
    record: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def template_fields(template: str) -> set[str]:
    """Top-level field names used by a ``str.format`` template (``{a.b}`` and ``{a[0]}`` give ``a``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise PromptDataError(
            f"data.prompt_template {template!r} is not a valid str.format template ({exc}); use {{prompt}} "
            "for the prompt and '{{' / '}}' for literal braces"
        ) from None
    return {re.split(r"[.\[]", name, maxsplit=1)[0] for _, name, _, _ in parsed if name}


def _format_prompt(template: str, prompt: str, record: dict[str, Any], where: str) -> str:
    fields = {k: v for k, v in record.items() if isinstance(k, str)}
    fields["prompt"] = prompt
    try:
        return template.format(**fields)
    except KeyError as exc:
        raise PromptDataError(
            f"{where}: data.prompt_template uses {{{exc.args[0]}}}, which is neither {{prompt}} nor a field of "
            f"the record ({', '.join(sorted(record)) or 'none'}); fix the template or escape braces as "
            "'{{' and '}}'"
        ) from None
    except (IndexError, ValueError) as exc:
        raise PromptDataError(
            f"{where}: data.prompt_template {template!r} is not a valid str.format template ({exc}); use "
            "{prompt} for the prompt and '{{' / '}}' for literal braces"
        ) from None


def load_prompts(
    path: str | Path,
    *,
    prompt_key: str,
    answer_key: str,
    prompt_template: str = "{prompt}",
    max_prompt_length: int = 0,
    count_tokens: Callable[[str], int] | None = None,
    on_filtered: Callable[[str], None] | None = None,
) -> list[PromptSample]:
    """Read a JSONL prompt file; errors name ``path:line`` and the config key to fix.

    ``max_prompt_length > 0`` drops prompts longer than that many tokens as counted by
    ``count_tokens(formatted_prompt)`` (required then: the driver passes its tokenizer's length);
    ``on_filtered`` receives one summary line when any prompt was dropped.
    """
    p = Path(path)
    if "prompt" not in template_fields(prompt_template):
        raise PromptDataError(
            f"data.prompt_template {prompt_template!r} has no {{prompt}} placeholder; the prompt would never "
            "reach the model. Add {prompt}"
        )
    if max_prompt_length > 0 and count_tokens is None:
        raise PromptDataError(
            "data.max_prompt_length > 0 needs a token counter: pass count_tokens (e.g. "
            "lambda s: len(tokenizer(s).input_ids)) or set data.max_prompt_length: 0"
        )
    try:
        text = read_capped(p, DATA_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise PromptDataError(f"data file {p} does not exist; fix data.train_path / data.val_path") from None
    except OSError as exc:
        raise PromptDataError(f"data file {p}: cannot read it ({exc.strerror or exc}); fix data.train_path / "
                              "data.val_path") from None
    except UnicodeDecodeError as exc:
        raise PromptDataError(f"{p}: not UTF-8 text ({exc}); prompt files must be UTF-8 JSONL") from None

    samples: list[PromptSample] = []
    too_long = 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            record = parse_json(line)
        except JsonError as exc:
            raise PromptDataError(f"{where}: invalid JSON ({exc.detail}); each line must be one JSON object") from None
        if not isinstance(record, dict):
            raise PromptDataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        for key, setting in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
            if key not in record:
                raise PromptDataError(
                    f"{where}: missing key {key!r} ({setting}); the record has "
                    f"{', '.join(repr(k) for k in sorted(record)) or 'no keys'}: set {setting} to one of them"
                )
        prompt = record[prompt_key]
        if not isinstance(prompt, str):
            raise PromptDataError(
                f"{where}: {prompt_key!r} ({'data.prompt_key'}) is a {type(prompt).__name__}, expected a string"
            )
        answer = record[answer_key]
        if isinstance(answer, (dict, list)) or answer is None:
            raise PromptDataError(
                f"{where}: {answer_key!r} (data.answer_key) is {answer!r}; expected a string or a number"
            )
        formatted = _format_prompt(prompt_template, prompt, record, where)
        if max_prompt_length > 0:
            assert count_tokens is not None
            if count_tokens(formatted) > max_prompt_length:
                too_long += 1
                continue
        samples.append(
            PromptSample(index=len(samples), prompt=formatted, answer=str(answer), source=where, record=record)
        )
    total = len(samples) + too_long
    if total == 0:
        raise PromptDataError(f"{p}: no records (the file is empty); fix data.train_path")
    if not samples:
        raise PromptDataError(
            f"{p}: all {total} prompts are longer than data.max_prompt_length={max_prompt_length} tokens; "
            "raise data.max_prompt_length"
        )
    if too_long and on_filtered is not None:
        on_filtered(
            f"{p}: dropped {too_long}/{total} prompts longer than data.max_prompt_length={max_prompt_length} tokens"
        )
    return samples


def load_prompts_from_config(
    data: Any,
    *,
    split: str = "train",
    count_tokens: Callable[[str], int] | None = None,
    on_filtered: Callable[[str], None] | None = None,
) -> list[PromptSample]:
    """``load_prompts`` for ``DataConfig`` (``split``: "train" or "val"; val returns [] when unset)."""
    path = data.train_path if split == "train" else data.val_path
    if path is None:
        return []
    return load_prompts(
        path,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        prompt_template=data.prompt_template,
        max_prompt_length=data.max_prompt_length,
        count_tokens=count_tokens,
        on_filtered=on_filtered,
    )


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The sample order of ``epoch``: a permutation fixed by ``(seed, epoch)``, or 0..n-1."""
    order = list(range(num_samples))
    if shuffle:
        # str seeds hash with SHA-512 in random.seed(version=2): stable across processes and PYTHONHASHSEED
        random.Random(f"rlc-prompts:{seed}:{epoch}").shuffle(order)
    return order


class PromptCursor:
    """Deterministic, resumable iteration over prompts in epochs."""

    def __init__(self, samples: Sequence[PromptSample], *, seed: int, shuffle: bool = True) -> None:
        if not samples:
            raise PromptDataError("PromptCursor: no prompts to iterate over")
        self.samples = list(samples)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into the current epoch's order
        self.consumed = 0  # samples handed out since the start of training
        self._order = epoch_order(len(self.samples), seed=seed, epoch=0, shuffle=shuffle)

    def __len__(self) -> int:
        return len(self.samples)

    def next_batch(self, n: int) -> list[PromptSample]:
        """The next ``n`` prompts; crosses into the next epoch (new permutation) when needed."""
        if n < 0:
            raise ValueError(f"next_batch: n must be >= 0, got {n}")
        out: list[PromptSample] = []
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = epoch_order(len(self.samples), seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
            take = min(n - len(out), len(self._order) - self.position)
            out.extend(self.samples[i] for i in self._order[self.position : self.position + take])
            self.position += take
        self.consumed += n
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position, for the driver checkpoint."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "consumed": self.consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": len(self.samples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the dataset and its order settings must be the same."""
        missing = [k for k in ("epoch", "position", "consumed", "seed", "shuffle", "num_samples") if k not in state]
        if missing:
            raise PromptDataError(
                f"data cursor state is missing {', '.join(missing)}; the checkpoint is not from this runtime"
            )
        mismatched = [
            f"{name}: checkpoint {state[key]!r}, now {now!r}"
            for key, name, now in (
                ("num_samples", "number of prompts (data.train_path / data.max_prompt_length)", len(self.samples)),
                ("seed", "seed (grpo.seed)", self.seed),
                ("shuffle", "data.shuffle", self.shuffle),
            )
            if state[key] != now
        ]
        if mismatched:
            raise PromptDataError(
                "cannot resume the prompt order: the dataset changed since the checkpoint ("
                + "; ".join(mismatched)
                + "). Restore the original data/settings, or start without checkpointing.resume"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if not 0 <= position <= len(self.samples) or epoch < 0:
            raise PromptDataError(f"data cursor state has epoch={epoch}, position={position}: out of range")
        self.epoch, self.position, self.consumed = epoch, position, int(state["consumed"])
        self._order = epoch_order(len(self.samples), seed=self.seed, epoch=epoch, shuffle=self.shuffle)
