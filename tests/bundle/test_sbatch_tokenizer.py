"""`#SBATCH` values read back by sbatch's own tokenizer: any value (quotes, backslashes, `#`, spaces,
`%`, non-ASCII) is one argument that sbatch reads as exactly the recipe's value.

The tokenizer below is SLURM 22.05's `_get_argument` (src/sbatch/opt.c) written in Python: whitespace
separates arguments, `'` and `"` group, a backslash takes the next character as it is (inside quotes
too), and an unquoted, unescaped `#` ends the line. Output file names then go through sbatch's `%`
expansion (`%%` is `%`, `%j` the job id, `%x` the job name, ...)."""
from __future__ import annotations

import json
import re

from hypothesis import example, given, settings
from hypothesis import strategies as st

from bundle_helpers import compile_recipe
from rlc.compiler.shell import quote


def sbatch_arguments(rest: str) -> list[str]:
    """The arguments sbatch reads from the rest of an ``#SBATCH`` line."""
    args: list[str] = []
    i, n = 0, len(rest)
    while True:
        while i < n and rest[i].isspace():
            i += 1
        if i >= n:
            return args
        arg, quoted, q_char, escape = [], False, "", False
        while i < n and (quoted or not rest[i].isspace()) and rest[i] != "\n":
            ch = rest[i]
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
                i += 1
                continue
            elif quoted:
                if ch == q_char:
                    quoted = False
                    i += 1
                    continue
            elif ch in "\"'":
                quoted, q_char = True, ch
                i += 1
                continue
            elif ch == "#":  # an unquoted, unescaped '#': the rest of the line is a comment
                if arg:
                    args.append("".join(arg))
                return args
            arg.append(ch)
            i += 1
        args.append("".join(arg))


def expand_filename(pattern: str, job_id: str = "4242", name: str = "JOBNAME") -> str:
    """sbatch's expansion of ``--output``/``--error`` (``%%``, ``%j``, ``%x``, other ``%X`` kept as a marker)."""
    def one(m: re.Match) -> str:
        code = m.group(2)
        return {"%": "%", "j": job_id, "x": name}.get(code, f"<{code}>")
    return re.sub(r"%(\d*)([%A-Za-z])", one, pattern)


VALUE = st.text(alphabet=st.sampled_from(list("ab/ _-.#\"'\\%jx$`;:=,@+~!*()[]{}é漢")), min_size=1, max_size=30)


@settings(max_examples=400, deadline=None)
@given(value=VALUE)
@example(value='a b"c\\d#e\'f')
def test_any_sbatch_value_is_one_argument_sbatch_reads_back_exactly(value):
    line = f"--job-name={quote(value, 'cluster.slurm.job_name', 'sbatch')}"
    assert sbatch_arguments(line) == [f"--job-name={value}"], line


@settings(max_examples=400, deadline=None)
@given(value=VALUE.filter(lambda v: "\\" not in v))
@example(value="/logs/%j/%x%%a")
@example(value="/runs/100%a 50%b")
def test_any_output_folder_is_one_argument_that_expands_to_itself(value):
    line = f"--output={quote(value, 'cluster.log_dir', 'sbatch_path')}/slurm-%j.out"
    (arg,) = sbatch_arguments(line)
    assert expand_filename(arg) == f"--output={value}/slurm-4242.out", line


def test_the_rendered_header_reads_back_as_the_recipe_says(tmp_path, e2e_recipe):
    """The whole #SBATCH block of a compiled launch.sbatch, read the way sbatch reads it."""
    name = "a b\"c'd#e\\f%j$(id)"
    logs = tmp_path / "lo gs#1%x"
    sets = [f"cluster.log_dir={json.dumps(str(logs))}", f"cluster.slurm.job_name={json.dumps(name)}"]
    script = compile_recipe(e2e_recipe, tmp_path / "b", sets).path / "launch.sbatch"
    args = []
    for line in script.read_text().splitlines()[1:]:
        if not line.startswith("#SBATCH"):
            break
        args += sbatch_arguments(line[len("#SBATCH"):])
    assert f"--job-name={name}" in args
    outputs = [expand_filename(a) for a in args if a.startswith(("--output=", "--error="))]
    assert outputs == [f"--output={logs}/slurm-4242.out", f"--error={logs}/slurm-4242.out"]
