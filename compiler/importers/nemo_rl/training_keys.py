"""NeMo-RL keys whose rlc value depends on other keys or on files: activation recomputation, the trainer's MTP
blocks, prompt template files, and the classification of what is left out (:mod:`.effects`).

Each function takes the mapper of :mod:`.mapping` and adds values (``m.put`` / ``m.take``), consumed keys
(``m.consume``) or unmapped keys (``m.out.unmapped``) as the table rows there do.
"""
from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rlc.compiler.importers.nemo_rl.config_sections import M
from rlc.compiler.importers.nemo_rl.effects import MOOT, effect_of, is_default
from rlc.compiler.importers.nemo_rl.results import Unmappable, Unmapped
from rlc.compiler import catalog
from rlc.compiler.files import read_text_capped
from rlc.contract.chat_template import TOKENIZER_TEMPLATE
from rlc.contract.model_overrides import MTP_HIDDEN_KEY, NEXTN_KEY

if TYPE_CHECKING:
    from rlc.compiler.importers.nemo_rl.config_loader import NemoRlConfig
    from rlc.compiler.importers.nemo_rl.mapping import _Mapper



def classified(u: Unmapped, cfg: NemoRlConfig) -> Unmapped:
    """``u`` with its effect on the experiment decided (:mod:`.effects`); a key of a component the config turns
    off changes nothing."""
    import dataclasses  # noqa: PLC0415

    if u.effect == "none" and is_default(u.key, u.value, cfg.raw_text(u.key)):
        return dataclasses.replace(u, effect="default")
    if u.effect:
        return u
    if u.inactive:
        return dataclasses.replace(u, effect="none")
    effect = effect_of(u.key, u.value, cfg.raw_text(u.key), cfg.get("policy.generation.backend"))
    for key, other, value, why in MOOT:
        if u.key == key and cfg.get(other) == value and effect == "changes":
            return dataclasses.replace(u, effect="none", reason=f"{u.reason}; {other} is {value!r}: {why}")
    switch = _disabled_block(u.key, cfg)
    if effect == "changes" and switch:
        return dataclasses.replace(u, effect="none", reason=f"{u.reason}; {switch} is false: the block is off")
    return dataclasses.replace(u, effect=effect)


def _disabled_block(key: str, cfg: NemoRlConfig) -> str:
    """The ``<block>.enabled`` key that turns the block holding ``key`` off, or ``""``."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        switch = ".".join(parts[:i]) + ".enabled"
        if switch != key and cfg.get(switch) is False:
            return switch
    return ""


def activation_checkpointing(m: _Mapper) -> None:
    """NeMo-RL recomputes activations when ``activation_checkpointing`` is true, at ``recompute_granularity``
    ``full`` (whole layers) or ``selective`` (``recompute_modules``; Megatron-core's default ``core_attn`` when
    null). rlc's ``training.activation_checkpointing: selective`` sets the same granularity and leaves the
    modules to Megatron-core, so other modules go to ``training.megatron_kwargs.recompute_modules``."""
    on_key, granularity_key, modules_key = (f"{M}.activation_checkpointing", f"{M}.recompute_granularity",
                                            f"{M}.recompute_modules")
    if on_key not in m.leaves:
        return
    on = m.leaves[on_key]
    granularity = m.leaves.get(granularity_key) or "full"
    modules = m.leaves.get(modules_key)
    if on is not True:
        m.take(on_key, "training.activation_checkpointing", lambda v: "none")
        m.consume(granularity_key, modules_key, why="activation checkpointing is off")
        return
    if granularity not in ("full", "selective"):
        m.consumed.update({on_key, granularity_key})
        m.out.unmapped.append(Unmapped(granularity_key, granularity, "rlc recomputes full layers or selective modules"))
        return
    m.put("training.activation_checkpointing", granularity, (on_key, granularity_key) if granularity_key in m.leaves
          else (on_key,), "NeMo-RL recomputes full layers" if granularity == "full" else
          "Megatron-core's selective recomputation")
    m.consumed.update({on_key, granularity_key})
    if granularity == "full" or modules is None:
        m.consume(modules_key, why="full layers are recomputed" if granularity == "full" else
                  "null: Megatron-core's default modules (core_attn)")
        return
    m.consumed.add(modules_key)
    m.put("training.megatron_kwargs.recompute_modules", modules, (modules_key,),
          "set on the Megatron-Bridge model provider unchanged")


#: The config.json key a model family states its MTP block count with (rlc's model.overrides key).
_MTP_KEYS = {"qwen3_5_moe": MTP_HIDDEN_KEY, "qwen3_5": MTP_HIDDEN_KEY, "deepseek_v3": NEXTN_KEY,
             "glm4_moe": NEXTN_KEY, "nemotron_h": NEXTN_KEY}


def _model_mtp(model_id: Any) -> tuple[Optional[int], Optional[str]]:
    """``(MTP blocks in the checkpoint, the config key stating them)`` from the offline model facts, or Nones."""
    if not isinstance(model_id, str):
        return None, None

    try:
        facts = catalog.model_facts(model_id, Path.cwd(), hub=False)
    except catalog.CatalogError:
        return None, None
    return facts.checkpoint_mtp_num_layers, _MTP_KEYS.get(facts.family)


def mtp_layers(m: _Mapper) -> None:
    """``mtp_num_layers``: the MTP blocks NeMo-RL builds in the trainer (0: none, its default; null: the
    checkpoint's). rlc builds the checkpoint's blocks unless ``model.overrides`` sets the count, so a different
    count becomes that override; with no MTP loss the main model trains the same either way."""
    key = f"{M}.mtp_num_layers"
    if key not in m.leaves:
        return
    value = m.leaves[key]
    m.consumed.add(key)
    if value is None:
        m.out.implied[key] = "null: the checkpoint's MTP blocks, as rlc builds them"
        return
    have, config_key = _model_mtp(m.cfg.get("policy.model_name"))
    if have is not None and have == value:
        m.out.implied[key] = f"the checkpoint has {have} MTP block(s), which rlc builds"
        return
    if have == 0 or (have is None and value == 0):
        m.out.implied[key] = "the model has no MTP blocks" if have == 0 else \
            "no MTP blocks in the trainer; rlc builds the checkpoint's, which train nothing without an MTP loss"
        return
    if config_key is None:
        m.out.unmapped.append(Unmapped(key, value, "rlc builds the checkpoint's MTP blocks; set the model's MTP "
                                       "count under model.overrides"))
        return
    m.put(f"model.overrides.{config_key}", value, (key,),
          f"the trainer builds {value} MTP block(s) (the checkpoint has {have})")


FREEZE = f"{M}.freeze_config"
#: Why freezing a vision-language checkpoint's vision parts changes nothing rlc trains.
_VISION_FROZEN_OR_NOT = ("rlc's prompts are text, so the vision tower and its projection get no gradient and the "
                         "language model trains the same either way; unfrozen, weight decay alone moves their "
                         "weights (learning rate x weight decay a step)")


def freeze_config(m: _Mapper) -> None:
    """``policy.megatron_cfg.freeze_config`` (vision-language checkpoints, e.g. Qwen3.5): freezing the vision tower
    or its projection changes nothing rlc trains (listed); freezing the language model would train nothing of it."""
    for part in ("freeze_vision_model", "freeze_vision_projection", "freeze_language_model"):
        key = f"{FREEZE}.{part}"
        if key not in m.leaves:
            continue
        m.consumed.add(key)
        value = m.leaves[key]
        if part != "freeze_language_model":
            m.out.unmapped.append(Unmapped(key, value, _VISION_FROZEN_OR_NOT, effect="none"))
        elif value:
            m.out.unmapped.append(Unmapped(key, value, "rlc trains the language model"))
        else:
            m.out.implied[key] = "false: the language model trains, as rlc trains it"


HF_CONFIG_OVERRIDES = "policy.hf_config_overrides"


def hf_config_overrides(m: _Mapper) -> None:
    """``policy.hf_config_overrides`` -> ``model.overrides``, one key per top-level entry: NeMo-RL builds the
    trainer (Megatron-Bridge) and vLLM from the checkpoint's config with them, as rlc does (a YaRN
    ``rope_scaling``, ``router_aux_loss_coef: 0.0``, a nested ``text_config`` entry merged into the checkpoint's)."""
    if m.leaves.get(HF_CONFIG_OVERRIDES) == {}:
        m.consume(HF_CONFIG_OVERRIDES, why="empty: the checkpoint's config as it is")
        return
    prefix = HF_CONFIG_OVERRIDES + "."
    entries: dict[str, list[str]] = {}
    for key in m.leaves:
        if key.startswith(prefix):
            entries.setdefault(key[len(prefix):].split(".", 1)[0], []).append(key)
    for entry, keys in entries.items():
        m.consumed.update(keys)
        m.put(f"model.overrides.{entry}", m.cfg.get(f"{HF_CONFIG_OVERRIDES}.{entry}"), tuple(keys),
              "the trainer and vLLM read the checkpoint's config with it")


def _nemo_rl_template(text: str) -> str:
    """NeMo-RL's prompt template (``str.format`` with one positional field, the problem) as rlc's
    ``data.prompt_template`` (the field named ``prompt``). ``Unmappable`` for other fields."""
    out = []
    for literal, field, spec, conversion in string.Formatter().parse(text):
        out.append(literal.replace("{", "{{").replace("}", "}}"))
        if field is None:
            continue
        if field not in ("", "0") or spec or conversion:
            raise Unmappable(f"the template uses {{{field}}}; NeMo-RL fills one positional field, the problem")
        out.append("{prompt}")
    return "".join(out)


def _find(name: str, config_files: list[str]) -> Optional[Path]:
    """NeMo-RL opens a prompt file relative to its working directory, its checkout: try the working directory, then
    every folder above each config of the chain (the checkout holding ``examples/configs``)."""
    path = Path(name)
    if path.is_absolute():
        return path if path.is_file() else None
    candidates = [Path.cwd() / path]
    for config in config_files:
        candidates += [parent / path for parent in Path(config).resolve().parents]
    return next((c for c in candidates if c.is_file()), None)


def prompt_files(m: _Mapper) -> None:
    """``data.*.prompt_file`` (a text file NeMo-RL formats each problem into) becomes ``data.prompt_template``,
    the file's text inline, so the job needs no NeMo-RL checkout; a file the import cannot find is dropped (it
    changes every prompt). ``system_prompt_file`` has no rlc equivalent."""
    keys = [k for k in m.leaves if k.startswith("data.") and k.rsplit(".", 1)[-1] == "prompt_file"]
    active = [k for k in keys if m.leaves[k] is not None]
    m.consume(*[k for k in keys if m.leaves[k] is None], why="null: the prompt as it is (data.prompt_template "
              "'{prompt}')")
    if len({m.leaves[k] for k in active}) > 1:
        for k in active:
            m.consumed.add(k)
            m.out.unmapped.append(Unmapped(k, m.leaves[k], "datasets with different prompt files: rlc has one "
                                           "data.prompt_template"))
        return
    for k in active:
        m.consumed.add(k)
        read = _file_text(m, k, "NeMo-RL formats every prompt with this file, which the import did not find (run it "
                                "from the NeMo-RL checkout, or --set data.prompt_template='...{prompt}...')")
        if read is None:
            continue
        text, found = read
        try:
            template = _nemo_rl_template(text)
        except ValueError as exc:
            m.out.unmapped.append(Unmapped(k, m.leaves[k], f"{found}: {exc}", effect="changes"))
            continue
        m.put("data.prompt_template", template, (k,), f"the text of {found} (NeMo-RL's '{{}}' is rlc's '{{prompt}}')")
    chat_template(m)


def _file_text(m: _Mapper, key: str, missing: str) -> Optional[tuple[str, Path]]:
    """``(text, path)`` of the file NeMo-RL's ``key`` names (found as NeMo-RL would: :func:`_find`), or None with the
    key listed as dropped: ``missing`` where the file is not found, the error where it cannot be read."""
    name = str(m.leaves[key])
    found = _find(name, list(m.cfg.files))
    if found is None:
        m.out.unmapped.append(Unmapped(key, m.leaves[key], missing, effect="changes"))
        return None
    try:
        return read_text_capped(found), found
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        m.out.unmapped.append(Unmapped(key, m.leaves[key], f"{found}: {getattr(exc, 'strerror', None) or exc}",
                                       effect="changes"))
        return None


#: NeMo-RL's data processors that put each prompt into the tokenizer's chat template (nemo_rl/data/processors.py).
_CHAT_PROCESSORS = ("math_hf_data_processor", "math_data_processor")
#: NeMo-RL's template for ``policy.tokenizer.chat_template: null``
#: (``COMMON_CHAT_TEMPLATES.passthrough_prompt_response``): the turns' text, no markup, no special tokens.
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _chat_template_value(m: _Mapper) -> tuple[Optional[str], tuple[str, ...], str]:
    """``data.chat_template`` for NeMo-RL's ``policy.tokenizer.chat_template`` (absent or ``default``: the tokenizer's;
    null: NeMo-RL's passthrough; a ``.jinja`` path: its text; other text: itself), its sources and a note; None where
    a template file cannot be read (listed as dropped)."""
    key = "policy.tokenizer.chat_template"
    if key not in m.leaves:
        return TOKENIZER_TEMPLATE, (), "NeMo-RL's data processor renders each prompt with the tokenizer's chat template"
    m.consumed.add(key)
    value = m.leaves[key]
    if value is None:
        return PASSTHROUGH_TEMPLATE, (key,), "null: NeMo-RL's passthrough template (the text, no special tokens)"
    text = str(value)
    if text.lower() == "default":  # NeMo-RL's word for the tokenizer's own template
        return TOKENIZER_TEMPLATE, (key,), "the tokenizer's chat template"
    if not text.endswith(".jinja"):
        return text, (key,), "NeMo-RL's custom chat template"
    read = _file_text(m, key, "NeMo-RL renders every prompt with this template file, which the import did not find")
    return (None, (key,), "") if read is None else (read[0], (key,), f"the text of {read[1]}")


def chat_template(m: _Mapper) -> None:
    """NeMo-RL's math data processors render each prompt (after its system prompt, if any) with the tokenizer's chat
    template, the assistant's turn opened, and tokenize it without adding special tokens: ``data.chat_template`` and
    ``data.system_prompt`` say the same, ``policy.tokenizer.chat_template_kwargs`` are the template's arguments.
    ``math_data_processor`` renders a system prompt as a conversation of its own, which rlc does not."""
    processors = {str(m.leaves[k]) for k in m.leaves
                  if k.startswith("data.") and k.endswith(".processor") and m.leaves[k] is not None}
    systems = {k: m.leaves[k] for k in m.leaves if k.startswith("data.") and k.endswith(".system_prompt_file")}
    kwargs_key = "policy.tokenizer.chat_template_kwargs"
    if not processors or not processors <= set(_CHAT_PROCESSORS):
        for k in [*systems, *(k for k in m.leaves if k.startswith(kwargs_key + "."))]:
            if m.leaves.get(k) is not None:
                m.consumed.add(k)
                m.out.unmapped.append(Unmapped(k, m.leaves[k], "rlc renders prompts with a chat template as NeMo-RL's "
                                               "math data processors do; this config's processor "
                                               f"({', '.join(sorted(processors)) or 'none'}) is not one of them"))
        return
    template, sources, note = _chat_template_value(m)
    if template is None:
        return
    m.put("data.chat_template", template, sources or tuple(sorted(k for k in m.leaves if k.endswith(".processor"))),
          note)
    kwargs_leaves = tuple(k for k in m.leaves if k == kwargs_key or k.startswith(kwargs_key + "."))
    kwargs = m.cfg.get(kwargs_key)
    if isinstance(kwargs, dict) and kwargs:
        m.consumed.update(kwargs_leaves)
        m.put("data.chat_template_kwargs", dict(kwargs), kwargs_leaves, "the chat template's arguments")
    else:
        m.consume(*kwargs_leaves, why="null: the template's defaults")
    active = {k: v for k, v in systems.items() if v is not None}
    m.consume(*[k for k in systems if systems[k] is None], why="null: no system prompt")
    several = len({str(v) for v in active.values()}) > 1
    if several or ("math_data_processor" in processors and active):
        why = ("datasets with different system prompts: rlc has one data.system_prompt" if several
               else "math_data_processor renders the system prompt as a conversation of its own; rlc renders one "
                    "conversation")
        for k, v in active.items():
            m.consumed.add(k)
            m.out.unmapped.append(Unmapped(k, v, why, effect="changes"))
        return
    for k in active:
        m.consumed.add(k)
        read = _file_text(m, k, "NeMo-RL opens every conversation with this system prompt, which the import did not "
                                "find")
        if read is not None:
            m.put("data.system_prompt", read[0], (k,), f"the text of {read[1]}")
