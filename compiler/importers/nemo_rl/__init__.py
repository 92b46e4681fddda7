"""``rlc import nemo-rl``: a NeMo-RL GRPO config (defaults chain, interpolations, Hydra-style
overrides) becomes a commented rlc recipe.

``import_nemo_rl`` loads the config (:mod:`.config_loader`), maps its keys (:mod:`.mapping`), applies
the ``--set`` rlc overrides, and renders the file text (:mod:`.recipe_writer`); the CLI writes it and
validates it with the normal pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rlc.compiler.diagnostics import Diagnostic
from rlc.compiler.importers.nemo_rl.config_loader import NemoRlConfig, NemoRlConfigError, load_nemo_rl_config
from rlc.compiler.importers.nemo_rl.mapping import Mapping, MissingKey, Unmapped, map_config
from rlc.compiler.importers.nemo_rl.recipe_writer import build_tree, comment_for, render_recipe
from rlc.compiler.recipe import apply_set_overrides

__all__ = ["ImportStopped", "ImportedRecipe", "NemoRlConfigError", "NotGrpoConfig", "import_nemo_rl",
           "load_nemo_rl_config", "map_config"]


@dataclass(frozen=True)
class ImportedRecipe:
    """The recipe text and what went into it."""

    text: str
    data: dict[str, Any]
    config: NemoRlConfig
    mapping: Mapping
    still_missing: tuple[MissingKey, ...]  # rlc keys neither NeMo-RL nor --set gave

    @property
    def unmapped(self) -> list[Unmapped]:
        return self.mapping.unmapped

    @property
    def dropped(self) -> list[Unmapped]:
        """Settings that change the experiment and that the recipe does not carry (kept only with --accept-loss)."""
        return [u for u in self.mapping.unmapped if u.effect == "changes"]


class ImportStopped(Exception):
    """The config has settings that change the experiment and have no rlc equivalent; ``--accept-loss`` was not
    given. ``dropped`` lists them; ``config`` is the loaded NeMo-RL config (for their origins)."""

    def __init__(self, dropped: list[Unmapped], config: NemoRlConfig) -> None:
        super().__init__(f"{len(dropped)} NeMo-RL setting(s) change the experiment and have no rlc equivalent")
        self.dropped, self.config = dropped, config


class NotGrpoConfig(Exception):
    """The config trains with another NeMo-RL algorithm (DPO, SFT, reward model, distillation): rlc compiles GRPO
    runs only."""


#: NeMo-RL's top-level section of each algorithm other than GRPO, and its name.
OTHER_ALGORITHMS = {"dpo": "DPO", "sft": "SFT", "rm": "reward-model training", "distillation": "distillation"}


def check_grpo(cfg: NemoRlConfig, config_path: str) -> None:
    """Refuse a config of another NeMo-RL algorithm: it has that algorithm's section and no ``grpo`` one."""
    if "grpo" in cfg.values:
        return
    found = [(key, name) for key, name in OTHER_ALGORITHMS.items() if key in cfg.values]
    if found:
        key, name = found[0]
        raise NotGrpoConfig(f"{config_path} is a NeMo-RL {name} config (it has a '{key}:' section and no 'grpo:' "
                            "section); rlc compiles GRPO runs and imports NeMo-RL GRPO configs only (NeMo-RL's "
                            "examples/configs/grpo_*.yaml and examples/configs/recipes/llm/grpo-*.yaml)")


class SetError(Exception):
    """A ``--set`` override is malformed or names no recipe key."""

    def __init__(self, diagnostics: list[Diagnostic]) -> None:
        super().__init__("; ".join(d.message for d in diagnostics))
        self.diagnostics = diagnostics


def _has(tree: dict[str, Any], key: str) -> bool:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def import_nemo_rl(config_path: str, overrides: Sequence[str] = (), sets: Sequence[str] = (),
                   accept_loss: bool = False, allow_env: bool = False) -> ImportedRecipe:
    """Load, map and render; raises ``NemoRlConfigError`` (config), ``SetError`` (``--set``), or
    ``ImportStopped`` when a setting that changes the experiment has no rlc equivalent and ``accept_loss`` is
    false. With ``accept_loss`` the recipe records each dropped setting (comments, and
    ``extensions.nemo_rl_import.dropped``). ``allow_env``: resolve ``${oc.env:...}`` (its values are
    written into the recipe)."""
    import dataclasses  # noqa: PLC0415

    cfg = load_nemo_rl_config(config_path, overrides, allow_env=allow_env)
    check_grpo(cfg, config_path)
    mapping = map_config(cfg)
    tree, _ = build_tree(mapping, config_path)
    comments = comment_for(mapping, cfg)
    set_diags, set_keys = apply_set_overrides(tree, sets)
    if set_diags:
        raise SetError(set_diags)
    for key in set_keys:
        comments[key] = "from --set"
    # a loss the import names its own fix for (e.g. --set data.prompt_template=...) is no loss once --set gives it
    mapping.unmapped = [dataclasses.replace(u, effect="none", reason=f"{u.reason}; given with --set")
                        if u.effect == "changes" and any(f"--set {k}=" in u.reason for k in set_keys) else u
                        for u in mapping.unmapped]
    dropped = [u for u in mapping.unmapped if u.effect == "changes"]
    if dropped and not accept_loss:
        raise ImportStopped(dropped, cfg)
    if dropped:
        extensions = tree.setdefault("extensions", {})
        extensions["nemo_rl_import"] = {"dropped": {u.key: u.value for u in dropped}}
        comments["extensions.nemo_rl_import.dropped"] = ("accepted with --accept-loss: settings that change the "
                                                         "experiment, which this recipe does not carry")
    runtime_none = tree.get("cluster", {}).get("container", {}).get("runtime") == "none"
    missing = tuple(m for m in mapping.missing if not _has(tree, m.key)
                    and not (m.key == "cluster.container.image" and runtime_none))
    text = render_recipe(tree, comments, cfg=cfg, config_path=config_path, overrides=overrides, sets=sets,
                         mapping=mapping, still_missing=missing)
    return ImportedRecipe(text, tree, cfg, mapping, missing)
