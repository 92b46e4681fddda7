"""RLC0xx: findings other stages emit, registered here so ``rlc explain`` knows them."""
from __future__ import annotations

from rlc.compiler.rules.engine import Rule, register

register(Rule(
    id="RLC001", title="model or GPU not in the catalog", severities=("error",),
    rationale="The planner and the layout rules need the model's real architecture (layers, heads, experts, "
              "vocabulary) and the GPU's usable memory. The architecture comes from the checkpoint's own config.json "
              "(the model.checkpoint folder, the Hugging Face cache, or the Hub where the machine has network), the "
              "shipped catalog, or a local config.json named by model.config; the GPU from the shipped catalog. The "
              "error lists every place rlc looked.",
    seed="Design: plans are computed from real configs, never guessed (rlc/compiler/catalog/models/SOURCES.md).",
    fixes="Use a catalog id (rlc/compiler/catalog/models/SOURCES.md; the error names the closest), point "
          "model.checkpoint at a folder holding the model's config.json, download it into the Hugging Face cache "
          "(`huggingface-cli download MODEL config.json`), or set model.config to it; "
          "pick cluster.gpu from the schema's list.",
))
register(Rule(
    id="RLC002", title="lint.ignore cannot silence an error", severities=("error",),
    rationale="Errors describe recipes that fail at run time (a crash, an OOM, or silently wrong weights). "
              "Silencing them would only move the failure to the cluster, after the queue wait.",
    seed="rlc design: warnings may be silenced with a reason, errors may not.",
    fixes="Fix the recipe (`rlc explain <rule>` names the cheapest fix) and remove the lint.ignore entry.",
))
register(Rule(
    id="RLC003", title="lint.ignore names an unknown rule", severities=("warning",),
    rationale="An ignore entry for a rule id that does not exist silences nothing; it is usually a typo.",
    seed="Compiler hygiene.",
    fixes="Correct the id (`rlc explain --list`) or remove the entry.",
))
register(Rule(
    id="RLC004", title="calibration file cannot be used", severities=("error",),
    rationale="cluster.calibration (or --calibration) names the planner's constants for a GPU and software "
              "stack. A file that is missing or malformed would silently fall back to other constants and "
              "plan with numbers measured elsewhere.",
    seed="Design: every planner constant comes from a measurement that can be named.",
    fixes="Point cluster.calibration at a file written by `rlc calibrate` (path relative to the recipe) or at a "
          "shipped calibration name, or remove the key to use the shipped table.",
))
