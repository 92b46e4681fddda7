"""The dtypes of megatron-core's per-request Mamba states (``generation.megatron.mamba_*_states_dtype``), read by the
runtime (the engine's ``MambaInferenceStateConfig``) and the planner (the KV pool's bytes). Pure Python."""
from __future__ import annotations

#: Values other than ``auto`` (the model's dtype) -> the dtype's full name: torch's attribute, the planner's byte-table
#: key.
MAMBA_STATE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
