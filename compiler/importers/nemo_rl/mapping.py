"""What each NeMo-RL key becomes in an rlc recipe.

The one-to-one keys are a table (:data:`DIRECT`, :data:`MEGATRON`, :data:`DTENSOR`): NeMo-RL key ->
rlc key, with a converter that either returns the rlc value or raises :class:`Unmappable` with the
reason (the converters are :mod:`.converters`). Keys whose meaning spans several NeMo-RL keys (sequence lengths,
refit buffer, environment variables, data files, reward) have one function each below; those of the trainer's
recomputation, MTP blocks and prompt files are in :mod:`.training_keys`, those of the rollout engine (vLLM's options
and FP8, megatron-core inference) in :mod:`.generation_keys`. Every NeMo-RL leaf that no rule takes
ends up in :attr:`Mapping.unmapped` with a reason, so nothing is dropped silently. A NeMo-RL ``null``
means "unset" and leaves the rlc default in place.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from rlc.compiler.importers.nemo_rl.config_loader import NemoRlConfig
from rlc.compiler.importers.nemo_rl.config_sections import VLLM_CFG, D, M
from rlc.compiler.importers.nemo_rl.converters import (
    boolean,
    dtype,
    fp8_format,
    fp8_recipe,
    generation_backend,
    int_list,
    kl_type,
    lr_style,
    non_negative_int,
    number,
    optimizer_name,
    packing_algorithm,
    positive_int,
    recompute,
    router_dtype,
    same,
    string_list,
    token_dispatcher,
    top_k,
)
from rlc.compiler.importers.nemo_rl.generation_keys import (
    expert_parallel_flag,
    mcore_dedicated,
    mcore_generation,
    vllm_fp8,
    vllm_kwargs,
    vllm_precision,
)
from rlc.compiler.importers.nemo_rl.effects import no_effect_reason
from rlc.contract.kl_term import KL_LOG_RATIO_BOUND
from rlc.contract.ranges import schema_ranges
from rlc.compiler.importers.nemo_rl.results import Mapping, MappedValue, MissingKey, Unmappable, Unmapped
from rlc.compiler.importers.nemo_rl.training_keys import activation_checkpointing as _activation_checkpointing
from rlc.compiler.importers.nemo_rl.training_keys import classified as _classified
from rlc.compiler.importers.nemo_rl.training_keys import freeze_config as _freeze_config
from rlc.compiler.importers.nemo_rl.training_keys import hf_config_overrides as _hf_config_overrides
from rlc.compiler.importers.nemo_rl.training_keys import mtp_layers as _mtp_layers
from rlc.compiler.importers.nemo_rl.training_keys import prompt_files as _prompt_files


# --------------------------------------------------------------------------- the key tables

Rule = tuple[str, str, Callable[[Any], Any], str]  # source, target, convert, note


DIRECT: tuple[Rule, ...] = (
    ("cluster.num_nodes", "cluster.nodes", positive_int, ""),
    ("cluster.gpus_per_node", "cluster.gpus_per_node", positive_int, ""),
    ("policy.model_name", "model.id", str, ""),
    ("policy.precision", "model.dtype", dtype, ""),
    ("policy.train_global_batch_size", "training.global_batch_size", positive_int, ""),
    ("policy.train_micro_batch_size", "training.micro_batch_size", positive_int, ""),
    ("policy.logprob_batch_size", "training.logprob_batch_size", positive_int, ""),
    ("policy.max_total_sequence_length", "training.max_sequence_length", positive_int, ""),
    ("policy.refit_buffer_size_gb", "refit.buffer_gb", number, "both ping-pong halves together"),
    ("policy.offload_optimizer_for_refit", "refit.offload_optimizer_for_refit", boolean, ""),
    ("policy.generation.backend", "generation.backend", generation_backend, ""),
    ("policy.generation.temperature", "generation.sampling.temperature", number, ""),
    ("policy.generation.top_p", "generation.sampling.top_p", number, ""),
    ("policy.generation.top_k", "generation.sampling.top_k", top_k, ""),
    ("policy.generation.stop_strings", "generation.sampling.stop", string_list, ""),
    ("policy.generation.stop_token_ids", "generation.sampling.stop_token_ids", int_list, ""),
    ("policy.sequence_packing.enabled", "training.sequence_packing.enabled", boolean, ""),
    ("policy.router_replay.enabled", "training.router_replay.enabled", boolean, ""),
    ("loss_fn.ratio_clip_c", "loss.clip_ratio_c", number, "dual-clip constant for negative advantages"),
    ("loss_fn.use_importance_sampling_correction", "loss.importance_sampling_correction", boolean, ""),
    ("loss_fn.truncated_importance_sampling_ratio", "loss.importance_sampling_cap", number, ""),
    ("policy.generation.vllm_cfg.tensor_parallel_size", "parallelism.generation.tp", positive_int, ""),
    ("policy.generation.vllm_cfg.pipeline_parallel_size", "parallelism.generation.pp", positive_int, ""),
    ("policy.generation.vllm_cfg.expert_parallel_size", "parallelism.generation.ep", positive_int, ""),
    ("policy.generation.vllm_cfg.gpu_memory_utilization", "generation.gpu_memory_utilization", number, ""),
    ("policy.generation.vllm_cfg.enforce_eager", "generation.enforce_eager", boolean, ""),
    ("policy.generation.vllm_cfg.sleep_level", "refit.sleep_level", positive_int, ""),
    ("policy.generation.colocated.enabled", "colocated", boolean, ""),
    ("grpo.num_prompts_per_step", "grpo.prompts_per_step", positive_int, ""),
    ("grpo.num_generations_per_prompt", "grpo.generations_per_prompt", positive_int, ""),
    ("grpo.max_num_steps", "grpo.max_steps", positive_int, ""),
    ("grpo.normalize_rewards", "grpo.normalize_advantages", boolean,
     "NeMo-RL divides advantages by the group's reward std"),
    ("grpo.use_leave_one_out_baseline", "grpo.leave_one_out", boolean, ""),
    ("grpo.use_dynamic_sampling", "grpo.dynamic_sampling.enabled", boolean, ""),
    ("grpo.dynamic_sampling_max_gen_batches", "grpo.dynamic_sampling.max_gen_batches", positive_int, ""),
    ("grpo.seed", "grpo.seed", non_negative_int, ""),
    ("loss_fn.reference_policy_kl_penalty", "loss.kl_penalty", number, ""),
    ("loss_fn.reference_policy_kl_type", "loss.kl_estimator", kl_type, "Schulman's KL estimator"),
    ("loss_fn.ratio_clip_min", "loss.ratio_clip_low", number, ""),
    ("loss_fn.ratio_clip_max", "loss.ratio_clip_high", number, ""),
    ("loss_fn.token_level_loss", "loss.token_level", boolean, ""),
    ("loss_fn.force_on_policy_ratio", "loss.force_on_policy_ratio", boolean, "the policy ratio taken as exactly 1"),
    ("checkpointing.enabled", "checkpointing.enabled", boolean, ""),
    ("checkpointing.checkpoint_dir", "checkpointing.dir", str, ""),
    ("checkpointing.save_period", "checkpointing.every_steps", positive_int, ""),
    ("logger.log_dir", "logging.dir", str, ""),
    ("logger.tensorboard_enabled", "logging.tensorboard", boolean, ""),
    ("data.shuffle", "data.shuffle", boolean, ""),
    ("data.train_data_path", "data.train", str, ""),
    ("data.val_data_path", "data.val", str, ""),
    ("data.train.data_path", "data.train", str, ""),
    ("data.validation.data_path", "data.val", str, ""),
    ("data.input_key", "data.prompt_key", str, ""),
    ("data.output_key", "data.answer_key", str, ""),
    ("data.train.input_key", "data.prompt_key", str, ""),
    ("data.train.output_key", "data.answer_key", str, ""),
)

MEGATRON: tuple[Rule, ...] = (
    (f"{M}.tensor_model_parallel_size", "parallelism.train.tp", positive_int, ""),
    (f"{M}.pipeline_model_parallel_size", "parallelism.train.pp", positive_int, ""),
    (f"{M}.context_parallel_size", "parallelism.train.cp", positive_int, ""),
    (f"{M}.expert_model_parallel_size", "parallelism.train.ep", positive_int, ""),
    (f"{M}.expert_tensor_parallel_size", "parallelism.train.etp", positive_int, ""),
    (f"{M}.virtual_pipeline_model_parallel_size", "parallelism.train.vpp", positive_int, ""),
    (f"{M}.sequence_parallel", "parallelism.train.sequence_parallel", boolean, ""),
    (f"{M}.num_layers_in_first_pipeline_stage", "parallelism.train.num_layers_in_first_pipeline_stage",
     non_negative_int, ""),
    (f"{M}.num_layers_in_last_pipeline_stage", "parallelism.train.num_layers_in_last_pipeline_stage",
     non_negative_int, ""),
    (f"{M}.optimizer.optimizer", "training.optimizer.name", optimizer_name, ""),
    (f"{M}.optimizer.lr", "training.optimizer.lr", number, ""),
    (f"{M}.optimizer.min_lr", "training.optimizer.min_lr", number, ""),
    (f"{M}.optimizer.weight_decay", "training.optimizer.weight_decay", number, ""),
    (f"{M}.optimizer.adam_beta1", "training.optimizer.adam_beta1", number, ""),
    (f"{M}.optimizer.adam_beta2", "training.optimizer.adam_beta2", number, ""),
    (f"{M}.optimizer.adam_eps", "training.optimizer.adam_eps", number, ""),
    (f"{M}.optimizer.use_distributed_optimizer", "training.use_distributed_optimizer", boolean, ""),
    (f"{M}.optimizer.clip_grad", "training.grad_clip", number, ""),
    (f"{M}.optimizer.optimizer_cpu_offload", "training.optimizer_cpu_offload", boolean, ""),
    (f"{M}.optimizer.optimizer_offload_fraction", "training.optimizer_offload_fraction", number, ""),
    (f"{M}.scheduler.lr_warmup_iters", "training.lr_schedule.warmup_steps", non_negative_int, ""),
    (f"{M}.scheduler.lr_decay_style", "training.lr_schedule.name", lr_style, ""),
    (f"{M}.scheduler.lr_warmup_init", "training.lr_schedule.warmup_start_lr", number, ""),
    (f"{M}.distributed_data_parallel_config.overlap_param_gather", "training.overlap_param_gather", boolean, ""),
    (f"{M}.distributed_data_parallel_config.overlap_grad_reduce", "training.overlap_grad_reduce", boolean, ""),
    (f"{M}.offload_optimizer_for_refit", "refit.offload_optimizer_for_refit", boolean, ""),
    (f"{M}.optimizer.use_precision_aware_optimizer", "training.use_precision_aware_optimizer", boolean, ""),
    (f"{M}.moe_token_dispatcher_type", "training.moe.token_dispatcher", token_dispatcher, ""),
    (f"{M}.moe_enable_deepep", "training.moe.deepep", boolean, ""),
    (f"{M}.moe_router_dtype", "training.moe.router_dtype", router_dtype, ""),
    (f"{M}.mtp_loss_scaling_factor", "training.mtp_loss_scale", number, "weight of the MTP loss"),
    ("policy.max_grad_norm", "training.grad_clip", number, ""),
)

DTENSOR: tuple[Rule, ...] = (
    (f"{D}.tensor_parallel_size", "parallelism.train.tp", positive_int,
     "from the DTensor trainer; its FSDP shards become Megatron data parallelism"),
    (f"{D}.context_parallel_size", "parallelism.train.cp", positive_int, ""),
    (f"{D}.sequence_parallel", "parallelism.train.sequence_parallel", boolean, ""),
    (f"{D}.activation_checkpointing", "training.activation_checkpointing", recompute, ""),
    ("policy.optimizer.kwargs.lr", "training.optimizer.lr", number, ""),
    ("policy.optimizer.kwargs.weight_decay", "training.optimizer.weight_decay", number, ""),
    ("policy.optimizer.kwargs.eps", "training.optimizer.adam_eps", number, ""),
    ("policy.max_grad_norm", "training.grad_clip", number, ""),
)

# Megatron model-config options NeMo-RL sets on the provider as they are; rlc passes them through
# unchanged (training.megatron_kwargs).
MEGATRON_PASS_THROUGH = ("apply_rope_fusion", "bias_activation_fusion", "moe_permute_fusion", "defer_fp32_logits",
                         "moe_shared_expert_overlap", "moe_router_load_balancing_type", "moe_router_bias_update_rate",
                         "moe_aux_loss_coeff", "moe_grouped_gemm", "moe_router_enable_expert_bias",
                         "mtp_use_repeated_layer", "mtp_detach_heads")

# NeMo-RL env vars with an rlc key of their own (NeMo-RL reads them in its refit code).
ENV_KEYS = {"NRL_REFIT_BUFFER_MEMORY_RATIO": ("refit.buffer_memory_ratio", number)}
EXPANDABLE_SEGMENTS = re.compile(r"expandable_segments\s*:\s*true", re.IGNORECASE)


# --------------------------------------------------------------------------- the mapper

class _Mapper:
    def __init__(self, cfg: NemoRlConfig) -> None:
        self.cfg = cfg
        self.leaves = cfg.leaves()
        self.consumed: set[str] = set()
        self.out = Mapping()
        self._by_target: dict[str, int] = {}

    def put(self, target: str, value: Any, sources: tuple[str, ...], note: str = "") -> None:
        """Set ``target``; a second source for the same target and value joins the first."""
        if target in self._by_target:
            i = self._by_target[target]
            prev = self.out.values[i]
            if prev.value == value:
                self.out.values[i] = MappedValue(target, value, prev.sources + sources, prev.note or note)
                return
            for s in sources:
                self.out.unmapped.append(Unmapped(s, self.leaves.get(s), f"{target} already comes from "
                                                  f"{prev.sources[0]} ({prev.value!r})", effect="none"))
            return
        self._by_target[target] = len(self.out.values)
        self.out.values.append(MappedValue(target, value, sources, note))

    def take(self, source: str, target: str, convert: Callable[[Any], Any] = same, note: str = "") -> None:
        if source not in self.leaves:
            return
        self.consumed.add(source)
        value = self.leaves[source]
        if value is None:
            self.out.implied[source] = f"null: the default of {target} applies"
            return
        try:
            converted = convert(value)
        except (Unmappable, TypeError, ValueError) as exc:
            self.out.unmapped.append(Unmapped(source, value, str(exc)))
            return
        self.put(target, converted, (source,), note)

    def consume(self, *sources: str, why: str) -> None:
        """Mark ``sources`` as read; unless they end up mapped or listed, ``why`` says what they became."""
        for s in sources:
            if s in self.leaves:
                self.consumed.add(s)
                self.out.implied.setdefault(s, why)

    def inactive(self, prefix: str, reason: str) -> None:
        for key in self.leaves:
            if key not in self.consumed and (key == prefix or key.startswith(prefix + ".")):
                self.consumed.add(key)
                self.out.unmapped.append(Unmapped(key, self.leaves[key], reason, inactive=True))


def map_config(cfg: NemoRlConfig) -> Mapping:
    """Translate ``cfg`` into rlc keys; see the module docstring."""
    m = _Mapper(cfg)
    megatron = cfg.get(f"{M}.enabled") is True
    m.consume(f"{M}.enabled", f"{D}.enabled", why="selects the trainer (rlc always trains with Megatron-core)")
    mcore = cfg.get("policy.generation.backend") == "megatron"
    for rule in DIRECT:
        if mcore and rule[0].startswith(VLLM_CFG):
            continue  # NeMo-RL keeps vllm_cfg in its defaults; megatron generation does not read it
        m.take(*rule)
    if megatron:
        for rule in MEGATRON:
            m.take(*rule)
        m.inactive(D, "the DTensor trainer is off (policy.megatron_cfg.enabled: true)")
        m.inactive("policy.optimizer", "the DTensor trainer's optimizer (Megatron's is policy.megatron_cfg.optimizer)")
        m.inactive("policy.scheduler", "the DTensor trainer's scheduler (Megatron's is policy.megatron_cfg.scheduler)")
    else:
        for rule in DTENSOR:
            m.take(*rule)
        betas = cfg.get("policy.optimizer.kwargs.betas")
        if isinstance(betas, list) and len(betas) == 2:
            m.consume("policy.optimizer.kwargs.betas", why="adam_beta1 / adam_beta2")
            m.put("training.optimizer.adam_beta1", betas[0], ("policy.optimizer.kwargs.betas",))
            m.put("training.optimizer.adam_beta2", betas[1], ("policy.optimizer.kwargs.betas",))
        m.inactive(M, "the Megatron trainer is off (policy.megatron_cfg.enabled is not true)")
        m.out.notes.append("this NeMo-RL config trains with DTensor (FSDP2); rlc trains with Megatron-core: the "
                           "trainer's TP/CP come from policy.dtensor_cfg and its FSDP shards become data "
                           "parallelism (distributed optimizer)")
    if megatron:
        _activation_checkpointing(m)
        _mtp_layers(m)
        _freeze_config(m)
        _fp8(m)
        _grad_reduce_in_fp32(m)
        _pass_through(m, [f"{M}.{k}" for k in MEGATRON_PASS_THROUGH], "training.megatron_kwargs",
                      "set on the Megatron-Bridge model provider unchanged")
    _hf_config_overrides(m)
    _packing(m)
    _tokenizer(m)
    if not mcore:
        expert_parallel_flag(m)
        vllm_precision(m)
        vllm_fp8(m)
        vllm_kwargs(m)
    _batch_multiplier(m)
    _lengths(m)
    if mcore:
        mcore_generation(m, megatron)
    _env_vars(m, f"{M}.env_vars" if megatron else f"{D}.env_vars")
    _vllm_env_vars(m)
    _weight_decay_schedule(m)
    _truncated_importance_sampling_type(m)
    _reward(m)
    _prompt_files(m)
    _data(m)
    _checkpoints_kept(m)
    _buffer_exclusive(m)
    _params_offload(m, megatron, offloads=not mcore or (megatron and mcore_dedicated(m)))
    _reference_policy(m)
    _kl_term(m)
    _reward_transforms(m)
    _logprob_chunks(m)
    if cfg.get("policy.generation.colocated.enabled", True) is not False:
        m.inactive("policy.generation.colocated.resources", "only used when generation is not colocated")
    else:
        _non_colocated(m)
    for key, value in m.leaves.items():
        if key not in m.consumed:
            m.out.unmapped.append(Unmapped(key, value, "no rlc equivalent"))
    m.out.unmapped = [_classified(u, cfg) for u in m.out.unmapped]
    written = {s for v in m.out.values for s in v.sources} | {u.key for u in m.out.unmapped}
    m.out.implied = {k: why for k, why in m.out.implied.items() if k not in written}
    order = {key: i for i, key in enumerate(m.leaves)}
    m.out.unmapped.sort(key=lambda u: order.get(u.key, len(order)))
    m.out.missing.extend(_missing(m))
    return m.out


def _fp8(m: _Mapper) -> None:
    base = f"{M}.fp8_cfg"
    if m.cfg.get(f"{base}.enabled") is not True:
        m.consume(*[k for k in m.leaves if k.startswith(base + ".") or k == base],
                  why="FP8 training off (training.fp8.enabled defaults to false)")
        return
    m.take(f"{base}.enabled", "training.fp8.enabled", boolean)
    m.take(f"{base}.fp8", "training.fp8.format", fp8_format)
    m.take(f"{base}.fp8_recipe", "training.fp8.recipe", fp8_recipe)
    m.take(f"{base}.fp8_param", "training.fp8.param_gather", boolean,
           "Megatron fp8_param: the all-gathered parameters stay in FP8")


GRAD_REDUCE_IN_FP32 = f"{M}.distributed_data_parallel_config.grad_reduce_in_fp32"


def _grad_reduce_in_fp32(m: _Mapper) -> None:
    """Megatron's fp32 gradient buffers. NeMo-RL reads the key without a default of its own (its GRPO
    configs set false, ``grpo_math_1B.yaml``) and a ``null`` turns it off, while rlc's default is true
    (the bundled runtime's): so the recipe always states NeMo-RL's value."""
    value = m.leaves.get(GRAD_REDUCE_IN_FP32)
    if value is not None:
        m.take(GRAD_REDUCE_IN_FP32, "training.grad_reduce_in_fp32", boolean,
               "fp32 gradient buffers: 4 B/param" if value is True else "")
        return
    m.consume(GRAD_REDUCE_IN_FP32, why="null: bf16 gradient buffers (training.grad_reduce_in_fp32: false)")
    m.put("training.grad_reduce_in_fp32", False, (GRAD_REDUCE_IN_FP32,),
          "not set in this config: NeMo-RL's GRPO configs keep bf16 gradient buffers (grpo_math_1B.yaml: false), "
          "rlc's default is fp32")


PACKING_BUDGETS = ("train_mb_tokens", "logprob_mb_tokens")
PACKING_PAD = "policy.make_sequence_length_divisible_by"


def _packing(m: _Mapper) -> None:
    """NeMo-RL packs with its algorithm and per-pass token budgets (``${mul:...}`` already resolved);
    the pad multiple rlc works out from the layout (2 × CP, × TP with sequence parallelism, as NeMo-RL
    asserts ``make_sequence_length_divisible_by`` to be a multiple of)."""
    base = "policy.sequence_packing"
    if m.cfg.get(f"{base}.enabled") is True:
        m.take(f"{base}.algorithm", "training.sequence_packing.algorithm", packing_algorithm)
        for budget in PACKING_BUDGETS:
            m.take(f"{base}.{budget}", f"training.sequence_packing.{budget}", positive_int,
                   "tokens per packed micro batch")
        m.consume(f"{base}.sequence_length_round", why="NeMo-RL's dynamic batching rounding; packing pads each "
                  "sequence to the multiple the layout needs")
        m.consume(f"{base}.microbatch_order", why="rlc runs the bins in the packer's order")
        m.consume(PACKING_PAD, why="rlc pads each packed sequence to the multiple the layout needs "
                  "(2 × CP, × TP with sequence parallelism)")
    m.consume(*[k for k in m.leaves if k.startswith(f"{base}.") and not k.endswith(".enabled")],
              why="packing is off")


def _pass_through(m: _Mapper, keys: list[str], target: str, note: str) -> None:
    for key in keys:
        if key not in m.leaves or m.leaves[key] is None:
            m.consume(key, why="null: not set")
            continue
        value = m.leaves[key]
        if value == {}:
            m.consume(key, why="empty: nothing to pass")
            continue
        m.consume(key, why=note)
        m.put(f"{target}.{key.rsplit('.', 1)[1]}", value, (key,), note)


def _tokenizer(m: _Mapper) -> None:
    key = "policy.tokenizer.name"
    if key not in m.leaves:
        return
    m.consume(key, why="the model's own tokenizer (model.tokenizer defaults to the checkpoint)")
    name = m.leaves[key]
    if name is not None and name != m.cfg.get("policy.model_name"):
        m.put("model.tokenizer", str(name), (key,))


def _batch_multiplier(m: _Mapper) -> None:
    key = "grpo.batch_multiplier"
    if key not in m.leaves:
        return
    m.consume(key, why="null: the default of grpo.dynamic_sampling.batch_multiplier applies")
    value = m.leaves[key]
    if value is None:
        return
    if m.cfg.get("grpo.use_dynamic_sampling") is True:
        try:
            m.put("grpo.dynamic_sampling.batch_multiplier", number(value), (key,))
        except Unmappable as exc:
            m.out.unmapped.append(Unmapped(key, value, str(exc)))
    else:
        m.out.unmapped.append(Unmapped(key, value, "only used with grpo.use_dynamic_sampling: true", effect="none"))


def _lengths(m: _Mapper) -> None:
    """NeMo-RL bounds prompt and response each by the model length (vLLM stops a response at
    max_model_len − prompt); rlc needs max_prompt_length + max_tokens ≤ max_model_len."""
    k_len, k_new, k_in = ("policy.generation.vllm_cfg.max_model_len", "policy.generation.max_new_tokens",
                          "data.max_input_seq_length")
    m.consume(k_len, k_new, k_in, why="sizes generation.max_model_len, sampling.max_tokens and "
              "data.max_prompt_length together")
    model_len = m.cfg.get(k_len) or m.cfg.get("policy.max_total_sequence_length")
    if not isinstance(model_len, int) or isinstance(model_len, bool) or model_len < 1:
        for k in (k_len, k_new, k_in):
            if k in m.leaves:
                m.out.unmapped.append(Unmapped(k, m.leaves[k], "no usable max_model_len to size lengths against"))
        return
    src_len = (k_len,) if m.cfg.get(k_len) else ("policy.max_total_sequence_length",)
    m.put("generation.max_model_len", model_len, src_len)
    new = m.cfg.get(k_new)
    prompt = m.cfg.get(k_in)
    new = new if isinstance(new, int) and new > 0 else None
    prompt = min(prompt, model_len) if isinstance(prompt, int) and prompt > 0 else None
    if new is None and prompt is None:
        return
    if prompt is None and new is not None:
        prompt = max(1, model_len - new) if new < model_len else model_len // 2
    if new is None and prompt is not None:
        new = model_len - prompt
    note_tokens = ""
    if prompt + new > model_len:
        if prompt < model_len:
            note_tokens = (f"max_new_tokens {new} capped to max_model_len {model_len} − max_prompt_length "
                           f"{prompt}, the most vLLM generates after the longest prompt")
            new = model_len - prompt
        else:
            prompt = model_len // 2
            new = min(new, model_len - prompt)
            note_tokens = (f"prompt and response each allowed {model_len} tokens; rlc splits max_model_len: "
                           f"{prompt} for the prompt, {new} for the response")
            m.out.notes.append(f"data.max_input_seq_length and max_new_tokens both reach max_model_len {model_len}; "
                               f"the recipe gives {prompt} tokens to the prompt and {new} to the response "
                               "(change with --set data.max_prompt_length=N --set generation.sampling.max_tokens=M)")
    m.put("data.max_prompt_length", prompt, (k_in,) if k_in in m.leaves else src_len,
          note_tokens if note_tokens and prompt != m.cfg.get(k_in) else "")
    m.put("generation.sampling.max_tokens", new, (k_new,) if k_new in m.leaves else src_len, note_tokens)


def _truncated_importance_sampling_type(m: _Mapper) -> None:
    """``loss_fn.truncated_importance_sampling_type: tis`` without a lower bound clamps each importance weight to
    ``[0, truncated_importance_sampling_ratio]``: rlc's ``loss.importance_sampling_cap`` (``min(weight, cap)``).
    ``icepop`` and ``seq-mask-tis`` (tokens or sequences dropped outside the bounds) and a lower bound stay
    unmapped."""
    key = "loss_fn.truncated_importance_sampling_type"
    if m.leaves.get(key) == "tis" and not m.cfg.get("loss_fn.truncated_importance_sampling_ratio_min"):
        m.consume(key, why="clamps the importance weights at truncated_importance_sampling_ratio, as "
                           "loss.importance_sampling_cap does")


def _weight_decay_schedule(m: _Mapper) -> None:
    """Megatron's scheduler with ``weight_decay_incr_style: constant`` applies ``end_weight_decay`` (it asserts the
    start equals it): where both equal ``optimizer.weight_decay`` (mapped to ``training.optimizer.weight_decay``),
    writing them out changes nothing. Other schedules stay unmapped (rlc's weight decay is constant)."""
    sched, wd = f"{M}.scheduler", m.cfg.get(f"{M}.optimizer.weight_decay")
    if m.cfg.get(f"{sched}.weight_decay_incr_style", "constant") != "constant" or wd is None:
        return
    keys = [k for k in (f"{sched}.start_weight_decay", f"{sched}.end_weight_decay") if k in m.leaves]
    if keys and all(m.leaves[k] == wd for k in keys):
        m.consume(*keys, f"{sched}.weight_decay_incr_style",
                  why=f"a constant weight decay equal to {M}.optimizer.weight_decay ({wd:g})")


def _env_text(value: Any) -> str:
    """An environment variable's text for a YAML value (booleans as ``true`` / ``false``)."""
    return value if isinstance(value, str) else "true" if value is True else "false" if value is False else str(value)


def _vllm_env_vars(m: _Mapper) -> None:
    """``vllm_cfg.env_vars``: NeMo-RL sets them in its vLLM workers. vLLM's own (``VLLM_*``) go to ``cluster.env``
    (the trainer reads none of them); NeMo-RL's refit-buffer and vLLM-executor variables change nothing
    (:mod:`.effects`); any other stays unmapped, since in ``cluster.env`` it would reach the trainer too."""
    prefix = f"{VLLM_CFG}.env_vars"
    env = m.cfg.get(prefix)
    if not isinstance(env, dict):
        return
    for name, value in env.items():
        key = f"{prefix}.{name}"
        if value is None or not str(name).startswith("VLLM_") or no_effect_reason(key):
            continue  # null, or listed with why (changes nothing, or reaches more than vLLM in rlc)
        m.consumed.add(key)
        text = _env_text(value)
        m.put(f"cluster.env.{name}", text, (key,), "NeMo-RL sets it in vLLM's workers; rlc for every task")


def _env_vars(m: _Mapper, prefix: str) -> None:
    env = m.cfg.get(prefix)
    if not isinstance(env, dict):
        return
    for name, value in env.items():
        key = f"{prefix}.{name}"
        m.consume(key, why="null: not set")
        if value is None:
            continue
        if name in ENV_KEYS:
            target, convert = ENV_KEYS[name]
            try:
                m.put(target, convert(value), (key,), f"NeMo-RL reads {name} from the environment")
            except Unmappable as exc:
                m.out.unmapped.append(Unmapped(key, value, str(exc)))
            continue
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)):
            m.out.unmapped.append(Unmapped(key, value, "not a valid environment variable name"))
            continue
        text = _env_text(value)
        if name == "PYTORCH_CUDA_ALLOC_CONF" and EXPANDABLE_SEGMENTS.search(text):
            # NeMo-RL gives it to the Megatron workers only; cluster.env reaches vLLM too, whose
            # sleep-mode pool cannot use expandable segments (RLC301 would reject the recipe).
            m.out.unmapped.append(Unmapped(key, value, "trainer-only in NeMo-RL; rlc's cluster.env reaches every "
                                           "process, and vLLM's sleep-mode memory pool cannot use expandable "
                                           "segments (RLC301)", effect="none"))
            continue
        m.put(f"cluster.env.{name}", text, (key,), "NeMo-RL sets it for the trainer; rlc for every task")


def _reward(m: _Mapper) -> None:
    math = m.cfg.get("env.math")
    if not isinstance(math, dict):
        return
    env_name = m.cfg.get("data.default.env_name", m.cfg.get("data.env_name", "math"))
    if env_name not in (None, "math"):
        return
    impl = math.get("math_verify_impl")
    m.consume("env.math.math_verify_impl", "data.default.env_name", "data.env_name",
              why="selects the math reward (reward.function)")
    m.put("reward.function", "math", ("env.math.math_verify_impl",) if impl is not None else ("env.math",),
          f"NeMo-RL's math environment{f' ({impl})' if impl else ''} -> rlc's built-in math reward "
          "(final numeric answer)")


def _data(m: _Mapper) -> None:
    for key in ("data.dataset_name", "data.train.dataset_name"):
        name = m.cfg.get(key)
        if isinstance(name, str) and key in m.leaves and any(v.target == "data.train" for v in m.out.values):
            m.consume(key, why="the prompts come from the JSONL file data.train")
        if isinstance(name, str) and key in m.leaves and not any(v.target == "data.train" for v in m.out.values):
            m.consume(key, why="listed as not mapped")
            m.out.unmapped.append(Unmapped(key, name, "rlc reads prompts from a JSONL file, not a named dataset: "
                                           "convert it and pass --set data.train=/path/train.jsonl", effect="none"))


def _non_colocated(m: _Mapper) -> None:
    """NeMo-RL generates on GPUs of its own (``policy.generation.colocated.resources``: whole nodes, or GPUs of the
    one node) and trains on the others; rlc generates colocated only (RLC207). The note names the ``--set`` that
    plans the trainer's share of the cluster with generation on the same GPUs."""
    res = "policy.generation.colocated.resources"
    nodes, gpus = m.cfg.get("cluster.num_nodes"), m.cfg.get("cluster.gpus_per_node")
    gen_nodes, gen_gpus = m.cfg.get(f"{res}.num_nodes"), m.cfg.get(f"{res}.gpus_per_node")
    m.consume(f"{res}.num_nodes", f"{res}.gpus_per_node", why="the GPUs NeMo-RL gives generation (see the note)")
    sets = "--set colocated=true"
    if isinstance(nodes, int) and isinstance(gen_nodes, int) and nodes > 1 and 0 < gen_nodes < nodes:
        where = f"{gen_nodes} of the {nodes} nodes"
        sets += f" --set cluster.nodes={nodes - gen_nodes}"
    elif isinstance(gpus, int) and isinstance(gen_gpus, int) and nodes == 1 and 0 < gen_gpus < gpus:
        where = f"{gen_gpus} of the node's {gpus} GPUs"
        sets += f" --set cluster.gpus_per_node={gpus - gen_gpus}"
    else:
        where = "GPUs of its own"
    m.out.notes.append(f"NeMo-RL generates on {where} and trains on the rest (policy.generation.colocated.enabled: "
                       "false); rlc generates on the trainer's GPUs only, so the recipe keeps colocated: false and "
                       f"rlc validate refuses it (RLC207): {sets} plans the trainer's share with generation "
                       "colocated")


def _checkpoints_kept(m: _Mapper) -> None:
    """``checkpointing.keep_top_k`` -> ``checkpointing.keep_last``. NeMo-RL keeps every checkpoint when it is null
    (``CheckpointManager``: "If None, all checkpoints are kept") and its recipes write 1000000 for "never prune";
    rlc's default keeps 2, so both become rlc's largest count rather than a default that deletes checkpoints."""
    key = "checkpointing.keep_top_k"
    if key not in m.leaves:
        return
    most = int(schema_ranges()["checkpointing.keep_last"][0]["maximum"])
    value = m.leaves[key]
    m.consumed.add(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > most):
        said = "null" if value is None else str(value)
        m.put("checkpointing.keep_last", most, (key,),
              f"NeMo-RL's keep_top_k {said} keeps every checkpoint; rlc keeps the last {most}, its largest count")
        return
    try:
        kept = positive_int(value)
    except Unmappable as exc:
        m.out.unmapped.append(Unmapped(key, value, str(exc)))
        return
    m.put("checkpointing.keep_last", kept, (key,),
          "NeMo-RL keeps the best k by checkpointing.metric_name; rlc keeps the last k")


def _params_offload(m: _Mapper, megatron: bool, offloads: bool) -> None:
    """NeMo-RL moves the policy model to host memory after every refit when generation is colocated
    (``offload_after_refit``: its Megatron policy worker, and its DTensor workers, which move the whole model to the
    CPU); ``offloads``: the config's trainer does (not where Megatron generation runs on the training model itself).
    rlc's runtime does the same with ``refit.offload_params_for_generation``, which needs the distributed optimizer's
    parameter buffer (a DTensor config's FSDP shards become the distributed optimizer's data parallelism)."""
    colocated = "policy.generation.colocated.enabled"
    if not offloads or m.cfg.get(colocated, True) is False:
        return
    if megatron and m.cfg.get(f"{M}.optimizer.use_distributed_optimizer") is False:
        m.out.notes.append("NeMo-RL moves the Megatron model to host memory after each refit; rlc does that only "
                           "with the distributed optimizer (refit.offload_params_for_generation), which this "
                           "config turns off, so the plan keeps the parameters on the GPU while vLLM generates")
        return
    m.put("refit.offload_params_for_generation", True, (colocated,),
          f"NeMo-RL moves the {'Megatron' if megatron else 'DTensor'} model to host memory after every refit when "
          "generation is colocated")


def _reference_policy(m: _Mapper) -> None:
    """NeMo-RL builds a reference policy whenever ``loss_fn.reference_policy_kl_penalty > 0`` and keeps it in host
    memory, swapping it into the model for the reference logprob pass: a CPU state dict in both trainers
    (``setup_reference_model_state`` in nemo_rl/models/megatron/setup.py, "Store reference state dict on CPU";
    ``use_reference_model`` in the policy workers). No key turns that off, so the recipe states it."""
    key = "loss_fn.reference_policy_kl_penalty"
    kl = m.cfg.get(key)
    if isinstance(kl, bool) or not isinstance(kl, (int, float)) or kl <= 0:
        return
    m.put("training.offload_reference_policy", True, (key,),
          "NeMo-RL keeps the reference policy in host memory and swaps it in for its logprob pass")


#: NeMo-RL's reward blocks and their numeric keys (rlc's keys have the same names under the same block).
_REWARD_BLOCKS = {
    "grpo.reward_scaling": {"source_min": number, "source_max": number, "target_min": number, "target_max": number},
    "grpo.reward_shaping": {"overlong_buffer_length": positive_int, "overlong_buffer_penalty": number,
                            "max_response_length": positive_int, "stop_properly_penalty_coef": number},
}


def _reward_transforms(m: _Mapper) -> None:
    """``grpo.reward_scaling`` and ``grpo.reward_shaping`` (DAPO's overlong penalty, or the stop-properly coefficient)
    map key for key where NeMo-RL turns them on; turned off, their keys change nothing."""
    for block, keys in _REWARD_BLOCKS.items():
        switch = f"{block}.enabled"
        if m.cfg.get(switch) is not True:
            m.consume(switch, *(f"{block}.{k}" for k in keys), why=f"{switch} is false: the block is off")
            continue
        m.take(switch, switch, boolean)
        for key, convert in keys.items():
            m.take(f"{block}.{key}", f"{block}.{key}", convert)


def _kl_term(m: _Mapper) -> None:
    """NeMo-RL's KL term (``ClippedPGLossFn``): each token's estimate is weighted by ``exp(logπ − sg(logπ))``, whose
    gradient adds the score-function term of sampling from the policy (NeMo-RL #2506), or with
    ``use_on_policy_kl_approximation`` by ``exp(logπ − log π_generation)``, then clamped at
    ``kl_output_clamp_value``; its log-ratio is clamped at ``kl_input_clamp_value``, which rlc holds at 20. Without a
    KL penalty none of them is read."""
    penalty = m.cfg.get("loss_fn.reference_policy_kl_penalty")
    keys = [f"loss_fn.{k}" for k in ("use_on_policy_kl_approximation", "kl_output_clamp_value", "kl_input_clamp_value")]
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or penalty <= 0:
        m.consume(*keys, why="no KL penalty (loss_fn.reference_policy_kl_penalty is 0)")
        return
    approx, output_clamp, input_clamp = (m.cfg.get(k) for k in keys)
    m.put("loss.kl_weighting", "on_policy" if approx is True else "sampling",
          tuple(k for k in keys[:1] if k in m.leaves) + ("loss_fn.reference_policy_kl_penalty",),
          "NeMo-RL weights the KL term so its gradient includes sampling from the policy (NeMo-RL #2506)")
    m.consumed.add(keys[0])
    if output_clamp is not None:
        m.take(keys[1], "loss.kl_clamp", number)
    else:
        m.consume(keys[1], why="null: no bound on the KL term (loss.kl_clamp null)")
    if input_clamp is None or input_clamp == KL_LOG_RATIO_BOUND:
        m.consume(keys[2], why=f"rlc bounds the KL's log-ratio at {KL_LOG_RATIO_BOUND:g} (beyond it no gradient)")


def _logprob_chunks(m: _Mapper) -> None:
    key = "policy.logprob_chunk_size"
    if key not in m.leaves:
        return
    m.consume(key, why="null: not set")
    value = m.leaves[key]
    if value is None:
        return
    m.out.unmapped.append(Unmapped(key, value, "rlc does not chunk the logits along the sequence: the plan counts "
                                   "the whole sequence's fp32 logits in the logprob and train passes (bound them with "
                                   "training.logprob_batch_size and training.micro_batch_size, or split them with "
                                   "parallelism.train.tp)"))


def _buffer_exclusive(m: _Mapper) -> None:
    targets = {v.target: i for i, v in enumerate(m.out.values)}
    if "refit.buffer_gb" in targets and "refit.buffer_memory_ratio" in targets:
        ratio = m.out.values.pop(targets["refit.buffer_memory_ratio"])
        for s in ratio.sources:
            m.out.unmapped.append(Unmapped(s, ratio.value, "refit.buffer_gb (policy.refit_buffer_size_gb) wins; "
                                           "rlc takes one of buffer_gb and buffer_memory_ratio", effect="none"))


def _missing(m: _Mapper) -> list[MissingKey]:
    have = {v.target for v in m.out.values}
    out = [MissingKey("cluster.gpu", "NeMo-RL configs do not name the GPU type (it sets the memory the plan uses)",
                      "cluster.gpu=h100-80gb"),
           MissingKey("cluster.container.image", "NeMo-RL configs do not name the container image",
                      "cluster.container.image=nvcr.io/nvidia/nemo-rl:v0.6.0")]
    if "data.train" not in have:
        out.append(MissingKey("data.train", "rlc needs a JSONL prompt file (NeMo-RL names a dataset)",
                              "data.train=/data/train.jsonl"))
    return out


