"""Whether a tensor a log names belongs to the recipe's model.

``rlc doctor LOG --recipe RECIPE`` re-plans with the log's numbers; that says nothing when the log is from
another model's job. The log's tensors (names, shapes, byte sizes from the refit and weight-sync lines) are
checked against the recipe's model facts: the HF name prefix, the layer index against the layer count, the
vocabulary matrices' shape, and the byte size of a tensor the exporter produces under that name.
"""
from __future__ import annotations

import re
from typing import Any, Optional

from rlc.compiler.doctor.sizes import gib
from rlc.compiler.model import ModelFacts

_LAYER = re.compile(r"\.layers\.(\d+)\.")
#: HF parameter-name prefixes (``<prefix>.layers.N`` / ``<prefix>.embed_tokens``), longest first.
_PREFIXES = ("model.language_model", "language_model.model", "backbone", "model")
_VOCAB = ("embed_tokens.weight", "embeddings.weight", "lm_head.weight")


def _prefix(name: str) -> Optional[str]:
    for p in _PREFIXES:
        if name.startswith(p + ".layers.") or name.startswith(p + ".embed") or name.startswith(p + ".norm"):
            return p
    return None


def _normalised(name: str) -> str:
    return _LAYER.sub(".layers.N.", name)


def _element_counts(facts: ModelFacts) -> dict[str, int]:
    """Elements of each tensor the exporter produces, by name with the layer index written N."""
    tensors = facts.export_tensors(bytes_per_param=1) or []
    return {_normalised(name): size for name, size in tensors}


def mismatch(values: dict[str, Any], facts: ModelFacts) -> Optional[str]:
    """Why the tensor in ``values`` (``name``; ``shape`` / ``tensor_bytes`` when the log gave them) cannot be
    one of ``facts``' model, or ``None`` when nothing in the log contradicts it."""
    name = values.get("name")
    if not isinstance(name, str) or not name:
        return None
    model = facts.model_id
    prefix = _prefix(name)
    if prefix is not None and prefix != facts.hf_prefix:
        return (f"the log's tensor {name} is named under {prefix}, while {model}'s parameters are under "
                f"{facts.hf_prefix}")
    layer = _LAYER.search(name)
    if layer and facts.num_layers is not None:
        limit = facts.num_layers + (facts.checkpoint_mtp_num_layers or 0)
        if int(layer.group(1)) >= limit:
            return f"the log's tensor {name} is in layer {layer.group(1)}; {model} has {limit} layers (MTP included)"
    shape = values.get("shape")
    if name.endswith(_VOCAB) and isinstance(shape, list) and len(shape) == 2 and facts.vocab and facts.hidden:
        if shape != [facts.vocab, facts.hidden]:
            return (f"the log's {name} is {shape}; {model}'s vocabulary matrix is [{facts.vocab}, {facts.hidden}] "
                    "(vocab_size, hidden_size)")
    nbytes = values.get("tensor_bytes")
    expected = _element_counts(facts).get(_normalised(name))
    if isinstance(nbytes, int) and expected:
        if all(nbytes != expected * per for per in (1, 2, 4)):
            return (f"the log's {name} is {gib(nbytes)} ({nbytes} bytes); in {model} that tensor has {expected} "
                    f"elements ({gib(2 * expected)} in bf16)")
    return None
