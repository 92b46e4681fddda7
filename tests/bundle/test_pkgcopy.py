"""The bundle's copy of rlc: the files ``shutil.copytree`` copied before, each hashed from the bytes
written in the same pass, with the bundle's permissions and the installed files' times."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import rlc
from rlc.compiler.bundle import pkgcopy
from rlc.compiler.bundle.lock import DIR_MODE, FILE_MODE


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_the_copy_is_the_package_with_the_hash_of_each_file(tmp_path):
    hashes = pkgcopy.copy_rlc(tmp_path / "new")
    shutil.copytree(Path(rlc.__file__).resolve().parent, tmp_path / "old" / "rlc",
                    ignore=shutil.ignore_patterns(*pkgcopy.SKIP))
    assert set(hashes) == _files(tmp_path / "new") == _files(tmp_path / "old")
    assert "rlc/compiler/cli.py" in hashes and not any("__pycache__" in rel for rel in hashes)
    source = Path(rlc.__file__).resolve().parent
    for rel, digest in hashes.items():
        copied, installed = tmp_path / "new" / rel, source / rel.removeprefix("rlc/")
        assert digest == hashlib.sha256(copied.read_bytes()).hexdigest() == hashlib.sha256(
            installed.read_bytes()).hexdigest(), rel
        st = copied.stat()
        assert stat.S_IMODE(st.st_mode) == FILE_MODE and st.st_mtime_ns == installed.stat().st_mtime_ns, rel
    for folder in (p for p in (tmp_path / "new").rglob("*") if p.is_dir()):
        assert stat.S_IMODE(folder.stat().st_mode) == DIR_MODE


def test_a_changed_file_changes_its_hash(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.py").write_text("x = 1\n")
    (src / ".hidden").write_text("skipped\n")
    (src / "big.bin").write_bytes(os.urandom(3 << 20))  # more than one read
    first: dict[str, str] = {}
    pkgcopy._copy_dir(src, tmp_path / "one", "rlc", first)
    (src / "sub" / "a.py").write_text("x = 2\n")
    second: dict[str, str] = {}
    pkgcopy._copy_dir(src, tmp_path / "two", "rlc", second)
    assert set(first) == set(second) == {"rlc/sub/a.py", "rlc/big.bin"}
    assert first["rlc/sub/a.py"] != second["rlc/sub/a.py"]
    assert second["rlc/sub/a.py"] == hashlib.sha256(b"x = 2\n").hexdigest()
    assert (tmp_path / "two" / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    assert first["rlc/big.bin"] == hashlib.sha256((src / "big.bin").read_bytes()).hexdigest()
