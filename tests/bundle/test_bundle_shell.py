"""rlc.compiler.shell.quote: the one quoting function, checked against real bash."""
from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bundle_helpers import bash
from rlc.compiler.shell import Quoted, UnsafeValue, quote

NASTY = ["a b", "it's", 'say "hi"', "$(touch /tmp/rlc-never)", "`id`", "a;b", "x\ny", "tab\there",
         "back\\slash", "#comment", "%j%x", "", "'", '"', "$HOME", "!event", "*", "~root", "a\rb"]


@pytest.mark.parametrize("value", NASTY)
def test_shell_context_round_trips_through_bash(value):
    out = bash(f"printf '%s' {quote(value, 'k')}")
    assert out.returncode == 0 and out.stdout == value


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=40))
def test_shell_context_round_trips_any_text(value):
    assert bash(f"printf '%s' {quote(value, 'k')}").stdout == value


def test_nul_is_rejected_everywhere_with_the_key():
    for ctx in ("shell", "word", "sbatch", "sbatch_path", "mount"):
        with pytest.raises(UnsafeValue, match=r"^cluster\.env\.X: contains a NUL byte"):
            quote("a\x00b", "cluster.env.X", ctx)


@pytest.mark.parametrize("ctx", ["sbatch", "sbatch_path"])
@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "tab\t", "\x1b[0m", "del\x7f"])
def test_sbatch_context_rejects_control_characters(ctx, bad):
    with pytest.raises(UnsafeValue, match="cluster.slurm.job_name: contains .*#SBATCH line"):
        quote(bad, "cluster.slurm.job_name", ctx)


@pytest.mark.parametrize("bad", ["\x7f", "a\x1fb", "a\x01"])
def test_word_context_rejects_control_characters_including_del(bad):
    with pytest.raises(UnsafeValue, match=r"cluster\.container\.python: must be one word but contains the character"):
        quote(bad, "cluster.container.python", "word")


def test_sbatch_context_quotes_for_sbatchs_tokenizer():
    assert quote("plain-name_1.x", "k", "sbatch") == "plain-name_1.x"
    assert quote('a b"c\\d#e', "k", "sbatch") == '"a b\\"c\\\\d#e"'
    assert quote("/logs/100%", "k", "sbatch_path") == "/logs/100%%"
    with pytest.raises(UnsafeValue, match="backslash"):
        quote("/a\\b", "cluster.log_dir", "sbatch_path")


@pytest.mark.parametrize("path", ["/data", "/lustre/a.b/c-d_e+f@g=h~i"])
def test_mount_context_accepts_plain_absolute_paths(path):
    assert quote(path, "k", "mount") == path


@pytest.mark.parametrize("path,what", [("rel/path", "not absolute"), ("/a,b", "','"), ("/a:b", "':'"),
                                        ("/a b", "' '"), ("/a$(x)", "'\\$'"), ("/a\nb", "a newline")])
def test_mount_context_rejects_what_mount_lists_cannot_hold(path, what):
    with pytest.raises(UnsafeValue, match=rf"cluster\.container\.mounts\[0\]: .*{what}"):
        quote(path, "cluster.container.mounts[0]", "mount")


def test_word_context_needs_one_token():
    assert quote("/usr/bin/python3", "k", "word") == "/usr/bin/python3"
    with pytest.raises(UnsafeValue, match="cluster.container.python: must be one word"):
        quote("python3 -X dev", "cluster.container.python", "word")


def test_quoted_type_and_scalars():
    q = quote(8, "cluster.nodes", "sbatch")
    assert isinstance(q, Quoted) and q == "8"
    assert quote(True, "k") == "1"
    with pytest.raises(UnsafeValue, match="expected a string"):
        quote(["a"], "k")


def test_unknown_context_is_a_programming_error():
    with pytest.raises(ValueError):
        quote("x", "k", "html")


def test_printable_ascii_survive_sbatch_quoting_as_one_token():
    # every printable character but the ones sbatch rejects: one quoted token, no unquoted '#'
    value = "".join(c for c in string.printable if c not in "\n\r\t\x0b\x0c")
    q = quote(value, "k", "sbatch")
    assert q.startswith('"') and q.endswith('"') and "\n" not in q
