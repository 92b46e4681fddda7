"""``rlc COMMAND ...`` builds the parser of that command alone; it must parse and explain exactly as
the whole parser does, and every command must be listed in ``cli.COMMANDS``."""
from __future__ import annotations

import argparse

import pytest

from rlc.compiler import cli


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _helps(parser: argparse.ArgumentParser) -> list[str]:
    """The help of a parser and of every parser nested in it."""
    out = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _helps(sub)
    return out


def test_every_command_is_listed():
    assert tuple(_commands(cli.build_parser())) == cli.COMMANDS


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_the_one_command_parser_is_the_whole_parsers(command):
    whole, one = _commands(cli.build_parser()), _commands(cli.build_parser(only=command))
    assert list(one) == [command]
    assert _helps(one[command]) == _helps(whole[command])


@pytest.mark.parametrize("argv, only", [
    (["validate", "r.yaml"], "validate"), (["--debug", "compile", "r.yaml", "-o", "b"], "compile"),
    (["import", "nemo-rl", "c.yaml", "-o", "r.yaml"], "import"), (["--help"], None), (["--version"], None),
    (["valid", "r.yaml"], None), ([], None), (["--debug"], None), (["-h", "validate"], None),
])
def test_which_runs_build_one_command(argv, only):
    assert cli._command_only(argv) == only


@pytest.mark.parametrize("argv", [
    ["validate", "r.yaml", "--set", "a=1", "--calibration", "c.yaml"], ["--debug", "plan", "r.yaml", "--json"],
    ["compile", "r.yaml", "-o", "out", "--force"], ["lint", "a", "b", "--format", "github", "-j", "2"],
    ["import", "nemo-rl", "c.yaml", "-o", "r.yaml", "a.b=1", "--set", "k=v"], ["explain", "RLC301"],
    ["doctor", "-", "--recipe", "r.yaml"], ["submit", "b", "--test-only"], ["show", "--list"],
])
def test_the_arguments_parse_the_same(argv):
    whole, _ = cli.build_parser().parse_known_args(argv)
    one, _ = cli.build_parser(only=cli._command_only(argv)).parse_known_args(argv)
    assert vars(one) == vars(whole)
