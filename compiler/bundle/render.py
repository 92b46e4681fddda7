"""Render the bundle's jinja2 templates (package ``rlc.templates``, folder ``bundle/``).

Scripts are rendered by an environment whose ``finalize`` refuses any value that is not an
``int`` or a :class:`rlc.compiler.shell.Quoted` string: a template cannot print an unquoted
recipe value. Plain text files (README.txt) use a permissive environment.
"""
from __future__ import annotations

from typing import Any

import jinja2

from rlc.compiler.shell import Quoted
from rlc.templates import BUNDLE_TEMPLATES


def _load(name: str) -> str:
    # a file of the package, read as the recipe schema is (``importlib.resources`` would load ``tempfile`` and
    # more for the same path)
    return (BUNDLE_TEMPLATES / name).read_text(encoding="utf-8")


def _only_quoted(value: Any) -> Any:
    if isinstance(value, Quoted) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise TypeError(f"template printed an unquoted value {value!r}; quote it with rlc.compiler.shell.quote")


def _environment(strict: bool) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(_load),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        finalize=_only_quoted if strict else None,
        comment_start_string="{##",  # bash has `${#array[@]}`; jinja's default `{#` would eat it
        comment_end_string="##}",
    )


def render_script(name: str, values: dict[str, Any]) -> str:
    """Render a script template; every printed value must be quoted (see module docstring)."""
    return _environment(strict=True).get_template(name).render(**values)


def render_text(name: str, values: dict[str, Any]) -> str:
    """Render a plain-text template (no quoting rules: not executed by anything)."""
    return _environment(strict=False).get_template(name).render(**values)
