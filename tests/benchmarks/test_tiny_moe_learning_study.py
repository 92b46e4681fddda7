"""The CPU learning study's fast path (benchmarks/tiny_moe_learning_study.py) computes what a full forward of
each padded rollout row computes: the same log-probs, the same gradient, the same tokens per expert."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks import tiny_moe_learning_study as study  # noqa: E402
from rlc.runtime import toy  # noqa: E402


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return study.build_model(study.VARIANTS["moe"], tmp_path_factory.mktemp("moe"))


def _rows(prompts, prompt_of, t1, t2, width=study.PAD_TO):
    """The runtime's rollout rows: prompt, response, right padding to ``width`` (rlc.runtime.policy.batches)."""
    rows = torch.full((len(prompt_of), width), toy.PAD_ID, dtype=torch.int64)
    rows[:, :5] = prompts[torch.tensor(prompt_of)]
    rows[:, 5] = t1
    rows[:, 6] = torch.where(t2 >= 0, t2, torch.full_like(t2, toy.PAD_ID))
    return rows


def test_moe_checkpoint_is_the_toy_builders(moe):
    assert moe.config.vocab_size == toy.vocab_size()  # build_toy_model uses the tokenizer's size, not the config's
    biases = [r.e_score_correction_bias for r in study._routers(moe)]
    assert len(biases) == 3 and all(b.dtype == torch.float32 and 29.8 < float(b.mean()) < 30.2 for b in biases)


def test_one_forward_gives_the_full_rows_logprobs_and_gradient(moe):
    prompts = torch.tensor([toy.char_ids(t) for t in ("1+2=", "3+4=", "9+9=")])
    prompt_of = [0, 0, 0, 1, 1, 2, 2, 2, 2, 1, 0, 2]
    gen = torch.Generator().manual_seed(3)
    moe.zero_grad()
    t1, t2, lp, _ = study.rollout_and_logprobs(moe, prompts, prompt_of, gen)
    weights = torch.linspace(-1.0, 1.0, lp.numel()).view_as(lp)
    (lp * weights * torch.stack([torch.ones_like(lp[:, 0]), (t2 >= 0).float()], 1)).sum().backward()
    fast = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    moe.zero_grad()
    rows = _rows(prompts, prompt_of, t1, t2)
    full = torch.log_softmax(moe(input_ids=rows).logits.float(), -1)[:, 4:6].gather(-1, rows[:, 5:7, None]).squeeze(-1)
    mask = torch.stack([torch.ones_like(full[:, 0]), (t2 >= 0).float()], 1)
    assert torch.allclose(lp * mask, full * mask, atol=1e-5)
    (full * weights * mask).sum().backward()
    ref = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    assert fast.keys() == ref.keys() and len(ref) > 50
    for name, g in ref.items():
        assert torch.allclose(fast[name], g, rtol=1e-4, atol=1e-7 + 1e-4 * float(g.abs().max())), name
    moe.zero_grad()


def test_routing_counts_match_the_padded_rows(moe):
    counter = study.RoutingCounter(moe)
    prompts = torch.tensor([toy.char_ids(t) for t in ("5+5=", "0+7=")])
    prompt_of = [0, 1, 1, 0, 1, 0, 0]
    gen = torch.Generator().manual_seed(5)
    counter.armed = True
    with torch.no_grad():
        t1, t2, _, (cache, row_of) = study.rollout_and_logprobs(moe, prompts, prompt_of, gen, counter)
        rest = torch.full((len(prompt_of), study.PAD_TO - 6), toy.PAD_ID, dtype=torch.int64)
        rest[:, 0] = torch.where(t2 >= 0, t2, torch.full_like(t2, toy.PAD_ID))
        counter.weights = torch.ones(rest.numel(), dtype=torch.float64)
        study._continue(moe, cache, row_of, rest)
    fast = [c.clone() for c in counter.counts]
    for c in counter.counts:
        c.zero_()
    counter.weights = None
    with torch.no_grad():
        moe(input_ids=_rows(prompts, prompt_of, t1, t2))
    counter.armed = False
    assert all(torch.equal(a, b) for a, b in zip(fast, counter.counts))
    assert all(float(c.sum()) == len(prompt_of) * study.PAD_TO * 2 for c in fast)  # top-2 of every token


def test_bias_update_is_megatrons_sign_rule(moe):
    counter = study.RoutingCounter(moe)
    before = [r.e_score_correction_bias.clone() for r in counter.routers]
    counter.counts = [torch.tensor([5.0, 1, 1, 1, 0, 0, 0, 0], dtype=torch.float64) for _ in counter.routers]
    counter.update(1e-3)
    for r, b in zip(counter.routers, before):
        step = (r.e_score_correction_bias - b).tolist()
        assert step[0] == pytest.approx(-1e-3, abs=1e-5) and step[4] == pytest.approx(1e-3, abs=1e-5)
        assert step[1] == 0.0  # at the mean load (1 token): sign(0) leaves the bias
    assert all(float(c.sum()) == 0 for c in counter.counts)


def _per_group_loop(probs, group_of, skip):
    """The study's original sampling loop (one multinomial per group, members by ``nonzero``)."""
    out = torch.full((group_of.numel(),), -1, dtype=torch.int64)
    gen = torch.Generator().manual_seed(11)
    for g in torch.unique(group_of).tolist():
        if g in skip:
            continue
        members = (group_of == g).nonzero().squeeze(1)
        out[members] = torch.multinomial(probs[g], len(members), replacement=True, generator=gen)
    return out


def test_grouped_sampling_draws_what_the_per_group_loop_draws():
    probs = torch.softmax(torch.randn(9, 23, generator=torch.Generator().manual_seed(0)), -1)
    group_of = torch.tensor([3, 0, 3, 8, 8, 8, 1, 0, 3, 5, 5, 1, 8, 0])
    for skip in (set(), {3, 5}):
        fast = study._sample_groups(probs, group_of, 9, torch.Generator().manual_seed(11), skip=skip)
        assert torch.equal(fast, _per_group_loop(probs, group_of, skip))
    assert (fast[group_of == 3] == -1).all() and (fast[group_of == 0] >= 0).all()


def test_vllm_hopper_mla_backends_follow_the_pinned_kernels():
    shipped = study.model_config(study.VARIANTS["moe"])
    info = study.vllm_hopper_mla(shipped)
    assert info["decode_head_size"] == 576 and info["prefill_qk_v"] == [192, 128]
    assert info["decode_backends"] == ["FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA"] and info["servable"]
    # latent 256 + rope 64 = 320: FA3 MLA decode still takes it, FlashMLA's dense kernel only 576
    assert study.vllm_hopper_mla({**shipped, "kv_lora_rank": 256})["decode_backends"] == [
        "FLASH_ATTN_MLA",
        "TRITON_MLA",
    ]
    assert study.vllm_hopper_mla({**shipped, "kv_lora_rank": 128})["decode_backends"] == ["TRITON_MLA"]
    # FA3 prefill, V unpadded on SM90: equal dims, (128, 192] x (96, 128], or q/k <= 64
    assert study.vllm_hopper_mla({**shipped, "qk_nope_head_dim": 64})["servable"]  # 128 / 128
    assert not study.vllm_hopper_mla({**shipped, "qk_nope_head_dim": 64, "v_head_dim": 64})["servable"]
    assert not study.vllm_hopper_mla({**shipped, "v_head_dim": 64})["servable"]  # 192 / 64
    assert study.vllm_hopper_mla(study.model_config(study.VARIANTS["qwen3_moe"])) is None
    assert study.vllm_note(study.VARIANTS["moe_fix"]) == "FLASH_ATTN_MLA+FLASHMLA+TRITON_MLA"


def test_mla_attention_is_uniform_at_init_and_the_fix_is_not(moe, tmp_path):
    """The measured init difference the proposed fix targets: the shipped MLA's last-position attention is
    uniform (entropy ~1 of the maximum), the fix's is as peaked as the dense model's q/k-normed attention."""
    prompts = torch.tensor([toy.char_ids(f"{a}+{b}=") for a in range(10) for b in range(0, 10, 3)])
    shipped = study.attention_focus(moe, prompts)
    assert len(shipped["entropy"]) == 4 and min(shipped["entropy"]) > 0.99
    assert all(abs(m - 0.4) < 0.03 for m in shipped["operand_mass"])
    fixed = study.attention_focus(study.build_model(study.VARIANTS["moe_fix"], tmp_path), prompts)
    assert max(fixed["entropy"]) < 0.95
    assert moe.config._attn_implementation == "sdpa"  # switched back after the probe


def test_parallel_workers_give_the_in_process_result(tmp_path):
    """--jobs 2 (spawned workers) writes per (variant, seed) what one in-process run computes."""
    args = ["--variants", "dense", "--seeds", "1,2", "--steps", "2", "--prompts", "4", "--gens", "4"]
    assert study.main([*args, "--jobs", "2", "--out", str(tmp_path)]) == 0
    out = __import__("json").loads((tmp_path / "tiny_moe_learning_study.json").read_text())
    assert out["jobs"] == 2 and out["machine"]["device"] == "cpu" and "--jobs 2" in out["command"]
    assert sorted(r["seed"] for r in out["runs"]) == [1, 2]
    job = {"variant": "dense", "seed": 2, "steps": 2, "prompts": 4, "gens": 4, "max_tokens": 2, "device": "cpu",
           "attn": None, "stop_at": None}
    here = study.run_job(job)
    there = next(r for r in out["runs"] if r["seed"] == 2)
    assert there["reward_curve"] == here["reward_curve"] and there["grad_norm"] == here["grad_norm"]
    assert there["final_per_prompt"] == here["final_per_prompt"]
    init = there["policy_at_init"]  # the initial policy over the 100 prompts: near uniform for the dense model
    assert 2.9 < init["first_token_entropy"] <= torch.log(torch.tensor(float(toy.vocab_size()))).item() + 1e-4
    assert 0 < init["mean_p_right"] < init["mean_p_top"] < 1 and there["policy_kl_per_step"][0][0] == 1
    assert there["settings"]["init_seed"] == 0 and "| dense | 0 of 2 |  |" in study.summary(out["runs"])
    late = study.run_job({**job, "stop_at": 0.0})
    assert late["skipped"] and "reward_curve" not in late


def _checkpoint(path, **overrides):
    """The toy builder's MoE checkpoint (seed 0) with every matrix at ``initializer_range``, with its config."""
    from safetensors.torch import load_file

    from rlc.runtime.toy_model import build_toy_model

    cfg = {**study.model_config(study.VARIANTS["moe"]), **overrides}
    out = build_toy_model(path, config=cfg, seed=0, init_std={})
    return load_file(str(next(out.glob("*.safetensors")))), cfg


def test_init_std_draws_the_builders_weights_at_another_std(tmp_path):
    """A pattern's std gives what ``initializer_range`` at that std gives (the same draws, one bf16 rounding
    apart); only the named matrices change; vectors and unmatched tensors stay bit for bit."""
    from rlc.runtime.toy_model import with_init_std

    shipped, cfg = _checkpoint(tmp_path / "a")
    wide, _ = _checkpoint(tmp_path / "b", initializer_range=0.07)
    every = with_init_std(shipped, cfg, {"*": 0.07})
    for name, t in wide.items():
        got, want = every[name].float(), t.float()
        if t.ndim < 2:
            assert torch.equal(every[name], shipped[name]), name  # norms stay 1
            continue
        assert torch.equal(got == 0, want == 0), name  # the embedding's padding row stays 0
        assert float(((got - want).abs() / want.abs().clamp_min(1e-30)).max()) <= 2 ** -7, name
        assert not torch.equal(every[name], shipped[name]), name
    attn = with_init_std(shipped, cfg, {study.ATTN: 0.07})
    changed = {k for k in shipped if not torch.equal(attn[k], shipped[k])}
    assert changed == {k for k in shipped if ".self_attn." in k and shipped[k].ndim == 2} and len(changed) == 20
    assert all(torch.equal(attn[k], every[k]) for k in changed)  # the same matrices as everything at 0.07
    mlp = with_init_std(shipped, cfg, study.MLP_NOT_ROUTER)  # first match wins: routers stay at 0.02
    assert all(torch.equal(mlp[k], shipped[k]) for k in shipped if k.endswith("mlp.gate.weight"))
    assert not torch.equal(mlp["model.layers.1.mlp.experts.3.up_proj.weight"],
                           shipped["model.layers.1.mlp.experts.3.up_proj.weight"])
    with pytest.raises(ValueError, match=r"'model.layers.\*.self_attn.q_proj.weight'.*name no weight matrix"):
        with_init_std(shipped, cfg, {study.ATTN: 0.07, "model.layers.*.self_attn.q_proj.weight": 0.05})
    with pytest.raises(ValueError, match="name no weight matrix"):
        with_init_std(shipped, cfg, {"model.norm.weight": 0.05})  # a vector: not redrawn


def test_study_checkpoint_is_the_workspace_builders(tmp_path):
    """The study's MLA-at-0.07 model is the checkpoint ``build_workspace(init_std=...)`` writes for the GPU
    runs, bit for bit, and its MTP layer copies the rescaled last layer."""
    from safetensors.torch import load_file
    from tests.gpu.test_four_gpu_grpo import build_workspace

    v = study.VARIANTS["moe_attn0.07"]
    study.build_model(v, tmp_path / "study")
    ours = load_file(str(tmp_path / "study" / "ckpt" / "model.safetensors"))
    build_workspace(tmp_path / "gpu", init_std=v.init_std)
    theirs = load_file(str(tmp_path / "gpu" / "deepseek_v3" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    last, mtp = "model.layers.3.self_attn.kv_b_proj.weight", "model.layers.4.self_attn.kv_b_proj.weight"
    assert torch.equal(ours[mtp], ours[last]) and 0.06 < float(ours[last].float().std()) < 0.08


def test_the_shipped_tiny_moe_is_drawn_as_its_model_folder_says(tmp_path):
    """The GPU runs' checkpoint (``build_workspace`` with no ``init_std``) takes ``_init_std`` from the model
    folder's config.json: bit for bit the study's ``moe_attn0.07``; ``init_std={}`` is the study's ``moe`` (every
    matrix at ``initializer_range``), so the study's baseline keeps meaning the first shipped draw."""
    import json

    from safetensors.torch import load_file
    from tests.gpu.test_four_gpu_grpo import MODEL_CONFIG, build_workspace

    declared = json.loads(MODEL_CONFIG.read_text(encoding="utf-8"))["_init_std"]
    assert declared == study.VARIANTS["moe_attn0.07"].init_std
    build_workspace(tmp_path / "shipped")
    shipped = load_file(str(tmp_path / "shipped" / "deepseek_v3" / "model.safetensors"))
    study.build_model(study.VARIANTS["moe_attn0.07"], tmp_path / "fix")
    fix = load_file(str(tmp_path / "fix" / "ckpt" / "model.safetensors"))
    assert shipped.keys() == fix.keys() and all(torch.equal(shipped[k], fix[k]) for k in shipped)
    build_workspace(tmp_path / "plain", init_std={})
    study.build_model(study.VARIANTS["moe"], tmp_path / "base")
    plain = load_file(str(tmp_path / "plain" / "deepseek_v3" / "model.safetensors"))
    base = load_file(str(tmp_path / "base" / "ckpt" / "model.safetensors"))
    assert all(torch.equal(plain[k], base[k]) for k in plain)
    q = "model.layers.0.self_attn.q_a_proj.weight"
    assert 0.06 < float(shipped[q].float().std()) < 0.08 and 0.015 < float(plain[q].float().std()) < 0.025
    router = "model.layers.1.mlp.gate.weight"
    assert torch.equal(shipped[router], plain[router])  # only the attention is drawn wider


def test_variant_seed_counts_and_seed_major_order():
    picks = study.parse_variants("dense@2,moe,moe_attn0.07@1,dense")
    assert picks == {"dense": 2, "moe": None, "moe_attn0.07": 1}
    assert study.run_order(picks, [7, 13, 42]) == [("dense", 7), ("moe", 7), ("moe_attn0.07", 7), ("dense", 13),
                                                   ("moe", 13), ("moe", 42)]
    init = study.parse_variants("init")
    order = study.run_order(init, [7, 13, 42, 99])
    assert len(order) == 47 and [s for _, s in order] == sorted((s for _, s in order), key=[7, 13, 42, 99].index)
    assert all(study.vllm_note(study.VARIANTS[n]) in ("not MLA", "FLASH_ATTN_MLA+FLASHMLA+TRITON_MLA") for n in init)
    for bad, why in (("moe_nope", "unknown variant 'moe_nope'"), ("moe@0", "whole number >= 1"),
                     ("moe@x", "whole number >= 1"), (",", "names no variant")):
        with pytest.raises(ValueError, match=why):
            study.parse_variants(bad)


def test_glm_checkpoint_is_the_megatron_checks(tmp_path):
    """The study's ``glm`` is the tiny GLM-4.5-style MoE the Megatron generation checks train (``build_toy_model``
    from its model folder, then ``add_mtp_layers``), every matrix at ``initializer_range``, bit for bit; its
    ``glm_attn0.07`` redraws only the attention projections (QKV biases are vectors: kept)."""
    from safetensors.torch import load_file

    from rlc.runtime.toy_model import build_toy_model
    from tests.gpu.test_four_gpu_grpo import add_mtp_layers

    model = study.build_model(study.VARIANTS["glm"], tmp_path / "study")
    assert type(model).__name__ == "Glm4MoeForCausalLM" and model.config.num_key_value_heads == 2
    biases = [r.e_score_correction_bias for r in study._routers(model)]
    assert len(biases) == 3 and all(b.dtype == torch.float32 and 29.8 < float(b.mean()) < 30.2 for b in biases)
    build_toy_model(tmp_path / "gpu", config=study.GLM_CONFIG, init_std={})
    add_mtp_layers(tmp_path / "gpu")
    ours = load_file(str(tmp_path / "study" / "ckpt" / "model.safetensors"))
    theirs = load_file(str(tmp_path / "gpu" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    study.build_model(study.VARIANTS["glm_attn0.07"], tmp_path / "attn")
    attn = load_file(str(tmp_path / "attn" / "ckpt" / "model.safetensors"))
    q, qb, up = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                 "model.layers.1.mlp.experts.0.up_proj.weight")
    assert 0.06 < float(attn[q].float().std()) < 0.08 and 0.015 < float(ours[q].float().std()) < 0.025
    assert torch.equal(attn[qb], ours[qb]) and torch.equal(attn[up], ours[up])
    assert [n for n, _ in study.run_order(study.parse_variants("glm_init"), [7])] == [
        "dense", "glm", "glm_attn0.07", "glm_body0.07", "glm_bias_update", "glm_body0.07_bias_update"]


def test_the_shipped_glm_checkpoint_is_the_studied_glm_body0_07(tmp_path):
    """The Megatron checks build the GLM from its model folder, whose ``_init_std`` draws every decoder matrix at
    0.07: bit for bit the study's ``glm_body0.07`` (the embedding and lm_head stay at 0.02)."""
    from safetensors.torch import load_file

    from rlc.runtime.toy_model import build_toy_model
    from tests.gpu.test_four_gpu_grpo import add_mtp_layers

    build_toy_model(tmp_path / "gpu", config=study.GLM_CONFIG)  # init_std None: the config's
    add_mtp_layers(tmp_path / "gpu")
    study.build_model(study.VARIANTS["glm_body0.07"], tmp_path / "study")
    shipped = load_file(str(tmp_path / "gpu" / "model.safetensors"))
    studied = load_file(str(tmp_path / "study" / "ckpt" / "model.safetensors"))
    assert shipped.keys() == studied.keys() and all(torch.equal(shipped[k], studied[k]) for k in shipped)
    assert 0.06 < float(shipped["model.layers.1.mlp.experts.0.up_proj.weight"].float().std()) < 0.08
    assert 0.015 < float(shipped["model.embed_tokens.weight"].float().std()) < 0.025


def test_markdown_names_every_command_that_made_a_run():
    out = {"runs": [{"command": "python a"}, {"command": "python b"}, {"command": "python a"}, {}],
           "machine": {"cpus": 2, "device": "cpu"}}
    assert study.provenance(out) == "    python a\n    python b\n\nmachine: cpus 2, device cpu"
