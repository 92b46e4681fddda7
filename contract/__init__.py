"""What the compiler and the runtime agree on, in one pure-Python package (no torch, ray, vllm or megatron).

* :mod:`rlc.contract.runtime_config` — the resolved ``runtime.yaml`` as typed, frozen dataclasses.
* :mod:`rlc.contract.calibration_record` — the memory record the runtime writes per phase and the
  compiler's ``rlc calibrate`` reads.
* :mod:`rlc.contract.engine_options` — the vLLM and Megatron options rlc sets from typed keys, which
  the pass-through blocks may not set (the compiler refuses them; the runtime refuses them again).
* :mod:`rlc.contract.refit_buffer` — how the refit ping-pong buffer is sized from free memory; the
  planner predicts with it and the runtime allocates with it.
* :mod:`rlc.contract.host_blocks` — the pinned host blocks a weight copy in host memory is laid out in;
  the runtime allocates them, the planner counts them.
* :mod:`rlc.contract.job_paths` — which recipe values name paths the job opens (the compiler checks
  them against the container's mounts, the probe on every node).
* :mod:`rlc.contract.files` — the one bounded reader for every file either half opens (regular files
  only, size-capped, never blocking) and a JSON parser that never crashes on input.
* :mod:`rlc.contract.bounds` — the limits every key path, value and resolution stays within
  (``--set``, the importer's interpolations, runtime overrides).
* :mod:`rlc.contract.ranges` and :mod:`rlc.contract.runtime_file` — every number of ``runtime.yaml``
  checked against the recipe schema's range where the runtime reads it, and ``runtime.yaml`` read safely.

Both sides import these modules; neither keeps a copy.
"""
