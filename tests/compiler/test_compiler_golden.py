"""Golden output of ``rlc`` for every class of recipe error.

Each case runs the CLI in-process in a copy of ``fixtures/`` (so file names in the output are
short and stable) and compares stdout+stderr and the exit code with ``golden/<case>.txt``.

Regenerate after an intended change of messages or of the schema:

    RLC_UPDATE_GOLDEN=1 python -m pytest tests/compiler/test_compiler_golden.py
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest
from compiler_testing import FIXTURES, HERE

from rlc.compiler import yaml_loader
from rlc.compiler.cli import main

GOLDEN = HERE / "golden"
UPDATE = os.environ.get("RLC_UPDATE_GOLDEN") == "1"


def _non_utf8(root: Path) -> None:
    (root / "generated").mkdir(exist_ok=True)
    (root / "generated" / "non_utf8.yaml").write_bytes("version: 1\nname: caf\u00e9\n".encode("latin-1"))


def _binary(root: Path) -> None:
    (root / "generated").mkdir(exist_ok=True)
    (root / "generated" / "binary.yaml").write_bytes(b"version: 1\n\x00\x01\x02\xff")


def _too_large(root: Path) -> None:
    (root / "generated").mkdir(exist_ok=True)
    text = "version: 1\n" + "# padding line\n" * (yaml_loader.MAX_BYTES // 15 + 1)
    (root / "generated" / "too_large.yaml").write_text(text)


V = "valid/minimal.yaml"
CASES: dict[str, tuple[list[str], object]] = {
    # schema errors
    "unknown_key": (["validate", "errors/unknown_key.yaml"], None),
    "enum": (["validate", "errors/enum.yaml"], None),
    "type": (["validate", "errors/type.yaml"], None),
    "range": (["validate", "errors/range.yaml"], None),
    "required": (["validate", "errors/required.yaml"], None),
    "oneof": (["validate", "errors/oneof.yaml"], None),
    "oneof_item": (["validate", "errors/oneof_item.yaml"], None),
    "pattern": (["validate", "errors/pattern.yaml"], None),
    "const": (["validate", "errors/const.yaml"], None),
    "many": (["validate", "errors/many.yaml"], None),
    # YAML errors
    "duplicate_key": (["validate", "errors/duplicate_key.yaml"], None),
    "alias_bomb": (["validate", "errors/alias_bomb.yaml"], None),
    "syntax": (["validate", "errors/syntax.yaml"], None),
    "not_mapping": (["validate", "errors/not_mapping.yaml"], None),
    "empty": (["validate", "errors/empty.yaml"], None),
    "multi_doc": (["validate", "errors/multi_doc.yaml"], None),
    "python_tag": (["validate", "errors/python_tag.yaml"], None),
    "merge_key": (["validate", "errors/merge_key.yaml"], None),
    "non_string_key": (["validate", "errors/non_string_key.yaml"], None),
    "non_utf8": (["validate", "generated/non_utf8.yaml"], _non_utf8),
    "binary": (["validate", "generated/binary.yaml"], _binary),
    "too_large": (["validate", "generated/too_large.yaml"], _too_large),
    # extends
    "extends_cycle": (["validate", "extends/cycle_a.yaml"], None),
    "extends_missing": (["validate", "extends/missing_parent.yaml"], None),
    "extends_parent_error": (["validate", "extends/bad_parent.yaml"], None),
    # --set
    "set_unknown_key": (["validate", V, "--set", "parallelism.train.tpp=2", "--set", "clsuter.nodes=2"], None),
    "set_bad_syntax": (["validate", V, "--set", "parallelism.train.tp"], None),
    "set_bad_value": (["validate", V, "--set", "cluster.nodes=[1"], None),
    "set_index": (["validate", V, "--set", "cluster.slurm.extra_flags[3]=--x"], None),
    "set_schema_error": (["validate", V, "--set", "cluster.nodes=0",
                          "--set", "data.prompt_template=Q: {prompt}"], None),
    # IO / usage
    "missing_file": (["validate", "no/such/recipe.yaml"], None),
    "folder_as_file": (["validate", "errors"], None),
    "show_errors": (["show", "errors/range.yaml"], "stderr-only"),
    # lint formats
    "lint_text": (["lint", "lintdir"], None),
    "lint_github": (["lint", "--format", "github", "lintdir"], None),
    "lint_json": (["lint", "--format", "json", "lintdir", "missing-folder"], None),
}


def _run(argv: list[str], cwd: Path, stderr_only: bool) -> str:
    buf = io.StringIO()
    sink = io.StringIO() if stderr_only else buf
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(buf):
            code = main(argv)
    finally:
        os.chdir(old)
    return f"$ rlc {' '.join(argv)}\n{buf.getvalue()}[exit {code}]\n"


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case, tmp_path):
    argv, setup = CASES[case]
    root = tmp_path / "fixtures"
    shutil.copytree(FIXTURES, root)
    if callable(setup):
        setup(root)
    got = _run(argv, root, stderr_only=setup == "stderr-only")
    assert "Traceback" not in got and "internal error" not in got
    golden = GOLDEN / f"{case}.txt"
    if UPDATE:
        golden.write_text(got, encoding="utf-8")
    assert golden.exists(), f"missing {golden}; run with RLC_UPDATE_GOLDEN=1"
    assert got == golden.read_text(encoding="utf-8")


def test_every_error_fixture_has_a_golden_case():
    used = {arg for argv, _ in CASES.values() for arg in argv}
    fixtures = {f"errors/{p.name}" for p in (FIXTURES / "errors").glob("*.yaml")}
    assert fixtures <= used, sorted(fixtures - used)


def test_no_stale_golden_files():
    assert {p.stem for p in GOLDEN.glob("*.txt")} == set(CASES)
