"""Why the tiny DeepSeek-V3 MoE learns the toy task slower than the dense tiny Qwen3: a controlled study.

The GPU runs (Megatron trainer + vLLM sampler) compare the dense ``tiny-qwen3-1gpu`` recipe with the tiny
MoE of ``tiny-moe-mtp-2gpu-ep2`` on one GPU. This script replays the same GRPO step in pure PyTorch (CPU or
one GPU), with the policy sampling from itself (no engine, so no generation/trainer mismatch), to separate
the causes that need neither vLLM nor Megatron from those that do:

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
full batch's (this is what makes 2048 samples per step affordable).

Variants (``--variants``; ``--list`` prints them with what vLLM 0.22 can serve on Hopper): the dense and MoE
models as shipped; the MoE with Megatron's aux-loss-free expert-bias update, other routers, frozen router,
other learning rates; the MLA attention's dims changed one at a time (``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim`` / ``v_head_dim``, heads, ``initializer_range``), with and without experts; a Qwen3-MoE
(the dense model's GQA attention with the same experts) as control; and a proposed fix (``moe_fix*``: the
MLA attention initialised to start like the dense model's, every dim kept); the initialisation's size, place
and draws (``init_std``: named weight matrices drawn at another std, as the checkpoint builder
``rlc.runtime.toy_model.build_toy_model(init_std=...)`` does; ``init_seed``). ``--variants attention``
and ``--variants init`` are presets for one GPU call each. Every variant's checkpoint is drawn with its own
``init_std`` only: ``moe`` is the tiny MoE as first shipped (every matrix at ``initializer_range`` 0.02), and
``moe_attn0.07`` is the one its model folder now ships (``_init_std`` in its config.json).
The tiny GLM-4.5-style MoE of ``tiny-glm-moe-1gpu-megatron`` (``glm*``: grouped-query attention with QKV bias
and half-width rotary, the same 8 experts top-2 + shared behind one dense layer, sigmoid router with the fp32
bias, one MTP layer) is built as its GPU checks build it (``build_toy_model`` from
``rlc/recipes/models/tiny-glm-moe-mtp/config.json``, then ``add_mtp_layers``); ``glm`` is every matrix at
``initializer_range``; the others change only the draws or add Megatron's router-bias update
(``--variants glm_init``).
Every run also records the attention of the last prompt position (where the answer is predicted) at init
and after training: its entropy (1 = uniform) and the mass on the two operand positions (0.4 = uniform).

Each (variant, seed) is deterministic: the checkpoint drawn with seed 0 (the shipped builder's; ``init_seed``
None: the run's seed), prompt order and sampling by the seed on a CPU generator; on CUDA deterministic
algorithms, eager attention and no TF32. Every run records the initial policy (``policy_at_init``: first-token
entropy over the 100 prompts, mean p(right digit)) and the first step's policy KL.

    python benchmarks/tiny_moe_learning_study.py --variants dense,moe --seeds 1,42 --steps 150 --json OUT.json
    python3 benchmarks/tiny_moe_learning_study.py --device cuda --jobs 12 --variants attention --seeds 1,42 \\
        --steps 150 --deadline-s 500 --out DIR       # one GPU, 12 worker processes
    python3 benchmarks/tiny_moe_learning_study.py --device cuda --jobs 16 --variants init --seeds 7,13,42,99 \\
        --steps 150 --deadline-s 270 --out DIR       # 47 runs
    python benchmarks/tiny_moe_learning_study.py --threads 2 --variants glm_init --seeds 7,13 --steps 150 \\
        --out DIR --name glm_init                    # DIR/glm_init.json, .md

Writes the reward curve of every run, the 10-step mean reward at steps 25/50/100/150 and the first step where
it reaches 0.8, with the command and the machine (``--out DIR``: ``DIR/tiny_moe_learning_study.json`` and a
markdown table next to it; ``--name`` renames them). Not a test (hours on a small CPU; minutes on one GPU with
``--jobs``).
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
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renames past_key_values
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # ``rlc`` from this checkout, also in spawned workers
    sys.path.insert(0, str(REPO))
MOE_CONFIG = REPO / "rlc" / "recipes" / "models" / "tiny-moe-mtp" / "config.json"
GLM_CONFIG = REPO / "rlc" / "recipes" / "models" / "tiny-glm-moe-mtp" / "config.json"
WINDOW, GOAL, MARKS = 10, 0.8, (25, 50, 100, 150)
PAD_TO = 16  # rlc.runtime.driver: pack_rollouts(pad_to_multiple=16 * tp * cp)
OPERANDS = (1, 3)  # positions of a and b in [BOS, a, +, b, =]
RESULT_NAME = "tiny_moe_learning_study"


@dataclass(frozen=True)
class Variant:
    model: str  # "dense" (tiny Qwen3) | "moe" (tiny DeepSeek-V3) | "qwen3_moe" | "glm" (tiny GLM-4.5 MoE)
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
    qk_norm: bool = True  # False: the dense model's per-head q/k RMSNorm replaced by identity
    o_proj_scale: float = 1.0  # the attention output projections' weights times this
    attn_norm_gain: float = 1.0  # MoE: q_a_layernorm / kv_a_layernorm weights (1 in the checkpoint) times this
    q_norm_gain: float = 1.0  # MoE: q_a_layernorm's weights times this (the queries, so the attention logits, scale)
    #: weight matrices drawn at another std than ``initializer_range``: fnmatch pattern over the checkpoint's tensor
    #: names -> std, first match wins (``rlc.runtime.toy_model.with_init_std``, the checkpoint builder's own)
    init_std: dict[str, float] = field(default_factory=dict)
    init_seed: int | None = 0  # the checkpoint builder's seed (the shipped checkpoint's: 0); None: the run's seed


#: Tiny Qwen3-MoE with the DeepSeek-V3 tiny model's layout: 4 layers, the first dense (intermediate 256),
#: 8 routed experts top-2 of width 64; the dense tiny model's attention (GQA 4/2, head_dim 32, q/k RMSNorm).
#: Qwen3-MoE has no shared expert and routes by softmax top-k (renormalised).
QWEN3_MOE = {"num_hidden_layers": 4, "mlp_only_layers": [0], "intermediate_size": 256, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 64}
#: Every attention matrix with fan-in 128 (the hidden size), as in the dense model: no query LoRA, latent 128,
#: 4 heads x v 32 into o_proj; queries/keys 32 + 64 rope.
SMALL_MLA = {"q_lora_rank": None, "kv_lora_rank": 128, "qk_nope_head_dim": 32, "v_head_dim": 32}
#: The proposed fix, in the checkpoint's initial weights only (every MLA dim stays DeepSeek-V3's, so vLLM's
#: Hopper MLA kernels keep their shapes): at init the MLA attention of this 128-wide model is uniform (last
#: position's attention entropy 0.999 of the maximum; the dense model's q/k RMSNorm gives 0.82-0.90) because
#: its logits are ~16x smaller, and its output is ~3x the dense model's (o_proj and kv_b_proj have fan-in 512).
#: q_a_layernorm's weights 16 make the logits O(1) as in the dense model; o_proj x 0.25 its output scale.
FIX = {"q_norm_gain": 16.0, "o_proj_scale": 0.25}
#: Checkpoint tensor-name patterns for ``Variant.init_std``: the MLA projections (q_a, q_b, kv_a_proj_with_mqa,
#: kv_b, o_proj; their norms are vectors and keep weight 1), every decoder layer (attention, MLPs, experts,
#: routers: all but the embedding and lm_head), the MLPs without the routers, the routers, the output head.
ATTN = "model.layers.*.self_attn.*"
BODY = "model.layers.*"
ROUTER = "model.layers.*.mlp.gate.weight"
MLP_NOT_ROUTER = {ROUTER: 0.02, "model.layers.*.mlp.*": 0.07}  # first match wins: routers stay at 0.02
HEAD = "lm_head.weight"
RUNTIME = {"bias_update_rate": 1e-3, "kl_penalty": 0.01}  # as the GPU runs train: Megatron's bias update, KL 0.01

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
    # --- the MLA attention, one dim at a time (experts, sigmoid router + fp32 bias, MTP kept)
    "moe_q_full": Variant("moe", "MoE, q_lora_rank null: plain q_proj (128 -> heads x 192) as DeepSeek-V2-Lite",
                          overrides={"q_lora_rank": None}),
    "moe_q128": Variant("moe", "MoE, q_lora_rank 128 (= hidden) instead of 64", overrides={"q_lora_rank": 128}),
    "moe_q256": Variant("moe", "MoE, q_lora_rank 256", overrides={"q_lora_rank": 256}),
    "moe_kv128": Variant("moe", "MoE, kv_lora_rank 128 (= hidden) instead of 512", overrides={"kv_lora_rank": 128}),
    "moe_kv256": Variant("moe", "MoE, kv_lora_rank 256", overrides={"kv_lora_rank": 256}),
    "moe_nope64_v128": Variant("moe", "MoE, qk_nope_head_dim 64 (q/k 128 = v 128)",
                               overrides={"qk_nope_head_dim": 64}),
    "moe_nope64_v64": Variant("moe", "MoE, qk_nope_head_dim 64, v_head_dim 64",
                              overrides={"qk_nope_head_dim": 64, "v_head_dim": 64}),
    "moe_nope32_v32": Variant("moe", "MoE, qk_nope_head_dim 32, v_head_dim 32 (o_proj fan-in 128)",
                              overrides={"qk_nope_head_dim": 32, "v_head_dim": 32}),
    "moe_heads8": Variant("moe", "MoE, 8 attention heads instead of 4",
                          overrides={"num_attention_heads": 8, "num_key_value_heads": 8}),
    "moe_init0.01": Variant("moe", "MoE with initializer_range 0.01", overrides={"initializer_range": 0.01}),
    "moe_init0.04": Variant("moe", "MoE with initializer_range 0.04", overrides={"initializer_range": 0.04}),
    "moe_small_mla": Variant("moe", "MoE, MLA with every attention fan-in 128: q_lora_rank null, kv_lora_rank "
                             "128, qk_nope 32, v 32", overrides=SMALL_MLA),
    # --- the same attention changes without experts (no routing at all)
    "moe_all_dense_q_full": Variant("moe", "all-dense MLA model, q_lora_rank null",
                                    overrides={"first_k_dense_replace": 4, "q_lora_rank": None}),
    "moe_all_dense_small_mla": Variant("moe", "all-dense MLA model with every attention fan-in 128",
                                       overrides={"first_k_dense_replace": 4, **SMALL_MLA}),
    "moe_all_dense_fix": Variant("moe", "all-dense MLA model with the proposed init (moe_fix)",
                                 overrides={"first_k_dense_replace": 4}, **FIX),
    # --- control: the same experts behind the dense model's attention
    "qwen3_moe": Variant("qwen3_moe", "Qwen3-MoE: the dense model's GQA + q/k-norm attention, 4 layers (first "
                         "dense), 8 experts top-2 of width 64, softmax router, no shared expert",
                         overrides=QWEN3_MOE),
    "qwen3_moe_frozen_router": Variant("qwen3_moe", "Qwen3-MoE control with the router frozen",
                                       overrides=QWEN3_MOE, freeze_router=True),
    # --- combinations
    "moe_q_full_frozen_router": Variant("moe", "MoE, q_lora_rank null, router frozen",
                                        overrides={"q_lora_rank": None}, freeze_router=True),
    "moe_small_mla_frozen_router": Variant("moe", "MoE, MLA fan-ins 128, router frozen", overrides=SMALL_MLA,
                                           freeze_router=True),
    "moe_q_full_lr2.5e-4": Variant("moe", "MoE, q_lora_rank null, lr 2.5e-4", overrides={"q_lora_rank": None},
                                   lr=2.5e-4),
    "moe_q_gain16_frozen_router": Variant("moe", "MoE, q_a_layernorm's weights 16, router frozen",
                                          q_norm_gain=16.0, freeze_router=True),
    "moe_fix": Variant("moe", "proposed fix (init only): q_a_layernorm's weights 16 (attention logits O(1)) and "
                       "o_proj x 0.25 (the dense model's output scale)", **FIX),
    "moe_fix_q4": Variant("moe", "the fix with q_a_layernorm's weights 4 instead of 16", q_norm_gain=4.0,
                          o_proj_scale=0.25),
    "moe_fix_bias_update": Variant("moe", "proposed fix + Megatron's expert-bias update (as the runtime trains)",
                                   bias_update_rate=1e-3, **FIX),
    "moe_fix_frozen_router": Variant("moe", "proposed fix, router frozen", freeze_router=True, **FIX),
    "moe_fix_lr2.5e-4": Variant("moe", "proposed fix, lr 2.5e-4", lr=2.5e-4, **FIX),
    # --- the initialisation: how large, where, and with which draws
    "moe_init0.05": Variant("moe", "MoE with initializer_range 0.05", overrides={"initializer_range": 0.05}),
    "moe_init0.10": Variant("moe", "MoE with initializer_range 0.10", overrides={"initializer_range": 0.10}),
    "moe_attn0.05": Variant("moe", "MoE, only the MLA projections at std 0.05 (the rest 0.02, the same draws)",
                            init_std={ATTN: 0.05}),
    "moe_attn0.07": Variant("moe", "MoE, only the MLA projections at std 0.07 (the rest 0.02, the same draws)",
                            init_std={ATTN: 0.07}),
    "moe_body0.07": Variant("moe", "MoE, every decoder layer at std 0.07; embedding and lm_head 0.02 (a "
                            "near-uniform initial policy)", init_std={BODY: 0.07}),
    "moe_head0.07": Variant("moe", "MoE, only lm_head at std 0.07 (the sharper initial policy alone)",
                            init_std={HEAD: 0.07}),
    "moe_mlp0.07": Variant("moe", "MoE, only the MLPs and experts (dense, shared, routed) at std 0.07, routers 0.02",
                           init_std=MLP_NOT_ROUTER),
    "moe_router0.07": Variant("moe", "MoE, only the router weights at std 0.07", init_std={ROUTER: 0.07}),
    "moe_init0.07_frozen_router": Variant("moe", "initializer_range 0.07, router frozen",
                                          overrides={"initializer_range": 0.07}, freeze_router=True),
    "moe_init0.07_lr2.5e-4": Variant("moe", "initializer_range 0.07, lr 2.5e-4", overrides={"initializer_range": 0.07},
                                     lr=2.5e-4),
    "moe_init0.07_runtime": Variant("moe", "initializer_range 0.07 trained as the GPU runs: expert-bias update 1e-3, "
                                    "KL penalty 0.01", overrides={"initializer_range": 0.07}, **RUNTIME),
    "moe_attn0.07_runtime": Variant("moe", "MLA projections at 0.07 trained as the GPU runs: expert-bias update "
                                    "1e-3, KL penalty 0.01", init_std={ATTN: 0.07}, **RUNTIME),
    "moe_initseed": Variant("moe", "MoE as shipped, the checkpoint drawn with the run's seed instead of 0",
                            init_seed=None),
    "moe_init0.07_initseed": Variant("moe", "initializer_range 0.07, the checkpoint drawn with the run's seed",
                                     overrides={"initializer_range": 0.07}, init_seed=None),
    "moe_attn0.07_initseed": Variant("moe", "MLA projections at 0.07, the checkpoint drawn with the run's seed",
                                     init_std={ATTN: 0.07}, init_seed=None),
    # --- the tiny GLM-4.5-style MoE (tiny-glm-moe-1gpu-megatron): GQA attention, the same experts and router
    "glm": Variant("glm", "tiny GLM-4.5 MoE as first shipped (tiny-glm-moe-mtp, every matrix at 0.02)"),
    "glm_attn0.07": Variant("glm", "GLM, only the attention projections (q/k/v with bias, o) at std 0.07 (the rest "
                            "0.02, the same draws)", init_std={ATTN: 0.07}),
    "glm_body0.07": Variant("glm", "GLM, every decoder layer at std 0.07; embedding and lm_head 0.02",
                            init_std={BODY: 0.07}),
    "glm_bias_update": Variant("glm", "GLM + Megatron's expert-bias update (rate 1e-3, pad tokens counted)",
                               bias_update_rate=1e-3),
    "glm_body0.07_bias_update": Variant("glm", "GLM, every decoder layer at 0.07, + Megatron's expert-bias update "
                                        "(rate 1e-3)", init_std={BODY: 0.07}, bias_update_rate=1e-3),
}


#: ``--variants attention``: the attention study for one GPU call, the most telling first (with a deadline,
#: runs go seed-major in this order, so the later ones are the ones that may miss their second seed).
#: ``NAME@K``: that variant with the first K of ``--seeds`` only. ``--variants init`` (seeds 7,13,42,99: 47 runs)
#: separates the initialisation's size (initializer_range 0.05 / 0.07 / 0.10), its place (MLA projections
#: only, every decoder layer but embedding and head, head only, MLPs only, routers only; the rest 0.02 with the
#: same draws), the draws themselves (the builder's seed = the run's), and the best candidates under the GPU
#: runs' training (expert-bias update, KL 0.01), a frozen router and half the learning rate.
PRESETS: dict[str, list[str]] = {
    "attention": ["dense", "moe", "moe_fix", "moe_bias_update", "moe_fix_bias_update", "moe_all_dense",
                  "moe_all_dense_fix", "qwen3_moe", "moe_small_mla", "moe_q_gain16", "moe_o_proj0.25", "moe_q_full",
                  "moe_nope64_v128", "moe_kv256", "moe_kv128", "moe_nope32_v32", "moe_heads8", "moe_q128",
                  "moe_init0.01", "moe_init0.04", "moe_all_dense_small_mla", "dense_4layers", "dense_no_qknorm",
                  "qwen3_moe_frozen_router", "moe_fix_q4", "moe_fix_frozen_router"],
    "init": ["dense@2", "moe@2", "moe_init0.07", "moe_attn0.07", "moe_body0.07", "moe_head0.07",
             "moe_init0.07_runtime@2", "moe_attn0.07_runtime@2", "moe_attn0.05@3", "moe_init0.05@3", "moe_init0.10@3",
             "moe_mlp0.07@2", "moe_router0.07@2", "moe_init0.07_initseed@2", "moe_attn0.07_initseed@2",
             "moe_initseed@2", "moe_init0.07_frozen_router@2", "moe_init0.07_lr2.5e-4@2"],
    "glm_init": ["dense", "glm", "glm_attn0.07", "glm_body0.07", "glm_bias_update", "glm_body0.07_bias_update"],
}

# ------------------------------------------------------------------ what vLLM 0.22 serves on Hopper


def model_config(v: Variant) -> dict[str, Any]:
    """The config fields the variant's checkpoint is built from (over ``build_toy_model``'s defaults)."""
    if v.model in ("moe", "glm"):
        path = MOE_CONFIG if v.model == "moe" else GLM_CONFIG
        return {**json.loads(path.read_text(encoding="utf-8")), **v.overrides}
    return dict(v.overrides)


def vllm_hopper_mla(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """Which vLLM 0.22.0 MLA attention backends run this DeepSeek-V3 config on Hopper (SM90); None if not MLA.

    From the pinned source: decode keeps the latent cache of head size ``kv_lora_rank + qk_rope_head_dim``.
    FLASH_ATTN_MLA and FLASHMLA take only the ``MLACommonBackend`` head sizes 320 and 576
    (``model_executor/layers/attention/mla_attention.py``); FLASH_ATTN_MLA runs FA3 with q/k = rope dim and
    v = ``kv_lora_rank`` (FA3: q/k <= 64 and v <= 512); FLASHMLA's SM90 dense decode kernel is built for 576
    (``_flashmla_C``: "Only head_size_k == 576 or 512", kv 512 + rope 64); TRITON_MLA takes any head size.
    Prefill on SM90 has only the FLASH_ATTN prefill backend (``prefill/selector.py``), which calls FA3 with
    q/k ``qk_nope + qk_rope`` and v ``v_head_dim`` without padding V (``prefill/flash_attn.py``): FA3 takes
    equal dims, or q/k in (128, 192] with v in (96, 128], or q/k <= 64 with v <= 512, all <= 256 and
    multiples of 8. The auto order on Hopper is FLASH_ATTN_MLA, FLASHMLA, TRITON_MLA (``platforms/cuda.py``).
    """
    if cfg.get("kv_lora_rank") is None:
        return None
    kv, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    d, dv = int(cfg["qk_nope_head_dim"]) + rope, int(cfg["v_head_dim"])
    head = kv + rope
    decode = []
    if head in (320, 576) and rope <= 64 and kv <= 512:
        decode.append("FLASH_ATTN_MLA")
    if kv == 512 and rope == 64:
        decode.append("FLASHMLA")
    decode.append("TRITON_MLA")
    fa3_dims = d <= 256 and d % 8 == 0 and dv % 8 == 0
    prefill = fa3_dims and (d == dv or (128 < d <= 192 and 96 < dv <= 128) or (d <= 64 and dv <= 512))
    return {"decode_head_size": head, "decode_backends": decode, "prefill_qk_v": [d, dv],
            "prefill_fa3": prefill, "servable": prefill and bool(decode)}


def vllm_note(v: Variant) -> str:
    """One cell: the Hopper MLA decode backends, or why vLLM 0.22 cannot serve the variant."""
    if v.model != "moe":
        return "not MLA"
    info = vllm_hopper_mla(model_config(v))
    assert info is not None
    if not info["prefill_fa3"]:
        d, dv = info["prefill_qk_v"]
        return f"no: FA3 prefill refuses q/k {d} with v {dv}"
    return "+".join(info["decode_backends"])


# ------------------------------------------------------------------ models


def build_model(v: Variant, workdir: Path, device: str = "cpu", attn: str | None = None,
                init_seed: int = 0) -> torch.nn.Module:
    """The toy builders' checkpoint for this variant (drawn with ``init_seed``; ``v.init_std`` rescaled before the
    MTP layer is added, as the checkpoint builder does), loaded in fp32 on ``device``.

    ``attn``: transformers' attention implementation (None: its default, SDPA)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from rlc.runtime import toy  # noqa: PLC0415
    from rlc.runtime import toy_model  # noqa: PLC0415

    out = workdir / "ckpt"
    config: dict[str, Any] | None = model_config(v) or None
    real_vocab_size = toy.vocab_size
    if v.vocab is not None:  # build_toy_model always uses the tokenizer's size; this variant asks otherwise
        toy.vocab_size = lambda: v.vocab  # type: ignore[assignment]
    try:
        # the variant's own init only (the model folder's _init_std is the shipped choice, ``moe_attn0.07``)
        toy_model.build_toy_model(out, config=config, moe=v.model == "qwen3_moe", seed=init_seed,
                                  init_std=v.init_std)
    finally:
        toy.vocab_size = real_vocab_size  # type: ignore[assignment]
    if v.model in ("moe", "glm"):  # as the GPU checks build both (tests/gpu/test_mcore_generation.py: the GLM)
        from tests.gpu.test_four_gpu_grpo import add_mtp_layers  # noqa: PLC0415

        add_mtp_layers(out, seed=init_seed, bias_base=v.bias_base)
    import transformers  # noqa: PLC0415

    transformers.logging.set_verbosity_error()
    kwargs: dict[str, Any] = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, **kwargs)
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
    model = model.to(device)
    if device != "cpu":
        _experts_smoke(model, device)
    return model


def _experts_smoke(model: torch.nn.Module, device: str) -> None:
    """One forward and backward on ``device``; if transformers' default experts kernel (grouped_mm) cannot run
    fp32 there, switch the experts to the per-expert loop ("eager"). Gradients are cleared afterwards."""
    from rlc.runtime import toy  # noqa: PLC0415

    ids = torch.tensor([toy.char_ids("1+2=")], device=device)
    try:
        model(input_ids=ids).logits.float().sum().backward()
    except (RuntimeError, NotImplementedError) as e:
        if not hasattr(model, "set_experts_implementation"):
            raise
        print(f"experts: grouped_mm failed on {device} ({str(e).splitlines()[0][:120]}); using eager", flush=True)
        model.set_experts_implementation("eager")
        model(input_ids=ids).logits.float().sum().backward()
    model.zero_grad(set_to_none=True)


def _router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers (DeepSeek-V3's ``DeepseekV3TopkRouter``, Qwen3-MoE's ``Qwen3MoeTopKRouter``)."""
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


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
            idx = output[2].cpu()  # [tokens, top_k]
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
                r.e_score_correction_bias += (torch.sign(offset) * rate).to(torch.float32).to(
                    r.e_score_correction_bias.device)
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
    runtime's batch (every sample is a row there). The model and ``prompts`` may be on a GPU; sampling runs
    on the CPU generator ``gen`` (the same draws on every device), the returned tokens are CPU tensors."""
    from rlc.runtime import toy  # noqa: PLC0415

    dev = prompts.device
    n = len(prompt_of)
    if counter is not None:
        per_prompt = torch.bincount(torch.tensor(prompt_of), minlength=prompts.shape[0]).double()
        counter.weights = per_prompt[:, None].expand(-1, prompts.shape[1]).reshape(-1).contiguous()
    lp1, cache = _prefix(model, prompts)
    p1 = lp1.detach().exp().cpu()
    po = torch.tensor(prompt_of)
    t1 = _sample_groups(p1, po, prompts.shape[0], gen, skip=())
    t1_list = t1.tolist()
    pairs = sorted({(prompt_of[i], t1_list[i]) for i in range(n)})
    pair_row = {pair: r for r, pair in enumerate(pairs)}
    row_of = torch.tensor([pair_row[(prompt_of[i], t1_list[i])] for i in range(n)])
    if counter is not None:
        counter.weights = torch.bincount(row_of, minlength=len(pairs)).double()
    lp2 = _continue(model, cache, torch.tensor([p for p, _ in pairs], device=dev),
                    torch.tensor([[t] for _, t in pairs], device=dev))[:, 0]
    p2 = lp2.detach().exp().cpu()
    t2 = _sample_groups(p2, row_of, len(pairs), gen, skip={r for r, (_, t) in enumerate(pairs) if t == toy.EOS_ID})
    logprobs = torch.stack([lp1[po.to(dev), t1.to(dev)], lp2[row_of.to(dev), t2.clamp(min=0).to(dev)]], dim=1)
    return t1, t2, logprobs, (cache, row_of)


def _sample_groups(probs: torch.Tensor, group_of: torch.Tensor, groups: int, gen: torch.Generator,
                   skip: "set[int] | tuple[()]") -> torch.Tensor:
    """For each group ``g`` in increasing order (except ``skip``), its members' tokens: ``multinomial(probs[g],
    members, replacement=True)`` on ``gen``, members in increasing index order; -1 where skipped."""
    out = torch.full((group_of.numel(),), -1, dtype=torch.int64)
    order = torch.argsort(group_of, stable=True)
    counts = torch.bincount(group_of, minlength=groups).tolist()
    draws, where, start = [], [], 0
    for g, k in enumerate(counts):
        if k and g not in skip:
            draws.append(torch.multinomial(probs[g], k, replacement=True, generator=gen))
            where.append(order[start:start + k])
        start += k
    if draws:
        out[torch.cat(where)] = torch.cat(draws)
    return out


def attention_focus(model: torch.nn.Module, prompt_ids: torch.Tensor) -> dict[str, list[float]]:
    """Per layer, the attention of the last prompt position (``=``, where the answer is predicted), averaged
    over heads and prompts: its entropy over the prompt divided by log(length) (1 = uniform) and its mass on
    the operand positions a and b (uniform: 2/5). Runs once with transformers' eager attention, whose
    attention modules return their weights."""
    impl = getattr(model.config, "_attn_implementation", None)
    switch = impl != "eager" and hasattr(model, "set_attn_implementation")
    if switch:
        model.set_attn_implementation("eager")
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: seen.append(out[1].detach()))
             for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "o_proj")]
    try:
        with torch.no_grad():
            model(input_ids=prompt_ids)
    finally:
        for h in hooks:
            h.remove()
        if switch:
            model.set_attn_implementation(impl)
    ent, mass = [], []
    length = prompt_ids.shape[1]
    for w in seen:  # [prompts, heads, q, k]
        if w is None:
            continue
        last = w[:, :, -1, :].float().clamp_min(1e-30)
        ent.append(round(float((-(last * last.log()).sum(-1) / torch.log(torch.tensor(float(length)))).mean()), 4))
        mass.append(round(float(last[:, :, list(OPERANDS)].sum(-1).mean()), 4))
    return {"entropy": ent, "operand_mass": mass}


def run_variant(name: str, v: Variant, *, seed: int, steps: int, prompts: int, gens: int, max_tokens: int,
                workdir: Path, log=print, device: str = "cpu", attn: str | None = None,  # noqa: ANN001
                stop_at: float | None = None, kl_every: int = 10) -> dict[str, Any]:
    """One GRPO run of ``steps`` steps; ``stop_at`` (a ``time.time()``) ends it early, marked ``stopped_early``."""
    from rlc.contract.runtime_config import LossConfig  # noqa: PLC0415
    from rlc.runtime import toy  # noqa: PLC0415
    from rlc.runtime.grpo.advantages import group_advantages, group_has_signal  # noqa: PLC0415
    from rlc.runtime.grpo.data import PromptCursor, PromptSample  # noqa: PLC0415
    from rlc.runtime.grpo.loss import grpo_loss  # noqa: PLC0415

    torch.manual_seed(seed)
    model = build_model(v, workdir, device, attn, init_seed=seed if v.init_seed is None else v.init_seed)
    model.train()
    if v.freeze_router:
        for r in _router_modules(model):
            r.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=v.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    counter = RoutingCounter(model) if v.bias_update_rate > 0 else None
    ref = copy.deepcopy(model).eval() if v.kl_penalty > 0 else None
    loss_cfg = LossConfig(ratio_clip_low=0.2, ratio_clip_high=0.28, kl_penalty=v.kl_penalty, kl_estimator="k3",
                          token_level=True,
                          clip_ratio_c=None, max_log_ratio=20.0, importance_sampling_correction=False,
                          importance_sampling_cap=2.0, kl_weighting="none",
                          kl_clamp=None, force_on_policy_ratio=False)  # the recipes' resolved loss section
    samples = [PromptSample(i, ex["prompt"], ex["answer"], f"toy:{i}") for i, ex in enumerate(toy.examples(4096, 0))]
    cursor = PromptCursor(samples, seed=seed, shuffle=True)
    gen = torch.Generator().manual_seed(seed)
    all_prompts = torch.tensor([toy.char_ids(f"{a}+{b}=") for a in range(10) for b in range(10)], device=device)
    focus_init = attention_focus(model, all_prompts)
    policy_init = policy_summary(model, all_prompts)
    rewards_curve, grad_norms, bias_spread, signal, entropy, policy_kl = [], [], [], [], [], []
    t0 = time.perf_counter()
    stopped = False
    for step in range(1, steps + 1):
        if stop_at is not None and time.time() > stop_at:
            stopped = True
            log(f"[{name} seed {seed}] deadline: stopped before step {step}")
            break
        batch = cursor.next_batch(prompts)
        texts = sorted({p.prompt for p in batch})
        where = {t: i for i, t in enumerate(texts)}
        prompt_ids = torch.tensor([toy.char_ids(t) for t in texts], dtype=torch.int64, device=device)  # "a+b=": 5
        prompt_of = [where[p.prompt] for p in batch for _ in range(gens)]
        if counter is not None:
            counter.armed = True
        t1, t2, lp, (cache, row_of) = rollout_and_logprobs(model, prompt_ids, prompt_of, gen, counter)
        resp = [[int(a)] if b < 0 else [int(a), int(b)] for a, b in zip(t1.tolist(), t2.tolist())]
        rewards = [decode_reward(batch[i // gens].answer, resp[i]) for i in range(prompts * gens)]
        adv = group_advantages(torch.tensor(rewards).reshape(prompts, gens), leave_one_out=False,
                               normalize=True).view(-1).to(device)
        mask = torch.stack([torch.ones(len(resp)), (t2 >= 0).float()], dim=1).to(device)
        if counter is not None:  # the rest of each row of the runtime's batch: t2 (if any), then pad to PAD_TO
            width = PAD_TO - prompt_ids.shape[1] - 1 if v.bias_count_padding else 1
            rest = torch.full((len(resp), width), toy.PAD_ID, dtype=torch.int64)
            rest[:, 0] = torch.where(t2 >= 0, t2, torch.full_like(t2, toy.PAD_ID))
            wt = torch.ones(len(resp), width, dtype=torch.float64)
            if not v.bias_count_padding:
                wt = wt * (t2 >= 0).double()[:, None]
            # one row per distinct (pair, rest), weighted by its count
            keys: dict[tuple[int, tuple[int, ...]], list[int]] = {}
            for i in range(len(resp)):
                keys.setdefault((int(row_of[i]), tuple(rest[i].tolist())), []).append(i)
            ks = list(keys)
            counter.weights = torch.stack([wt[keys[k]].sum(0) for k in ks]).reshape(-1).contiguous()
            with torch.no_grad():
                _continue(model, cache, torch.tensor([k[0] for k in ks], device=device),
                          torch.tensor([k[1] for k in ks], device=device))
            counter.armed = False
        ref_lp = None
        if ref is not None:
            with torch.no_grad():
                r1, rcache = _prefix(ref, prompt_ids)
                pair_prompt = torch.zeros(int(row_of.max()) + 1, dtype=torch.int64)
                pair_prompt[row_of] = torch.tensor(prompt_of)
                pair_t1 = torch.zeros_like(pair_prompt)
                pair_t1[row_of] = t1
                r2 = _continue(ref, rcache, pair_prompt.to(device), pair_t1[:, None].to(device))[:, 0]
                ref_lp = torch.stack([r1[torch.tensor(prompt_of, device=device), t1.to(device)],
                                      r2[row_of.to(device), t2.clamp(min=0).to(device)]], dim=1)
        loss, _ = grpo_loss(lp, lp.detach(), adv, mask, loss_cfg, ref_logprobs=ref_lp)  # token mean over the batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        before = None
        if kl_every and (step % kl_every == 0 or step == 1):
            with torch.no_grad():
                before = torch.log_softmax(model(input_ids=prompt_ids).logits[:, -1, :].float(), dim=-1)
        opt.step()
        if counter is not None:
            bias_spread.append(round(counter.update(v.bias_update_rate), 5))
        mean_r = sum(rewards) / len(rewards)
        rewards_curve.append(round(mean_r, 5))
        signal.append(round(float(group_has_signal(torch.tensor(rewards).reshape(prompts, gens)).double().mean()), 4))
        entropy.append(round(float(first_token_entropy(model, prompt_ids)), 4))
        if before is not None:
            policy_kl.append([step, round(first_token_kl(model, prompt_ids, before), 6)])
        grad_norms.append(round(float(gn), 4))
        if step % 10 == 0 or step == 1:
            w = rewards_curve[-WINDOW:]
            log(f"[{name} seed {seed}] step {step} reward {mean_r:.3f} 10-mean {sum(w) / len(w):.3f} "
                f"signal {signal[-1]:.2f} H {entropy[-1]:.2f} grad_norm {float(gn):.3f} pairs {int(row_of.max()) + 1} "
                f"{time.perf_counter() - t0:.0f}s")
    return {"variant": name, "seed": seed, "reward_curve": rewards_curve, "grad_norm": grad_norms,
            "groups_with_signal": signal, "first_token_entropy": entropy, "bias_spread": bias_spread,
            "policy_kl_per_step": policy_kl, "policy_at_init": policy_init, "attention_at_init": focus_init,
            "attention_at_end": attention_focus(model, all_prompts),
            "final_per_prompt": per_prompt_answers(model), "seconds": round(time.perf_counter() - t0, 1),
            "steps_done": len(rewards_curve), "stopped_early": stopped,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            **summarize(rewards_curve)}


def first_token_entropy(model: torch.nn.Module, prompt_ids: torch.Tensor) -> float:
    """Mean entropy (nats) of the first response token's distribution over the step's distinct prompts."""
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=prompt_ids).logits[:, -1, :].float(), dim=-1)
    return float(-(lp.exp() * lp).sum(-1).mean())


def policy_summary(model: torch.nn.Module, all_prompts: torch.Tensor) -> dict[str, float]:
    """The first response token's distribution over the 100 prompts: mean entropy (nats; uniform over the
    vocabulary: log V), mean probability of the right digit, mean top probability, prompts answered wrong
    with probability > 0.9."""
    answers = per_prompt_answers(model)
    with torch.no_grad():
        top = torch.softmax(model(input_ids=all_prompts).logits[:, -1, :].float(), -1).max(-1).values
    return {"first_token_entropy": round(first_token_entropy(model, all_prompts), 4),
            "mean_p_right": round(sum(answers["p_right"]) / len(answers["p_right"]), 4),
            "mean_p_top": round(float(top.mean()), 4), "confidently_wrong": answers["confidently_wrong"]}


def first_token_kl(model: torch.nn.Module, prompt_ids: torch.Tensor, before: torch.Tensor) -> float:
    """KL(before || now) of the first response token, mean over the step's distinct prompts: how far one
    optimizer step moved the policy (``before``: log-probs ``[P, V]`` taken just before the step)."""
    with torch.no_grad():
        now = torch.log_softmax(model(input_ids=prompt_ids).logits[:, -1, :].float(), dim=-1)
    return float((before.exp() * (before - now)).sum(-1).mean())


def per_prompt_answers(model: torch.nn.Module) -> dict[str, Any]:
    """After training, for each of the 100 prompts: the probability of the right first token and the argmax token."""
    from rlc.runtime import toy  # noqa: PLC0415

    texts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    dev = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([toy.char_ids(t) for t in texts], device=dev)
        probs = torch.softmax(model(input_ids=ids).logits[:, -1, :].float(), -1).cpu()
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
    """Markdown: per variant and batch, the 10-step mean reward at MARKS and the step reaching GOAL, per seed,
    with what vLLM 0.22 can serve on Hopper and the attention focus after training."""
    rows = ["| variant | prompts x gens | seed | " + " | ".join(f"step {m}" for m in MARKS)
            + f" | last 10-mean | 10-mean >= {GOAL} at | H init | KL step 1 | operand attention init -> end "
            "| vLLM 0.22 Hopper MLA |",
            "|---|---|---|" + "---|" * (len(MARKS) + 6)]
    order = list(VARIANTS)
    for r in sorted(runs, key=lambda r: (order.index(r["variant"]) if r["variant"] in order else 99,
                                         r["settings"]["prompts"], r["seed"])):
        if "error" in r or "skipped" in r:
            rows.append(f"| {r['variant']} | | {r['seed']} | " + " | ".join([""] * len(MARKS))
                        + f" | | {'error' if 'error' in r else r['skipped']} | | | | |")
            continue
        cells = [f"{r['mean10_at'].get(str(m), r['mean10_at'].get(m, float('nan'))):.3f}" for m in MARKS]
        last = r["reward_curve"][-WINDOW:]
        cells.append(f"{sum(last) / len(last):.3f}" if last else "")
        reached = r["step_10mean_reached_goal"]
        done = "" if not r.get("stopped_early") else f" (stopped at {r.get('steps_done')})"
        focus = ""
        if r.get("attention_at_init") and r.get("attention_at_end"):
            focus = (f"{max(r['attention_at_init']['operand_mass'], default=float('nan')):.2f} -> "
                     f"{max(r['attention_at_end']['operand_mass'], default=float('nan')):.2f}")
        vllm = vllm_note(VARIANTS[r["variant"]]) if r["variant"] in VARIANTS else ""
        rows.append(f"| {r['variant']} | {r['settings']['prompts']} x {r['settings']['gens']} | {r['seed']} | "
                    + " | ".join(cells) + f" | {reached if reached is not None else 'not reached'}{done} | "
                    + f"{_fmt(_init_entropy(r), 2)} | {_fmt(_kl1(r), 3)} | {focus} | {vllm} |")
    return "\n".join(rows)


def _fmt(x: float | None, digits: int) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _init_entropy(r: dict[str, Any]) -> float | None:
    """First-token entropy of the initial policy over the 100 prompts (older results: none)."""
    return (r.get("policy_at_init") or {}).get("first_token_entropy")


def _kl1(r: dict[str, Any]) -> float | None:
    """KL of the first response token moved by the first optimizer step."""
    return next((kl for step, kl in r.get("policy_kl_per_step", []) if step == 1), None)


def summary(runs: list[dict[str, Any]]) -> str:
    """Markdown: per variant (and batch), the seeds whose 10-step mean reached GOAL, the steps, the 10-step mean at
    the last step (min-max), the initial policy's first-token entropy and the first step's policy KL (min-max)."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in runs:
        if "error" in r or "skipped" in r:
            continue
        groups.setdefault((r["variant"], r["settings"]["prompts"], r["settings"]["gens"]), []).append(r)
    order = list(VARIANTS)
    head = f"| variant | seeds reaching {GOAL} | steps | last 10-mean (min-max) | H init | KL step 1 (min-max) | what |"
    rows = [head, "|---|---|---|---|---|---|---|"]

    def span(xs: list[float], digits: int) -> str:
        return "" if not xs else (f"{min(xs):.{digits}f}" if min(xs) == max(xs) else
                                  f"{min(xs):.{digits}f}-{max(xs):.{digits}f}")

    for (name, _, _), rs in sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]) if kv[0][0] in order
                                                                  else 99, kv[0][1])):
        steps = sorted(r["step_10mean_reached_goal"] for r in rs if r["step_10mean_reached_goal"] is not None)
        last = [sum(r["reward_curve"][-WINDOW:]) / len(r["reward_curve"][-WINDOW:]) for r in rs if r["reward_curve"]]
        ents = [x for x in map(_init_entropy, rs) if x is not None]
        kls = [x for x in map(_kl1, rs) if x is not None]
        short = sum(1 for r in rs if r.get("stopped_early"))
        rows.append(f"| {name} | {len(steps)} of {len(rs)}{f' ({short} stopped early)' if short else ''} | "
                    f"{', '.join(map(str, steps))} | {span(last, 3)} | {span(ents, 2)} | {span(kls, 3)} | "
                    f"{VARIANTS[name].about if name in VARIANTS else ''} |")
    return "\n".join(rows)


def report(runs: list[dict[str, Any]]) -> str:
    """The markdown result: the per-variant summary, then every run."""
    return summary(runs) + "\n\n" + table(runs)


def provenance(out: dict[str, Any]) -> str:
    """Markdown lines under the tables: every command that made a run of the file (results added by later calls keep
    their own), and the machine of the last call."""
    commands = list(dict.fromkeys(r["command"] for r in out["runs"] if r.get("command")))
    m = out.get("machine") or {}
    return ("\n".join(f"    {c}" for c in commands) + "\n\nmachine: "
            + ", ".join(f"{k} {v}" for k, v in m.items()))


def machine(device: str = "cpu") -> dict[str, Any]:
    import transformers  # noqa: PLC0415

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


# ------------------------------------------------------------------ many runs, in parallel workers


def _worker_init(device: str, threads: int) -> None:
    """Each worker: ``threads`` CPU threads; on CUDA deterministic kernels and full-fp32 matmuls."""
    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One (variant, seed): the result dict, or ``error`` with the traceback / ``skipped`` past the deadline."""
    name, seed = job["variant"], job["seed"]
    base = {"variant": name, "seed": seed, "about": VARIANTS[name].about,
            "settings": {"prompts": job["prompts"], "gens": job["gens"], "steps": job["steps"],
                         "lr": VARIANTS[name].lr, "max_tokens": job["max_tokens"], "device": job["device"],
                         "init_seed": seed if VARIANTS[name].init_seed is None else VARIANTS[name].init_seed,
                         "init_std": VARIANTS[name].init_std, "kl_penalty": VARIANTS[name].kl_penalty,
                         "bias_update_rate": VARIANTS[name].bias_update_rate}}
    if job["stop_at"] is not None and time.time() > job["stop_at"]:
        return {**base, "skipped": "deadline passed before it started"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            res = run_variant(name, VARIANTS[name], seed=seed, steps=job["steps"], prompts=job["prompts"],
                              gens=job["gens"], max_tokens=job["max_tokens"], workdir=Path(tmp),
                              device=job["device"], attn=job["attn"], stop_at=job["stop_at"],
                              log=lambda msg: print(msg, flush=True))
    except Exception:  # noqa: BLE001 - one variant failing must not lose the others' results
        return {**base, "error": traceback.format_exc()}
    return {**res, **base, "vllm_hopper_mla": vllm_hopper_mla(model_config(VARIANTS[name]))
            if VARIANTS[name].model == "moe" else None, "machine": machine(job["device"])}


def iter_results(jobs: list[dict[str, Any]], n_workers: int, device: str, threads: int):  # noqa: ANN201
    """Results as they finish: in this process for one worker, else in ``n_workers`` spawned processes
    (each with its own CUDA context on the same GPU)."""
    if n_workers <= 1:
        _worker_init(device, threads)
        for job in jobs:
            yield run_job(job)
        return
    import torch.multiprocessing as mp  # noqa: PLC0415

    ctx = mp.get_context("spawn")
    with ctx.Pool(n_workers, initializer=_worker_init, initargs=(device, threads)) as pool:
        yield from pool.imap_unordered(run_job, jobs)


def list_variants() -> str:
    lines = [f"{name:30s} {vllm_note(v):48s} {v.about}" for name, v in VARIANTS.items()]
    lines += [f"preset {name}: {','.join(names)}" for name, names in PRESETS.items()]
    return "\n".join(lines)


def parse_variants(spec: str) -> dict[str, int | None]:
    """``--variants``: variant names, presets and ``NAME@K`` (the first K seeds only) -> name: K (None: every
    seed), in order, the first mention of a name kept."""
    picks: dict[str, int | None] = {}
    for item in (x.strip() for x in spec.split(",")):
        for entry in PRESETS.get(item, [item]) if item else []:
            name, _, k = entry.partition("@")
            if name not in VARIANTS:
                raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}; presets: "
                                 f"{', '.join(PRESETS)}")
            if k and (not k.isdigit() or int(k) < 1):
                raise ValueError(f"{entry!r}: the seed count after '@' must be a whole number >= 1")
            picks.setdefault(name, int(k) if k else None)
    if not picks:
        raise ValueError("--variants names no variant")
    return picks


def run_order(picks: dict[str, int | None], seeds: list[int]) -> list[tuple[str, int]]:
    """(variant, seed) runs, seed-major: when the deadline bites, every variant has its first seed before any has
    its second."""
    return [(n, sd) for i, sd in enumerate(seeds) for n, k in picks.items() if k is None or i < k]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="dense,moe",
                    help=f"comma list of variants ({', '.join(VARIANTS)}) and presets ({', '.join(PRESETS)}); "
                    "NAME@K runs NAME with the first K seeds only")
    ap.add_argument("--seeds", default="1", help="grpo.seed values (prompt order and sampling); init is seed 0")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument(
        "--prompts", type=int, default=128, help="prompts per step (the recipes' grpo.prompts_per_step: 128)"
    )
    ap.add_argument("--gens", type=int, default=16,
                    help="generations per prompt (the recipes' grpo.generations_per_prompt: 16)")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda (every worker on the same GPU)")
    ap.add_argument("--jobs", type=int, default=1, help="(variant, seed) runs in parallel worker processes")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads per worker (default: 1 on cpu; cpus / jobs, at most 4, on cuda)")
    ap.add_argument("--attn", default=None,
                    help="transformers attention implementation (default: sdpa on cpu, eager on cuda: deterministic)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop every run this many seconds after the start (results so far are kept, marked "
                    "stopped_early); runs not started by then are skipped")
    ap.add_argument("--json", default=None, help="write (or add to) this JSON result file")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="write DIR/NAME.json (added to if present) and DIR/NAME.md (NAME: --name)")
    ap.add_argument("--name", default=RESULT_NAME, help=f"the result files' name under --out (default {RESULT_NAME})")
    ap.add_argument("--table", default=None, metavar="JSON", help="print the markdown table of a result file and exit")
    ap.add_argument("--list", action="store_true", help="print the variants, what vLLM 0.22 serves, and exit")
    a = ap.parse_args(argv)
    if a.list:
        print(list_variants())
        return 0
    if a.table:
        print(report(json.loads(Path(a.table).read_text(encoding="utf-8"))["runs"]))
        return 0
    try:
        picks = parse_variants(a.variants)
    except ValueError as e:
        ap.error(str(e))
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if a.jobs < 1:
        ap.error("--jobs must be >= 1")
    seeds = [int(s) for s in a.seeds.split(",") if s]
    cuda = a.device.startswith("cuda")
    threads = a.threads or (max(1, min(4, (os.cpu_count() or 1) // a.jobs)) if cuda else 1)
    attn = a.attn or ("eager" if cuda else None)
    if cuda:  # read by cuBLAS at context creation: set before any worker starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    command = "python " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    started = time.time()
    stop_at = started + a.deadline_s if a.deadline_s else None
    jobs = [{"variant": n, "seed": sd, "steps": a.steps, "prompts": a.prompts, "gens": a.gens,
             "max_tokens": a.max_tokens, "device": a.device, "attn": attn, "stop_at": stop_at}
            for n, sd in run_order(picks, seeds)]
    paths = [Path(a.json)] if a.json else []
    if a.out:
        paths.append(Path(a.out) / f"{a.name}.json")
    out: dict[str, Any] = {"study": "tiny MoE vs dense GRPO learning speed, pure PyTorch", "runs": []}
    if paths and paths[0].exists():
        out = json.loads(paths[0].read_text(encoding="utf-8"))
    out.update({"command": command, "machine": machine(a.device), "jobs": a.jobs, "threads_per_job": threads,
                "attn_implementation": attn or "sdpa (transformers' default)"})
    print(f"{len(jobs)} runs on {a.device} with {a.jobs} worker(s), {threads} thread(s) each", flush=True)
    for res in iter_results(jobs, min(a.jobs, len(jobs)), a.device, threads):
        res["command"] = command
        keep = ("variant", "seed", "mean10_at", "step_10mean_reached_goal", "seconds", "steps_done", "skipped")
        print(json.dumps({k: res[k] for k in keep if k in res}
                         | ({"error": res["error"].strip().splitlines()[-1]} if "error" in res else {})), flush=True)
        key = (res["variant"], res["seed"], a.prompts, a.gens)
        out["runs"] = [r for r in out["runs"] if (r["variant"], r["seed"], r["settings"]["prompts"],
                                                  r["settings"]["gens"]) != key] + [res]
        out["wall_seconds"] = round(time.time() - started, 1)
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        if a.out:
            (Path(a.out) / f"{a.name}.md").write_text(report(out["runs"]) + "\n\nMade by\n\n" + provenance(out) + "\n",
                                                      encoding="utf-8")
    print(f"done in {time.time() - started:.0f} s", flush=True)
    if a.out or a.json:
        print(report(out["runs"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
