"""The Megatron policy side of the runtime (one worker per GPU).

- ``megatron_setup``: process groups, the AutoBridge model under ``train_parallel``, DDP, optimizer.
- ``megatron_worker``: the Ray actor: logprobs, GRPO train step, refit producer, checkpoints.
- ``refit_source``: the export plan and the trainer-side refit fixes (MTP dedupe, param sync, offload).
- ``batches``: rollout batches as padded tensors, DP shards and micro-batches.

Nothing is imported here: ``import rlc.runtime.policy`` stays free of torch and megatron.
"""
