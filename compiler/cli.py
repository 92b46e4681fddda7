"""The ``rlc`` command line.

Subcommands: ``validate``, ``lint``, ``show``, ``schema``, ``explain``, ``plan``, ``compile``,
``calibrate``, ``submit``, ``import nemo-rl``, ``doctor``. Exit codes: 0 ok, 1 recipe errors, 2 usage or IO
errors (3 only for an internal error, i.e. a bug in rlc). Bad input never produces a Python traceback;
``--debug`` shows one for internal errors.

``validate``/``lint``/``plan``/``compile`` all go through :func:`run_check`
(``rlc.compiler.api.check``), so a recipe that passes one passes them all. Heavy or optional
modules (the API pipeline, bundle, submit, rules, jsonschema, jinja2) are imported inside the
command that needs them: ``rlc validate`` stays fast and never imports torch, ray, vllm or
megatron.
"""
from __future__ import annotations

import argparse
import atexit
import errno
import io
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

from rlc.compiler import collect_rarely
from rlc.compiler.diagnostics import (
    DEFAULT_ORIGIN,
    INTERNAL_RULE,
    FORMATTERS,
    Diagnostic,
    PathPart,
    exit_code,
    format_path,
    format_text,
    sort_diagnostics,
    summary,
)
from rlc.compiler.yaml_writer import dump_yaml

if TYPE_CHECKING:
    from rlc.compiler.api import CheckResult
    from rlc.compiler.recipe_types import Recipe

EXIT_OK, EXIT_RECIPE, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class UsageError(Exception):
    """A problem with how rlc was called (exit code 2)."""


def _version() -> str:
    from rlc import __version__  # noqa: PLC0415

    return __version__


# --------------------------------------------------------------------------- the check pipeline

def run_check(path: str, overrides: Sequence[str] = ()) -> CheckResult:
    """Every compiler stage on one recipe: ``rlc.compiler.api.check``."""
    from rlc.compiler import api  # noqa: PLC0415

    return api.check(path, overrides)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _recipe_arg(text: str) -> str:
    """A recipe file, or the name of a shipped recipe when no such file exists."""
    if os.path.exists(text):
        return text
    from rlc.compiler.recipe import looks_like_path, shipped_recipe_path  # noqa: PLC0415

    if not looks_like_path(text):
        try:
            return str(shipped_recipe_path(text))
        except KeyError:
            pass
    return text


def _print_diags(diags: Sequence[Diagnostic], stream: Any = None) -> None:
    if diags:
        (stream or sys.stderr).write(format_text(diags))


def _overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` values, then ``--calibration FILE`` as the ``cluster.calibration`` override."""
    sets = list(getattr(args, "set", None) or ())
    calibration = getattr(args, "calibration", None)
    if calibration:
        from rlc.compiler.planner.calibration import shipped_calibrations  # noqa: PLC0415

        ref = calibration if calibration in shipped_calibrations() else os.path.abspath(calibration)
        sets.append(f"cluster.calibration={json.dumps(ref)}")
    return sets


def _checked(args: argparse.Namespace) -> tuple[CheckResult, list[Diagnostic], int]:
    result = run_check(_recipe_arg(args.file), _overrides(args))
    diags = _ordered(result.diagnostics, result)
    return result, diags, exit_code(diags)


def _ordered(diags: Sequence[Diagnostic], result: CheckResult) -> list[Diagnostic]:
    """Reading order, the checked recipe's own file first (parents' after)."""
    root = result.loaded.root if result.loaded is not None else None
    return sort_diagnostics(diags, root.file if root is not None else None)


# --------------------------------------------------------------------------- commands

def cmd_validate(args: argparse.Namespace) -> int:
    """Check one recipe: YAML, extends, --set, schema, model facts, memory plan and rules."""
    _result, diags, code = _checked(args)
    _print_diags(diags)
    if code == EXIT_OK:
        extra = f" ({summary(diags)})" if diags else ""
        print(f"{args.file}: ok{extra}")
    else:
        print(f"{args.file}: {summary(diags)}", file=sys.stderr)
    return code


def cmd_lint(args: argparse.Namespace) -> int:
    """Check every recipe under the given files/folders; print in text, GitHub or JSON format."""
    from rlc.compiler.lint import OUTPUTS_RULE, lint, output_folders, shared_output_warnings  # noqa: PLC0415

    def check(path: str) -> list[Diagnostic]:
        try:
            result = run_check(path, ())
            outputs = [output_folders(path, result)] if result.ok else []  # (checks may run in workers)
        except Exception as exc:  # a bug in rlc: say so for this file and lint the others  # noqa: BLE001
            if getattr(args, "debug", False):
                import traceback  # noqa: PLC0415 - only for --debug

                traceback.print_exc()
            return [Diagnostic("error", f"internal error: {type(exc).__name__}: {exc} (a bug in rlc; rerun "
                               "`rlc validate --debug` on this file for the traceback and report it)",
                               file=path, rule=INTERNAL_RULE)]
        return _ordered(result.diagnostics, result) + outputs

    found, target = lint(args.paths, check, args.jobs, skip_non_recipes=args.skip_non_recipes)
    diags = [d for d in found if d.rule != OUTPUTS_RULE]
    diags += shared_output_warnings([d for d in found if d.rule == OUTPUTS_RULE])
    sys.stdout.write(FORMATTERS[args.format](diags))
    if args.format == "text" or args.verbose:
        skipped = f", skipped {len(target.skipped)} other YAML file(s)" if target.skipped else ""
        print(f"linted {len(target.recipes)} recipe(s){skipped}: {summary(diags)}", file=sys.stderr)
    return exit_code(diags)


def cmd_show(args: argparse.Namespace) -> int:
    """Print the resolved recipe (extends merged, --set applied, defaults filled)."""
    from rlc.compiler import recipe as recipe_mod  # noqa: PLC0415

    if args.list:
        for name in recipe_mod.shipped_recipe_names():
            print(name)
        return EXIT_OK
    if not args.file:
        raise UsageError("show needs a recipe FILE (or --list)")
    from rlc.compiler import schema  # noqa: PLC0415

    try:
        loaded = recipe_mod.load_recipe(_recipe_arg(args.file), args.set or ())
    except recipe_mod.RecipeLoadError as exc:
        _print_diags(exc.diagnostics)
        return exit_code(exc.diagnostics)
    diags = schema.validate(loaded)
    resolved = schema.with_defaults(loaded.data)
    comment = None
    if args.origin:
        def comment(path: tuple[PathPart, ...]) -> str:
            origin = loaded.origins.get(format_path(path))
            return str(origin) if origin is not None else DEFAULT_ORIGIN
    sys.stdout.write(dump_yaml(resolved, comment))
    _print_diags(diags)
    return exit_code(diags)


def cmd_schema(args: argparse.Namespace) -> int:
    """Print the recipe JSON Schema, or the Markdown reference rendered from it."""
    from rlc.compiler import schema  # noqa: PLC0415

    if args.markdown:
        from rlc.compiler.docs import render_markdown  # noqa: PLC0415

        text = render_markdown(schema.load_schema())
    else:
        text = schema.schema_text()
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return EXIT_OK


def _stage(module: str, name: str | None = None) -> Any:
    """Import a later compiler stage (``rlc.compiler.<module>``) inside the command that needs it;
    a stage missing from this build is a usage error, not a crash."""
    import importlib  # noqa: PLC0415

    try:
        mod = importlib.import_module(f"rlc.compiler.{module}")
        return getattr(mod, name) if name else mod
    except ImportError as exc:
        if not (exc.name or "").startswith("rlc.compiler"):
            raise
        raise UsageError(f"rlc.compiler.{module} is not available in this build") from None
    except AttributeError:
        raise UsageError(f"rlc.compiler.{module}.{name} is not available in this build") from None


def cmd_explain(args: argparse.Namespace) -> int:
    """Explain a rule id (``RLC301``): what it checks, why, and how to fix it."""
    rules = _stage("rules")
    if args.list:
        for r in rules.all_rules():
            print(f"{r.id}  {'/'.join(r.severities):<15} {r.title}")
        return EXIT_OK
    if not args.rule:
        raise UsageError("explain needs a RULE id (or --list)")
    try:
        text = rules.explain(args.rule)
    except LookupError as exc:  # UnknownRuleError: its message suggests close ids
        raise UsageError(str(exc) if str(exc) else f"unknown rule {args.rule!r}") from None
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """Show the memory plan and the refit decisions for a recipe."""
    result, diags, code = _checked(args)
    plan = result.plan
    if args.json:
        payload = {
            "diagnostics": [d.__dict__ for d in diags],
            "decisions": {k: list(v) for k, v in result.decisions.items()},
            "plan": plan.to_json() if plan is not None else None,
        }
        print(json.dumps(payload, indent=2, default=str))
        return code
    _print_diags(diags)
    if plan is not None:
        print(plan.to_text())
    elif code == EXIT_OK:
        print(f"{args.file}: no memory plan (see the messages above)", file=sys.stderr)
    return code


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the planner's constants for a GPU and software stack from runs' memory records."""
    from rlc.compiler.calibrate import calibrate  # noqa: PLC0415
    from rlc.compiler.planner.calibration import CalibrationError  # noqa: PLC0415

    result = run_check(_recipe_arg(args.recipe), args.set or ())
    fatal = [d for d in result.diagnostics if d.severity == "error" and d.rule not in _PLAN_RULES]
    if result.recipe is None or result.facts is None or result.gpu is None or fatal:
        diags = _ordered(result.diagnostics, result)
        _print_diags(diags)
        return exit_code(diags) or EXIT_RECIPE
    try:
        text = calibrate(args.runs, result, Path(args.output), entry_id=args.id)
    except CalibrationError as exc:
        raise UsageError(str(exc)) from None
    sys.stdout.write(text)
    return EXIT_OK


#: Rule ids about the plan's verdict: a recipe whose refit fails still has measurable runs to fit from.
_PLAN_RULES = frozenset({"RLC210", "RLC211"})


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a recipe into a launch bundle folder."""
    result, diags, code = _checked(args)
    _print_diags(diags)
    if code != EXIT_OK:
        return code
    bundle = _stage("bundle")
    assert result.recipe is not None  # no errors: the schema accepted it
    try:
        built = bundle.build_bundle(result, Path(args.output or default_bundle_dir(result.recipe)), force=args.force)
    except bundle.BundleError as exc:
        diag = Diagnostic("error", str(exc), path=exc.key or "", rule="io" if exc.kind == "io" else None)
        origin = result.loaded.locate(exc.key) if exc.key and result.loaded is not None else None
        if origin is not None:
            diag.file, diag.line, diag.col = origin.file, origin.line, origin.col
        _print_diags([diag])
        return exc.exit_code
    reported = {f"{d.path}: {d.message}" for d in diags}
    for warning in built.warnings:
        if warning not in reported:  # the check above printed the bundle stage's own warnings
            sys.stderr.write(f"warning: {warning}\n")
    print(
        f"wrote bundle {built.path} ({len(built.files)} files); submit with: rlc submit {shlex.quote(str(built.path))}"
    )
    return EXIT_OK


def default_bundle_dir(recipe: Recipe) -> Path:
    """Where ``rlc compile RECIPE`` without ``-o`` writes: ``bundles/<name>`` here."""
    return Path("bundles") / recipe.name


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit a compiled bundle with sbatch (``--test-only`` asks SLURM without queueing)."""
    submit_main = _stage("submit", "main")
    return submit_main(Path(args.bundle), test_only=args.test_only)


def cmd_import_nemo_rl(args: argparse.Namespace) -> int:
    """Turn a NeMo-RL config into a commented rlc recipe, write it, and validate it."""
    from rlc.compiler.importers import nemo_rl  # noqa: PLC0415
    from rlc.compiler.importers.nemo_rl.cli_output import import_report, stopped_report, write_atomically  # noqa: PLC0415

    out = Path(args.output)
    if out.is_dir():
        raise UsageError(f"{out} is a folder; name the recipe file to write (e.g. {out / 'recipe.yaml'})")
    if out.exists() and not args.force:
        raise UsageError(f"{out} exists; pass --force to replace it")
    try:
        imported = nemo_rl.import_nemo_rl(args.config, args.overrides, args.set or (), accept_loss=args.accept_loss,
                                          allow_env=args.allow_env)
    except nemo_rl.NemoRlConfigError as exc:
        raise UsageError(f"cannot read the NeMo-RL config: {exc}") from None
    except nemo_rl.NotGrpoConfig as exc:
        raise UsageError(str(exc)) from None
    except nemo_rl.ImportStopped as exc:
        sys.stderr.write(stopped_report(exc, args.config))
        return EXIT_RECIPE
    except nemo_rl.SetError as exc:
        _print_diags(exc.diagnostics)
        return exit_code(exc.diagnostics)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # like `rlc compile -o`: a new folder is made
        write_atomically(out, imported.text)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    result, diags, code = _checked(argparse.Namespace(file=str(out), set=()))
    sys.stdout.write(import_report(imported, out))
    _print_diags(diags)
    print(
        f"{out}: {'ok' if code == EXIT_OK else summary(diags)}"
        + (f" ({summary(diags)})" if code == EXIT_OK and diags else ""),
        file=sys.stderr if code else sys.stdout,
    )
    return code


def cmd_doctor(args: argparse.Namespace) -> int:
    """Read a failed job's log; name the rule that would have caught each failure and the fix."""
    from rlc.compiler.doctor import diagnose  # noqa: PLC0415
    from rlc.compiler.doctor.logs import LogReadError, read_logs  # noqa: PLC0415
    from rlc.compiler.doctor.report import render  # noqa: PLC0415

    notes: list[str] = []
    try:
        logs = read_logs(args.log, notes)
    except LogReadError as exc:
        raise UsageError(str(exc)) from None
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    result = None
    if args.recipe:
        result, diags, code = _checked(argparse.Namespace(file=args.recipe, set=args.set))
        if result.recipe is None:
            _print_diags(diags)
            raise UsageError(f"cannot re-plan: {args.recipe} does not pass the schema (see above)")
    elif args.set:
        raise UsageError("--set needs --recipe")
    findings = diagnose(logs if len(logs) > 1 or logs[0][0] else logs[0][1], result)
    sys.stdout.write(render(findings, "stdin" if args.log == "-" else args.log, args.recipe))
    return EXIT_OK if findings else EXIT_RECIPE


# --------------------------------------------------------------------------- argument parsing

class _Unparsed:
    """Stands in for the parser of a command this run does not parse (``build_parser(only=...)``)."""

    epilog: str | None = None

    def add_argument(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_defaults(self, **kwargs: Any) -> None:
        pass

    def add_subparsers(self, **kwargs: Any) -> _Unparsed:
        return self

    def add_parser(self, *args: Any, **kwargs: Any) -> _Unparsed:
        return self


#: The commands :func:`build_parser` adds, in its order.
COMMANDS = ("validate", "lint", "show", "schema", "explain", "plan", "compile", "calibrate", "import", "doctor",
            "submit")


def _command_only(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs when nothing but it needs parsing (``rlc [--debug] COMMAND ...``):
    then only that command's parser is built, the others cost nothing. ``None`` for anything else
    (``--help``, ``--version``, an unknown command): the whole parser."""
    for arg in argv:
        if arg != "--debug":
            return arg if arg in COMMANDS else None
    return None


def _terminal_columns() -> int:
    """``shutil.get_terminal_size().columns``, the width argparse's help formatter asks for, without importing
    ``shutil`` (with bz2 and lzma): argparse builds a formatter for every argument added, so every command paid
    for that import."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
        columns = columns or 80
    return columns


class _Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose help formatter gets the terminal width from :func:`_terminal_columns`
    (argparse subtracts 2 from it, as here). Subcommands' parsers are of this class too."""

    def _get_formatter(self) -> argparse.HelpFormatter:
        formatter = cast("type[argparse.HelpFormatter]", self.formatter_class)  # (every argparse formatter takes width)
        return formatter(prog=self.prog, width=_terminal_columns() - 2)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``rlc`` argument parser (exposed for documentation and tests); with ``only``, the
    parser of that command alone is built (the others are listed nowhere but never run)."""
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show a traceback for internal errors")
    sets = _Parser(add_help=False)
    sets.add_argument("--set", action="append", metavar="KEY=VALUE",
                      help="override a key after extends (VALUE is YAML); repeatable")

    parser = _Parser(
        prog="rlc", parents=[common],
        description="Declarative recipe compiler for large-scale RL post-training.",
        epilog="exit codes: 0 ok, 1 recipe errors, 2 usage or IO errors, 3 a bug in rlc",
    )
    parser.add_argument("--version", action="version", version=f"rlc {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, func: Callable[[argparse.Namespace], int], help_text: str,
            with_set: bool = False) -> argparse.ArgumentParser:
        if only is not None and name != only:
            return cast(argparse.ArgumentParser, _Unparsed())
        parents = [common, sets] if with_set else [common]
        p = sub.add_parser(name, parents=parents, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    def calibration_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument("--calibration", metavar="FILE",
                       help="planner constants written by `rlc calibrate` (or a shipped calibration name); "
                            "same as --set cluster.calibration=FILE")

    p = add("validate", cmd_validate, "check one recipe", with_set=True)
    p.add_argument("file", metavar="FILE", help="recipe file or shipped recipe name")
    calibration_flag(p)

    p = add("lint", cmd_lint, "check recipes in files and folders (for CI and pre-commit)")
    p.add_argument("paths", metavar="PATH", nargs="+", help="recipe files or folders (recursive)")
    p.add_argument("--format", choices=sorted(FORMATTERS), default="text", help="output format")
    p.add_argument("-v", "--verbose", action="store_true", help="print the summary in every format")
    p.add_argument("-j", "--jobs", type=_positive_int, metavar="N",
                   help="worker processes (default: one per CPU, at most one per 100 recipes)")
    p.add_argument("--skip-non-recipes", action="store_true",
                   help="skip named files that do not look like recipes, as in folders (pre-commit passes "
                        "every YAML file); by default a named file is always checked")

    p = add("show", cmd_show, "print the resolved recipe (extends, --set and defaults applied)",
            with_set=True)
    p.add_argument("file", metavar="FILE", nargs="?", help="recipe file or shipped recipe name")
    p.add_argument("--origin", action="store_true", help="annotate each key with the file:line that set it")
    p.add_argument("--list", action="store_true", help="list the recipes shipped with rlc")

    p = add("schema", cmd_schema, "print the recipe JSON Schema")
    p.add_argument("--markdown", action="store_true", help="render the Markdown reference instead")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")

    p = add("explain", cmd_explain, "explain a rule id (e.g. RLC301)")
    p.add_argument("rule", metavar="RULE", nargs="?")
    p.add_argument("--list", action="store_true", help="list every rule")

    p = add("plan", cmd_plan, "show the memory plan and refit decisions", with_set=True)
    p.add_argument("file", metavar="FILE", help="recipe file or shipped recipe name")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    calibration_flag(p)

    p = add("compile", cmd_compile, "compile a recipe into a launch bundle", with_set=True)
    p.add_argument("file", metavar="FILE", help="recipe file or shipped recipe name")
    calibration_flag(p)
    p.add_argument("-o", "--output", metavar="DIR",
                   help="bundle folder to write (default: bundles/<recipe name> in the current folder)")
    p.add_argument("--force", action="store_true", help="replace an existing bundle folder")

    p = add("calibrate", cmd_calibrate, "fit the planner's constants for a GPU and software stack from runs",
            with_set=True)
    p.add_argument("runs", metavar="RUN_DIR", nargs="+",
                   help="a run's log folder (logging.dir: calibration.jsonl and metrics.jsonl)")
    p.add_argument("--recipe", metavar="RECIPE", required=True,
                   help="the recipe the runs were compiled from (model, layout, generation budget)")
    p.add_argument("-o", "--output", metavar="FILE", required=True, help="calibration file to write")
    p.add_argument("--id", metavar="ID", help="entry id (default: GPU and vLLM version, e.g. h200-141gb-vllm-0.22.0)")

    p = (sub.add_parser("import", parents=[common], help="turn another tool's config into an rlc recipe",
                        description="turn another tool's config into an rlc recipe")
         if only in (None, "import") else cast(argparse.ArgumentParser, _Unparsed()))
    importers = p.add_subparsers(dest="source", metavar="SOURCE")
    importers.required = True
    p = importers.add_parser(
        "nemo-rl", parents=[common, sets], help="a NeMo-RL GRPO config (defaults chain, ${...}, overrides)",
        description="Read a NeMo-RL config as NeMo-RL does (defaults chain, interpolations, Hydra-style "
                    "overrides), write a commented rlc recipe, and validate it. Keys rlc cannot map are listed.",
        epilog="example: rlc import nemo-rl grpo-qwen3-30ba3b-8n8g-megatron.yaml -o recipe.yaml "
               "--set cluster.gpu=h100-80gb policy.megatron_cfg.tensor_model_parallel_size=2")
    p.set_defaults(func=cmd_import_nemo_rl)
    p.add_argument("config", metavar="CONFIG", help="the NeMo-RL YAML config")
    p.add_argument("overrides", metavar="OVERRIDE", nargs="*",
                   help="Hydra-style override of the NeMo-RL config (key=value, +key=value, ++key=value, ~key)")
    p.add_argument("-o", "--output", metavar="RECIPE", required=True, help="recipe file to write")
    p.add_argument("--force", action="store_true", help="replace an existing recipe file")
    p.add_argument("--accept-loss", action="store_true",
                   help="write the recipe although settings that change the experiment have no rlc equivalent (the "
                        "recipe lists them, and extensions.nemo_rl_import.dropped records them)")
    p.add_argument("--allow-env", action="store_true",
                   help="resolve ${oc.env:VAR} from this environment (refused by default: the values are written "
                        "into the recipe)")

    p = add("doctor", cmd_doctor, "name the rule and the fix for the failures in a job's log", with_set=True)
    p.add_argument("log", metavar="LOG", help="the failed job's log (rlc, NeMo-RL, verl, vLLM, Megatron), a folder "
                   "of logs (read recursively: *.log, *.out, *.err, *.txt), or - for stdin")
    p.add_argument("--recipe", metavar="RECIPE", help="re-plan this recipe with the log's numbers")
    p.epilog = "exit codes: 0 a known failure recognised, 1 nothing recognised, 2 usage or IO errors"

    p = add("submit", cmd_submit, "submit a compiled bundle with sbatch")
    p.add_argument("bundle", metavar="DIR")
    p.add_argument("--test-only", action="store_true", help="sbatch --test-only (nothing is queued)")
    return parser


class _ClosedOutput(io.TextIOBase):
    """Standard output or error that was closed before rlc started (``rlc schema >&-``): Python
    sets it to ``None``; writing reports it as the I/O error it is."""

    def __init__(self, name: str) -> None:
        self._name = name

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, f"standard {self._name} is closed")


def _discard_stdout() -> None:
    """After stdout failed: no more writes to it, not even Python's flush at exit."""
    try:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
    except OSError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rlc`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    if sys.stdout is None:
        sys.stdout = _ClosedOutput("output")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - nowhere to report to; the exit code still says
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=_command_only(argv))
    try:
        args, extra = parser.parse_known_args(argv)
        # `rlc import nemo-rl CONFIG --set k=v a.b=1`: NeMo-RL overrides may follow options
        if extra and getattr(args, "source", None) == "nemo-rl" and not any(e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    debug = getattr(args, "debug", False)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a full disk or a closed output fails here, not in Python's exit
        return code
    except UsageError as exc:
        print(f"rlc {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `rlc schema | head`
        _discard_stdout()
        return EXIT_OK
    except OSError as exc:  # the output could not be written (disk full, closed), or a file read failed
        _discard_stdout()
        if debug:
            import traceback  # noqa: PLC0415 - only for --debug

            traceback.print_exc()
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        print(f"rlc {args.command}: I/O error: {exc.strerror or exc}{where}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # a bug in rlc, not bad input  # noqa: BLE001
        if debug:
            import traceback  # noqa: PLC0415 - only for --debug

            traceback.print_exc()
        else:
            print(f"rlc: internal error: {type(exc).__name__}: {exc}\n"
                  "This is a bug in rlc; rerun with --debug for the traceback and report it.",
                  file=sys.stderr)
        return EXIT_INTERNAL


def run() -> None:
    """The ``rlc`` command as a process: :func:`main`, then exit without tearing the interpreter down.

    At exit Python frees every module and object one by one, about a tenth of ``rlc validate``; the
    operating system frees the process anyway. Exit handlers still run and the output is flushed
    first, so nothing but that teardown is skipped. Under a profiler or tracer (``python -m cProfile -m
    rlc``, a debugger), which reports after the command returns, it exits as usual."""
    collect_rarely()  # (``python -m rlc`` does it before importing this module)
    code = main()
    if sys.getprofile() is not None or sys.gettrace() is not None:
        raise SystemExit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed output: main() has said so, the exit code too
            pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()
