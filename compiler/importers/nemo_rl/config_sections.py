"""The NeMo-RL config sections the importer's key tables and key functions read (dotted prefixes)."""
from __future__ import annotations

#: The Megatron trainer's settings.
M = "policy.megatron_cfg"
#: The DTensor (FSDP2) trainer's settings.
D = "policy.dtensor_cfg"
#: vLLM's settings (rollouts with ``policy.generation.backend: vllm``).
VLLM_CFG = "policy.generation.vllm_cfg"
#: megatron-core inference's settings (``policy.generation.backend: megatron``).
MCORE = "policy.generation.mcore_generation_config"
