"""Architecture facts of a policy model, and parameter accounting by component (no torch).

:class:`ModelFacts` is what the catalog (``rlc.compiler.catalog``) reads out of a model's HF
``config.json``. Every field that the config does not state is ``None`` and its name is listed in
``unknown``; nothing is guessed. The accounting below propagates ``None``: a count that needs an
unknown fact is itself unknown, and the planner reports it as such.

Parameters are counted in three sharding classes (:class:`ParamSplit`), because that is all the
memory planner needs to place them on GPUs:

* ``tp``: matrices split across tensor-parallel ranks (attention projections, dense and shared
  MLPs, linear-attention and Mamba projections, vocabulary matrices are kept separately);
* ``replicated``: small tensors every TP rank holds whole (norms, MoE router, MLA down-projections,
  LatentMoE latent projections, which we assume replicated to stay on the safe side);
* ``expert``: routed experts, split across EP × ETP in Megatron and across the expert-sharding
  degree in vLLM.

A layer is a ``(mixer, mlp)`` pair: mixer in :data:`MIXERS` or ``None`` (Nemotron-H MoE/MLP-only
layers), mlp in :data:`MLPS` or ``None`` (Nemotron-H Mamba/attention-only layers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

MIXERS = ("full_attention", "linear_attention", "mla", "mamba")
MLPS = ("dense", "moe")
LayerKind = tuple[Optional[str], Optional[str]]

#: How routed experts leave Megatron-Bridge on export: one stacked ``[E, ...]`` tensor per
#: projection ("stacked", HF checkpoints with fused experts: Qwen3.5, gpt-oss) or one tensor per
#: expert ("per_expert", e.g. Qwen3-MoE, DeepSeek-V3, Nemotron-H ``experts.*.up_proj``).
EXPERT_EXPORTS = ("stacked", "per_expert")


def _sum(values: Iterable[Optional[int]]) -> Optional[int]:
    total = 0
    for v in values:
        if v is None:
            return None
        total += v
    return total


def _mul(*values: Optional[int]) -> Optional[int]:
    out = 1
    for v in values:
        if v is None:
            return None
        out *= v
    return out


@dataclass(frozen=True)
class ParamSplit:
    """A parameter count split by how it is sharded (see module docstring)."""

    tp: int = 0
    replicated: int = 0
    expert: int = 0

    def __add__(self, other: "ParamSplit") -> "ParamSplit":
        return ParamSplit(self.tp + other.tp, self.replicated + other.replicated, self.expert + other.expert)

    def times(self, k: int) -> "ParamSplit":
        return ParamSplit(self.tp * k, self.replicated * k, self.expert * k)

    @property
    def total(self) -> int:
        return self.tp + self.replicated + self.expert

    def per_gpu(self, tp: int, expert_shards: int) -> int:
        """Parameters one GPU holds when ``tp`` splits the dense part and ``expert_shards`` the experts."""
        return self.tp // tp + self.replicated + self.expert // expert_shards


def add_splits(splits: Iterable[Optional[ParamSplit]]) -> Optional[ParamSplit]:
    """Sum of splits, ``None`` if any is unknown."""
    total = ParamSplit()
    for s in splits:
        if s is None:
            return None
        total = total + s
    return total


@dataclass(frozen=True)
class Fp32Param:
    """A parameter family kept in fp32 on the wire: an fnmatch pattern and an example HF name."""

    pattern: str
    example: str
    why: str


@dataclass(frozen=True)
class ModelFacts:
    """Architecture facts of one model; ``None`` = not stated by any source (listed in ``unknown``)."""

    model_id: str
    family: str  # model_type: qwen3, qwen3_moe, qwen3_5_moe, deepseek_v3, nemotron_h, gpt_oss, llama ...
    source: str  # where the facts came from (catalog file + provenance, or a local config path)
    num_layers: Optional[int]
    hidden: Optional[int]
    heads: Optional[int]
    kv_heads: Optional[int]
    head_dim: Optional[int]
    vocab: Optional[int]
    tied_embeddings: Optional[bool]
    num_experts: Optional[int] = 0  # 0 = dense model
    experts_per_tok: Optional[int] = None
    moe_intermediate: Optional[int] = None
    shared_expert_intermediate: Optional[int] = None  # total width of the shared expert(s); 0 = none
    shared_expert_gate: bool = False  # Qwen3-Next/3.5 sigmoid gate on the shared expert
    dense_intermediate: Optional[int] = None
    first_k_dense: int = 0
    gated_mlp: bool = True  # SwiGLU (gate+up) vs. non-gated (Nemotron-H squared ReLU: up only)
    latent_size: Optional[int] = None  # LatentMoE: experts work in this width instead of hidden
    layer_kinds: Optional[tuple[LayerKind, ...]] = None  # one (mixer, mlp) per decoder layer, in order
    layer_order_known: bool = True  # False when only per-kind counts are known (order assumed even)
    mtp_num_layers: Optional[int] = 0  # MTP blocks the trainer builds (after ``model.overrides``)
    #: MTP blocks in the checkpoint, which vLLM's MTP drafter loads whatever the trainer does: differs from
    #: ``mtp_num_layers`` only when ``model.overrides`` changes an MTP-count key (None: unknown)
    checkpoint_mtp_num_layers: Optional[int] = 0
    #: vLLM's MTP module keeps ``eh_proj`` (2H→H) whole on every GPU (a plain ``nn.Linear`` in vLLM's
    #: deepseek_mtp.py / glm4_moe_mtp.py) instead of splitting it by TP (Qwen3.5, Nemotron-H)
    vllm_mtp_eh_proj_replicated: bool = False
    mtp_shared_embedding: Optional[bool] = None  # MTP reuses the main word embedding (no own copy)
    mtp_layer_kinds: Optional[tuple[LayerKind, ...]] = None  # sub-layers of ONE MTP block
    attn_output_gate: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    expert_bias: bool = False  # router e_score_correction_bias (aux-loss-free routing)
    router_groups: Optional[int] = None  # group-limited routing (HF n_group; None: not stated)
    expert_mlp_bias: bool = False  # gpt-oss experts carry biases
    # linear attention (Gated DeltaNet)
    linear_key_heads: Optional[int] = None
    linear_value_heads: Optional[int] = None
    linear_key_head_dim: Optional[int] = None
    linear_value_head_dim: Optional[int] = None
    linear_conv_kernel: Optional[int] = None
    # multi-head latent attention (DeepSeek-V3 / Kimi-K2)
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    # Mamba-2 (Nemotron-H)
    mamba_heads: Optional[int] = None
    mamba_head_dim: Optional[int] = None
    mamba_groups: Optional[int] = None
    mamba_state: Optional[int] = None
    mamba_conv_kernel: Optional[int] = None
    expert_export: Optional[str] = None  # see EXPERT_EXPORTS
    hf_prefix: str = "model"  # HF parameter-name prefix ("model.language_model", "backbone")
    fp32_params: tuple[Fp32Param, ...] = ()
    unknown: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: longest sequence the config allows, as vLLM derives it (RoPE scaling included); None when it states none
    context_length: Optional[int] = None
    context_length_source: str = (
        ""  # how it was derived, e.g. "YaRN rope factor 4 × original_max_position_embeddings 32768"
    )
    #: every place looked at for the model's config.json and what it gave (checkpoint folder, Hugging Face
    #: cache, catalog, Hub), for errors about a fact none of them states
    searched: tuple[str, ...] = ()
    reference_total_params: Optional[int] = None  # a published total, for cross-checks only

    # ------------------------------------------------------------------ derived shapes

    @property
    def is_moe(self) -> Optional[bool]:
        return None if self.num_experts is None else self.num_experts > 0

    @property
    def fp32_patterns(self) -> list[str]:
        """fnmatch patterns of the parameters this model keeps in fp32 (router bias, if any)."""
        return [p.pattern for p in self.fp32_params]

    @property
    def layer_types(self) -> Optional[tuple[str, ...]]:
        """Per decoder layer: its mixer (full_attention, linear_attention, mla, mamba), or its MLP
        (moe, dense) for Nemotron-H layers without a mixer."""
        if self.layer_kinds is None:
            return None
        return tuple(mixer or mlp or "none" for mixer, mlp in self.layer_kinds)

    @property
    def expert_input_width(self) -> Optional[int]:
        """Width experts work in: the latent size for LatentMoE, else hidden."""
        return self.latent_size if self.latent_size is not None else self.hidden

    def moe_layer_indices(self) -> Optional[list[int]]:
        if self.layer_kinds is None:
            return None
        return [i for i, (_, mlp) in enumerate(self.layer_kinds) if mlp == "moe"]

    # ------------------------------------------------------------------ components

    def _attention(self) -> Optional[ParamSplit]:
        h, nh, kv, hd = self.hidden, self.heads, self.kv_heads, self.head_dim
        if h is None or nh is None or kv is None or hd is None:
            return None
        q_out = nh * hd * (2 if self.attn_output_gate else 1)
        tp = h * q_out + 2 * h * kv * hd + nh * hd * h
        rep = 0
        if self.attention_bias:
            tp += q_out + 2 * kv * hd
            rep += h  # o_proj bias
        if self.qk_norm:
            rep += 2 * hd
        return ParamSplit(tp=tp, replicated=rep)

    def _linear_attention(self) -> Optional[ParamSplit]:
        h, nk, nv = self.hidden, self.linear_key_heads, self.linear_value_heads
        dk, dv, ck = self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel
        if h is None or nk is None or nv is None or dk is None or dv is None or ck is None:
            return None
        kd, vd = nk * dk, nv * dv
        tp = h * (2 * kd + 2 * vd) + h * 2 * nv + (2 * kd + vd) * ck + 2 * nv + vd * h
        return ParamSplit(tp=tp, replicated=dv)

    def _mla(self) -> Optional[ParamSplit]:
        h, nh = self.hidden, self.heads
        qr, kvr = self.q_lora_rank, self.kv_lora_rank
        nope, rope, vh = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        if h is None or nh is None or kvr is None or nope is None or rope is None or vh is None:
            return None
        rep = h * (kvr + rope) + kvr  # kv down-projection (replicated in Megatron and vLLM) + its norm
        if qr:
            rep += h * qr + qr
            tp = qr * nh * (nope + rope)
        else:
            tp = h * nh * (nope + rope)
        tp += kvr * nh * (nope + vh) + nh * vh * h
        return ParamSplit(tp=tp, replicated=rep)

    def _mamba(self) -> Optional[ParamSplit]:
        h, mh, mhd = self.hidden, self.mamba_heads, self.mamba_head_dim
        ng, ds, ck = self.mamba_groups, self.mamba_state, self.mamba_conv_kernel
        if h is None or mh is None or mhd is None or ng is None or ds is None or ck is None:
            return None
        d_in, gs = mh * mhd, ng * ds
        conv_dim = d_in + 2 * gs
        tp = h * (2 * d_in + 2 * gs + mh) + conv_dim * (ck + 1) + 3 * mh + d_in + d_in * h
        return ParamSplit(tp=tp)

    def _dense_mlp(self) -> Optional[ParamSplit]:
        if self.hidden is None or self.dense_intermediate is None:
            return None
        return ParamSplit(tp=(3 if self.gated_mlp else 2) * self.hidden * self.dense_intermediate)

    def moe_components(self) -> Optional[dict[str, ParamSplit]]:
        """Router, routed experts, shared experts and latent projections of ONE MoE layer."""
        h, e, i, he = self.hidden, self.num_experts, self.moe_intermediate, self.expert_input_width
        if h is None or e is None or i is None or he is None:
            return None
        mats = 3 if self.gated_mlp else 2
        router = ParamSplit(replicated=h * e + (e if self.expert_bias else 0))
        expert = e * mats * i * he
        if self.expert_mlp_bias:
            expert += e * ((2 if self.gated_mlp else 1) * i + he)
        routed = ParamSplit(expert=expert)
        shared_i = self.shared_expert_intermediate
        if shared_i is None:
            return None
        shared = ParamSplit(tp=mats * h * shared_i, replicated=h if (self.shared_expert_gate and shared_i) else 0)
        latent = ParamSplit(replicated=2 * h * self.latent_size) if self.latent_size else ParamSplit()
        return {"moe_router": router, "routed_experts": routed, "shared_experts": shared,
                "latent_projections": latent}

    def layer_components(self, kind: LayerKind) -> Optional[dict[str, ParamSplit]]:
        """Parameters of one decoder layer of ``kind``, by component (``None`` if unknown)."""
        mixer, mlp = kind
        if self.hidden is None:
            return None
        out: dict[str, ParamSplit] = {}
        norms = 0
        if mixer is not None:
            fn = {"full_attention": self._attention, "linear_attention": self._linear_attention,
                  "mla": self._mla, "mamba": self._mamba}[mixer]
            split = fn()
            if split is None:
                return None
            out["attention" if mixer == "full_attention" else mixer] = split
            norms += self.hidden
        if mlp == "dense":
            split = self._dense_mlp()
            if split is None:
                return None
            out["dense_mlp"] = split
            norms += self.hidden
        elif mlp == "moe":
            moe = self.moe_components()
            if moe is None:
                return None
            out.update(moe)
            norms += self.hidden
        out["norms"] = ParamSplit(replicated=norms)
        return out

    def layer_split(self, kind: LayerKind) -> Optional[ParamSplit]:
        comps = self.layer_components(kind)
        return None if comps is None else add_splits(comps.values())

    def mtp_block_split(self) -> Optional[ParamSplit]:
        """One MTP block: enorm + hnorm + eh_proj (2H→H) + its sub-layers + final norm.

        A dedicated MTP embedding (``mtp_shared_embedding`` False) is counted separately by
        :meth:`vocab_matrix_params`.
        """
        if self.hidden is None or self.mtp_layer_kinds is None:
            return None
        layers = add_splits(self.layer_split(k) for k in self.mtp_layer_kinds)
        if layers is None:
            return None
        h = self.hidden
        return layers + ParamSplit(tp=2 * h * h, replicated=3 * h)

    def vllm_mtp_block_split(self) -> Optional[ParamSplit]:
        """One MTP block as vLLM's drafter shards it: :meth:`mtp_block_split`, with ``eh_proj`` replicated
        where vLLM does not split it (``vllm_mtp_eh_proj_replicated``)."""
        block = self.mtp_block_split()
        if block is None or not self.vllm_mtp_eh_proj_replicated or self.hidden is None:
            return block
        eh_proj = 2 * self.hidden * self.hidden
        return ParamSplit(tp=block.tp - eh_proj, replicated=block.replicated + eh_proj, expert=block.expert)

    def vocab_matrix_params(self) -> Optional[int]:
        """Elements of one vocabulary matrix (embedding or output layer): vocab × hidden."""
        return _mul(self.vocab, self.hidden)

    # ------------------------------------------------------------------ totals

    def param_counts(self) -> dict[str, Optional[int]]:
        """Total parameters by component (HF checkpoint view, main model + MTP); ``None`` = unknown.

        Keys: embedding, output_layer, attention, linear_attention, mla, mamba, dense_mlp,
        moe_router, routed_experts, shared_experts, latent_projections, norms, mtp,
        total_without_mtp, total. The vision tower of VL checkpoints is not counted.
        """
        keys = ("attention", "linear_attention", "mla", "mamba", "dense_mlp", "moe_router",
                "routed_experts", "shared_experts", "latent_projections", "norms")
        counts: dict[str, Optional[int]] = {}
        vocab = self.vocab_matrix_params()
        counts["embedding"] = vocab
        if self.tied_embeddings is None:
            counts["output_layer"] = None
        else:
            counts["output_layer"] = 0 if self.tied_embeddings else vocab
        per_key: dict[str, Optional[int]] = {k: 0 for k in keys}
        if self.layer_kinds is None:
            per_key = {k: None for k in keys}
        else:
            for kind in self.layer_kinds:
                comps = self.layer_components(kind)
                if comps is None:
                    for k in _component_keys(kind):
                        per_key[k] = None
                    continue
                for name, split in comps.items():
                    current = per_key.get(name)
                    if current is not None:
                        per_key[name] = current + split.total
        counts.update(per_key)
        if self.hidden is not None:
            final_norm = self.hidden
            counts["norms"] = None if counts["norms"] is None else counts["norms"] + final_norm
        counts["total_without_mtp"] = _sum(counts[k] for k in ("embedding", "output_layer") + keys)
        if self.mtp_num_layers == 0:
            counts["mtp"] = 0
        else:
            block = self.mtp_block_split()
            mtp = _mul(None if block is None else block.total, self.mtp_num_layers)
            if mtp is not None and self.mtp_shared_embedding is False:
                mtp = _sum([mtp, vocab])  # a dedicated MTP embedding
            counts["mtp"] = mtp
        counts["total"] = _sum([counts["total_without_mtp"], counts["mtp"]])
        return counts

    # ------------------------------------------------------------------ export

    def export_tensors(self, bytes_per_param: int = 2) -> Optional[list[tuple[str, int]]]:
        """Candidate largest tensors as Megatron-Bridge exports them (HF names), bytes each.

        ``None`` when a fact needed to size any candidate is unknown (then the largest is unknown).
        """
        shapes = self.export_tensor_shapes()
        if shapes is None:
            return None
        return [(name, math.prod(shape) * bytes_per_param) for name, shape in shapes]

    def export_tensor_shapes(self) -> Optional[list[tuple[str, tuple[int, ...]]]]:
        """The candidates of :meth:`export_tensors` with their shapes (rows, columns; experts first when
        stacked), ``None`` when a fact needed to shape any of them is unknown."""
        h, v = self.hidden, self.vocab
        if h is None or v is None or self.layer_kinds is None or self.tied_embeddings is None:
            return None
        p = self.hf_prefix
        out: list[tuple[str, tuple[int, ...]]] = [(f"{p}.embed_tokens.weight", (v, h))]
        if not self.tied_embeddings:
            out.append(("lm_head.weight", (v, h)))
        for idx, kind in _first_of_each_kind(self.layer_kinds):
            mixer, mlp = kind
            name = f"{p}.layers.{idx}"
            if mixer == "full_attention":
                if self.heads is None or self.head_dim is None:
                    return None
                q_out = self.heads * self.head_dim * (2 if self.attn_output_gate else 1)
                out.append((f"{name}.self_attn.q_proj.weight", (q_out, h)))
            elif mixer == "linear_attention":
                if (self.linear_key_heads is None or self.linear_key_head_dim is None or
                        self.linear_value_heads is None or self.linear_value_head_dim is None):
                    return None
                width = 2 * self.linear_key_heads * self.linear_key_head_dim + \
                    2 * self.linear_value_heads * self.linear_value_head_dim
                out.append((f"{name}.linear_attn.in_proj_qkvz.weight", (width, h)))
            elif mixer == "mamba":
                if (self.mamba_heads is None or self.mamba_head_dim is None or self.mamba_groups is None or
                        self.mamba_state is None):
                    return None
                d_in, gs = self.mamba_heads * self.mamba_head_dim, self.mamba_groups * self.mamba_state
                out.append((f"{name}.mixer.in_proj.weight", (2 * d_in + 2 * gs + self.mamba_heads, h)))
            elif mixer == "mla":
                if (self.heads is None or self.kv_lora_rank is None or self.qk_nope_head_dim is None or
                        self.v_head_dim is None):
                    return None
                out.append((f"{name}.self_attn.kv_b_proj.weight",
                            (self.heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)))
            if mlp == "dense":
                if self.dense_intermediate is None:
                    return None
                out.append((f"{name}.mlp.gate_proj.weight", (self.dense_intermediate, h)))
            elif mlp == "moe":
                e, i, he = self.num_experts, self.moe_intermediate, self.expert_input_width
                if e is None or i is None or he is None or self.expert_export is None:
                    return None
                up = (2 if self.gated_mlp else 1) * i
                if self.expert_export == "stacked":
                    out.append((f"{name}.mlp.experts.gate_up_proj", (e, up, he)))
                    out.append((f"{name}.mlp.experts.down_proj", (e, i, he)))
                else:
                    out.append((f"{name}.mlp.experts.0.up_proj.weight", (up, he)))
                if self.shared_expert_intermediate:
                    out.append((f"{name}.mlp.shared_expert.up_proj.weight", (self.shared_expert_intermediate, h)))
        return out

    def largest_export_tensor(self, bytes_per_param: int = 2) -> tuple[str, Optional[int]]:
        """The largest single tensor the exporter materializes: ``(HF name, bytes)``.

        ``(reason, None)`` when it cannot be known from the facts.
        """
        cands = self.export_tensors(bytes_per_param)
        if cands is None:
            missing = [f for f in ("vocab", "moe_intermediate", "layer_kinds", "tied_embeddings", "hidden")
                       if f in self.unknown or getattr(self, f, None) is None]
            if self.is_moe and self.expert_export is None:
                missing.append("expert_export")
            return (f"unknown (needs {', '.join(missing) or 'more facts'})", None)
        name, size = max(cands, key=lambda c: c[1])
        return name, size


def _component_keys(kind: LayerKind) -> list[str]:
    mixer, mlp = kind
    keys = ["norms"]
    if mixer:
        keys.append("attention" if mixer == "full_attention" else mixer)
    if mlp == "dense":
        keys.append("dense_mlp")
    elif mlp == "moe":
        keys += ["moe_router", "routed_experts", "shared_experts", "latent_projections"]
    return keys


def _first_of_each_kind(kinds: tuple[LayerKind, ...]) -> list[tuple[int, LayerKind]]:
    seen: dict[LayerKind, int] = {}
    for i, k in enumerate(kinds):
        seen.setdefault(k, i)
    return sorted(((i, k) for k, i in seen.items()), key=lambda t: t[0])


__all__ = ["EXPERT_EXPORTS", "Fp32Param", "LayerKind", "MIXERS", "MLPS", "ModelFacts", "ParamSplit",
           "add_splits"]
