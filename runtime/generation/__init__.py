"""The vLLM generation side of the runtime (one engine per ``generation_parallel.tp * pp`` GPUs).

- ``vllm_worker``: the Ray actor: engine start, generate with logprobs, sleep/wake, refit consumer RPCs.
- ``extension``: methods injected into vLLM's workers (the refit consumer next to the model).
- ``sampling``: ``SamplingParams`` arguments and output parsing (pure Python).

Nothing is imported here: ``import rlc.runtime.generation`` stays free of torch and vllm.
"""
