"""The compiler pipeline in one call: load → schema → bundle checks → model facts → memory plan →
rules.

Every command (`validate`, `lint`, `plan`, `compile`) goes through :func:`check`, so a recipe that
passes one passes them all, and every problem comes out in one round. Each stage adds
diagnostics; a stage runs on the parts of the recipe the earlier ones accepted: the bundle checks
(which read only ``cluster`` and ``name``) run whenever the schema found nothing wrong there, the
model facts, memory plan and rules only on a recipe the schema accepted whole. So every message is
about a real problem, not a consequence of one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rlc.compiler.diagnostics import Diagnostic
from rlc import __version__
from rlc.compiler import catalog, recipe as recipe_mod, schema
from rlc.compiler.bundle.checks import KEYS_READ, PATH_KEYS_READ, bundle_diagnostics, job_path_diagnostics
from rlc.compiler.planner import plan_memory
from rlc.compiler.planner.calibration import CalibrationError, calibration_path, load_table
from rlc.compiler.recipe_types import (CheckpointingSection, ClusterSection, DataSection, LoggingSection, ModelSection,
                                       RewardSection, recipe_from_data, section_from_data)
from rlc.compiler.rules import run_rules

if TYPE_CHECKING:
    from rlc.compiler.catalog.gpus import GpuSpec
    from rlc.compiler.model import ModelFacts
    from rlc.compiler.planner.calibration import Calibration
    from rlc.compiler.planner.plan import MemoryPlan
    from rlc.compiler.recipe import LoadedRecipe
    from rlc.compiler.recipe_types import Recipe


@dataclass
class CheckResult:
    """Everything the compiler learned about one recipe."""

    loaded: LoadedRecipe | None  # None when loading failed
    recipe: Recipe | None  # typed, schema defaults filled; None when the schema rejected it
    diagnostics: list[Diagnostic] = field(default_factory=list)
    facts: ModelFacts | None = None
    gpu: GpuSpec | None = None
    plan: MemoryPlan | None = None
    calibration: tuple[Calibration, ...] = ()  # entries of cluster.calibration; () = the shipped table
    decisions: dict[str, tuple[Any, str]] = field(default_factory=dict)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    @property
    def ok(self) -> bool:
        """True when the recipe can be compiled (no errors; warnings and infos allowed)."""
        return self.recipe is not None and not self.errors


def _place(diags: Sequence[Diagnostic], loaded: Any) -> list[Diagnostic]:
    """Give diagnostics that only know their key path the file:line:col that set that key."""
    placed = []
    for d in diags:
        if d.file is None and loaded is not None:
            origin = loaded.locate(d.path or "")
            if origin is not None:
                d.file, d.line, d.col = origin.file, origin.line, origin.col
        placed.append(d)
    return placed


def check(path: str | Path, overrides: Sequence[str] = ()) -> CheckResult:
    """Run every compiler stage on ``path`` with ``--set`` ``overrides``; never raises for bad input."""
    try:
        loaded = recipe_mod.load_recipe(path, overrides)
    except recipe_mod.RecipeLoadError as exc:
        return CheckResult(loaded=None, recipe=None, diagnostics=list(exc.diagnostics))

    diags = list(schema.validate(loaded))
    if loaded.named_after_file is not None:
        diags.append(Diagnostic("info", f"named {loaded.named_after_file!r} after its file (it sets no `name` of its "
                                "own): its checkpoints and metrics get their own folders", path="name"))
    schema_errors = [d for d in diags if d.severity == "error"]
    filled = schema.with_defaults(loaded.data)
    if not any(_below(d.path, root) for d in schema_errors for root in _bundle_keys()):
        diags += _bundle_stage(filled)
    if not any(_below(d.path, root) for d in schema_errors for root in _path_keys()):
        diags += _paths_stage(filled)
    if schema_errors:
        return CheckResult(loaded=loaded, recipe=None, diagnostics=_place(diags, loaded))
    recipe = recipe_from_data(filled)  # the one place defaults enter: every later stage reads this
    result = CheckResult(loaded=loaded, recipe=recipe, diagnostics=diags)

    try:
        recipe_dir = Path(loaded.files[0]).parent if loaded.files else Path.cwd()
        # a relative model.config is beside the recipe file that sets it (a shipped parent's, say)
        base = _base_dir(loaded, "model.config", recipe_dir) if recipe.model.config else recipe_dir
        result.facts = catalog.model_facts(recipe.model.id, base, recipe.model.config, recipe.model.overrides,
                                           checkpoint=recipe.model.checkpoint,
                                           mounts=recipe.cluster.container.mounts)
    except catalog.CatalogError as exc:
        result.diagnostics.append(Diagnostic("error", str(exc), path=_catalog_path(recipe), rule="RLC001"))
    try:
        result.gpu = catalog.gpu_spec(recipe.cluster.gpu)
    except catalog.CatalogError as exc:
        result.diagnostics.append(Diagnostic("error", str(exc), path="cluster.gpu", rule="RLC001"))

    table = _calibration_table(recipe, loaded, result.diagnostics)
    if table is not False:
        result.calibration = table
    if result.facts is not None and result.gpu is not None and table is not False:
        result.plan = plan_memory(recipe, result.facts, result.gpu, calibration=table or None)

    rules = run_rules(recipe, result.facts, result.plan, raw=loaded.data)
    result.diagnostics.extend(rules.diagnostics)
    result.decisions = dict(rules.decisions)
    result.diagnostics = _place(result.diagnostics, loaded)
    return result


def _calibration_table(recipe: Recipe, loaded: Any, diags: list[Diagnostic]) -> Any:
    """The entries of ``cluster.calibration`` (relative to the file that set it), () when unset,
    False after adding the error when the file cannot be used."""
    ref = recipe.cluster.calibration
    if ref is None:
        return ()

    try:
        return load_table(str(calibration_path(ref, _base_dir(loaded, "cluster.calibration", Path.cwd()))))
    except CalibrationError as exc:
        diags.append(Diagnostic("error", str(exc), path="cluster.calibration", rule="RLC004",
                                hint="write one with `rlc calibrate RUN_DIR... --recipe RECIPE -o FILE`"))
        return False


def _base_dir(loaded: LoadedRecipe, key: str, otherwise: Path) -> Path:
    """The folder a relative path in ``key`` is taken from: that of the recipe file that set the key (a
    shipped parent's ``model.config`` is beside the parent, wherever the child is), else ``otherwise``
    (a value from ``--set``)."""
    origin = loaded.locate(key)
    return Path(origin.file).parent if origin is not None and Path(origin.file).is_file() else otherwise


def _below(path: str, root: str) -> bool:
    """True when key path ``path`` is ``root``, inside it, or the whole recipe (``""``)."""
    return path == "" or path == root or path.startswith((root + ".", root + "["))


def _bundle_keys() -> tuple[str, ...]:
    return KEYS_READ


def _bundle_stage(filled: dict[str, Any]) -> list[Diagnostic]:
    """The bundle writer's checks (ports, mounts, env, sbatch flags, script-safe values), on the
    parts of the recipe they read (the schema accepted those, maybe not the rest)."""
    return bundle_diagnostics(section_from_data(ClusterSection, filled["cluster"], "cluster"), filled["name"],
                              __version__)


def _path_keys() -> tuple[str, ...]:
    return PATH_KEYS_READ


def _paths_stage(filled: dict[str, Any]) -> list[Diagnostic]:
    """Every path the job reads or writes, checked against the container's mounts."""
    sections = [section_from_data(cls, filled[key], key) for cls, key in (
        (ClusterSection, "cluster"), (DataSection, "data"), (ModelSection, "model"), (RewardSection, "reward"),
        (CheckpointingSection, "checkpointing"), (LoggingSection, "logging"))]
    return job_path_diagnostics(*sections, filled["name"])


def _catalog_path(recipe: Recipe) -> str:
    return "model.config" if recipe.model.config is not None else "model.id"
