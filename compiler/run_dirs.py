"""The folders a run writes: its checkpoints and its metrics.

``checkpointing.dir`` and ``logging.dir``, by default ``checkpoints/<name>`` and ``metrics/<name>`` under
``cluster.log_dir``. A relative ``cluster.log_dir`` means "beside where rlc compile ran" (shipped recipes
live inside the installed package, so the recipe's own folder would be the wrong anchor). The resolver
writes them into ``runtime.yaml``; the bundle checks and ``rlc lint`` read them from here.
"""
from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlc.compiler.recipe_types import Recipe


def output_dirs(recipe: Recipe) -> tuple[str, str]:
    """The absolute checkpoint and metrics folders of a recipe's run."""
    return output_dirs_of(recipe.cluster.log_dir, recipe.name, recipe.checkpointing.dir, recipe.logging.dir)


def output_dirs_of(log_dir: str, name: str, checkpoint_dir: str | None, logging_dir: str | None) -> tuple[str, str]:
    """:func:`output_dirs` from the four settings it reads (for checks that run without a whole recipe)."""
    log_dir = os.path.abspath(log_dir)
    return (os.path.abspath(checkpoint_dir if checkpoint_dir is not None
                            else posixpath.join(log_dir, "checkpoints", name)),
            os.path.abspath(logging_dir if logging_dir is not None else posixpath.join(log_dir, "metrics", name)))
