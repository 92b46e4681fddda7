"""The shipped catalog: real model configs (``models/``) and GPU types (``gpus.yaml``).

``model_facts(model_id, recipe_dir, config, overrides)`` gives the :class:`~rlc.compiler.model.ModelFacts` of a
recipe's model (catalog id, or ``model.config`` for a local ``config.json``); ``gpu_spec(name)``
the usable memory of a ``cluster.gpu``; ``model_ids()`` the catalog's HF ids. Unknown names raise
:class:`CatalogError` whose message lists close entries.
"""
from rlc.compiler.catalog.errors import CatalogError
from rlc.compiler.catalog.gpus import GpuSpec, gpu_names, gpu_spec
from rlc.compiler.catalog.models import catalog_config, model_facts, model_ids

__all__ = ["CatalogError", "GpuSpec", "catalog_config", "gpu_names", "gpu_spec", "model_facts", "model_ids"]
