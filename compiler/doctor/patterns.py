"""The pattern table: log text -> finding -> the rlc rule that would have caught it -> the fix.

Data, not code: each row is a regex over one log line, an optional regex that must appear near it
(``near``, within ``window`` lines; ``not_near`` must not), the extractor that reads its numbers
(:mod:`rlc.compiler.doctor.extractors`), the rule id (``None`` when no compile-time rule can catch
it), the recipe change, the public reports the row is modelled on, and ``hints``: lower-case text every
match contains, so a long log costs a substring test per row and line, not a regex. Rows are tried in order and
a line is claimed by the first row that matches it, so specific rows come before general ones.
Every row is tested on log text the project writes itself (tests/doctor/).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rlc.compiler.doctor import extractors as x
from rlc.compiler.doctor.sizes import SIZE


@dataclass(frozen=True)
class Pattern:
    id: str
    rule: Optional[str]
    title: str
    regex: re.Pattern
    extract: Callable[..., Any]
    fix: str
    reports: tuple[str, ...]
    near: Optional[re.Pattern] = None
    not_near: Optional[re.Pattern] = None
    window: int = 40
    observation: bool = False  # healthy logs have it too: reported only with a failure it explains
    hints: tuple[str, ...] = ()  # lower-case text every match contains (a cheap test before the regex)

    def may_match(self, lower_line: str) -> bool:
        return any(h in lower_line for h in self.hints)


def _rx(text: str) -> re.Pattern:
    return re.compile(text, re.IGNORECASE)


_EXPORT = _rx(r"_accumulate_grouped_export|export_hf_weights|torch\.stack|stream_weights_via_ipc|refit_send|"
              r"RefitProducer|conversion_tasks")
_WAKE = _rx(r"wake_up|create_and_map|cumem")
_OOM = r"(?:torch\.(?:cuda\.)?OutOfMemoryError|CUDA out of memory)"
_NUM = r"(?P<value>[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?|nan)"


_LOGPROB_TITLE = "vLLM's logprobs disagree with the trainer's after refit"
_LOGPROB_FIX = ("find which refit fix is off: refit.sync_params_before_refit (RLC202), refit.per_rank_ipc_metadata "
                "(RLC203), refit.fp32_params (RLC204)")


def _logprob_metric(names: str, metric: str, limit: float, source: str, hints: tuple[str, ...]) -> Pattern:
    """A framework's trainer-vs-vLLM logprob metric (``names``: a regex of its log names) above ``limit`` (RLC306)."""
    return Pattern("logprob-mismatch", "RLC306", _LOGPROB_TITLE, _rx(rf"\b{names}\b\W{{0,4}}{_NUM}"),
                   x.threshold(metric, limit), _LOGPROB_FIX, (source,), hints=hints)



#: Lines of a weight sync (trainer -> rollout engine) in the frameworks' logs: OpenRLHF's "update weight: NAME",
#: verl's update_weights / bucket, NeMo-RL's refit, slime's update_weight, rlc's refit, a broadcast of weights.
_WEIGHT_SYNC = _rx(r"update[ _]weights?\b|_broadcast_to_vllm|broadcast_weights|sync_weights|weight[ _]sync|refit|"
                   r"update_weight_from|stream_weights")
_NETWORK_FIX = (
    "a network fault, not a memory or layout one. Check the InfiniBand / RoCE links of the hosts the log names "
    "(`ibstat` / `ibv_devinfo`: port State Active, error counters not rising; `ibdiagnet`), that NCCL uses the "
    "fabric you expect (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, NCCL_IB_GID_INDEX for RoCE; NCCL_DEBUG=INFO prints its "
    "choice) and that every node reaches the peer's address; leave a bad node out (cluster.slurm.extra_flags: "
    "[--exclude=HOST]) and resume from the last checkpoint. A watchdog timeout names a collective that never "
    "finished: the first error of another rank is the cause")
_NETWORK_REPORTS = ("OpenRLHF #621 (vLLM weight update across nodes: 'mlx5: host_unknown: got completion with "
                    "error'); OpenRLHF #335 ('NCCL WARN Call to ibv_modify_qp failed with error Connection timed out' "
                    "in update_weight); NVIDIA/nccl #1405 ('NET/IB : Got completion from peer ... status=12'); "
                    "OpenRLHF #265 (NCCL watchdog timeout, client socket timeout)",)
#: Each NCCL / InfiniBand / socket failure line: (regex, lower-case hint).
_NETWORK_LINES = (
    (r"NET/IB\w* ?: Got completion from peer (?P<peer>[^\s<]+)(?:<\d+>)? with (?:status|error)[= ](?P<status>\d+)",
     "got completion from peer"),
    (r"mlx5: \S+: got completion with error", "got completion with error"),
    (r"NCCL WARN Call to (?P<call>ibv_\w+) failed with error (?P<error>.+)", "ncclwarn call to ibv_"),
    (r"NCCL error in: \S+, (?P<error>remote process exited or there was a network error|unhandled system error|"
     r"unhandled cuda error|internal error|invalid usage)", "nccl error in"),
    (r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+).*?"
     r"Timeout\(ms\)=(?P<timeout_ms>\d+)\)", "watchdog caught collective operation timeout"),
    (r"client socket has timed out after (?P<secs>\d+)s while trying to connect to \((?P<peer>[^)]+)\)",
     "client socket has timed out"),
)


def _network_rows() -> tuple[Pattern, ...]:
    """NCCL / InfiniBand / socket failures: during a weight sync (a sync line within the window), else anywhere."""
    rows = []
    for regex, hint in _NETWORK_LINES:
        hints = (hint.replace("ncclwarn ", ""),)
        rows.append(Pattern("weight-sync-network", None, "NCCL / InfiniBand failure during a weight sync",
                            _rx(regex), x.network, _NETWORK_FIX, _NETWORK_REPORTS, near=_WEIGHT_SYNC, window=12,
                            hints=hints))
    for regex, hint in _NETWORK_LINES:
        hints = (hint.replace("ncclwarn ", ""),)
        rows.append(Pattern("nccl-network", None, "NCCL / InfiniBand / network failure", _rx(regex), x.network,
                            _NETWORK_FIX, _NETWORK_REPORTS, hints=hints))
    return tuple(rows)


PATTERNS: tuple[Pattern, ...] = (
    Pattern(
        "mtp-duplicate-owner", "RLC201", "a parameter owned by two pipeline stages (MTP shared embedding)",
        _rx(r"Object present on multiple PP ranks:\s*(?:\[|[\w.]+ on PP ranks \[).*"), x.ranks,
        "refit.dedupe_mtp_embedding: auto (or on): the last stage drops its MTP replica of the word embedding",
        ("NeMo-RL #2471 (Qwen3.5-397B-A17B, PP 8): 'ValueError: Object present on multiple PP ranks: [0, 7]' "
         "(Megatron-Bridge build_conversion_tasks does not skip the MTP-replicated embedding)",),
        hints=('multiple pp ranks',)),
    Pattern(
        "tensor-delivered-twice", "RLC201", "a tensor exported twice in one refit (duplicate owner)",
        _rx(r"tensor '(?P<name>[^']+)' delivered twice \(buckets \d+ and \d+\)"), x.ranks,
        "refit.dedupe_mtp_embedding: auto (or on)",
        ("rlc refit manifest (each tensor exactly once per refit)",),
        hints=('delivered twice',)),
    Pattern(
        "refit-buffer-too-small", "RLC210", "a tensor larger than a refit ping-pong half",
        _rx(r"Parameter (?P<name>\S+)\s+too large for buffer: (?P<tensor>[0-9]+) > (?P<half>[0-9]+)"),
        x.buffer_sizes,
        "raise refit.buffer_memory_ratio so free × ratio / 2 holds the tensor, or free memory first "
        "(a larger generation EP, generation.enforce_eager: true)",
        ("NeMo-RL #2471: 'AssertionError: Parameter "
         "model.language_model.layers.0.mlp.experts.gate_up_proj too large for buffer: 8589934592 > 6263046144'",),
        hints=('too large for buffer',)),
    Pattern(
        "refit-buffer-too-small", "RLC210", "a tensor larger than a refit ping-pong half",
        _rx(rf"refit: tensor '(?P<name>[^']+)' \((?P<tensor>{SIZE}),.*?larger than a ping-pong half "
            rf"\((?P<half>{SIZE}) =.*?> (?P<free>{SIZE}) free at refit time"),
        x.buffer_sizes,
        "raise refit.buffer_memory_ratio so free × ratio / 2 holds the tensor, or free memory first "
        "(a larger generation EP, generation.enforce_eager: true)",
        ("rlc refit bucket planner (plans the transfer before any byte moves)",),
        hints=('larger than a ping-pong half',)),
    Pattern(
        "refit-bucket-too-small", "RLC210", "a tensor larger than the refit bucket (verl)",
        _rx(r"Weight (?P<name>[^\s(]+)\((?:torch\.Size\()?\[(?P<shape>[0-9, ]*)\]\)?, (?:torch\.)?(?P<dtype>\w+)\) is "
            r"too large to fit in the bucket\.\s*(?:Please increase rollout\.update_weights_bucket_megabytes\("
            r"(?P<mb>[0-9]+) MB\))?"),
        x.bucket_sizes,
        "in verl, rollout.update_weights_bucket_megabytes (rollout.checkpoint_engine.update_weights_bucket_megabytes) "
        "at least the tensor's size; in rlc the refit buffer is sized against the largest exported tensor before "
        "submission (RLC210: refit.buffer_memory_ratio or refit.buffer_gb)",
        ("verl #5779: 'is too large to fit in the bucket. Please increase rollout.update_weights_bucket_megabytes' "
         "(verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py)",),
        hints=("too large to fit in the bucket",)),
    Pattern(
        "refit-bucket-too-small", "RLC210", "a tensor larger than the refit bucket (slime)",
        _rx(r"ValueError: one source-to-target expert transfer bundle exceeds update_weight_buffer_size"), x.nothing,
        "in slime, --update-weight-buffer-size at least one layer's experts that one trainer rank sends to one "
        "rollout rank; in rlc the refit buffer is sized against the largest exported tensor before submission "
        "(RLC210: refit.buffer_memory_ratio or refit.buffer_gb)",
        ("slime slime/backends/megatron_utils/update_weight/expert_routing.py ('ValueError: one source-to-target "
         "expert transfer bundle exceeds update_weight_buffer_size')",),
        hints=("exceeds update_weight_buffer_size",)),
    *_network_rows(),
    Pattern(
        "refit-buffer-over-free", "RLC210", "the fixed refit buffer is larger than the free memory",
        _rx(rf"refit\.buffer_gb=(?P<gb>[0-9.]+) asks for (?P<tensor>{SIZE}).*?only (?P<free>{SIZE}) is free"),
        x.buffer_over_free,
        "use refit.buffer_memory_ratio (sized from the free memory) or a smaller refit.buffer_gb",
        ("rlc refit bucket planner",),
        hints=('asks for',)),
    Pattern(
        "vllm-startup-oom", "RLC214", "vLLM ran out of memory warming up at start",
        _rx(r"CUDA out of memory occurred when warming up (?P<what>sampler|pooler) with (?P<requests>[0-9]+) dummy "
            r"requests"), x.lengths,
        "leave vLLM's budget free when it starts: lower generation.gpu_memory_utilization (what else holds the GPU "
        "then, the trainer's memory and vLLM's own, is `rlc plan`'s generate phase), or move the trainer's "
        "parameters off the GPU while vLLM generates (refit.offload_params_for_generation)",
        ("vLLM 0.22 vllm/v1/worker/gpu_model_runner.py ('CUDA out of memory occurred when warming up sampler with "
         "... dummy requests'); huggingface/trl #3523 and vllm-project/vllm #14452",),
        hints=("when warming up",)),
    Pattern(
        "cumem-wake-oom", "RLC214", "vLLM ran out of memory waking up (cumem allocator)",
        _rx(r"CUDA Error: out of memory at \S*cumem_allocator\.cpp:[0-9]+"), x.nothing,
        "leave vLLM room to wake: lower generation.gpu_memory_utilization, keep "
        "refit.offload_optimizer_for_refit: true so the trainer's optimizer is on the CPU at wake-up",
        ("vllm-project/vllm #13941 'wake up OOM' ('RuntimeError: CUDA Error: out of memory at "
         "/workspace/csrc/cumem_allocator.cpp:62'); verl #575 (OOM at vLLM wake_up)",),
        hints=('cumem_allocator',)),
    Pattern(
        "cumem-wake-oom", "RLC214", "vLLM ran out of memory waking up (cumem allocator)",
        _rx(rf"{_OOM}.*"), x.oom,
        "leave vLLM room to wake: lower generation.gpu_memory_utilization, keep "
        "refit.offload_optimizer_for_refit: true so the trainer's optimizer is on the CPU at wake-up",
        ("vllm-project/vllm #13941; verl #575",), near=_WAKE, not_near=_EXPORT, window=25,
        hints=('out of memory', 'outofmemoryerror')),
    Pattern(
        "export-stack-oom", "RLC211", "CUDA OOM while the exporter stacks a fused tensor",
        _rx(rf"{_OOM}.*"), x.oom,
        "lower refit.buffer_memory_ratio into the window `rlc plan` names (the two halves leave too little for "
        "the stack), or free memory first (a larger generation EP, enforce_eager)",
        ("NeMo-RL #2471, ratio 0.5: 'torch.OutOfMemoryError: CUDA out of memory. Tried "
         "to allocate 8.00 GiB' in model_bridge.py _accumulate_grouped_export (torch.stack of 512 experts)",),
        near=_EXPORT, window=25,
        hints=('out of memory', 'outofmemoryerror')),
    Pattern(
        "cuda-oom", None, "CUDA out of memory (phase not recognised)",
        _rx(rf"{_OOM}.*"), x.oom,
        "`rlc plan RECIPE` shows each phase's memory on the worst GPU and the cheapest lever",
        ("PyTorch caching allocator OOM report",),
        hints=('out of memory', 'outofmemoryerror')),
    Pattern(
        "expandable-segments", "RLC301", "expandable_segments with vLLM's memory pool",
        _rx(r"Expandable segments are not compatible with memory pool.*"), x.nothing,
        "remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF in cluster.env",
        ("NeMo-RL #2471 (vllm cumem.py:132 'AssertionError: Expandable segments are "
         "not compatible with memory pool'); pytorch/pytorch #147851",),
        hints=('expandable segments',)),
    Pattern(
        "ipc-metadata-mismatch", "RLC203", "a refit buffer sliced with another rank's metadata",
        _rx(r"carries slicing metadata from producer rank (?P<got>[0-9]+) \(GPU [^)]*\), not from this GPU's "
            r"producer rank (?P<own>[0-9]+)"), x.metadata_ranks,
        "refit.per_rank_ipc_metadata: auto (or on): every trainer rank sends its own slicing metadata",
        ("SkyRL #1816 (Nemotron-3-Ultra, TP8/PP4/EP16): rank-0 metadata on every GPU, post-sync logprob diff 2.0 "
         "-> 0.15 once per-GPU metadata was sent",),
        hints=('slicing metadata',)),
    Pattern(
        "ipc-metadata-mismatch", "RLC203", "a refit buffer sliced with another rank's metadata",
        _rx(r"has tensor '(?P<name>[^']+)', which producer rank (?P<rank>[0-9]+) did not announce at prepare"),
        x.metadata_ranks,
        "refit.per_rank_ipc_metadata: auto (or on): every trainer rank sends its own slicing metadata",
        ("SkyRL #1816 (rank-0 metadata reused on every GPU)",),
        hints=('did not announce',)),
    Pattern(
        "fp32-param-rounded", "RLC204", "an fp32 parameter reached vLLM rounded to bf16",
        _rx(r"worker (?P<worker>[0-9]+): (?P<name>\S+) \(float32, (?P<elements>[0-9]+) elements\): rounded to bf16, "
            r"(?P<bits>[0-9]+) mantissa bits lost"), x.metadata_ranks,
        "refit.fp32_params: auto (the router biases the model keeps in fp32 travel as fp32), or list the "
        "parameter's name pattern",
        ("SkyRL #1816 (Nemotron-3-Ultra: fp32 router bias cast to bf16 on the wire)",),
        hints=('mantissa bits lost',)),
    Pattern(
        "refit-not-bit-exact", "RLC306", "a refit left vLLM's weights different from the trainer's export",
        _rx(r"refit (?P<step>[0-9]+) is not bit-exact"), x.metadata_ranks,
        "find which refit fix is off: refit.per_rank_ipc_metadata (RLC203), refit.dedupe_mtp_embedding (RLC201), "
        "refit.fp32_params (RLC204); the lines after it name the parameters",
        ("rlc's refit.verify_every check",),
        not_near=_rx(r"mantissa bits lost"), window=12,
        hints=('not bit-exact',)),
    Pattern(
        "logprob-mismatch", "RLC306", _LOGPROB_TITLE,
        _rx(r"gen-KL (?P<kl>[0-9.eE+-]+|nan) at step (?P<step>[0-9]+) exceeds grpo\.max_gen_kl=(?P<thr>[0-9.eE+-]+)"),
        x.gen_kl, _LOGPROB_FIX + "; keep grpo.max_gen_kl > 0 so it stops early",
        ("NeMo-RL #4086 (stale shards with overlap_param_gather); "
         "SkyRL #1816 (per-GPU refit metadata)",),
        hints=('gen-kl',)),
    _logprob_metric("gen_kl_error", "gen_kl_error", 0.05,
                    "NeMo-RL GRPO metric gen_kl_error (NeMo-RL #2471 saw 'KL Error' 1.97-2.18)", ("gen_kl_error",)),
    _logprob_metric("token_mult_prob_error", "token_mult_prob_error", 1.1,
                    "NeMo-RL GRPO metric token_mult_prob_error (1.0 when vLLM and the trainer agree)",
                    ("token_mult_prob_error",)),
    _logprob_metric("(?:rollout_probs_diff_mean|train_rollout_logprob_abs_diff|rollout_corr/logprob_abs_diff_mean)",
                    "logprob_abs_diff", 0.05,
                    "verl training/rollout_probs_diff_mean; slime train_rollout_logprob_abs_diff "
                    "(OpenClaw-RL #69 saw 0.2-0.4)",
                    ("rollout_probs_diff_mean", "train_rollout_logprob_abs_diff", "logprob_abs_diff_mean")),
    Pattern(
        "stopped-by-signal", None, "the run was stopped by a signal: scancel, the job's time limit or a container stop",
        _rx(r"run stopped by (?P<signal>SIG[A-Z]+)"), x.nothing,
        "nothing failed: if slurm-<jobid>.out says 'DUE TO TIME LIMIT', raise cluster.slurm.time; a resubmitted "
        "bundle resumes from the last checkpoint (checkpointing.save_every bounds the steps a stop loses)",
        ("rlc's driver (exit code 143)",),
        hints=("run stopped by sig",)),
    Pattern(
        "dynamic-sampling-exhausted", None, "dynamic sampling ran out of generation batches",
        _rx(r"dynamic sampling exhausted at step (?P<step>[0-9]+): (?P<batches>[0-9]+) generation batches "
            r"\(grpo\.dynamic_sampling\.max_gen_batches=(?P<max_gen_batches>[0-9]+)\) of (?P<per_batch>[0-9]+) "
            r"prompts kept (?P<kept>[0-9]+)/(?P<target>[0-9]+)"), x.ds_rlc,
        "raise grpo.dynamic_sampling.max_gen_batches or batch_multiplier (or generations_per_prompt) to match "
        "the measured hit rate",
        ("NeMo-RL #3154 ('Dynamic sampling has reached the maximum allowed number of batches (10)'); "
         "verl #953 / #1108 ('num_gen_batches >= max_num_gen_batches')",),
        hints=('dynamic sampling exhausted',)),
    Pattern(
        "dynamic-sampling-exhausted", None, "dynamic sampling ran out of generation batches",
        _rx(r"Dynamic sampling has reached the maximum allowed number of batches \((?P<max_gen_batches>[0-9]+)\)"),
        x.ds_max,
        "raise grpo.dynamic_sampling.max_gen_batches or batch_multiplier (or generations_per_prompt)",
        ("NeMo-RL #3154",),
        hints=('maximum allowed number of batches',)),
    Pattern(
        "dynamic-sampling-exhausted", None, "dynamic sampling ran out of generation batches",
        _rx(r"num_gen_batches\s*=?\s*(?P<batches>[0-9]+)?\s*>=?\s*max_num_gen_batches\s*=?\s*(?P<max_gen_batches>[0-9]+)?"),
        x.ds_max,
        "raise grpo.dynamic_sampling.max_gen_batches or batch_multiplier (or generations_per_prompt)",
        ("verl #953 / #1108 (DAPO dynamic sampling)",),
        hints=('max_num_gen_batches',)),
    Pattern(
        "vllm-prompt-too-long", "RLC305", "a prompt longer than vLLM's max_model_len",
        _rx(r"The (?:decoder |encoder )?prompt \(length (?P<tokens>[0-9]+)\) (?:plus the number of requested output "
            r"tokens \(at least 1\) )?is longer than the maximum model length of (?P<max_model_len>[0-9]+)|Input "
            r"prompt \((?P<tokens2>[0-9]+) tokens\) is too long and exceeds limit of (?P<max_model_len2>[0-9]+)"),
        x.lengths,
        "data.max_prompt_length below generation.max_model_len (rlc skips longer prompts before they reach vLLM; "
        "RLC305 checks the two), or raise max_model_len",
        ("vLLM 0.22 vllm/v1/engine/input_processor.py ('The decoder prompt (length ...) is longer than the maximum "
         "model length of ...'); verl #673 ('Input prompt (6768 tokens) is too long and exceeds limit of 4096')",),
        hints=("is longer than the maximum model length", "is too long and exceeds limit of")),
    Pattern(
        "vllm-max-model-len-over-derived", "RLC112", "max_model_len above the model's context length",
        _rx(r"User-specified max_model_len \((?P<max_model_len>[0-9]+)\) is greater than the derived max_model_len "
            r"\((?P<derived>[^)]*)\)"),
        x.lengths,
        "generation.max_model_len at most the model's context length (RLC112 checks it against the checkpoint's "
        "config.json), or a model.overrides rope scaling that extends it",
        ("vLLM 0.22 vllm/config/model.py ('User-specified max_model_len (...) is greater than the derived "
         "max_model_len'); vllm-project/vllm #3676",),
        hints=("user-specified max_model_len",)),
    Pattern(
        "fp8-block-shape", "RLC330", "a layer's shape does not fit FP8 128×128 block scales",
        _rx(r"(?:(?P<what>Weight input_size_per_partition|Weight output_partition_size|The output_size of gate's and "
            r"up's weight|The input_size of down's weight) = (?P<width>[0-9]+) is not divisible by weight "
            r"quantization block_[nk] = (?P<block>[0-9]+))|(?:the last dimension of `x` (?P<width2>[0-9]+) must be "
            r"divisible by `group_size` (?P<block2>[0-9]+))"), x.block_shape,
        "keep the layer in bf16 (generation.fp8.keep_bf16: a fragment of its module name, e.g. `visual` for a vision "
        "tower that vLLM builds for a vision-language checkpoint), use generation.fp8.scales: tensor or auto, or a "
        "generation TP that keeps each shard 128-aligned; RLC330 checks the decoder layers before submission",
        ("vLLM 0.22 fp8_utils.py validate_fp8_block_shape and fp8.py Fp8MoEMethod.create_weights; NeMo-RL's Qwen3.5 "
         "guide ('the last dimension of x 4304 must be divisible by group_size 128' from a quantized vision tower, "
         "fixed by quantization_ignored_layer_kws: [visual])",),
        hints=("is not divisible by weight quantization block", "must be divisible by `group_size`")),
    Pattern(
        "vllm-no-kv-memory", "RLC214", "vLLM's budget leaves no memory for its KV cache",
        _rx(r"No available memory for the cache blocks"), x.nothing,
        "raise generation.gpu_memory_utilization above the weight shard and activations, shard vLLM further "
        "(TP / EP / PP), or move the trainer's parameters off the GPU while vLLM generates "
        "(refit.offload_params_for_generation); RLC214 checks the weight shard against the budget before submission",
        ("vLLM 0.22 vllm/v1/core/kv_cache_utils.py ('No available memory for the cache blocks'); "
         "vllm-project/vllm #13882 and #10439",),
        hints=("no available memory for the cache blocks",)),
    Pattern(
        "vllm-kv-one-request", "RLC229", "vLLM's KV cache cannot hold one request of max_model_len tokens",
        _rx(r"max seq len \((?P<max_model_len>[0-9]+)\) is larger than the maximum number of tokens that can be "
            r"stored in KV cache \((?P<kv_cache_tokens>[0-9]+)\)|To serve at least one request with the model's max "
            r"seq len \((?P<max_model_len2>[0-9]+)\), \((?P<need_gib>[0-9.]+) GiB KV cache is needed, which is larger "
            r"than the available KV cache memory \((?P<have_gib>[0-9.]+) GiB\)"),
        x.lengths,
        "raise generation.gpu_memory_utilization (or kv_cache_memory_bytes), shard the KV heads over more vLLM "
        "tensor parallelism, or lower generation.max_model_len; RLC229 checks it before submission",
        ("vLLM 0.22 vllm/v1/core/kv_cache_utils.py ('To serve at least one request with the model's max seq len'); "
         "OpenRLHF #336 and vllm-project/vllm #2418 ('The model's max seq len (...) is larger than the maximum "
         "number of tokens that can be stored in KV cache')",),
        hints=("stored in kv cache", "to serve at least one request")),
    Pattern(
        "packed-sequence-too-long", "RLC315", "a sequence longer than a packed micro batch's token budget",
        _rx(r"Sequence length (?P<tokens>[0-9]+) exceeds bin capacity (?P<budget_tokens>[0-9]+)|sequence length of "
            r"(?P<tokens2>[0-9]+), however max microbatch size is (?P<budget_tokens2>[0-9]+) tokens|a sequence of "
            r"(?P<tokens3>[0-9]+) tokens \(padded\) does not fit a packed micro batch of (?P<budget_tokens3>[0-9]+) "
            r"tokens; raise (?P<key>[\w.]+)"),
        x.lengths,
        "training.sequence_packing.train_mb_tokens and logprob_mb_tokens at least the longest sequence a rollout can "
        "give, padded (RLC315 checks them before submission); or lower generation.sampling.max_tokens",
        ("NeMo-RL nemo_rl/data/packing/algorithms.py ('Sequence length ... exceeds bin capacity'); "
         "nemo_rl/distributed/batched_data_dict.py (dynamic batching: '... however max microbatch size is ... "
         "tokens')",),
        hints=("exceeds bin capacity", "max microbatch size is", "does not fit a packed micro batch")),
    Pattern(
        "mcore-vpp", "RLC401", "Megatron inference with virtual pipeline stages",
        _rx(r"MCore colocated reshard is not supported with virtual pipeline parallelism|interleaving schedule is "
            r"not supported for inference|virtual pipeline chunks: megatron-core's engine"), x.nothing,
        "parallelism.train.vpp: 1 (or generation.backend: vllm)",
        ("NeMo-RL PR #3490 review: the colocated reshard truncated the inference model to chunk 0 with virtual "
         "pipeline stages (guard in nemo_rl/models/megatron/setup.py)",),
        hints=("virtual pipeline", "interleaving schedule")),
    Pattern(
        "mcore-router-num-groups", "RLC405", "megatron-core's inference router refuses grouped routing",
        _rx(r"InferenceTopKRouter requires moe_router_num_groups=None, got (?P<groups>\S+)"), x.nothing,
        "generation.megatron.transformer_impl: auto (Transformer Engine layers); rlc resets a degenerate n_group of 1",
        ("megatron-core 0.19 moe/router.py InferenceTopKRouter; NeMo-RL PR #3490 (_apply_moe_config resets "
         "moe_router_num_groups 1 -> None)",),
        hints=("inferencetopkrouter requires",)),
    Pattern(
        "mcore-inference-optimized-moe", "RLC405", "megatron-core's inference-optimized MoE refuses the model",
        _rx(r"inference_optimized'? does not yet support gated linear units|Inference-optimized MoE layers does not "
            r"support expert tensor parallelism|inference_optimized'? requires --moe-router-dtype=fp32|GDN layers are "
            r"not supported for inference"), x.nothing,
        "generation.megatron.transformer_impl: auto for SwiGLU MoE models; parallelism.train.etp: 1; "
        "generation.megatron.router_dtype: fp32 (the inference model's own; or training.moe.router_dtype: fp32) "
        "(gated delta-net models: generation.backend: vllm)",
        ("megatron-core 0.19 transformer_config.py (inference_optimized MoE checks; fixed for SwiGLU on Megatron-LM "
         "main by PR #5700)",),
        hints=("gated linear units", "expert tensor parallelism", "moe-router-dtype=fp32", "gdn layers")),
    Pattern(
        "mcore-top-k-top-p", "RLC404", "megatron-core's sampler refuses top-k with top-p",
        _rx(r"Cannot have top-p and top-k both greater than zero"), x.nothing,
        "generation.sampling.top_k: -1 or top_p: 1.0",
        ("megatron-core 0.19 inference/sampling/torch_sampling.py",),
        hints=("top-p and top-k",)),
    Pattern(
        "mcore-speculative", "RLC404", "megatron-core speculative decoding settings it cannot run",
        _rx(r"Number of speculative tokens (?P<tokens>[0-9]+) must be less than or equal to number of MTP layers"
            r"|logprobs_mode='processed_logprobs' is not yet supported with speculative decoding"), x.nothing,
        "generation.speculative_decoding with method mtp, at most one token per MTP layer, temperature 1 without "
        "top-k/top-p",
        ("megatron-core 0.19 engines/dynamic_engine.py and inference/config.py",),
        hints=("speculative tokens", "speculative decoding")),
    Pattern(
        "mcore-kv-pool", "RLC406", "megatron-core's KV pool or token budget cannot take a request",
        _rx(r"failed to be added to the engine \((?:BlockOverflowError|TokenOverflowError|"
            r"MaxSequenceLengthOverflowError)|max_tokens \((?P<max_tokens>[0-9]+)\) must be >= max_requests "
            r"\((?P<max_requests>[0-9]+)\)|megatron-core failed request [0-9]+|Not enough memory for [0-9]+ mamba "
            r"requests"), x.nothing,
        "raise generation.kv_cache_memory_bytes (rlc plan names the size one request needs), or set "
        "generation.megatron.max_requests <= max_tokens (and, for a hybrid model, few enough that their Mamba state "
        "leaves room for KV blocks)",
        ("megatron-core 0.19 engines/dynamic_engine.py (_add_request) and contexts/dynamic_context.py",),
        hints=("added to the engine", "must be >= max_requests", "megatron-core failed request",
               "mamba requests")),
    Pattern(
        "mcore-flash-attention", None, "megatron-core's inference engine found no FlashAttention it accepts",
        _rx(r"flash attn verion v2\.7\.3 and above is required for dynamic batching|megatron-core's dynamic "
            r"inference engine needs FlashAttention"), x.nothing,
        "install flash-attn >= 2.7.3, FlashAttention-3 (flash_attn_3) or flash-attn-4 in the container image (next to "
        "vLLM 0.22 on Hopper: tokenspeed-fa3 with flash_attn_interface.py copied into flash_attn_3/; flash-attn-4 "
        "breaks vLLM 0.22's rotary embedding, vLLM #42675), or generation.backend: vllm",
        ("megatron-core 0.19 transformer/attention.py (dynamic batching asserts a paged-KV FlashAttention)",),
        hints=("flash attn verion", "needs flashattention")),
    Pattern(
        "mcore-cuda-graph-ep", None, "megatron-core CUDA graphs with expert parallelism need padded experts",
        _rx(r"--moe-pad-experts-for-cuda-graph-inference must be set when using CUDA graphs with expert "
            r"parallelism"), x.nothing,
        "generation.enforce_eager: true (rlc runs the Megatron engine eager)",
        ("megatron-core 0.19 text_generation_controller.py; NeMo-RL PR #3490 sets it automatically",),
        hints=("moe-pad-experts-for-cuda-graph-inference",)),
    Pattern(
        "worker-lost", None, "a Ray worker or node was lost",
        _rx(r"(?P<role>policy|generation) worker (?P<rank>[0-9]+) \(node (?P<node>[^ /]+) / (?P<host>[^,]+), "
            r"GPU (?P<gpu>[^,]+),.*?\) died during (?P<phase>[^:]+):"), x.ray_lost,
        "resume instead of restarting: cluster.slurm.requeue: true with checkpointing on (a shorter "
        "checkpointing.every_steps loses less); if the host ran out of memory, set cluster.mem_per_node",
        ("rlc runtime worker failure report",),
        hints=(' died during ',)),
    Pattern(
        "worker-lost", None, "a Ray worker or node was lost",
        _rx(r"ray\.exceptions\.(?:RayActorError|ActorDiedError|NodeDiedError|OwnerDiedError|ActorUnavailableError)"
            r"|The actor died unexpectedly|has been marked dead because the detector has missed too many "
            r"heartbeats|Task was killed due to the node running low on memory"), x.ray_lost,
        "resume instead of restarting: cluster.slurm.requeue: true with checkpointing on (a shorter "
        "checkpointing.every_steps loses less); if the host ran out of memory, set cluster.mem_per_node",
        ("ray-project/ray #18586; EasyR1 #324 ('Owner's node has crashed'); Tool-Star #10 (worker killed by the "
         "OOM killer)",),
        hints=('ray.exceptions.', 'actor died unexpectedly', 'marked dead', 'running low on memory')),
    # observations: healthy logs have them; reported only next to a failure they explain
    Pattern(
        "vllm-sleep-residue", "RLC213", "memory vLLM keeps while asleep",
        _rx(r"Sleep mode freed (?P<freed>[0-9.]+) GiB memory, (?P<used>[0-9.]+) GiB memory is still in use"),
        x.sleep_residue,
        "generation.enforce_eager: true (CUDA-graph buffers survive sleep and grow after the first step); "
        "sleep level 2 does not lower it (both levels unmap the weights; level 2 only skips the host copy)",
        ("vLLM gpu_worker 'Sleep mode freed … still in use'; NeMo-RL #2471 (residue "
         "~24 GB -> ~7 GB with sleep level 2 + enforce_eager; step 2 refit failing after step 1 passed)",),
        observation=True,
        hints=('sleep mode freed',)),
    Pattern(
        "vllm-eager", None, "vLLM runs without CUDA graphs",
        _rx(r"enforce_eager=True\b"), x.nothing, "", ("vLLM engine config line",), observation=True,
        hints=('enforce_eager=true',)),
    Pattern(
        "overlap-param-gather-on", "RLC202", "distributed optimizer overlaps its parameter all-gather",
        _rx(r"overlap_param_gather['\"]?\s*[:=.]+\s*True\b"), x.nothing,
        "refit.sync_params_before_refit: auto (or on), or training.overlap_param_gather: false",
        ("NeMo-RL #4086 (stale shards with overlap_param_gather=True)",),
        observation=True,
        hints=('overlap_param_gather',)),
)
