"""The GRPO driver: ``python -m rlc.runtime runtime.yaml``.

The same code runs a 1-GPU toy and a 32-node job: it joins Ray, reserves one bundle per GPU, puts a
Megatron policy worker and a vLLM generation worker on every GPU (with ``generation.backend: megatron`` the
policy worker hosts megatron-core's engine itself), and loops::

    for step in steps:
        offload trainer params              # refit.offload_params_for_generation: to host memory
        groups   = rollout(step)            # prompts -> N generations each (with logprobs)
                                            #   -> rewards -> dynamic sampling -> advantages
        release generation                  # vLLM sleeps (refit.sleep_level) / the Megatron engine suspends
        onload trainer params               # back before the trainer's first forward
        batch    = trainer_logprobs(groups) # old logprobs (+ reference) and the gen-KL check
        train(batch)                        # clipped GRPO loss, optimizer step(s)
        refit(step)                         # the weight sync (rlc.runtime.weight_sync) readies the engines
        log(step); checkpoint(step)

Failures end the run with a report: a worker that dies names itself, its node and GPU; a gen-KL
above ``grpo.max_gen_kl`` explains the likely causes; exhausted dynamic sampling says what to change.
"""
from __future__ import annotations

import logging
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlc.contract.calibration_record import CalibrationRecord, memory_metric_key
from rlc.contract.runtime_config import RuntimeConfig, runtime_config_to_dict
from rlc.contract.refit_buffer import GIB
from rlc.runtime.metrics import JsonlFile, MetricsLogger, PhaseTimer
from rlc.runtime.worker_groups import GenerationGroup, Memory, PolicyGroup, RankCoords, RefitSent

if TYPE_CHECKING:
    from rlc.runtime.generation.backend import GenerationBackend
    from rlc.runtime.grpo.data import PromptCursor
    from rlc.runtime.grpo.rewards import RewardScorer
    from rlc.runtime.weight_sync import WeightSync

log = logging.getLogger("rlc.runtime.driver")

#: Exit codes (rlc's own: 0 ok, 1 the input is refused, 2 usage or I/O, 3 a bug in rlc; then the run's stops).
EXIT_OK, EXIT_CONFIG, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_WORKER_FAILED, EXIT_GEN_KL, EXIT_RUN_FAILED = 4, 5, 6


@dataclass
class Group:
    """One prompt and its generations."""

    sample: Any  # rlc.runtime.grpo.data.PromptSample
    prompt_ids: list[int]
    generations: list[dict]  # {token_ids, logprobs, text, finish_reason}
    rewards: list[float]


class GrpoRun:
    """State of one run: config, workers, data cursor, metrics (see the module docstring)."""

    def __init__(self, cfg: RuntimeConfig, cfg_path: str | None = None) -> None:
        self.cfg = cfg
        self.cfg_dict = runtime_config_to_dict(cfg)
        self.cfg_path = cfg_path
        self.session = f"{cfg.name}-{os.environ.get('SLURM_JOB_ID', os.getpid())}-{uuid.uuid4().hex[:6]}"
        self._policy: PolicyGroup | None = None
        self._generation: GenerationGroup | None = None
        self._metrics: MetricsLogger | None = None
        self.timer = PhaseTimer()  # every phase's wall time, drained into the step's metrics
        self.refits_done = 0
        self.checkpoint_failures = 0  # in a row; three stop the run
        self.coords: list[RankCoords] = []  # each trainer rank's place in the layout (start_workers)
        self.eos_token_id: int | None = None
        self.pad_id = 0
        # Set by start_workers(), before any phase runs:
        self.tokenizer: Any
        self.scorer: RewardScorer
        self.cursor: PromptCursor
        self.pg: Any  # the Ray placement group
        self.backend: GenerationBackend  # generates and releases (vLLM engines, or the policy workers' engines)
        self.weight_sync: WeightSync  # every refit goes through it
        logs = Path(cfg.logging.dir)
        self.calibration = JsonlFile(logs / "calibration.jsonl")
        self.ranks_log = JsonlFile(logs / "refit_ranks.jsonl")  # one line per trainer rank and refit
        self.verify_log = JsonlFile(logs / "refit_verify.jsonl")  # one line per verified vLLM worker
        self.versions: dict[str, str] = {}
        self.step_metrics: dict[str, Any] = {}

    # Workers and the metrics logger exist once started; using them earlier is a driver bug.

    @property
    def policy(self) -> PolicyGroup:
        if self._policy is None:
            raise RuntimeError("policy workers used before start_workers()")
        return self._policy

    @property
    def generation(self) -> GenerationGroup:
        if self._generation is None:
            raise RuntimeError("generation workers used before start_workers()")
        return self._generation

    @property
    def metrics(self) -> MetricsLogger:
        if self._metrics is None:
            raise RuntimeError("metrics used before open_logs()")
        return self._metrics

    # ================================================================== the algorithm

    def run(self) -> int:
        cfg = self.cfg
        self.start_workers()
        start_step = self.resume()
        self.open_logs(start_step)
        self.refit(step=start_step)  # vLLM gets the trainer's weights (fresh start or checkpoint)
        self.timer.drain()  # the initial refit is not part of step 1
        self.log_calibration(start_step, "after_initial_refit")
        for step in range(start_step + 1, cfg.grpo.max_steps + 1):
            self.step_metrics = {}
            self.run_step(step)
            self.step_metrics.update(self.timer.drain())
            self.metrics.log(step, self.step_metrics)
            if self.cfg.checkpointing.enabled and self._should_save(step):
                self.checkpoint(step)
        return EXIT_OK

    # ================================================================== phases

    def run_step(self, step: int) -> None:
        """One GRPO step's phases, in order (the loop in the module docstring)."""
        with self.timer("step"):
            self.offload_trainer_params()  # after the refit (and any checkpoint), before the engines generate
            groups = self.rollout(step)
            self.sleep_generation(step)
            self.onload_trainer_params()
            batch = self.trainer_logprobs(step, groups)
            self.train(step, batch)
            self.refit(step)

    def rollout(self, step: int) -> list[Group]:
        """Prompts -> generations -> rewards, with dynamic sampling; sets reward metrics."""
        from rlc.runtime.grpo.advantages import reward_metrics  # noqa: PLC0415
        from rlc.runtime.grpo.dynamic_sampling import DynamicSampler  # noqa: PLC0415

        sampler: DynamicSampler[Group] = DynamicSampler.from_config(self.cfg.grpo, logger=log.info)
        gen_tokens = 0

        def generate_batch(num_prompts: int) -> tuple[list[Group], list[list[float]]]:
            nonlocal gen_tokens
            groups = self.generate(self.cursor.next_batch(num_prompts))
            gen_tokens += sum(len(g["token_ids"]) for grp in groups for g in grp.generations)
            return groups, [grp.rewards for grp in groups]

        with self.timer("generate"):
            groups, rewards = sampler.collect(step, generate_batch)
        self.step_metrics.update(reward_metrics(rewards))
        self.step_metrics.update(self.scorer.take_metrics())
        self.step_metrics.update(sampler.metrics())
        self.step_metrics["throughput/generated_tokens"] = gen_tokens
        self.step_metrics["throughput/generate_tokens_per_s"] = gen_tokens / max(self.timer.seconds(self.backend.timer),
                                                                                 1e-9)
        lengths = [len(g["token_ids"]) for grp in groups for g in grp.generations]
        self.step_metrics["response_length/mean"] = sum(lengths) / max(len(lengths), 1)
        self.step_metrics["response_length/max"] = max(lengths) if lengths else 0
        self.sample_memory("generate")
        return groups

    def generate(self, prompts: list) -> list[Group]:
        """Split prompts over the engines; score each generation with the reward function."""
        n = self.cfg.grpo.generations_per_prompt
        ids = [self.encode(p.prompt) for p in prompts]
        engines = self.backend.engines
        per = (len(ids) + engines - 1) // engines
        chunks = [(e, ids[e * per : (e + 1) * per]) for e in range(engines)]
        with self.timer(self.backend.timer):
            results = self.backend.generate([(e, c) for e, c in chunks if c], n)
        samples = [s for r in results for s in r["samples"]]
        groups = []
        for prompt, pids, gens in zip(prompts, ids, samples):
            rewards = self.scorer.score([prompt.prompt] * len(gens), [g["text"] for g in gens],
                                        [prompt.answer] * len(gens))
            groups.append(Group(prompt, pids, gens, rewards))
        return groups

    def sleep_generation(self, step: int) -> None:
        """The engines release their memory for the trainer (vLLM: refit.sleep_level; Megatron: the engine
        suspends, its KV pool as generation.megatron.kv_cache says)."""
        with self.timer("sleep"):
            slept = self.backend.release(step)
        self.step_metrics["memory/sleep_freed_gib"] = slept.freed_gib
        self.sample_memory("after_sleep", slept.memory)
        if step <= 2 or step % 50 == 0:
            self.log_calibration(step, "after_sleep", slept.memory)

    def offload_trainer_params(self) -> None:
        """``refit.offload_params_for_generation``: the trainer's bf16 parameters to host memory while vLLM
        generates (the weights are in vLLM since the refit); the GPU memory freed goes into the metrics."""
        if not self.cfg.refit.offload_params_for_generation:
            return
        with self.timer("params_offload"):
            moved = self.policy.offload_params()
        self.step_metrics["memory/params_offload_freed_gib"] = max(m.bytes for m in moved) / GIB
        self.sample_memory("params_offload", moved[0].memory)

    def onload_trainer_params(self) -> None:
        """The parameters back on the GPU before the trainer's logprob pass (vLLM is asleep)."""
        if not self.cfg.refit.offload_params_for_generation:
            return
        with self.timer("params_onload"):
            self.policy.onload_params()

    def trainer_logprobs(self, step: int, groups: list[Group]) -> dict:
        """Advantages, the packed batch, the trainer's logprobs (+ reference); checks gen-KL."""
        from rlc.runtime.grpo.advantages import group_advantages  # noqa: PLC0415
        from rlc.runtime.grpo.loss import GenKLExceeded, check_gen_kl, gen_kl_metrics  # noqa: PLC0415
        from rlc.runtime.policy.batches import pack_rollouts  # noqa: PLC0415

        g = self.cfg.grpo
        adv = group_advantages([grp.rewards for grp in groups], leave_one_out=g.leave_one_out,
                               normalize=g.normalize_advantages)
        replay = self.cfg.training.router_replay.enabled
        prompt_ids, resp_ids, gen_lps, advantages, routes = [], [], [], [], []
        for grp, a in zip(groups, adv.tolist()):
            for gen, ai in zip(grp.generations, a):
                prompt_ids.append(grp.prompt_ids)
                resp_ids.append(gen["token_ids"])
                gen_lps.append(gen["logprobs"])
                advantages.append(ai)
                if replay:
                    routes.append(gen.get("routed_experts"))
        tp = self.cfg.train_parallel
        batch = pack_rollouts(prompt_ids, resp_ids, gen_lps, advantages, pad_id=self.pad_id,
                              pad_to_multiple=16 * tp.tp * tp.cp,
                              max_length=self.cfg.training.max_sequence_length,
                              routes=routes if replay else None, num_experts=self.cfg.model.num_experts)
        if replay:
            # response tokens whose logits depend on a route vLLM did not record leave the loss (mask 0)
            unrouted = sum(len(r) for r in resp_ids) - float(batch["mask"].sum())
            self.step_metrics["router_replay/unrouted_tokens"] = unrouted
        with self.timer("logprobs"):
            old = self.gather_output(self.policy.compute_logprobs(self._put(batch)))
            batch["old_logprobs"] = old
            if self.cfg.loss.kl_penalty > 0:
                batch["ref_logprobs"] = self.gather_output(self.policy.compute_ref_logprobs(self._put(batch)))
        if replay:
            self.check_router_replay(step)
        kl = gen_kl_metrics(batch["gen_logprobs"], old, batch["mask"])
        self.step_metrics.update(kl)
        self.sample_memory("logprobs")
        try:
            check_gen_kl(kl["gen_kl"], step=step, threshold=g.max_gen_kl, detail=kl)
        except GenKLExceeded:
            self.metrics.log(step, {**self.step_metrics, **self.timer.drain()})  # the step that stopped the run
            raise
        self.step_metrics["throughput/train_tokens"] = float(batch["mask"].sum())
        return batch

    def check_router_replay(self, step: int) -> None:
        """``training.router_replay``: in the logprob passes every decoder router must have routed every token to
        the experts vLLM recorded for it; a difference means the replay was bypassed, and the run stops."""
        check = self.policy.router_replay_check()
        m = self.step_metrics
        m["router_replay/routes_checked"] = check.routes_checked
        m["router_replay/routes_mismatched"] = check.routes_mismatched
        m["router_replay/layers_unarmed"] = check.layers_unarmed
        if check.routes_mismatched or check.layers_unarmed:
            raise RuntimeError(f"routing replay at step {step}: {check.routes_mismatched} of {check.routes_checked} "
                               f"(token, MoE layer) routings differ from vLLM's recorded experts and "
                               f"{check.layers_unarmed} router calls found no route armed: the trainer is not "
                               "replaying vLLM's routing (is a fused router on in training.megatron_kwargs?)")

    def train(self, step: int, batch: dict) -> None:
        """Optimizer step(s) on the batch; merges the output ranks' loss metrics."""
        with self.timer("train"):
            results = self.policy.train_step(self._put(batch), step)
        self.step_metrics.update(merge_train_metrics(results))
        self.step_metrics["throughput/train_tokens_per_s"] = (self.step_metrics["throughput/train_tokens"]
                                                              / max(self.timer.seconds("train"), 1e-9))
        self.sample_memory("train")

    def refit(self, step: int) -> None:
        """Trainer weights -> the engines, through the weight synchronizer (``rlc.runtime.weight_sync``)."""
        self.weight_sync.sync(step)

    def log_refit_ranks(self, step: int, sent: list[RefitSent]) -> None:
        """One line per trainer rank and refit in ``refit_ranks.jsonl``: every rank's own manifest
        (tensors, bytes, buckets), free memory and active fixes, so a rank that sent another rank's
        metadata (SkyRL #1816) or ran out of room is visible by rank, not only rank 0."""
        for rank, metrics in enumerate(sent):
            self.ranks_log.write({"step": step, "rank": rank, **metrics.raw})

    def checkpoint(self, step: int) -> None:
        """Policy shards (megatron-core dist checkpoint) + driver state (step, data cursor).

        A failed save leaves the previous checkpoint as the latest and training goes on; three
        failures in a row stop the run (a requeue would otherwise lose ever more work).
        """
        from rlc.runtime import checkpoint as ckpt  # noqa: PLC0415

        root = self.cfg.checkpointing.dir
        try:
            with self.timer("checkpoint"):
                folder = ckpt.begin(root, step)
                self.policy.save_checkpoint(str(Path(folder) / "policy"))
                ckpt.save(root, step, {"step": step, "cursor": self.cursor.state_dict(), "session": self.session,
                                       ckpt.EXPERIMENT_STATE_KEY: ckpt.experiment(self.cfg)},
                          keep_last=self.cfg.checkpointing.keep_last)
        except Exception as exc:  # any failure to save: training goes on from the previous checkpoint
            self.timer.drain()
            self.checkpoint_failures += 1
            log.error("checkpoint at step %d failed (%d in a row): %s", step, self.checkpoint_failures, exc)
            if self.checkpoint_failures >= 3:
                raise
            return
        self.checkpoint_failures = 0
        log.info("checkpoint step %d saved to %s in %.1f s", step, folder, self.timer.drain()["timing/checkpoint_s"])

    def resume(self) -> int:
        """Latest complete checkpoint -> policy state + cursor; returns the step to continue after."""
        from rlc.runtime import checkpoint as ckpt  # noqa: PLC0415

        found = ckpt.resume_from_latest(self.cfg.checkpointing, warn=log.warning, current=ckpt.experiment(self.cfg))
        if found is None:
            return 0
        self.policy.load_checkpoint(str(Path(found.path) / "policy"))
        self.cursor.load_state_dict(found.state["cursor"])
        log.info("resumed from %s (step %d)", found.path, found.step)
        return int(found.step)

    # ================================================================== setup

    def start_workers(self) -> None:
        """Ray, placement group, vLLM engines (then asleep), Megatron ranks, refit pairing; with
        ``generation.backend: megatron`` the Megatron ranks, then their engines."""
        from rlc.runtime import workers as W  # noqa: PLC0415
        from rlc.runtime.generation.backend import MegatronBackend, VllmBackend  # noqa: PLC0415
        from rlc.runtime.grpo.data import PromptCursor, load_prompts_from_config  # noqa: PLC0415
        from rlc.runtime.grpo.rewards import RewardScorer, make_reward_fn  # noqa: PLC0415
        from rlc.runtime.weight_sync import make_weight_sync  # noqa: PLC0415

        cfg = self.cfg
        self.versions = W.library_versions()  # the driver runs in the workers' container
        self.load_tokenizer()
        self.scorer = RewardScorer(make_reward_fn(cfg.reward.function, cfg.reward.kwargs),
                                   failure_reward=cfg.reward.failure_reward, warn=log.warning)
        prompts = load_prompts_from_config(cfg.data, count_tokens=lambda s: len(self.encode(s)), on_filtered=log.warning)
        self.cursor = PromptCursor(prompts, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle)
        placement = W.plan_placement(cfg)
        env = W.worker_env(cfg)
        log.info("%s", W.connect(cfg.cluster.ray, env))
        pg, order = W.reserve_gpus(placement)
        self.pg = pg
        if cfg.generation.backend == "megatron":
            self._start_policy(W, placement, env, order)
            megatron = MegatronBackend(self.policy)
            self.backend = megatron
            started = megatron.start()
            self.eos_token_id = started.eos_token_id
            log.info("Megatron inference engines up in %.1f s", started.seconds)
            self.log_memory_line("megatron_engine_started", started.memory)
        else:
            from rlc.runtime.generation.vllm_worker import VllmGenerationWorker  # noqa: PLC0415

            per_engine = placement.gpus_per_engine
            gen_actors = []
            for e, bundles in enumerate(placement.engine_bundles):
                phys = [order[b] for b in bundles]
                gen_actors.append(W.spawn(
                    VllmGenerationWorker, pg=pg, bundle=phys[0],
                    num_gpus=placement.gpu_fraction if per_engine == 1 else 0.0,
                    env=env, name=f"{self.session}-gen{e}", args=(self.cfg_dict, e, phys)))
            self._generation = GenerationGroup(W.WorkerGroup("generation", gen_actors))
            self.generation.describe()
            vllm = VllmBackend(self.generation, cfg.refit.sleep_level)
            self.backend = vllm
            started = vllm.start()
            self.eos_token_id = started.eos_token_id
            log.info("vLLM engines up in %.1f s", started.seconds)
            self.log_memory_line("vllm_started", started.memory)
            vllm.sleep_after_start()
            self._start_policy(W, placement, env, order)
            if cfg.training.router_replay.enabled:
                self.check_replay_layers(started.moe_layers)
        self.weight_sync = make_weight_sync(self)
        self.weight_sync.prepare()

    def _start_policy(self, W: Any, placement: Any, env: dict[str, str], order: list[int]) -> None:
        """The Megatron ranks: spawn, NCCL and model setup."""
        from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker  # noqa: PLC0415

        policy_env = {**env, "CUDA_DEVICE_MAX_CONNECTIONS": env.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")}
        pol = [W.spawn(MegatronPolicyWorker, pg=self.pg, bundle=order[b], num_gpus=placement.gpu_fraction,
                       env=policy_env, name=f"{self.session}-policy{r}",
                       args=(self.cfg_dict, r, placement.world_size, order[b]))
               for r, b in enumerate(placement.policy_bundles)]
        self._policy = PolicyGroup(W.WorkerGroup("policy", pol))
        self.policy.describe()
        master = self.policy.master_address()
        with self.timer("policy_setup"):
            self.coords = self.policy.setup(master, self.total_optimizer_steps())
        log.info("Megatron policy up in %.1f s (%d ranks, dp=%d)", self.timer.drain()["timing/policy_setup_s"],
                 len(pol), self.coords[0].dp_size)
        self.log_memory_line("policy_started", self.coords[0].memory)

    def check_replay_layers(self, recorded: list[int] | None) -> None:
        """Routing replay pairs vLLM's routes with the trainer's routers by decoder layer: both must see the
        same MoE layers (the routes' M axis, ascending)."""
        trainer = self.policy.router_replay_layers()
        if not recorded or any(t != recorded for t in trainer):
            raise RuntimeError(f"training.router_replay: vLLM records routes for decoder layers {recorded}, the "
                               f"trainer's MoE routers sit at layers {trainer[0] if trainer else []}; they must be "
                               "the same layers (turn training.router_replay.enabled off for this model)")
        log.info("routing replay: routes of %d MoE layers (%s) replayed in the trainer", len(recorded), recorded)

    def load_tokenizer(self) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415

        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.tokenizer,
                                                       trust_remote_code=self.cfg.model.trust_remote_code)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def total_optimizer_steps(self) -> int:
        import math  # noqa: PLC0415

        n = self.cfg.grpo.prompts_per_step * self.cfg.grpo.generations_per_prompt
        return self.cfg.grpo.max_steps * max(1, math.ceil(n / max(1, self.cfg.training.global_batch_size)))

    # ================================================================== logging helpers

    def open_logs(self, start_step: int) -> None:
        self._metrics = MetricsLogger.from_config(self.cfg.logging, total_steps=self.cfg.grpo.max_steps,
                                                  start_step=start_step)

    def log_memory_line(self, phase: str, memory: Memory) -> None:
        log.info("memory %s: free %.2f GiB, used %.2f GiB", phase, memory.free_gib, memory.used_gib)
        rec = CalibrationRecord.from_memory(phase, memory.as_dict(), step=0, sleep_level=self.cfg.refit.sleep_level,
                                 enforce_eager=self.cfg.generation.enforce_eager, gpu_type=self.cfg.cluster.gpu_type,
                                 versions=self.versions, worker="rank0")
        self.calibration.write(rec.to_dict())

    def log_calibration(self, step: int, phase: str, memory: Memory | None = None, extra: dict | None = None) -> None:
        if memory is None:
            memory = self.policy.memory()
        rec = CalibrationRecord.from_memory(phase, memory.as_dict(), step=step, sleep_level=self.cfg.refit.sleep_level,
                                 enforce_eager=self.cfg.generation.enforce_eager, gpu_type=self.cfg.cluster.gpu_type,
                                 versions=self.versions, worker="rank0", extra=extra)
        self.calibration.write(rec.to_dict())

    def sample_memory(self, phase: str, memory: Memory | None = None) -> None:
        """GPU 0's free/used GiB at the end of a phase, into the step's metrics."""
        if memory is None:
            memory = self.policy.memory()
        self.step_metrics[memory_metric_key(phase, "free_gib")] = memory.free_gib
        self.step_metrics[memory_metric_key(phase, "used_gib")] = memory.used_gib

    def _should_save(self, step: int) -> bool:
        from rlc.runtime.checkpoint import should_save  # noqa: PLC0415

        return should_save(self.cfg.checkpointing.every_steps, step, self.cfg.grpo.max_steps)

    def gather_output(self, results: list) -> Any:
        """Concatenate the output ranks' tensors in data-parallel order."""
        import torch  # noqa: PLC0415

        parts = sorted(((c.dp_rank, r) for c, r in zip(self.coords, results) if c.is_output), key=lambda x: x[0])
        return torch.cat([r for _, r in parts], dim=0)

    def _put(self, obj: Any) -> Any:
        import ray  # noqa: PLC0415

        return ray.put(obj)

    def shutdown(self) -> None:
        groups = [g.group for g in (self._generation, self._policy) if g is not None]
        if groups:
            from rlc.runtime.workers import stop_groups  # noqa: PLC0415

            late = stop_groups(groups)
            if late:
                log.warning("killed workers that were still busy at shutdown: %s", ", ".join(late))
        if self._metrics is not None:
            self._metrics.close()
        for handle in (self.calibration, self.ranks_log, self.verify_log):
            handle.close()
        try:
            import ray  # noqa: PLC0415

            if ray.is_initialized():
                ray.shutdown()
        except Exception:
            pass


def merge_train_metrics(results: list[dict]) -> dict[str, float]:
    """Combine the output ranks' ``train_step`` results (pure; CPU-tested).

    ``loss/*`` are shares of the global mean (summed over ranks); other per-token metrics are
    token-weighted means; ``ratio_max`` is a max; grad norm and lr are the same on every rank.
    """
    if not results:
        return {}
    out: dict[str, float] = {}
    tokens = sum(r["num_tokens"] for r in results)
    for r in results:
        for k, v in r["loss_sums"].items():
            out[k] = out.get(k, 0.0) + v
    keys = {k for r in results for k in r["weighted_sums"]}
    for k in keys:
        out[k] = sum(r["weighted_sums"].get(k, 0.0) for r in results) / max(tokens, 1.0)
    for r in results:
        for k, v in r["maxes"].items():
            out[k] = max(out.get(k, float("-inf")), v)
    out["num_tokens"] = tokens
    out["grad_norm"] = results[0]["grad_norm"]
    out["lr"] = results[0]["lr"]
    out["optimizer_steps"] = results[0]["optimizer_steps"]
    return out


def exit_code_for(exc: BaseException) -> int:
    """The process exit code of a run that stopped with ``exc``."""
    from rlc.runtime.grpo.loss import GenKLExceeded  # noqa: PLC0415  (torch: the runtime has it)
    from rlc.runtime.workers import WorkerFailure  # noqa: PLC0415

    if isinstance(exc, WorkerFailure):
        return EXIT_WORKER_FAILED
    if isinstance(exc, GenKLExceeded):
        return EXIT_GEN_KL
    return EXIT_RUN_FAILED


def stop_report(exc: BaseException) -> str:
    """The report that ends a failed run's log (what ``rlc doctor`` reads first)."""
    return f"\nrlc.runtime: run stopped ({type(exc).__name__}):\n{exc}\n"


def main(cfg_path: str, overrides: list[str] | None = None) -> int:
    """Run GRPO as ``runtime.yaml`` says (``overrides``: dotted ``key=value`` applied on top of it);
    returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    from rlc.contract.runtime_config import RuntimeConfigError  # noqa: PLC0415
    from rlc.runtime.overrides import load_with_overrides  # noqa: PLC0415

    try:
        cfg, changed = load_with_overrides(cfg_path, overrides or [])
    except RuntimeConfigError as exc:
        print(f"rlc.runtime: {cfg_path}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        print(f"rlc.runtime: cannot read {cfg_path}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in changed:
        log.warning("runtime.yaml overridden at start: %s", line)
    os.environ.update({str(k): str(v) for k, v in cfg.env.items()})
    run = GrpoRun(cfg, cfg_path)
    try:
        return run.run()
    except Exception as exc:  # every failure ends with one clear report, then the traceback in the log
        log.exception("run failed")
        print(stop_report(exc), file=sys.stderr)
        return exit_code_for(exc)
    finally:
        run.shutdown()
