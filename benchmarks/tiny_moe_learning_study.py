"""Why the tiny DeepSeek-V3 MoE learns the toy task slower than the dense tiny Qwen3: a controlled CPU study.

The GPU runs (Megatron trainer + vLLM sampler) compare the dense ``tiny-qwen3-1gpu`` recipe with the tiny
MoE of ``tiny-moe-mtp-2gpu-ep2`` on one GPU. This script replays the same GRPO step in pure PyTorch on CPU,
with the policy sampling from itself (no engine, so no generation/trainer mismatch), to separate the causes
that need neither vLLM nor Megatron from those that do:

- the models are the toy builders' own: ``rlc.runtime.toy_model.build_toy_model`` (random init, seed 0) and,
  for the MoE, ``tests/gpu/test_four_gpu_grpo.add_mtp_layers`` (fp32 router bias 30 + N(0, 0.05)); loaded
  with ``transformers`` in fp32 (the checkpoints are bf16, as on the GPU; training keeps fp32 weights, as
  Megatron's optimizer keeps fp32 master weights);
- the task, prompts and reward are the runtime's: ``rlc.runtime.toy`` data (4096 examples, seed 0),
  ``PromptCursor`` order by ``grpo.seed``, the vLLM-decoded text (special tokens skipped, EOS stops) scored
  with the built-in ``prefix_match``;
- the advantages and loss are ``rlc.runtime.grpo.advantages.group_advantages`` (group mean, std-normalised)
  and ``rlc.runtime.grpo.loss.grpo_loss`` (token mean, clip 0.2/0.28), one Adam step per GRPO step (lr 5e-4,
  betas 0.9/0.999, eps 1e-8, no weight decay, global grad-norm clip 1.0: ``training.grad_clip``).

Identical sampled sequences are trained once with their advantages summed and the loss normalised by the
batch's token count; with one update per step the ratio is exactly 1, so value and gradient equal the
full batch's (this is what makes 2048 samples per step affordable on CPU).

Variants (``--variants``; ``VARIANTS`` below): the dense and MoE models as shipped, the MoE with Megatron's
aux-loss-free expert-bias update (``moe_router_enable_expert_bias``, ``moe_router_bias_update_rate`` 1e-3,
counted over the training forward's tokens *including* the right padding to 16 the runtime adds), with the
config's vocabulary of 64 instead of the tokenizer's 23, without the dense first layer, with softmax
routing, all-dense (the same MLA model without experts), and other learning rates.

    python benchmarks/tiny_moe_learning_study.py --variants dense,moe --seeds 1,42 --steps 150 --json OUT.json

Writes the reward curve of every run, the 10-step mean reward at steps 25/50/100/150 and the first step where
it reaches 0.8, with the command and the machine. Not a test (hours on a small CPU).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renames past_key_values
REPO = Path(__file__).resolve().parents[1]
MOE_CONFIG = REPO / "rlc" / "recipes" / "models" / "tiny-moe-mtp" / "config.json"
WINDOW, GOAL, MARKS = 10, 0.8, (25, 50, 100, 150)
PAD_TO = 16  # rlc.runtime.driver: pack_rollouts(pad_to_multiple=16 * tp * cp)


@dataclass(frozen=True)
class Variant:
    model: str  # "dense" | "moe"
    about: str
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields over the shipped config
    lr: float = 5e-4
    bias_update_rate: float = 0.0  # Megatron's moe_router_bias_update_rate when > 0
    bias_count_padding: bool = True  # count the pad tokens of the training forward, as the runtime's does
    router: str = "sigmoid"  # "sigmoid" (noaux_tc, the config) | "softmax"
    vocab: int | None = None  # None: the tokenizer's size, as build_toy_model does
    bias_base: float = 30.0
    kl_penalty: float = 0.0  # loss.kl_penalty (k3) towards the initial model, as the runtime's reference policy
    freeze_router: bool = False  # the router weights get no update (NeMo-RL's freeze_moe_router)
    qk_norm: bool = True
    o_proj_scale: float = 1.0  # the attention output projections' weights times this
    attn_norm_gain: float = 1.0
    q_norm_gain: float = 1.0  # MoE: q_a_layernorm's weights times this (the queries, so the attention logits, scale)  # MoE: q_a_layernorm / kv_a_layernorm weights (1 in the checkpoint) times this  # False: the dense model's per-head q/k RMSNorm replaced by identity


VARIANTS: dict[str, Variant] = {
    "dense": Variant("dense", "tiny Qwen3 as shipped (tiny-qwen3-1gpu)"),
    "dense_lr2.5e-4": Variant("dense", "dense, lr 2.5e-4", lr=2.5e-4),
    "dense_no_qknorm": Variant("dense", "dense without Qwen3's per-head q/k RMSNorm", qk_norm=False),
    "dense_4layers": Variant("dense", "dense with 4 layers (the MoE's depth)", overrides={"num_hidden_layers": 4}),
    "moe": Variant("moe", "tiny DeepSeek-V3 as built for tiny-moe-mtp-* (vocab 23, fixed router bias)"),
    "moe_bias_update": Variant("moe", "MoE + Megatron's expert-bias update (rate 1e-3, pad tokens counted)",
                               bias_update_rate=1e-3),
    "moe_bias_update_nopad": Variant("moe", "MoE + expert-bias update counting only real tokens",
                                     bias_update_rate=1e-3, bias_count_padding=False),
    "moe_vocab64": Variant("moe", "MoE with the config's vocab_size 64 (41 logits no token needs)", vocab=64),
    "moe_no_dense_first": Variant("moe", "MoE, every layer MoE (first_k_dense_replace 0)",
                                  overrides={"first_k_dense_replace": 0}),
    "moe_kl0.05": Variant("moe", "MoE with loss.kl_penalty 0.05 (k3) towards the initial model", kl_penalty=0.05),
    "moe_frozen_router": Variant("moe", "MoE with the router weights frozen (NeMo-RL's GRPO default)",
                                 freeze_router=True),
    "moe_softmax": Variant("moe", "MoE with softmax top-2 routing, no bias", router="softmax"),
    "moe_bias0": Variant("moe", "MoE with router bias N(0, 0.05) instead of 30 + N(0, 0.05)", bias_base=0.0),
    "moe_all_dense": Variant("moe", "the same MLA model, every layer dense (no experts)",
                             overrides={"first_k_dense_replace": 4}),
    "moe_attn_gain4": Variant("moe", "MoE with the MLA latent norms' weights 4 (attention logits x16)",
                              attn_norm_gain=4.0),
    "moe_o_proj0.25": Variant("moe", "MoE with the attention output projections scaled by 1/4", o_proj_scale=0.25),
    "moe_q_gain4": Variant("moe", "MoE with q_a_layernorm's weights 4 (attention logits x4, values unchanged)",
                           q_norm_gain=4.0),
    "moe_q_gain16": Variant("moe", "MoE with q_a_layernorm's weights 16 (attention logits x16, values unchanged)",
                            q_norm_gain=16.0),
    "moe_init0.07": Variant("moe", "MoE with initializer_range 0.07", overrides={"initializer_range": 0.07}),
    "moe_lr2.5e-4": Variant("moe", "MoE, lr 2.5e-4", lr=2.5e-4),
    "moe_lr1e-4": Variant("moe", "MoE, lr 1e-4", lr=1e-4),
    "moe_lr1e-3": Variant("moe", "MoE, lr 1e-3", lr=1e-3),
    "moe_lr2e-3": Variant("moe", "MoE, lr 2e-3", lr=2e-3),
}


# ------------------------------------------------------------------ models


def build_model(v: Variant, workdir: Path) -> torch.nn.Module:
    """The toy builders' checkpoint for this variant, loaded in fp32 (one file per variant, seed 0)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from rlc.runtime import toy  # noqa: PLC0415
    from rlc.runtime import toy_model  # noqa: PLC0415

    out = workdir / "ckpt"
    config: dict[str, Any] | None = None
    if v.model == "moe":
        config = {**json.loads(MOE_CONFIG.read_text(encoding="utf-8")), **v.overrides}
    elif v.overrides:
        config = dict(v.overrides)
    real_vocab_size = toy.vocab_size
    if v.vocab is not None:  # build_toy_model always uses the tokenizer's size; this variant asks otherwise
        toy.vocab_size = lambda: v.vocab  # type: ignore[assignment]
    try:
        toy_model.build_toy_model(out, config=config, moe=False, seed=0)
    finally:
        toy.vocab_size = real_vocab_size  # type: ignore[assignment]
    if v.model == "moe":
        sys.path.insert(0, str(REPO / "tests" / "gpu"))
        from test_four_gpu_grpo import add_mtp_layers  # noqa: PLC0415

        add_mtp_layers(out, seed=0, bias_base=v.bias_base)
    import transformers  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.config.use_cache = False
    if v.router == "softmax":
        _softmax_routing(model)
    if v.attn_norm_gain != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_a_layernorm.weight", "kv_a_layernorm.weight")):
                    p.mul_(v.attn_norm_gain)
    if v.q_norm_gain != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("q_a_layernorm.weight"):
                    p.mul_(v.q_norm_gain)
    if v.o_proj_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("self_attn.o_proj.weight"):
                    p.mul_(v.o_proj_scale)
    if not v.qk_norm:
        for m in model.modules():
            if hasattr(m, "q_norm") and hasattr(m, "k_norm"):
                m.q_norm, m.k_norm = torch.nn.Identity(), torch.nn.Identity()
    return model


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]


def _softmax_routing(model: torch.nn.Module) -> None:
    """Replace DeepSeek-V3's sigmoid + bias top-k by softmax top-k (renormalised), bias unused."""
    import torch.nn.functional as F  # noqa: PLC0415

    def forward(self, hidden_states):  # noqa: ANN001, ANN202
        h = hidden_states.view(-1, self.hidden_dim)
        logits = F.linear(h.float(), self.weight.float())
        scores = logits.softmax(dim=-1)
        w, idx = torch.topk(scores, k=self.top_k, dim=-1)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, idx

    for r in _routers(model):
        r.forward = forward.__get__(r)


class RoutingCounter:
    """Tokens per expert of each MoE layer during the forwards it is armed for (Megatron's
    ``local_tokens_per_expert``, accumulated where ``torch.is_grad_enabled()``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = _routers(model)
        self.counts = [torch.zeros(r.e_score_correction_bias.numel(), dtype=torch.float64) for r in self.routers]
        self.weights: torch.Tensor | None = None  # per token (flattened [B, L]) multiplicity; None = 1
        self.armed = False
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int):  # noqa: ANN202
        def hook(module, args, output):  # noqa: ANN001, ANN202
            if not self.armed:
                return
            idx = output[2]  # [tokens, top_k]
            w = torch.ones(idx.shape[0], dtype=torch.float64) if self.weights is None else self.weights
            onehot = torch.zeros(idx.shape[0], self.counts[i].numel(), dtype=torch.float64)
            onehot.scatter_(1, idx, 1.0)
            self.counts[i] += (onehot * w[:, None]).sum(0)
        return hook

    def update(self, rate: float) -> float:
        """``get_updated_expert_bias``: bias += rate * sign(mean load - load); returns the max |bias - 30|-spread."""
        with torch.no_grad():
            for r, c in zip(self.routers, self.counts):
                offset = c.mean() - c
                r.e_score_correction_bias += (torch.sign(offset) * rate).to(torch.float32)
                c.zero_()
        return max(float(r.e_score_correction_bias.max() - r.e_score_correction_bias.min()) for r in self.routers)


# ------------------------------------------------------------------ one run


def decode_reward(answer: str, token_ids: list[int]) -> float:
    """The runtime's reward: vLLM's text (special tokens skipped; ids the tokenizer lacks give no text)
    scored by ``prefix_match``."""
    from rlc.runtime import toy  # noqa: PLC0415
    from rlc.runtime.grpo.rewards import prefix_match_reward  # noqa: PLC0415

    text = "".join(toy.VOCAB[t] for t in token_ids if t < len(toy.VOCAB) and toy.VOCAB[t] not in toy.SPECIAL_TOKENS)
    return prefix_match_reward("", text, answer)


def _prefix(model: torch.nn.Module, prompts: torch.Tensor):  # noqa: ANN202
    """Forward of the distinct prompts: next-token log-probs ``[P, V]`` and the KV cache."""
    out = model(input_ids=prompts, use_cache=True)
    return torch.log_softmax(out.logits[:, -1, :].float(), dim=-1), out.past_key_values


def _continue(model: torch.nn.Module, cache, rows: torch.Tensor, tokens: torch.Tensor):  # noqa: ANN001, ANN202
    """``tokens`` ``[N, k]`` after the cached prompt ``rows[i]`` of each sequence: log-probs ``[N, k, V]``.

    The cache's batch is re-indexed with ``index_select`` (differentiable), so the gradient of a
    response token's log-prob reaches the shared prompt positions, as in a full forward of each row."""
    cache.reorder_cache(rows)
    out = model(input_ids=tokens, past_key_values=cache, use_cache=True)
    return torch.log_softmax(out.logits.float(), dim=-1)


def rollout_and_logprobs(model: torch.nn.Module, prompts: torch.Tensor, prompt_of: list[int],
                         gen: torch.Generator, counter: "RoutingCounter | None" = None):  # noqa: ANN201
    """Sample two tokens per entry of ``prompt_of`` (an index into the distinct ``prompts``) at temperature 1,
    stopping at EOS, and return the responses with the log-probs of their tokens, still attached to the graph.

    One forward serves both the sampler and the trainer (the same weights: exactly on-policy, the ratio
    of the update is 1): the distinct prompts once, then each distinct (prompt, first token) pair as one
    token after the prompt's KV cache. ``counter`` gets each token's routing with its multiplicity in the
    runtime's batch (every sample is a row there)."""
    from rlc.runtime import toy  # noqa: PLC0415

    n = len(prompt_of)
    if counter is not None:
        per_prompt = torch.bincount(torch.tensor(prompt_of), minlength=prompts.shape[0]).double()
        counter.weights = per_prompt[:, None].expand(-1, prompts.shape[1]).reshape(-1).contiguous()
    lp1, cache = _prefix(model, prompts)
    t1 = torch.empty(n, dtype=torch.int64)
    po = torch.tensor(prompt_of)
    for p in torch.unique(po).tolist():
        members = (po == p).nonzero().squeeze(1)
        t1[members] = torch.multinomial(lp1[p].detach().exp(), len(members), replacement=True, generator=gen)
    pairs = sorted({(prompt_of[i], int(t1[i])) for i in range(n)})
    pair_row = {pair: r for r, pair in enumerate(pairs)}
    row_of = torch.tensor([pair_row[(prompt_of[i], int(t1[i]))] for i in range(n)])
    if counter is not None:
        counter.weights = torch.bincount(row_of, minlength=len(pairs)).double()
    lp2 = _continue(model, cache, torch.tensor([p for p, _ in pairs]), torch.tensor([[t] for _, t in pairs]))[:, 0]
    t2 = torch.full((n,), -1, dtype=torch.int64)
    for r in range(len(pairs)):
        if pairs[r][1] == toy.EOS_ID:
            continue
        members = (row_of == r).nonzero().squeeze(1)
        t2[members] = torch.multinomial(lp2[r].detach().exp(), len(members), replacement=True, generator=gen)
    logprobs = torch.stack([lp1[po, t1], lp2[row_of, t2.clamp(min=0)]], dim=1)
    return t1, t2, logprobs, (cache, row_of)


def run_variant(name: str, v: Variant, *, seed: int, steps: int, prompts: int, gens: int, max_tokens: int,
                workdir: Path, log=print) -> dict[str, Any]:  # noqa: ANN001
    from rlc.contract.runtime_config import LossConfig  # noqa: PLC0415
    from rlc.runtime import toy  # noqa: PLC0415
    from rlc.runtime.grpo.advantages import group_advantages, group_has_signal  # noqa: PLC0415
    from rlc.runtime.grpo.data import PromptCursor, PromptSample  # noqa: PLC0415
    from rlc.runtime.grpo.loss import grpo_loss  # noqa: PLC0415

    torch.manual_seed(seed)
    model = build_model(v, workdir)
    model.train()
    if v.freeze_router:
        for r in _routers(model):
            r.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=v.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    counter = RoutingCounter(model) if v.bias_update_rate > 0 else None
    ref = copy.deepcopy(model).eval() if v.kl_penalty > 0 else None
    loss_cfg = LossConfig(ratio_clip_low=0.2, ratio_clip_high=0.28, kl_penalty=v.kl_penalty, kl_estimator="k3",
                          token_level=True,
                          clip_ratio_c=None, max_log_ratio=20.0, importance_sampling_correction=False,
                          importance_sampling_cap=2.0)  # the recipes' resolved loss section
    samples = [PromptSample(i, ex["prompt"], ex["answer"], f"toy:{i}") for i, ex in enumerate(toy.examples(4096, 0))]
    cursor = PromptCursor(samples, seed=seed, shuffle=True)
    gen = torch.Generator().manual_seed(seed)
    rewards_curve, grad_norms, bias_spread, signal, entropy = [], [], [], [], []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        batch = cursor.next_batch(prompts)
        texts = sorted({p.prompt for p in batch})
        where = {t: i for i, t in enumerate(texts)}
        prompt_ids = torch.tensor([toy.char_ids(t) for t in texts], dtype=torch.int64)  # all "a+b=": 5 tokens
        prompt_of = [where[p.prompt] for p in batch for _ in range(gens)]
        if counter is not None:
            counter.armed = True
        t1, t2, lp, (cache, row_of) = rollout_and_logprobs(model, prompt_ids, prompt_of, gen, counter)
        resp = [[int(a)] if b < 0 else [int(a), int(b)] for a, b in zip(t1, t2)]
        rewards = [decode_reward(batch[i // gens].answer, resp[i]) for i in range(prompts * gens)]
        adv = group_advantages(torch.tensor(rewards).reshape(prompts, gens), leave_one_out=False,
                               normalize=True).view(-1)
        mask = torch.stack([torch.ones(len(resp)), (t2 >= 0).float()], dim=1)
        if counter is not None:  # the rest of each row of the runtime's batch: t2 (if any), then pad to PAD_TO
            width = PAD_TO - prompt_ids.shape[1] - 1 if v.bias_count_padding else 1
            rest = torch.full((len(resp), width), toy.PAD_ID, dtype=torch.int64)
            rest[:, 0] = torch.where(t2 >= 0, t2, torch.full_like(t2, toy.PAD_ID))
            wt = torch.ones(len(resp), width, dtype=torch.float64)
            if not v.bias_count_padding:
                wt = wt * (t2 >= 0).double()[:, None]
            # one row per distinct (pair, rest), weighted by its count
            keys = {}
            for i in range(len(resp)):
                keys.setdefault((int(row_of[i]), tuple(rest[i].tolist())), []).append(i)
            ks = list(keys)
            counter.weights = torch.stack([wt[keys[k]].sum(0) for k in ks]).reshape(-1).contiguous()
            with torch.no_grad():
                _continue(model, cache, torch.tensor([k[0] for k in ks]), torch.tensor([k[1] for k in ks]))
            counter.armed = False
        ref_lp = None
        if ref is not None:
            with torch.no_grad():
                r1, rcache = _prefix(ref, prompt_ids)
                pair_prompt = torch.zeros(int(row_of.max()) + 1, dtype=torch.int64)
                pair_prompt[row_of] = torch.tensor(prompt_of)
                pair_t1 = torch.zeros_like(pair_prompt)
                pair_t1[row_of] = t1
                r2 = _continue(ref, rcache, pair_prompt, pair_t1[:, None])[:, 0]
                ref_lp = torch.stack([r1[torch.tensor(prompt_of), t1], r2[row_of, t2.clamp(min=0)]], dim=1)
        loss, _ = grpo_loss(lp, lp.detach(), adv, mask, loss_cfg, ref_logprobs=ref_lp)  # token mean over the batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if counter is not None:
            bias_spread.append(round(counter.update(v.bias_update_rate), 5))
        mean_r = sum(rewards) / len(rewards)
        rewards_curve.append(round(mean_r, 5))
        signal.append(round(float(group_has_signal(torch.tensor(rewards).reshape(prompts, gens)).double().mean()), 4))
        entropy.append(round(float(first_token_entropy(model, prompt_ids)), 4))
        grad_norms.append(round(float(gn), 4))
        if step % 10 == 0 or step == 1:
            w = rewards_curve[-WINDOW:]
            log(f"[{name} seed {seed}] step {step} reward {mean_r:.3f} 10-mean {sum(w) / len(w):.3f} "
                f"signal {signal[-1]:.2f} H {entropy[-1]:.2f} grad_norm {float(gn):.3f} pairs {int(row_of.max()) + 1} {time.perf_counter() - t0:.0f}s")
    return {"variant": name, "seed": seed, "reward_curve": rewards_curve, "grad_norm": grad_norms,
            "groups_with_signal": signal, "first_token_entropy": entropy, "bias_spread": bias_spread,
            "final_per_prompt": per_prompt_answers(model), "seconds": round(time.perf_counter() - t0, 1),
            **summarize(rewards_curve)}


def first_token_entropy(model: torch.nn.Module, prompt_ids: torch.Tensor) -> float:
    """Mean entropy (nats) of the first response token's distribution over the step's distinct prompts."""
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=prompt_ids).logits[:, -1, :].float(), dim=-1)
    return float(-(lp.exp() * lp).sum(-1).mean())


def per_prompt_answers(model: torch.nn.Module) -> dict[str, Any]:
    """After training, for each of the 100 prompts: the probability of the right first token and the argmax token."""
    from rlc.runtime import toy  # noqa: PLC0415

    texts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([toy.char_ids(t) for t in texts])).logits[:, -1, :].float(), -1)
    right = [toy.TOKEN_IDS[str((a + b) % 10)] for a in range(10) for b in range(10)]
    p_right = [round(float(probs[i, r]), 4) for i, r in enumerate(right)]
    top = [toy.VOCAB[int(i)] for i in probs.argmax(-1)]
    return {"p_right": p_right, "argmax": top,
            "confidently_wrong": sum(1 for p, t, r in zip(probs.max(-1).values.tolist(), top, right)
                                     if p > 0.9 and t != toy.VOCAB[r])}


def summarize(curve: list[float]) -> dict[str, Any]:
    means = {s: round(sum(curve[s - WINDOW:s]) / WINDOW, 4) for s in MARKS if len(curve) >= s}
    reached = next((i for i in range(WINDOW, len(curve) + 1) if sum(curve[i - WINDOW:i]) / WINDOW >= GOAL), None)
    return {"mean10_at": means, "step_10mean_reached_goal": reached}


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown: per variant and batch, the 10-step mean reward at MARKS and the step reaching GOAL, per seed."""
    rows = ["| variant | prompts x gens | seed | " + " | ".join(f"step {m}" for m in MARKS) + f" | 10-mean >= {GOAL} at |",
            "|---|---|---|" + "---|" * (len(MARKS) + 1)]
    order = list(VARIANTS)
    for r in sorted(runs, key=lambda r: (order.index(r["variant"]) if r["variant"] in order else 99,
                                         r["settings"]["prompts"], r["seed"])):
        cells = [f"{r['mean10_at'].get(str(m), r['mean10_at'].get(m, float('nan'))):.3f}" for m in MARKS]
        reached = r["step_10mean_reached_goal"]
        rows.append(f"| {r['variant']} | {r['settings']['prompts']} x {r['settings']['gens']} | {r['seed']} | "
                    + " | ".join(cells) + f" | {reached if reached is not None else 'not reached'} |")
    return "\n".join(rows)


def machine() -> dict[str, Any]:
    import transformers  # noqa: PLC0415

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="dense,moe", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--seeds", default="1", help="grpo.seed values (prompt order and sampling); init is seed 0")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=128, help="prompts per step (the recipes: 128)")
    ap.add_argument("--gens", type=int, default=16, help="generations per prompt (the recipes: 16)")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write (or add to) this JSON result file")
    ap.add_argument("--table", default=None, metavar="JSON", help="print the markdown table of a result file and exit")
    a = ap.parse_args(argv)
    if a.table:
        print(table(json.loads(Path(a.table).read_text(encoding="utf-8"))["runs"]))
        return 0
    torch.set_num_threads(a.threads)
    names = [x for x in a.variants.split(",") if x]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    out: dict[str, Any] = {"study": "tiny MoE vs dense GRPO learning speed, pure PyTorch on CPU", "runs": []}
    path = Path(a.json) if a.json else None
    if path and path.exists():
        out = json.loads(path.read_text(encoding="utf-8"))
    for name in names:
        for seed in [int(s) for s in a.seeds.split(",") if s]:
            with tempfile.TemporaryDirectory() as tmp:
                res = run_variant(name, VARIANTS[name], seed=seed, steps=a.steps, prompts=a.prompts, gens=a.gens,
                                  max_tokens=a.max_tokens, workdir=Path(tmp))
            res["about"] = VARIANTS[name].about
            res["settings"] = {"prompts": a.prompts, "gens": a.gens, "steps": a.steps, "lr": VARIANTS[name].lr,
                               "max_tokens": a.max_tokens}
            res["command"] = "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv or sys.argv[1:])])
            res["machine"] = machine()
            print(json.dumps({k: res[k] for k in ("variant", "seed", "mean10_at", "step_10mean_reached_goal",
                                                  "seconds")}), flush=True)
            out["runs"] = [r for r in out["runs"] if (r["variant"], r["seed"], r["settings"]["prompts"],
                                                      r["settings"]["gens"]) != (name, seed, a.prompts, a.gens)] + [res]
            if path:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
