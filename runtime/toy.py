"""The learnable toy task for the GPU proof: single-digit addition modulo 10.

Prompts are ``"a+b="`` (``a``, ``b`` in 0..9) with answer ``str((a + b) % 10)``; the reward is the
built-in ``prefix_match`` (the completion must start with the digit). A tiny model with the
character-level tokenizer built here learns it in a few GRPO steps, so reward going up proves the
whole loop (generation → reward → loss → refit) works.

- ``write_dataset(path, n, seed)``: JSONL with ``prompt`` / ``answer`` fields.
- ``VOCAB``: the character vocabulary (special tokens first, then digits and a few symbols).
- ``build_tokenizer(dir)``: ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``special_tokens_map.json``)
  that ``transformers.AutoTokenizer.from_pretrained(dir)`` and vLLM load; needs the ``tokenizers``
  package. Every character is one token; the tokenizer prepends ``<bos>``; decoding concatenates.

``python -m rlc.runtime.toy OUT_DIR [--train N] [--val N] [--seed S]`` writes ``train.jsonl``,
``val.jsonl`` and ``tokenizer/`` under ``OUT_DIR``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
#: Token strings in id order.
VOCAB: list[str] = SPECIAL_TOKENS + list("0123456789") + list("+-*=#., \n")
TOKEN_IDS: dict[str, int] = {tok: i for i, tok in enumerate(VOCAB)}
PAD_ID, BOS_ID, EOS_ID, UNK_ID = (TOKEN_IDS[t] for t in SPECIAL_TOKENS)

PROMPT_KEY, ANSWER_KEY = "prompt", "answer"
REWARD_FUNCTION = "prefix_match"
#: Model context the toy task needs (bos + "a+b=" + answer + eos, with room to spare).
MAX_MODEL_LEN = 32


def vocab_size() -> int:
    return len(VOCAB)


def make_example(a: int, b: int) -> dict[str, str]:
    """``{"prompt": "3+9=", "answer": "2"}``."""
    if not (0 <= a <= 9 and 0 <= b <= 9):
        raise ValueError(f"toy operands are single digits, got {a} and {b}")
    return {PROMPT_KEY: f"{a}+{b}=", ANSWER_KEY: str((a + b) % 10)}


def examples(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` examples with operands drawn uniformly (with replacement) by ``random.Random(seed)``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    return [make_example(rng.randrange(10), rng.randrange(10)) for _ in range(n)]


def write_dataset(path: str | Path, n: int, seed: int) -> Path:
    """Write ``n`` toy examples as JSONL to ``path`` (parents created); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for ex in examples(n, seed):
            f.write(json.dumps(ex) + "\n")
    return p


def char_ids(text: str, *, add_bos: bool = True) -> list[int]:
    """Reference encoding without the ``tokenizers`` package: one id per character."""
    ids = [BOS_ID] if add_bos else []
    ids += [TOKEN_IDS.get(ch, UNK_ID) for ch in text]
    return ids


def build_tokenizer(directory: str | Path, *, model_max_length: int = MAX_MODEL_LEN) -> Path:
    """Build and save the character-level tokenizer in ``directory``; returns the directory.

    Word-level model over ``VOCAB`` with a pre-tokenizer that isolates every character, a ``<bos>``
    template post-processor, and a ``Fuse`` decoder (tokens join without spaces).
    """
    try:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError("build_tokenizer needs the 'tokenizers' package (pip install tokenizers)") from exc

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab=dict(TOKEN_IDS), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(d / "tokenizer.json"))

    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(TOKEN_IDS[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (d / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")
    return d


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlc.runtime.toy", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--train", type=int, default=2048, help="training prompts")
    parser.add_argument("--val", type=int, default=128, help="validation prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_dataset(args.out / "train.jsonl", args.train, args.seed)
    write_dataset(args.out / "val.jsonl", args.val, args.seed + 1)
    build_tokenizer(args.out / "tokenizer")
    print(f"wrote {args.out}/train.jsonl, val.jsonl, tokenizer/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
