"""``rlc doctor`` on log text the project writes itself, modelled on public reports (logs/README.md):
each names the rule and reads the numbers; a healthy log names nothing."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler.doctor import PATTERNS, diagnose

LOGS = Path(__file__).resolve().parent / "logs"
GIB = 1 << 30

# log -> (pattern, rule, values the finding must carry)
EXPECTED = {
    "nemo_rl_mtp_owner.log": ("mtp-duplicate-owner", "RLC201", {"ranks": [0, 7]}),
    "nemo_rl_buffer_too_small.log": (
        "refit-buffer-too-small",
        "RLC210",
        {
            "name": "model.language_model.layers.0.mlp.experts.gate_up_proj",
            "tensor_bytes": 8589934592,
            "half_bytes": 6263046144,
        },
    ),
    "megatron_bridge_stack_oom.log": (
        "export-stack-oom",
        "RLC211",
        {"ask_bytes": 8 * GIB, "free_bytes": int(6.76 * GIB), "total_bytes": int(79.11 * GIB), "gpu": 0},
    ),
    "vllm_sleep_residue_growth.log": ("vllm-sleep-residue", "RLC212", {"in_use_gib": 24.10}),
    "vllm_wake_oom.log": ("cumem-wake-oom", "RLC214", {}),
    "expandable_segments.log": ("expandable-segments", "RLC301", {}),
    "megatron_overlap_stale.log": ("logprob-mismatch", "RLC202", {"gen_kl_error": 0.8311, "step": 2}),
    "verl_rollout_diff.log": ("logprob-mismatch", "RLC306", {"logprob_abs_diff": 0.312, "step": 14}),
    "nemo_rl_dynamic_sampling.log": ("dynamic-sampling-exhausted", None, {"max_gen_batches": 10}),
    "verl_dapo_gen_batches.log": ("dynamic-sampling-exhausted", None, {"max_gen_batches": 10, "batches": 10}),
    "ray_node_lost.log": ("worker-lost", None, {"ip": "10.0.4.17", "pid": "159258"}),
    "ray_host_oom.log": ("worker-lost", None, {"ip": "10.0.4.21", "host_oom": True}),
    "verl_bucket_too_small.log": (
        "refit-bucket-too-small",
        "RLC210",
        {
            "name": "model.language_model.layers.0.mlp.experts.gate_up_proj",
            "shape": [512, 2048, 4096],
            "tensor_bytes": 8589934592,
            "bucket_bytes": 2048 << 20,
        },
    ),
    "slime_bucket_too_small.log": ("refit-bucket-too-small", "RLC210", {}),
    "openrlhf_weight_sync_ib.log": (
        "weight-sync-network",
        None,
        {
            "status": 12,
            "peer": "172.19.162.122",
            "host": "172.19.24.110",
            "name": "model.embed_tokens.weight",
            "shape": [152064, 5120],
        },
    ),
    "nccl_ibv_modify_qp.log": (
        "weight-sync-network",
        None,
        {
            "call": "ibv_modify_qp",
            "error": "Connection timed out",
            "host": "172.26.5.7",
            "name": "model.embed_tokens.weight",
        },
    ),
    "nccl_watchdog_timeout.log": (
        "nccl-network",
        None,
        {"op": "ALLREDUCE", "seq": 3856, "timeout_ms": 1800000, "host": "10.0.1.75"},
    ),
    "megatron_router_groups.log": ("mcore-router-num-groups", "RLC405", {}),
    "megatron_top_k_top_p.log": ("mcore-top-k-top-p", "RLC404", {}),
    "megatron_vpp.log": ("mcore-vpp", "RLC401", {}),
    "megatron_kv_pool.log": ("mcore-kv-pool", "RLC406", {}),
    "nemo_rl_packing_bin_capacity.log": ("packed-sequence-too-long", "RLC315",
                                         {"tokens": 51204, "budget_tokens": 49152}),
    "vllm_no_kv_memory.log": ("vllm-no-kv-memory", "RLC214", {}),
    "vllm_fp8_block_shape.log": ("fp8-block-shape", "RLC330", {"width": 4304, "block": 128}),
    "vllm_sampler_warmup_oom.log": ("vllm-startup-oom", "RLC214", {"what": "sampler", "requests": 1024}),
    "verl_prompt_too_long.log": ("vllm-prompt-too-long", "RLC305", {"tokens": 6768, "max_model_len": 4096}),
    "vllm_max_model_len_derived.log": ("vllm-max-model-len-over-derived", "RLC112",
                                       {"max_model_len": 131072, "derived": "None=8192 in model's config.json"}),
    "openrlhf_kv_cache_max_seq_len.log": ("vllm-kv-one-request", "RLC229",
                                          {"max_model_len": 8192, "kv_cache_tokens": 6048}),
}
# logs with more than one finding: (pattern, rule) in order
EXPECTED_MANY = {
    "nemo_rl_residue_growth_logprob_oom.log": [("cuda-oom", None), ("vllm-sleep-residue", "RLC220")],
    "megatron_inference_limits.log": [("mcore-inference-optimized-moe", "RLC405"), ("mcore-speculative", "RLC404"),
                                      ("mcore-cuda-graph-ep", None), ("mcore-flash-attention", None)],
}


def test_every_log_file_has_an_expectation():
    assert {p.name for p in LOGS.glob("*.log")} == set(EXPECTED) | set(EXPECTED_MANY) | {"healthy.log"}


@pytest.mark.parametrize("name", sorted(EXPECTED_MANY))
def test_log_with_several_findings(name):
    findings = diagnose((LOGS / name).read_text())
    assert [(f.pattern, f.rule) for f in findings] == EXPECTED_MANY[name]


def test_residue_growth_with_cuda_graphs_vs_eager_mode():
    growth = (LOGS / "vllm_sleep_residue_growth.log").read_text()
    (f,) = diagnose(growth)
    assert (f.rule, f.candidates) == ("RLC212", ("RLC220",))
    (f,) = diagnose("INFO engine config: enforce_eager=True, enable_sleep_mode=True\n" + growth)
    assert (f.rule, f.candidates) == ("RLC220", ("RLC212",))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_log_names_the_rule_with_the_numbers(name):
    pattern, rule, values = EXPECTED[name]
    findings = diagnose((LOGS / name).read_text())
    assert [f.pattern for f in findings] == [pattern], [(f.pattern, f.rule) for f in findings]
    (f,) = findings
    assert f.rule == rule
    for key, want in values.items():
        assert f.values[key] == want, (key, f.values)
    assert f.fix and f.reports and f.summary


def test_sleep_residue_growth_is_measured_over_steps():
    (f,) = diagnose((LOGS / "vllm_sleep_residue_growth.log").read_text())
    assert [m.values["in_use_gib"] for m in f.matches] == [24.10, 30.95, 36.30]
    assert "+12.20 GiB" in f.summary


def test_residue_without_growth_or_failure_is_not_a_finding_but_explains_an_oom():
    stable = ("Sleep mode freed 41.20 GiB memory, 24.10 GiB memory is still in use.\n"
              "Sleep mode freed 41.10 GiB memory, 24.30 GiB memory is still in use.\n")
    assert diagnose(stable) == []
    oom = (LOGS / "megatron_bridge_stack_oom.log").read_text()
    found = diagnose(stable + oom)
    assert [(f.pattern, f.rule) for f in found] == [("export-stack-oom", "RLC211"), ("vllm-sleep-residue", "RLC213")]


def test_logprob_mismatch_without_evidence_lists_the_candidate_rules():
    (f,) = diagnose((LOGS / "verl_rollout_diff.log").read_text())
    assert f.candidates == ("RLC202", "RLC203", "RLC204")
    (f,) = diagnose((LOGS / "megatron_overlap_stale.log").read_text())
    assert f.evidence and "overlap_param_gather" in f.evidence[0].text


def test_healthy_log_names_no_rule():
    assert diagnose((LOGS / "healthy.log").read_text()) == []


def test_an_oom_outside_export_and_wake_up_is_recognised_without_a_rule():
    text = ("  File \"megatron/core/pipeline_parallel/schedules.py\", line 380, in forward_backward_no_pipelining\n"
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total capacity of "
            "139.81 GiB of which 1.10 GiB is free.\n")
    (f,) = diagnose(text)
    assert (f.pattern, f.rule, f.values["gpu"], f.values["ask_bytes"]) == ("cuda-oom", None, 5, 2 * GIB)


def test_every_pattern_row_is_exercised_by_a_test_text():
    from runtime_messages import ALL

    texts = [p.read_text() for p in LOGS.glob("*.log")] + [fn()[1] for fn in ALL.values()]
    texts.append("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.")
    lines = [line for t in texts for line in t.splitlines()]
    missing = [f"{p.id}: {p.regex.pattern[:60]}" for p in PATTERNS if not any(p.regex.search(ln) for ln in lines)]
    assert not missing, missing


def test_every_row_hint_is_in_every_line_its_regex_matches():
    """Rows are skipped on lines without one of their hints: a hint missing from a real match would
    hide that failure."""
    from runtime_messages import ALL

    texts = [p.read_text() for p in LOGS.glob("*.log")] + [fn()[1] for fn in ALL.values()]
    for line in (ln for t in texts for ln in t.splitlines()):
        for p in PATTERNS:
            if p.regex.search(line):
                assert p.may_match(line.lower()), (p.id, line)


def test_a_network_failure_is_named_as_one_during_a_weight_sync_or_not():
    sync = (LOGS / "openrlhf_weight_sync_ib.log").read_text()
    (f,) = diagnose(sync)
    assert f.title == "NCCL / InfiniBand failure during a weight sync" and f.rule is None
    assert "InfiniBand completion error status=12 from peer 172.19.162.122 on 172.19.24.110" in f.summary
    assert "while syncing model.embed_tokens.weight [152064, 5120]" in f.summary
    assert "ibstat" in f.fix and "NCCL_IB_HCA" in f.fix and "NCCL_SOCKET_IFNAME" in f.fix
    # the same failure with no weight sync near it is a network failure, not a weight-sync one
    (g,) = diagnose("\n".join(line for line in sync.splitlines() if "update" not in line))
    assert g.pattern == "nccl-network" and "while syncing" not in g.summary


def test_vllms_current_message_for_a_cache_below_one_request_reads_the_gib():
    """vLLM 0.22's wording (vllm/v1/core/kv_cache_utils.py), next to the older one of the OpenRLHF log above."""
    text = ("(EngineCore_DP0 pid=4121) ValueError: To serve at least one request with the model's max seq len (65536), "
            "(8.00 GiB KV cache is needed, which is larger than the available KV cache memory (5.42 GiB). Based on the "
            "available memory, the estimated maximum model length is 44384. Try increasing `gpu_memory_utilization`")
    (f,) = diagnose(text)
    assert (f.pattern, f.rule) == ("vllm-kv-one-request", "RLC229")
    assert f.values == {"max_model_len": 65536, "need_gib": 8.0, "have_gib": 5.42}


def test_a_hybrid_models_max_requests_over_its_pool_names_rlc406():
    """megatron-core 0.19's assert when max_requests' Mamba states fill the KV pool (contexts/dynamic_context.py)."""
    text = ("AssertionError: Not enough memory for 2048 mamba requests. Need 24.08 GB for mamba states, but total "
            "buffer is 20.00 GB.")
    (f,) = diagnose(text)
    assert (f.pattern, f.rule) == ("mcore-kv-pool", "RLC406")


def test_vllms_current_prompt_length_messages_name_rlc305():
    """vLLM 0.22 (vllm/v1/engine/input_processor.py) refuses a prompt longer than max_model_len, and one exactly as
    long (no room for one generated token)."""
    for text, tokens in (("ValueError: The decoder prompt (length 9000) is longer than the maximum model length of "
                          "8192. Make sure that `max_model_len` is no smaller than the number of text tokens.", 9000),
                         ("ValueError: The decoder prompt (length 8192) plus the number of requested output tokens "
                          "(at least 1) is longer than the maximum model length of 8192.", 8192)):
        (f,) = diagnose(text)
        assert (f.pattern, f.rule, f.values) == ("vllm-prompt-too-long", "RLC305",
                                                 {"tokens": tokens, "max_model_len": 8192})


@pytest.mark.parametrize("line, what, width", [
    ("ValueError: Weight output_partition_size = 192 is not divisible by weight quantization block_n = 128.",
     "Weight output_partition_size", 192),
    ("ValueError: The input_size of down's weight = 96 is not divisible by weight quantization block_k = 128.",
     "The input_size of down's weight", 96),
])
def test_vllms_block_shape_checks_name_rlc330(line, what, width):
    """vLLM 0.22's own block-shape checks at engine start (fp8_utils.validate_fp8_block_shape, Fp8MoEMethod)."""
    from rlc.compiler.doctor import diagnose

    [finding] = diagnose(f"(VllmGenerationWorker pid=1) ERROR [core.py:708] {line}\n")
    assert (finding.rule, finding.values["what"], finding.values["width"], finding.values["block"]) == (
        "RLC330", what, width, 128)
    assert "generation.fp8.keep_bf16" in finding.fix
