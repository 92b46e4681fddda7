"""The GRPO driver: ``python -m rlc.runtime runtime.yaml``.

The same code runs a 1-GPU toy and a 32-node job: it joins Ray, reserves one bundle per GPU, puts a
Megatron policy worker and a vLLM generation worker on every GPU (with ``generation.backend: megatron`` the
policy worker hosts megatron-core's engine itself), and runs GRPO as :meth:`GrpoRun.run` spells it out: each
step generates with the engines, scores and normalises the rewards, trains the policy on the samples and moves
the new weights into the engines. Every phase returns a result (``rlc.runtime.recorder``); one recorder turns
them into the step's metrics and the calibration and refit records.

Failures end the run with a report: a worker that dies names itself, its node and GPU; a gen-KL
above ``grpo.max_gen_kl`` explains the likely causes; exhausted dynamic sampling says what to change.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlc.contract.runtime_config import RuntimeConfig, RuntimeConfigError, runtime_config_to_dict
from rlc.contract.sampling_truncation import Truncation
from rlc.contract.sequence_packing import padded_row_multiple
from rlc.runtime import checkpoint as ckpt
from rlc.runtime import workers as W
from rlc.runtime.generation.backend import GenerationBackend, MegatronBackend, VllmBackend
from rlc.runtime.generation.reshard_plan import prompt_chunks
from rlc.runtime.generation.vllm_worker import VllmGenerationWorker
from rlc.runtime.grpo.data import PromptCursor, load_prompts_from_config
from rlc.runtime.grpo.dynamic_sampling import DynamicSampler
from rlc.runtime.grpo.chat_prompt import PromptEncoder
from rlc.runtime.grpo.reward_shaping import scale_rewards, shape_rewards
from rlc.runtime.grpo.rewards import RewardScorer, make_reward_fn
from rlc.runtime.metrics import MetricsLogger, PhaseTimer
from rlc.runtime.overrides import load_with_overrides
from rlc.runtime.recorder import (Group, Packed, ParamsOffloaded, ParamsOnloaded, Recorder, Refitted, Released,
                                  Rollout, Scored, Trained)
from rlc.runtime.termination import EXIT_TERMINATED, TerminationWatch
from rlc.runtime.weight_sync import WeightSync, make_weight_sync
from rlc.runtime.worker_api import RankCoords, ReplayCheck, TrainBatch
from rlc.runtime.worker_groups import GenerationGroup, PolicyGroup
from rlc.runtime.workers import WorkerFailure

if TYPE_CHECKING:
    from rlc.runtime.grpo.data import PromptSample

log = logging.getLogger("rlc.runtime.driver")

#: Exit codes (rlc's own: 0 ok, 1 the input is refused, 2 usage or I/O, 3 a bug in rlc; then the run's stops).
EXIT_OK, EXIT_CONFIG, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_WORKER_FAILED, EXIT_GEN_KL, EXIT_RUN_FAILED = 4, 5, 6


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
        self.record = Recorder(cfg)  # the phases' results -> metrics, calibration and refit records
        self.termination = TerminationWatch()  # SIGTERM stops the run cleanly (rlc.runtime.termination)
        self.refits_done = 0
        self.checkpoint_failures = 0  # in a row; three stop the run
        self.coords: list[RankCoords] = []  # each trainer rank's place in the layout (start_workers)
        self.eos_token_id: int | None = None
        self.pad_id = 0
        # Set by start_workers(), before any phase runs:
        self.tokenizer: Any
        self.prompt_encoder: PromptEncoder
        self.scorer: RewardScorer
        self.cursor: PromptCursor
        self.pg: Any  # the Ray placement group
        self.backend: GenerationBackend  # generates and releases (vLLM engines, or the policy workers' engines)
        self.weight_sync: WeightSync  # every refit goes through it

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
        """GRPO with the trainer and the engines on the same GPUs (the phases below, each a method)."""
        from rlc.runtime.grpo.advantages import group_advantages  # noqa: PLC0415 - torch: the module imports none

        cfg, g, record = self.cfg, self.cfg.grpo, self.record
        self.start_workers()
        start_step = self.resume()
        self.open_logs(start_step)
        record.begin_step(start_step)
        self.refit(start_step)  # the engines get the trainer's weights (a fresh start or the checkpoint's)
        self.timer.drain()  # the initial refit is not part of step 1
        record.calibrate(start_step, "after_initial_refit", self.policy.memory())
        for step in range(start_step + 1, g.max_steps + 1):
            record.begin_step(step)
            with self.timer("step"):
                record.add(self.offload_trainer_params())  # refit.offload_params_for_generation: to host memory
                rollout = record.add(self.rollout(step))  # prompts -> n generations each -> rewards
                record.add(self.release_generation(step))  # the engines give their memory to the trainer
                record.add(self.onload_trainer_params())
                advantages = group_advantages(  # baseline on the shaped rewards; with dynamic sampling the
                    rollout.shaped_rewards, leave_one_out=g.leave_one_out, normalize=g.normalize_advantages,
                    spread=rollout.rewards if g.dynamic_sampling.enabled else None)  # spread before the shaping
                packed = record.add(self.pack(rollout, advantages.tolist()))
                scored = record.add(self.trainer_logprobs(step, packed.batch))  # old (+ reference) logprobs
                self.check_gen_kl(step, scored)  # the engines sampled from the weights being trained
                record.add(self.train(step, scored.batch))  # clipped GRPO loss, optimizer step(s)
                self.refit(step)  # the new weights into the engines (rlc.runtime.weight_sync)
            self.metrics.log(step, record.end_step(self.timer.drain()))
            if cfg.checkpointing.enabled and self._should_save(step):
                self.checkpoint(step)
        return EXIT_OK

    # ================================================================== phases

    def rollout(self, step: int) -> Rollout:
        """Prompts -> generations -> rewards, with dynamic sampling (groups whose rewards all agree carry no
        signal: more prompts are generated until the step has enough, as ``grpo.dynamic_sampling`` says)."""
        sampler: DynamicSampler[Group] = DynamicSampler.from_config(self.cfg.grpo, logger=log.info)
        gen_tokens = 0

        def generate_batch(num_prompts: int) -> tuple[list[Group], list[list[float]]]:
            nonlocal gen_tokens
            groups = self.generate(self.cursor.next_batch(num_prompts))
            gen_tokens += sum(len(s.token_ids) for grp in groups for s in grp.generations)
            return groups, [grp.rewards for grp in groups]

        with self.timer("generate"):
            groups, _ = sampler.collect(step, generate_batch)
        return Rollout(groups=groups, generated_tokens=gen_tokens,
                       generate_seconds=self.timer.seconds(self.backend.timer),
                       scorer_metrics=self.scorer.take_metrics(), sampling_metrics=sampler.metrics(),
                       memory=self.policy.memory())

    def generate(self, prompts: list[PromptSample]) -> list[Group]:
        """Split prompts over the engines; score each generation with the reward function."""
        n = self.cfg.grpo.generations_per_prompt
        ids = [self.encode(p.prompt) for p in prompts]
        chunks = [(e, ids[a:b]) for e, (a, b) in enumerate(prompt_chunks(len(ids), self.backend.engines))]
        with self.timer(self.backend.timer):
            results = self.backend.generate([(e, c) for e, c in chunks if c], n)
        samples = [s for r in results for s in r.samples]
        groups = []
        g, max_tokens = self.cfg.grpo, self.cfg.generation.sampling.max_tokens
        for prompt, pids, gens in zip(prompts, ids, samples):
            rewards = scale_rewards(self.scorer.score([prompt.prompt] * len(gens), [s.text for s in gens],
                                                      [prompt.answer] * len(gens)), g.reward_scaling)
            shaped = shape_rewards(rewards, [len(s.token_ids) for s in gens], [s.finish_reason for s in gens],
                                   g.reward_shaping, max_tokens)
            groups.append(Group(prompt, pids, gens, rewards, shaped))
        return groups

    def release_generation(self, step: int) -> Released:
        """The engines release their memory for the trainer (vLLM: refit.sleep_level; Megatron: the engine
        suspends, its KV pool as generation.megatron.kv_cache says)."""
        with self.timer("sleep"):
            slept = self.backend.release(step)
        return Released(step, slept)

    def offload_trainer_params(self) -> ParamsOffloaded | None:
        """``refit.offload_params_for_generation``: the trainer's bf16 parameters to host memory while vLLM
        generates (the weights are in vLLM since the refit)."""
        if not self.cfg.refit.offload_params_for_generation:
            return None
        with self.timer("params_offload"):
            return ParamsOffloaded(self.policy.offload_params())

    def onload_trainer_params(self) -> ParamsOnloaded | None:
        """The parameters back on the GPU before the trainer's logprob pass (vLLM is asleep)."""
        if not self.cfg.refit.offload_params_for_generation:
            return None
        with self.timer("params_onload"):
            return ParamsOnloaded(self.policy.onload_params())

    def pack(self, rollout: Rollout, advantages: list[list[float]]) -> Packed:
        """The kept groups' samples with their advantages as the trainer's batch (padded; with routing replay,
        vLLM's routes, and the response tokens no route was recorded for left out of the loss)."""
        from rlc.runtime.policy.batches import pack_rollouts  # noqa: PLC0415 - torch: the module imports none

        replay = self.cfg.training.router_replay.enabled
        prompt_ids, resp_ids, gen_lps, flat_advantages, routes = [], [], [], [], []
        for grp, adv in zip(rollout.groups, advantages):
            for sample, a in zip(grp.generations, adv):
                prompt_ids.append(grp.prompt_ids)
                resp_ids.append(sample.token_ids)
                gen_lps.append(sample.logprobs)
                flat_advantages.append(a)
                routes.append(sample.routed_experts)
        tp = self.cfg.train_parallel
        batch = pack_rollouts(prompt_ids, resp_ids, gen_lps, flat_advantages, pad_id=self.pad_id,
                              pad_to_multiple=padded_row_multiple(tp.tp, tp.cp),
                              max_length=self.cfg.training.max_sequence_length,
                              routes=routes if replay else None, num_experts=self.cfg.model.num_experts)
        unrouted = sum(len(r) for r in resp_ids) - float(batch.mask.sum()) if replay else None
        return Packed(batch, unrouted)

    def trainer_logprobs(self, step: int, batch: TrainBatch) -> Scored:
        """The trainer's logprobs of the batch (and the reference policy's, with a KL penalty) and how far they
        are from the engine's (gen-KL)."""
        from rlc.runtime.grpo.loss import gen_kl_metrics  # noqa: PLC0415 - torch: the module imports none

        with self.timer("logprobs"):
            old = self.gather_output(self.policy.compute_logprobs(self._put(batch)))
            batch = dataclasses.replace(batch, old_logprobs=old)
            if self.cfg.loss.kl_penalty > 0:
                batch = dataclasses.replace(
                    batch, ref_logprobs=self.gather_output(self.policy.compute_ref_logprobs(self._put(batch))))
        replay = self.check_router_replay(step) if self.cfg.training.router_replay.enabled else None
        truncated = Truncation.of(self.cfg.generation.sampling).active  # both sides scored under the engine's cuts
        return Scored(batch, gen_kl_metrics(batch.gen_logprobs, old, batch.mask, truncated=truncated), replay,
                      self.policy.memory())

    def check_gen_kl(self, step: int, scored: Scored) -> None:
        """``grpo.max_gen_kl``: the engines sampled from other weights than the trainer's; the step's metrics are
        logged, then the run stops with the likely causes."""
        from rlc.runtime.grpo.loss import GenKLExceeded, check_gen_kl  # noqa: PLC0415 - torch

        try:
            check_gen_kl(scored.kl["gen_kl"], step=step, threshold=self.cfg.grpo.max_gen_kl, detail=scored.kl)
        except GenKLExceeded:
            self.metrics.log(step, self.record.end_step(self.timer.drain()))  # the step that stopped the run
            raise

    def check_router_replay(self, step: int) -> ReplayCheck:
        """``training.router_replay``: in the logprob passes every decoder router must have routed every token to
        the experts vLLM recorded for it; a difference means the replay was bypassed, and the run stops."""
        check = self.policy.router_replay_check()
        if check.routes_mismatched or check.layers_unarmed:
            raise RuntimeError(f"routing replay at step {step}: {check.routes_mismatched} of {check.routes_checked} "
                               f"(token, MoE layer) routings differ from vLLM's recorded experts and "
                               f"{check.layers_unarmed} router calls found no route armed: the trainer is not "
                               "replaying vLLM's routing (is a fused router on in training.megatron_kwargs?)")
        return check

    def train(self, step: int, batch: TrainBatch) -> Trained:
        """Optimizer step(s) on the batch."""
        with self.timer("train"):
            results = self.policy.train_step(self._put(batch), step)
        return Trained(results, float(batch.mask.sum()), self.timer.seconds("train"), self.policy.memory())

    def refit(self, step: int) -> Refitted:
        """Trainer weights -> the engines, through the weight synchronizer (``rlc.runtime.weight_sync``); every
        ``refit.verify_every``-th refit is checked bit for bit, and a difference stops the run once recorded."""
        every = self.cfg.refit.verify_every
        done = self.weight_sync.sync(step, verify=bool(every) and self.refits_done % every == 0)
        done = self.record.add(dataclasses.replace(done, number=self.refits_done + 1))
        self.weight_sync.check(done)
        self.refits_done += 1
        return done

    def checkpoint(self, step: int) -> None:
        """Policy shards (megatron-core dist checkpoint) + driver state (step, data cursor).

        A failed save leaves the previous checkpoint as the latest and training goes on; three
        failures in a row stop the run (a requeue would otherwise lose ever more work).
        """
        root = self.cfg.checkpointing.dir
        try:
            with self.timer("checkpoint"):
                folder = ckpt.begin(root, step)
                self.policy.save_checkpoint(str(Path(folder) / "policy"))
                ckpt.save(root, step, {"step": step, "cursor": self.cursor.state_dict(), "session": self.session,
                                       ckpt.EXPERIMENT_STATE_KEY: ckpt.experiment(self.cfg)},
                          keep_last=self.cfg.checkpointing.keep_last)
        except Exception as exc:  # noqa: BLE001 - any failure to save: training goes on from the previous checkpoint
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
        cfg = self.cfg
        self.record.versions = W.library_versions()  # the driver runs in the workers' container
        self.load_tokenizer()
        self.scorer = RewardScorer(make_reward_fn(cfg.reward.function, cfg.reward.kwargs),
                                   failure_reward=cfg.reward.failure_reward, warn=log.warning)
        prompts = load_prompts_from_config(
            cfg.data, count_tokens=lambda s: len(self.encode(s)), on_filtered=log.warning
        )
        self.cursor = PromptCursor(prompts, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle)
        placement = W.plan_placement(cfg)
        env = W.worker_env(cfg)
        log.info("%s", W.connect(cfg.cluster.ray, env))
        self.termination.install()  # after Ray's own SIGTERM handler, which would exit with status 1
        pg, order = W.reserve_gpus(placement)
        self.pg = pg
        if cfg.generation.backend == "megatron":
            self._start_policy(placement, env, order)
            megatron = MegatronBackend(self.policy)
            self.backend = megatron
            started = megatron.start()
            self.eos_token_id = started.eos_token_id
            log.info("Megatron inference engines up in %.1f s", started.seconds)
            self.record.started("megatron_engine_started", started.memory)
        else:
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
            vllm = VllmBackend(self.generation, cfg.refit)
            self.backend = vllm
            started = vllm.start()
            self.eos_token_id = started.eos_token_id
            log.info("vLLM engines up in %.1f s", started.seconds)
            self.record.started("vllm_started", started.memory)
            vllm.sleep_after_start()
            self._start_policy(placement, env, order)
            if cfg.training.router_replay.enabled:
                self.check_replay_layers(started.moe_layers)
        self.weight_sync = make_weight_sync(cfg, self.policy, self._generation, self.session, self.timer)
        self.weight_sync.prepare()

    def _start_policy(self, placement: W.Placement, env: dict[str, str], order: list[int]) -> None:
        """The Megatron ranks: spawn, NCCL and model setup."""
        from rlc.runtime.policy.megatron_worker import MegatronPolicyWorker  # noqa: PLC0415 - torch

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
        log.info("Megatron policy up in %.1f s (%d ranks, dp=%d; %d objects of rank 0's heap frozen out of the "
                 "garbage collector's walks)", self.timer.drain()["timing/policy_setup_s"], len(pol),
                 self.coords[0].dp_size, self.coords[0].gc_frozen_objects)
        self.record.started("policy_started", self.coords[0].memory)

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
        self.prompt_encoder = PromptEncoder(self.tokenizer, self.cfg.data)  # data.chat_template checked here

    def encode(self, text: str) -> list[int]:
        return self.prompt_encoder(text)

    def total_optimizer_steps(self) -> int:
        n = self.cfg.grpo.prompts_per_step * self.cfg.grpo.generations_per_prompt
        return self.cfg.grpo.max_steps * max(1, math.ceil(n / max(1, self.cfg.training.global_batch_size)))

    # ================================================================== helpers

    def open_logs(self, start_step: int) -> None:
        self._metrics = MetricsLogger.from_config(self.cfg.logging, total_steps=self.cfg.grpo.max_steps,
                                                  start_step=start_step)

    def _should_save(self, step: int) -> bool:
        return ckpt.should_save(self.cfg.checkpointing.every_steps, step, self.cfg.grpo.max_steps)

    def gather_output(self, results: list[Any]) -> Any:
        """Concatenate the output ranks' tensors in data-parallel order."""
        import torch  # noqa: PLC0415

        parts = sorted(((c.dp_rank, r) for c, r in zip(self.coords, results) if c.is_output), key=lambda x: x[0])
        return torch.cat([r for _, r in parts], dim=0)

    def _put(self, obj: Any) -> Any:
        """``obj`` in Ray's object store (every worker reads the same copy)."""
        import ray  # noqa: PLC0415

        return ray.put(obj)

    def shutdown(self) -> None:
        groups = [g.group for g in (self._generation, self._policy) if g is not None]
        if groups:
            late = W.stop_groups(groups)
            if late:
                log.warning("killed workers that were still busy at shutdown: %s", ", ".join(late))
        if self._metrics is not None:
            self._metrics.close()
        self.record.close()
        try:
            import ray  # noqa: PLC0415

            if ray.is_initialized():
                ray.shutdown()
        except Exception:  # noqa: BLE001 - shutting down: nothing left to report to
            pass


def exit_code_for(exc: BaseException) -> int:
    """The process exit code of a run that stopped with ``exc``."""
    from rlc.runtime.grpo.loss import GenKLExceeded  # noqa: PLC0415  (torch: the runtime has it)

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
    except KeyboardInterrupt:
        if run.termination.received is None:
            raise  # Ctrl-C: the entry point's 130
        print(run.termination.report(), file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        run.shutdown()
