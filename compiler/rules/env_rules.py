"""RLC3xx: environment, sampling and algorithm settings that fail or mislead at run time."""
from __future__ import annotations

import re

from rlc.compiler.rules.engine import Context, rule
from rlc.contract.chat_template import TOKENIZER_TEMPLATE
from rlc.contract.reward_shaping import overlong_window
from rlc.contract.sampling_truncation import Truncation

_EXPANDABLE = re.compile(r"expandable_segments\s*:\s*true", re.IGNORECASE)


@rule("RLC301", "expandable_segments:True is incompatible with colocated vLLM", severities=("error",),
      rationale="vLLM's sleep mode allocates through CuMemAllocator (a CUDA memory pool); PyTorch's expandable "
                "segments cannot be combined with memory pools, and vLLM asserts at start-up, minutes into the "
                "job. Every Ray actor inherits the driver's environment, so there is no per-actor escape.",
      seed="NeMo-RL #2471 attempt 4: 'AssertionError: Expandable segments are not compatible with memory pool' "
           "(vllm cumem.py:132; pytorch/pytorch#147851).",
      fixes="Remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF in cluster.env "
            "(garbage_collection_threshold:0.6 is fine).")
def expandable_segments(ctx: Context) -> None:
    if not ctx.recipe.colocated:
        return
    for key, value in ctx.recipe.cluster.env.items():
        if isinstance(value, str) and _EXPANDABLE.search(value):
            ctx.error(f"{key}={value} enables expandable segments, which vLLM's CuMemAllocator rejects with "
                      "colocated generation (pytorch#147851)", f"cluster.env.{key}",
                      hint="drop expandable_segments:True from it")


@rule("RLC302", "batch_multiplier > 1 needs dynamic sampling", severities=("error",),
      rationale="batch_multiplier over-generates prompts so dynamic sampling can drop groups whose rewards are "
                "all equal; without dynamic sampling the extra samples have nowhere to go.",
      seed="NeMo-RL #2471 bonus (dynamic sampling with batch_multiplier 2, max_gen_batches 10).",
      fixes="Set grpo.dynamic_sampling.enabled: true or batch_multiplier: 1.")
def multiplier(ctx: Context) -> None:
    ds = ctx.recipe.grpo.dynamic_sampling
    if ds.batch_multiplier > 1 and not ds.enabled:
        ctx.error(f"batch_multiplier {ds.batch_multiplier} without dynamic sampling",
                  "grpo.dynamic_sampling.batch_multiplier", hint="enable dynamic_sampling or set batch_multiplier: 1")


@rule("RLC303", "truncated sampling: the trainer scores each sampled token under the engine's cuts",
      severities=("info",),
      rationale="With min_p > 0, top_k > 0 or top_p < 1 the rollout engine samples from a renormalised, truncated "
                "distribution and reports the sampled token's logprob under it. rlc's trainer applies the same cuts "
                "to its own logits (in the same order: min-p, top-k, top-p), so the policy ratio, the importance "
                "weights and the gen-KL guard compare logprobs of one distribution; the KL penalty compares the "
                "policy and the reference under the full distribution. A sampled token that the trainer's cut "
                "leaves out (its logits differ from the engine's in the last bits and the token sat at the edge) "
                "leaves the policy term and is counted (truncation_miss_fraction, gen_truncation_miss_fraction). "
                "Each TP rank cuts whole vocabulary rows, and the plan counts the extra copy of the logits.",
      seed="NeMo-RL logits_sampling_utils.py (apply_top_k_top_p in the training logprobs, -inf tokens masked); "
           "vLLM v1 Sampler (temperature, min-p, then top-k/top-p; processed_logprobs).",
      fixes="Nothing to fix; top_p: 1.0, top_k: -1 and min_p: 0 sample and score the full distribution.")
def truncation(ctx: Context) -> None:
    s = ctx.recipe.generation.sampling
    cut = Truncation.of(s)
    if not cut.active:
        return
    key = ("generation.sampling.min_p" if cut.min_p > 0 else "generation.sampling.top_k" if cut.top_k > 0
           else "generation.sampling.top_p")
    full = " and the KL penalty's reference under the full distribution" if ctx.recipe.loss.kl_penalty > 0 else ""
    ctx.info(f"sampling truncated ({cut.describe()}): the trainer scores each sampled token under the same cuts"
             f"{full}", key)


@rule("RLC304", "low sampling temperature starves GRPO of signal", severities=("warning",),
      rationale="GRPO learns from reward differences inside a group; at low temperature the samples of a group "
                "converge to the same answer, the group's rewards are equal and its advantage is zero.",
      seed="NeMo-RL #2471 bonus: only ~18% of groups had non-zero reward spread at temperature 1 on DAPO math.",
      fixes="Use temperature ≥ 0.7 (1.0 is the usual choice).")
def temperature(ctx: Context) -> None:
    t = ctx.recipe.generation.sampling.temperature
    if t < 0.5:
        ctx.warning(f"temperature {t} makes a group's samples nearly identical (zero advantage)",
                    "generation.sampling.temperature", hint="temperature: 1.0")


@rule("RLC305", "prompts must fit vLLM's max_model_len; responses must fit the trainer's sequence length",
      severities=("error", "warning", "info"),
      rationale="vLLM's offline engine rejects a prompt longer than max_model_len; a prompt that fits is generated "
                "until max_tokens or until prompt + response reaches max_model_len, whichever comes first (the "
                "sample ends with finish_reason 'length'). So max_prompt_length + max_tokens above max_model_len "
                "is not an error: NeMo-RL sets all three to the same value. A trainer sequence length below the "
                "longest sample truncates responses from the loss.",
      seed="vLLM input validation ('The decoder prompt (length N) is longer than the maximum model length'); "
           "NeMo-RL GRPO configs (max_total_sequence_length = max_model_len = max_new_tokens).",
      fixes="Raise generation.max_model_len above data.max_prompt_length (and training.max_sequence_length to "
            "max_model_len), or lower data.max_prompt_length.")
def lengths(ctx: Context) -> None:
    prompt = ctx.recipe.data.max_prompt_length
    tokens = ctx.recipe.generation.sampling.max_tokens
    model_len = ctx.recipe.generation.max_model_len
    if prompt > model_len:
        ctx.error(f"data.max_prompt_length {prompt} exceeds generation.max_model_len {model_len}: vLLM rejects "
                  "prompts longer than max_model_len", "generation.max_model_len",
                  hint=f"max_model_len: {prompt + tokens} (or max_prompt_length ≤ {model_len})")
        return
    if prompt + tokens > model_len:
        ctx.info(f"max_prompt_length {prompt} + max_tokens {tokens} = {prompt + tokens} > max_model_len "
                 f"{model_len}: responses to long prompts stop at {model_len} tokens in total "
                 "(finish_reason 'length')", "generation.sampling.max_tokens")
    longest = ctx.recipe.longest_rollout
    seq = ctx.recipe.training.max_sequence_length  # None: max_model_len, which caps the sample anyway
    if seq is not None and seq < longest:
        ctx.warning(f"training.max_sequence_length {seq} < the longest sample {longest} (prompt + response, capped "
                    "by max_model_len): long responses are truncated in the loss", "training.max_sequence_length",
                    hint=f"training.max_sequence_length: {longest}")


@rule("RLC306", "max_gen_kl 0 disables the stale-weights guard", severities=("info",),
      rationale="After every refit rlc compares vLLM's sampling logprobs with the trainer's; a large KL means "
                "vLLM runs wrong or stale weights (the NeMo-RL #4086 and 003 bugs produced no error, only garbage).",
      seed="NeMo-RL #4086 and SkyRL #1816 (silent wrong weights after refit).",
      fixes="Keep grpo.max_gen_kl > 0 (default 0.05).")
def gen_kl(ctx: Context) -> None:
    if ctx.recipe.grpo.max_gen_kl == 0:
        ctx.info("max_gen_kl: 0 turns off the check that catches wrong weights after refit", "grpo.max_gen_kl")


@rule("RLC307", "the overlong penalty must start where responses can reach", severities=("error", "warning"),
      rationale="DAPO's overlong penalty (grpo.reward_shaping) starts at max_response_length − overlong_buffer_length "
                "tokens (max_response_length null: generation.sampling.max_tokens). At or below zero every response is "
                "penalised by its whole length, which drowns the task reward; beyond generation.sampling.max_tokens "
                "no response can reach it and the shaping does nothing (NeMo-RL measures against "
                "max_total_sequence_length, which rlc splits between prompt and response).",
      seed="DAPO (arXiv 2503.14476) soft overlong punishment; NeMo-RL apply_reward_shaping.",
      fixes="Set grpo.reward_shaping.max_response_length to generation.sampling.max_tokens (or null) and the buffer "
            "below it.")
def overlong_penalty_reach(ctx: Context) -> None:
    shaping, tokens = ctx.recipe.grpo.reward_shaping, ctx.recipe.generation.sampling.max_tokens
    if not shaping.enabled or shaping.stop_properly_penalty_coef is not None:
        return
    start, limit = overlong_window(shaping, tokens)
    path = "grpo.reward_shaping.overlong_buffer_length"
    if start <= 0:
        ctx.error(f"overlong_buffer_length {shaping.overlong_buffer_length} ≥ the response limit {limit}: every "
                  "response is penalised from its first token", path,
                  hint=f"{path}: below {limit} (DAPO uses a quarter of the limit)")
    elif start >= tokens:
        ctx.warning(f"the overlong penalty starts at {start} tokens (max_response_length {limit} − buffer "
                    f"{shaping.overlong_buffer_length}), but responses stop at generation.sampling.max_tokens "
                    f"{tokens}: it never applies", "grpo.reward_shaping.max_response_length",
                    hint=f"grpo.reward_shaping.max_response_length: {tokens} (or null)")


@rule("RLC308", "a system prompt or chat-template arguments need a chat template", severities=("error",),
      rationale="data.system_prompt is a turn of the conversation the chat template renders, and "
                "data.chat_template_kwargs are that template's arguments; with data.chat_template null the prompt "
                "text goes to the tokenizer as it is, and the runtime refuses to start rather than drop them.",
      seed="NeMo-RL math_hf_data_processor (system prompt and user turn through apply_chat_template, with "
           "policy.tokenizer.chat_template_kwargs).",
      fixes="Set data.chat_template: default (the tokenizer's) or a Jinja template, or drop the key.")
def chat_template_needed(ctx: Context) -> None:
    d = ctx.recipe.data
    if d.chat_template is not None:
        return
    for key, value in (("system_prompt", d.system_prompt), ("chat_template_kwargs", d.chat_template_kwargs)):
        if value:
            ctx.error(f"data.{key} is set but data.chat_template is null: nothing renders it", f"data.{key}",
                      hint=f"data.chat_template: {TOKENIZER_TEMPLATE}")


@rule("RLC309", "a ratio forced to 1 needs one optimizer step per GRPO step", severities=("error",),
      rationale="loss.force_on_policy_ratio takes the policy ratio as exactly 1, which is only what the clipped loss "
                "would compute when every sample is trained on in one optimizer step, from the weights that scored "
                "it: with several optimizer steps per GRPO step the later ones train a policy that already moved, and "
                "the forced ratio hides it from the clip.",
      seed="NeMo-RL grpo.py (force_on_policy_ratio requires train_global_batch_size == num_prompts_per_step * "
           "num_generations_per_prompt).",
      fixes="Set training.global_batch_size to grpo.prompts_per_step × grpo.generations_per_prompt, or "
            "loss.force_on_policy_ratio: false.")
def forced_ratio_one_step(ctx: Context) -> None:
    r = ctx.recipe
    samples = r.grpo.prompts_per_step * r.grpo.generations_per_prompt
    if r.loss.force_on_policy_ratio and r.training.global_batch_size != samples:
        ctx.error(f"loss.force_on_policy_ratio with training.global_batch_size {r.training.global_batch_size}: a GRPO "
                  f"step of {samples} samples takes several optimizer steps, and the later ones see a moved policy",
                  "loss.force_on_policy_ratio", hint=f"training.global_batch_size: {samples}")
