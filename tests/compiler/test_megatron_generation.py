"""generation.backend: megatron through the compiler: schema, the RLC40x rules, the decisions runtime.yaml records,
what the bundled runtime refuses (RLC311), and the recipes the GPU checks compile."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlc.compiler import api
from rlc.compiler.mcore_generation import VLLM_ONLY, inference_model, kv_block_bytes, kv_pool
from rlc.compiler.resolve import resolve_runtime_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "rlc" / "recipes"
DENSE = RECIPES / "tiny-qwen3-1gpu-megatron.yaml"
MOE = RECIPES / "tiny-glm-moe-1gpu-megatron.yaml"
MLA = RECIPES / "tiny-moe-mtp-2gpu-ep2.yaml"
VLLM_DENSE = RECIPES / "tiny-qwen3-1gpu.yaml"
G = "generation.megatron"


def check(path: Path, *sets: str) -> api.CheckResult:
    return api.check(str(path), list(sets))


def found(result, severity: str = "error") -> list[tuple[str, str | None, str]]:
    return [(d.path, d.rule, d.message) for d in result.diagnostics if d.severity == severity]


# --------------------------------------------------------------------------- the shipped recipes


@pytest.mark.parametrize("path", [DENSE, MOE])
def test_the_shipped_megatron_recipes_compile_clean(path):
    result = check(path)
    assert result.ok, found(result) + found(result, "warning")
    cfg = resolve_runtime_config(result)
    assert cfg.generation.backend == "megatron" and cfg.generation.megatron is not None
    assert cfg.generation.megatron.mode == "shared"
    assert cfg.refit.decisions["weight_sync"].startswith("RLC403: shared mode")
    assert cfg.refit.decisions["generation.megatron.mode"].startswith("RLC403: auto -> shared")
    # the vLLM refit's switches have nothing to act on, and runtime.yaml says so
    assert (cfg.refit.per_rank_ipc_metadata, cfg.refit.dedupe_mtp_embedding, cfg.refit.fp32_params) == (False, False,
                                                                                                      [])
    assert "n/a with generation.backend megatron" in cfg.refit.decisions["fp32_params"]


def test_dedicated_mode_is_recorded_with_why():
    cfg = resolve_runtime_config(check(MOE, f"{G}.mode=dedicated"))
    assert (cfg.generation.megatron.mode, cfg.refit.decisions["weight_sync"].split(":")[0]) == ("dedicated", "RLC403")
    assert "swap_model_weights" in cfg.refit.decisions["weight_sync"]
    assert "same layout: every swap is a local copy" in cfg.refit.decisions["generation.megatron.mode"]


def test_the_vllm_recipe_has_no_megatron_section():
    cfg = resolve_runtime_config(check(VLLM_DENSE))
    assert cfg.generation.backend == "vllm" and cfg.generation.megatron is None
    assert "weight_sync" not in cfg.refit.decisions


# --------------------------------------------------------------------------- RLC401 / RLC402 / RLC403


def test_virtual_pipeline_stages_are_refused():
    errors = found(check(DENSE, "parallelism.train.vpp=2"))
    assert ("parallelism.train.vpp", "RLC401") in [(p, r) for p, r, _ in errors], errors
    [message] = [m for p, r, m in errors if r == "RLC401"]
    assert "only the first model chunk" in message


@pytest.mark.parametrize("key, value", [("refit.sleep_level", "2"), ("refit.buffer_memory_ratio", "0.05"),
                                        ("refit.buffer_gb", "4"), ("refit.transport", "shm"),
                                        ("refit.per_rank_ipc_metadata", "on"), ("refit.fp32_params", "[]"),
                                        ("generation.gpu_memory_utilization", "0.2"),
                                        ("generation.vllm_version", "0.22.0"),
                                        ("generation.vllm_kwargs.max_num_seqs", "64"),
                                        ("generation.precision", "fp8"), ("refit.fused_transfer", "on"),
                                        ("refit.keep_buffers_gb", "4")])
def test_each_vllm_only_key_is_an_error_that_says_why(key, value):
    errors = [(p, m) for p, r, m in found(check(DENSE, f"{key}={value}")) if r == "RLC402"]
    assert len(errors) == 1 and errors[0][0] == key.split(".vllm_kwargs")[0] + (".vllm_kwargs" if "vllm_kwargs" in key
                                                                                else ""), errors
    why = next(v.why for v in VLLM_ONLY if v.key == errors[0][0])
    assert errors[0][1] == f"{errors[0][0]} is a vLLM setting: it {why}"


def test_neutral_values_of_vllm_only_switches_are_fine():
    assert check(DENSE, "refit.per_rank_ipc_metadata=auto", "refit.fp32_params=auto").ok
    assert check(DENSE, "refit.fused_transfer=off").ok  # nothing to move, said explicitly
    assert check(DENSE, "refit.fused_transfer=auto").ok  # the default


def test_megatron_settings_with_vllm_are_an_error():
    errors = found(check(VLLM_DENSE, f"{G}.kv_cache=persist"))
    assert errors == [(G, "RLC402", "generation.megatron is set but generation.backend is vllm, which does not read "
                                    "it")]


def test_shared_mode_cannot_offload_the_parameters_it_generates_with():
    errors = found(check(DENSE, "refit.offload_params_for_generation=true"))
    assert [(p, r) for p, r, _ in errors] == [("refit.offload_params_for_generation", "RLC403")]
    assert check(DENSE, "refit.offload_params_for_generation=true", f"{G}.mode=dedicated").ok


def test_shared_mode_with_another_inference_impl_is_an_error_and_auto_goes_dedicated():
    errors = found(check(DENSE, f"{G}.mode=shared", f"{G}.transformer_impl=inference_optimized"))
    assert [(p, r) for p, r, _ in errors] == [(f"{G}.mode", "RLC403")]
    result = check(DENSE, f"{G}.transformer_impl=inference_optimized")
    assert result.ok, found(result)
    assert result.decisions["generation.megatron.mode"][0] == "dedicated"


# --------------------------------------------------------------------------- RLC404 sampling


@pytest.mark.parametrize("sets, path, needle", [
    (("generation.sampling.top_k=20", "generation.sampling.top_p=0.9"), "generation.sampling.top_k",
     "Cannot have top-p and top-k both greater than zero"),
    (("generation.sampling.stop_token_ids=[7]",), "generation.sampling.stop_token_ids", "one termination id"),
    (("generation.sampling.stop=['\\n']",), "generation.sampling.stop", "other token boundaries"),
])
def test_sampling_the_engine_cannot_do_is_refused(sets, path, needle):
    errors = [(p, m) for p, r, m in found(check(DENSE, *sets)) if r == "RLC404"]
    assert [p for p, _ in errors] == [path] and needle in errors[0][1], errors


def test_top_k_or_top_p_alone_is_fine():
    assert not [r for _, r, _ in found(check(DENSE, "generation.sampling.top_k=20")) if r == "RLC404"]
    assert not [r for _, r, _ in found(check(DENSE, "generation.sampling.top_p=0.9")) if r == "RLC404"]


def test_speculative_decoding_limits_and_the_runtime_gap():
    spec = "generation.speculative_decoding"
    errors = found(check(MOE, f"{spec}.method=mtp", f"{spec}.num_speculative_tokens=2"))
    assert ("generation.speculative_decoding.num_speculative_tokens", "RLC404") in [(p, r) for p, r, _ in errors]
    errors = found(check(MOE, f"{spec}.method=ngram", f"{spec}.num_speculative_tokens=2"))
    assert (f"{spec}.method", "RLC404") in [(p, r) for p, r, _ in errors]
    result = check(MOE, f"{spec}.method=mtp", f"{spec}.num_speculative_tokens=1")
    assert not found(result)  # the engine can; the bundled runtime does not run it yet (RLC311)
    assert (spec, "RLC311") in [(p, r) for p, r, _ in found(result, "warning")]


# --------------------------------------------------------------------------- RLC405 layer limits


def test_inference_optimized_refuses_swiglu_moe_on_megatron_core_0_19():
    errors = found(check(MOE, f"{G}.transformer_impl=inference_optimized", "training.moe.router_dtype=fp32"))
    assert {(p, r) for p, r, _ in errors} == {(f"{G}.transformer_impl", "RLC405")}, errors
    assert "gated linear units (SwiGLU)" in errors[0][2]
    assert "attention biases" in errors[1][2]  # GLM-4.5's QKV bias: inference-optimized layers assert none


def test_inference_optimized_needs_an_fp32_router_and_the_inference_model_may_have_its_own():
    errors = found(check(MOE, f"{G}.transformer_impl=inference_optimized", "training.moe.router_dtype=fp64"))
    (router,) = [(p, m) for p, r, m in errors if r == "RLC405" and "fp32" in m]
    assert router[0] == "training.moe.router_dtype" and "routes in fp64" in router[1]
    # NeMo-RL's colocated reshard: the trainer routes in fp64, its dedicated inference model in fp32
    result = check(MOE, f"{G}.transformer_impl=inference_optimized", "training.moe.router_dtype=fp64",
                   f"{G}.router_dtype=fp32")
    assert not [m for _, r, m in found(result) if r == "RLC405" and "fp32" in m]
    assert inference_model(result.recipe).router_dtype == "fp32"
    assert "router dtype fp64 -> fp32" in inference_model(result.recipe).differs
    errors = found(check(MOE, f"{G}.transformer_impl=inference_optimized", f"{G}.router_dtype=fp64"))
    assert (f"{G}.router_dtype", "RLC405") in [(p, r) for p, r, _ in errors]


def test_a_router_dtype_of_its_own_makes_the_inference_model_dedicated_and_reaches_runtime_yaml():
    cfg = resolve_runtime_config(check(MOE, "training.moe.router_dtype=fp64", f"{G}.router_dtype=fp32"))
    assert (cfg.generation.megatron.mode, cfg.generation.megatron.router_dtype) == ("dedicated", "fp32")
    assert cfg.training.moe.router_dtype == "fp64"
    assert "router dtype fp64 -> fp32" in cfg.refit.decisions["generation.megatron.mode"]
    assert cfg.refit.decisions["generation.megatron.router_dtype"] == "RLC403: set in recipe"
    same = resolve_runtime_config(check(MOE, "training.moe.router_dtype=fp32", f"{G}.router_dtype=fp32"))
    assert same.generation.megatron.mode == "shared"  # the same dtype: the training model generates
    errors = found(check(MOE, f"{G}.mode=shared", "training.moe.router_dtype=fp64", f"{G}.router_dtype=fp32"))
    assert [(p, r) for p, r, _ in errors] == [(f"{G}.mode", "RLC403")]
    errors = found(check(DENSE, f"{G}.router_dtype=fp32"))  # a dense model has no router to route with
    assert (f"{G}.router_dtype", "RLC405") in [(p, r) for p, r, _ in errors]


def test_a_degenerate_router_group_is_reset_and_recorded():
    result = check(MOE, f"{G}.transformer_impl=inference_optimized", "training.moe.router_dtype=fp32")
    assert result.facts.router_groups == 1
    value, reason = result.decisions["generation.megatron.reset_router_num_groups"]
    assert value is True and "InferenceTopKRouter" in reason
    assert not check(MOE).decisions.get("generation.megatron.reset_router_num_groups")


def test_multi_latent_attention_models_cannot_generate_with_megatron_core_0_19():
    for mode in ("shared", "dedicated"):
        result = check(MLA, "generation.backend=megatron", f"{G}.mode={mode}")
        [message] = [m for p, r, m in found(result) if r == "RLC405" and p == "generation.backend"]
        assert "latent caching" in message and "cache_mla_latents conflicts with training" in message


def test_linear_attention_models_cannot_generate_with_megatron_core():
    result = check(RECIPES / "qwen35-397b-grpo-32xh100.yaml", "generation.backend=megatron")
    assert ("generation.backend", "RLC405") in [(p, r) for p, r, _ in found(result)]
    [message] = [m for p, r, m in found(result) if r == "RLC405"]
    assert "GDN layers are not supported for inference" in message


# --------------------------------------------------------------------------- RLC406 the KV pool


def test_a_missing_pool_is_an_error_naming_a_size_that_holds_the_step():
    result = check(VLLM_DENSE, "generation.backend=megatron", "generation.enforce_eager=true")
    [(path, message, hint)] = [(d.path, d.message, d.hint) for d in result.errors if d.rule == "RLC406"]
    assert path == "generation.kv_cache_memory_bytes" and "fixed KV pool" in message
    assert "2048 rollouts" in hint
    size = int(hint.split(": ")[1].split()[0])
    pool = kv_pool(check(DENSE, f"generation.kv_cache_memory_bytes={size}").recipe, result.facts)
    assert pool.full_requests >= 2048


def test_a_pool_that_cannot_hold_one_request_is_refused_with_the_size_that_does():
    # tiny Qwen3 at 16-token blocks: 2 B x 2 (K, V) x 2 layers x 16 x 2 KV heads x 32 head dim = 8 KiB per block,
    # 4 blocks per 64-token request, and megatron-core's dummy block
    small = (f"{G}.block_size_tokens=16", f"{G}.max_requests=4")
    result = check(DENSE, "generation.kv_cache_memory_bytes=16384", *small)
    [d] = [d for d in result.errors if d.rule == "RLC406"]
    assert "BlockOverflowError" in d.message and "needs 4" in d.message
    assert d.hint.startswith("generation.kv_cache_memory_bytes: 40960 ")
    assert not [d for d in check(DENSE, "generation.kv_cache_memory_bytes=40960", *small).errors if d.rule == "RLC406"]


def test_a_pool_rounded_to_no_requests_is_refused():
    # 3 blocks of 32 KiB: 2 usable, rounded down to a multiple of 4 requests: 0 (max_requests left unset)
    result = check(VLLM_DENSE, "generation.backend=megatron", "generation.enforce_eager=true",
                   "generation.kv_cache_memory_bytes=98304")
    [d] = [d for d in result.errors if d.rule == "RLC406"]
    assert "leaves 0 requests" in d.message


def test_max_requests_above_max_tokens_is_megatron_cores_assert():
    result = check(DENSE, f"{G}.max_requests=4096", f"{G}.max_tokens=2048")
    [d] = [d for d in result.errors if d.rule == "RLC406"]
    assert "must be >= max_requests" in d.message and d.path == f"{G}.max_requests"


def test_block_bytes_follow_megatron_cores_formula():
    result = check(DENSE)  # 2 B x 2 (K, V) x 2 layers x 256 tokens x 2 KV heads x 32 head dim
    assert kv_block_bytes(result.recipe, result.facts) == 2 * 2 * 2 * 256 * 2 * 32
    pool = kv_pool(result.recipe, result.facts)
    assert (pool.blocks, pool.blocks_per_request, pool.full_requests) == (4096, 1, 4095)


def test_a_hybrid_models_pool_sets_a_requests_mamba_state_beside_every_block():
    """megatron-core 0.19 reserves one request's Mamba state (conv and SSM, per Mamba layer) beside each KV block when
    it derives the request count, and sets aside max_requests of them first when it is given: NeMo-RL's Nemotron-3
    Nano recipe (20 GiB pool, TP 2, max_tokens 2048) runs with 1600 requests a step, not the 27,304 the blocks alone
    would give (which megatron-core's max_tokens >= max_requests assert would refuse)."""
    from rlc.compiler import catalog
    from rlc.compiler.mcore_generation import mamba_state_bytes

    nano = catalog.model_facts("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B", RECIPES)
    layout = ("generation.backend=megatron", "generation.enforce_eager=true", "cluster.gpus_per_node=2",
              "parallelism.generation.tp=2", "generation.kv_cache_memory_bytes=21474836480", f"{G}.max_tokens=2048")
    recipe = check(VLLM_DENSE, *layout).recipe  # megatron-core derives the request count (no max_requests)
    # 23 Mamba layers x ((64 x 64 / 2 + 2 x 8 / 2 x 128) x 4 conv + 64 / 2 x 64 x 128 SSM) x 2 B
    assert mamba_state_bytes(recipe, nano) == 23 * ((64 * 64 // 2 + 2 * 4 * 128) * 4 + 32 * 64 * 128) * 2
    pool = kv_pool(recipe, nano)
    block = kv_block_bytes(recipe, nano)  # 6 attention layers x 2 x 1 KV head on the rank x 128 x 256 tokens x 2 B
    assert block == 6 * 2 * 1 * 128 * 256 * 2
    assert pool.blocks == (20 << 30) // (block + mamba_state_bytes(recipe, nano)) == 1601
    assert pool.max_requests == 1600 <= pool.max_tokens
    given = kv_pool(check(VLLM_DENSE, *layout, f"{G}.max_requests=512").recipe, nano)
    assert given.blocks == ((20 << 30) - 512 * mamba_state_bytes(recipe, nano)) // block


def test_fp32_mamba_states_take_their_bytes_in_the_pool_and_need_a_hybrid_model():
    """``generation.megatron.mamba_ssm_states_dtype: fp32`` (NeMo-RL's Nemotron-3 Nano recipes) doubles the SSM state
    megatron-core sets beside every KV block: fewer requests fit the same pool. On a model without Mamba layers the
    setting changes nothing and is refused."""
    from rlc.compiler import catalog
    from rlc.compiler.mcore_generation import mamba_state_bytes

    nano = catalog.model_facts("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B", RECIPES)
    layout = ("generation.backend=megatron", "generation.enforce_eager=true", "cluster.gpus_per_node=2",
              "parallelism.generation.tp=2", "generation.kv_cache_memory_bytes=21474836480", f"{G}.max_tokens=2048")
    conv, ssm = 23 * (64 * 64 // 2 + 2 * 4 * 128) * 4, 23 * 32 * 64 * 128  # elements per request on the rank
    auto = check(VLLM_DENSE, *layout).recipe
    fp32 = check(VLLM_DENSE, *layout, f"{G}.mamba_ssm_states_dtype=fp32").recipe
    both = check(VLLM_DENSE, *layout, f"{G}.mamba_ssm_states_dtype=fp32", f"{G}.mamba_conv_states_dtype=fp32").recipe
    assert mamba_state_bytes(auto, nano) == (conv + ssm) * 2
    assert mamba_state_bytes(fp32, nano) == conv * 2 + ssm * 4
    assert mamba_state_bytes(both, nano) == (conv + ssm) * 4
    block = kv_block_bytes(fp32, nano)
    assert kv_pool(fp32, nano).blocks == (20 << 30) // (block + conv * 2 + ssm * 4) < kv_pool(auto, nano).blocks
    dense = check(DENSE, f"{G}.mamba_ssm_states_dtype=fp32")
    assert (f"{G}.mamba_ssm_states_dtype", "RLC405") in [(p, r) for p, r, _ in found(dense, "error")]


# --------------------------------------------------------------------------- RLC311: what the runtime cannot run


@pytest.mark.parametrize("sets, key", [
    (("generation.enforce_eager=false",), "generation.enforce_eager"),
    (("cluster.gpus_per_node=2", "parallelism.train.tp=2", "parallelism.generation.tp=2"), "parallelism.generation"),
    (("cluster.gpus_per_node=2", "parallelism.generation.tp=2", f"{G}.mode=dedicated"), "parallelism.generation"),
    (("training.router_replay.enabled=true",), "training.router_replay.enabled"),
])
def test_settings_the_bundled_runtime_cannot_run_are_refused_by_compile(sets, key, tmp_path):
    recipe = MOE if key == "training.router_replay.enabled" else DENSE  # replay needs an MoE model (RLC320)
    result = check(recipe, *sets)
    assert (key, "RLC311") in [(p, r) for p, r, _ in found(result, "warning")], found(result, "warning")
    from rlc.compiler.cli import main

    assert main(["compile", str(recipe), "-o", str(tmp_path / "b"), *[w for s in sets for w in ("--set", s)]]) == 1


def test_inference_model_decision_is_one_function():
    result = check(DENSE, "cluster.gpus_per_node=2", "parallelism.generation.tp=2")
    model = inference_model(result.recipe)
    assert model.mode == "dedicated" and model.differs == ("TP 1 -> 2",)


def test_the_documented_guard_errors_are_what_rlc_validate_prints():
    """docs/generation-backends.md shows the VPP guard and two vLLM-only keys on the shipped dense recipe."""
    from compiler_testing import run_rlc

    doc = (ROOT / "docs" / "generation-backends.md").read_text()
    block = doc.split("--set refit.fused_transfer=on`;", 1)[1].split("```", 2)[1].strip("\n")
    sets = ["--set", "parallelism.train.vpp=2", "--set", "refit.sleep_level=2", "--set", "refit.fused_transfer=on"]
    run = run_rlc("validate", "recipes/tiny-qwen3-1gpu-megatron.yaml", *sets, cwd=ROOT)
    assert run.code == 1
    lines = (run.out + run.err).splitlines()
    shown = [ln for i, ln in enumerate(lines) if any(r in ln for r in ("[RLC401]", "[RLC402]"))
             or (i and any(r in lines[i - 1] for r in ("[RLC401]", "[RLC402]")) and ln.startswith("    hint:"))]
    assert "\n".join(shown) == block


def test_max_requests_whose_mamba_state_fills_the_pool_is_megatron_cores_assert(tmp_path):
    import yaml

    recipe = yaml.safe_load(VLLM_DENSE.read_text())
    recipe["model"] = {"id": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B", "dtype": "bfloat16"}
    path = tmp_path / "nano.yaml"
    path.write_text(yaml.safe_dump(recipe))
    sets = ("generation.backend=megatron", "generation.enforce_eager=true", "cluster.gpus_per_node=2",
            "parallelism.train.tp=2", "parallelism.generation.tp=2", "generation.kv_cache_memory_bytes=21474836480",
            f"{G}.max_tokens=2048")
    derived = [d for d in check(path, *sets).diagnostics if d.rule == "RLC406"]
    assert [d.severity for d in derived] == ["info"] and "1600 full-length requests at once" in derived[0].message
    [err] = [d for d in check(path, *sets, f"{G}.max_requests=2048").errors if d.rule == "RLC406"]
    assert err.path == f"{G}.max_requests" and "Not enough memory for 2048 mamba requests" in err.message
