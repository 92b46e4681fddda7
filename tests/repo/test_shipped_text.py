"""What ships to users (rlc/ and the component folders it links, docs/, README.md) speaks about the product: no
process text.

Sources are cited by their public names (``NeMo-RL #2471``, ``SkyRL #1816``); internal tracker
numbers, team roles, development tools and private paths have no meaning to a user.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".txt", ".j2", ".sh", ".toml", ".cfg"}

#: (pattern, why it is process text). Case-insensitive.
FORBIDDEN = [
    (r"(?<![\w/-])issue ?\d+\b", "an internal issue number (cite the public source by name, e.g. NeMo-RL #2471)"),
    (r"\bissue\d+", "an internal issue number in a name"),
    (r"\bseeds? ?0\d\d\b|\bseed[-_]?0\d\d", "an internal field-report number (cite NeMo-RL #2471, SkyRL #1816, ...)"),
    (r"\b(gpu|refit|planner|bundle|foundation|grpo) engineer\b", "a team role"),
    (r"\bthe lead\b|\bhelper session\b|\bfounding session", "a team role"),
    (r"customer'?s\b", "a reference to a customer"),
    (r"\bdevice tool\b|/work/shared|HELPERS\.md|\bclaude\b|\bcodex\b|\bchatgpt\b|\bcopilot\b",
     "a development tool or private path"),
]


#: The top-level folders that ship inside the ``rlc`` package (``rlc/`` links them).
SHIPPED_COMPONENTS = ("compiler", "runtime", "contract", "recipes", "templates", "schemas")


def shipped_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "rlc", *SHIPPED_COMPONENTS, "docs", "README.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / p for p in listed if Path(p).suffix in TEXT_SUFFIXES and (ROOT / p).is_file()]


def find_process_text(text: str) -> list[tuple[int, str, str]]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, why in FORBIDDEN:
            m = re.search(pattern, line, flags=re.IGNORECASE)
            if m:
                hits.append((n, m.group(0), why))
    return hits


def test_no_process_text_in_shipped_files():
    files = shipped_files()
    assert len(files) > 50
    problems = [f"{p.relative_to(ROOT)}:{n}: {word!r}: {why}"
                for p in files for n, word, why in find_process_text(p.read_text(encoding="utf-8", errors="replace"))]
    assert not problems, "process text in shipped files:\n" + "\n".join(problems)


def test_no_developer_notes_under_docs():
    assert not (ROOT / "docs" / "TEAM.md").exists()
    assert (ROOT / "CONTRIBUTING.md").exists()


@pytest.mark.parametrize("line", [
    "Rules (issue 3; see below)", "# Issue 8: a tiny model", "seed 000 failure 3", "from seed003",
    "the GPU engineer's file", "the customer's cluster", "dump(res, out, 'issue8_four_gpu')",
])
def test_the_check_catches_process_text(line):
    assert find_process_text(line)


@pytest.mark.parametrize("line", [
    "NeMo-RL #2471: refit fails with PP > 1", "verl-project/verl issue #6691 (num_experts=512)",
    "grpo.seed: 1", "a helper function", "leads to an OOM", "SkyRL #1816 (per-rank metadata)",
])
def test_the_check_leaves_product_text_alone(line):
    assert not find_process_text(line)
