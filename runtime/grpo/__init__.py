"""GRPO math and bookkeeping that runs on the driver's CPU: rewards, advantages, dynamic sampling,
the clipped policy loss, and the prompt dataset.

Each module has one job and can be imported on its own; ``loss`` and ``advantages`` import torch,
the others are pure Python. Nothing is imported here so that ``import rlc.runtime.grpo`` stays cheap.

- ``rewards``: built-in reward functions and ``reward.function`` resolution.
- ``advantages``: group-normalised advantages (mean or leave-one-out baseline).
- ``dynamic_sampling``: keep groups whose rewards differ until the step's batch is full.
- ``loss``: clipped GRPO policy loss, KL penalty, and the generation/trainer logprob check (gen-KL).
- ``data``: JSONL prompt dataset with a deterministic, resumable cursor.
"""
