"""The calls the driver makes per step through the generation backends and the weight synchronizer (CPU).

The driver runs its own phase code (rollout, release, logprobs, train, refit) over fake worker groups that
record every remote call and answer as the real workers do; only Ray is replaced. One test per backend
pins the order:

* vLLM: what the driver did before the weight synchronizer existed (refit offload, wake the weights, IPC
  send/receive, wake the KV cache, reset the prefix cache; generate, sleep at ``refit.sleep_level``); with
  ``refit.keep_weights_awake`` no weight wake-up, and only the KV cache sleeps;
* Megatron shared: refit offload then ``mg_sync`` (nothing moves), generate on the policy workers, release
  before the logprob pass;
* Megatron dedicated: the same, with ``refit.offload_params_for_generation`` around the rollout and the
  swap's bit-exact check on the refits ``refit.verify_every`` asks for.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlc.contract.runtime_config import (MegatronGenerationConfig, load_runtime_config, runtime_config_from_dict,
                                         runtime_config_to_dict)
from rlc.runtime import workers as W
from rlc.runtime.driver import GrpoRun
from rlc.runtime.generation.backend import MegatronBackend, VllmBackend
from rlc.runtime.metrics import PhaseTimer
from rlc.runtime.refit.verify import RefitVerifyError
from rlc.runtime.weight_sync import MegatronInProcessSync, VllmIpcSync, make_weight_sync
from rlc.runtime.worker_api import (Generated, MegatronSynced, Memory, Offloaded, ParamsMoved, RankCoords, RefitSent,
                                    Sample, Slept, TrainBatch, TrainStepResult, Woke)
from rlc.runtime.worker_groups import GenerationGroup, PolicyGroup

ROOT = Path(__file__).resolve().parents[2]
MEM = Memory(free_gib=100.0, used_gib=40.0, total_gib=140.0)
EOS = 2


# --------------------------------------------------------------------------- fakes (Ray replaced, answers real)


class _Remote:
    def __init__(self, actor: _Actor, method: str) -> None:
        self.actor, self.method = actor, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor.answer(self.method, args)


class _Actor:
    """A Ray actor handle whose method calls are answered at once (the answer is the "object ref")."""

    def __init__(self, role: str, rank: int, log: list[tuple[str, Any]], answers: dict[str, Any]) -> None:
        self.role, self.rank, self.log, self.answers = role, rank, log, answers

    def __getattr__(self, method: str) -> _Remote:
        if method.startswith("__"):
            raise AttributeError(method)
        return _Remote(self, method)

    def answer(self, method: str, args: tuple) -> Any:
        if method != "memory":
            self.log.append((f"{self.role}.{method}", args[0] if len(args) == 1 and method in ("wake_up", "sleep")
                             else None))
        fn = self.answers[method]
        return fn(self.rank, *args) if callable(fn) else fn


def fake_group(role: str, log: list[tuple[str, Any]], answers: dict[str, Any], ranks: int = 1) -> W.WorkerGroup[Any]:
    """The runtime's own ``WorkerGroup`` over actors that answer as the real workers do."""
    return W.WorkerGroup(role, [_Actor(role, r, log, answers) for r in range(ranks)])


@pytest.fixture(autouse=True)
def _answers_are_the_refs(monkeypatch):
    monkeypatch.setattr(W, "wait_all", lambda pending, what: [p.ref for p in pending])


def _samples(prompts: list[list[int]], n: int) -> Generated:
    """What a generating worker returns: ``n`` samples of the answer digit then EOS, with logprobs."""
    sample = Sample(token_ids=[5, EOS], logprobs=[-0.3, -0.3], text="1", finish_reason="stop")
    return Generated(samples=[[sample for _ in range(n)] for _ in prompts], seconds=0.01, memory=MEM)


def _policy_answers(log_verify: list[bool]) -> dict[str, Any]:
    def logprobs(rank: int, batch: TrainBatch) -> torch.Tensor:
        return torch.full((batch.tokens.shape[0], batch.tokens.shape[1] - 1), -0.3)

    def mg_sync(rank: int, step: int, verify: bool) -> MegatronSynced:
        log_verify.append(verify)
        report = None
        if verify:
            report = {"params_compared": 3, "bytes_compared": 96, "fp32_params": ["decoder.router.expert_bias"],
                      "mismatches": [], "not_loaded": [], "bit_exact": True}
        return MegatronSynced(kind="megatron-swap", seconds=0.01, bytes=96, num_tensors=3, memory=MEM, step=step,
                              verify=report)

    moved = ParamsMoved(bytes=1 << 20, seconds=0.01, memory=MEM)
    return {
        "memory": MEM,
        "refit_offload": Offloaded(synced_params=True, offloaded=True, seconds=0.01, memory=MEM),
        "compute_logprobs": logprobs,
        "train_step": lambda rank, batch, step: TrainStepResult(
            loss_sums={"loss/total": 0.1}, weighted_sums={}, maxes={}, num_tokens=8.0, grad_norm=1.0, lr=1e-4,
            optimizer_steps=1, train_s=0.01),
        "offload_params": moved, "onload_params": moved,
        "mg_sync": mg_sync,
        "mg_generate": lambda rank, prompts, n: _samples(prompts, n),
        "mg_release": Slept(freed_gib=1.0, memory=MEM, seconds=0.01),
        "refit_send": RefitSent.of({"bytes": 96, "gbps": 1.0, "num_buckets": 1, "num_tensors": 3, "half_bytes": 64,
                                    "free_before_bytes": 1 << 30, "min_free_bytes": 1 << 30}),
    }


def _generation_answers(woken: list[list[str]]) -> dict[str, Any]:
    def wake_up(rank: int, tags: list[str]) -> Woke:
        woken.append(list(tags))
        return Woke(memory=MEM, tags=tags)

    return {
        "generate": lambda rank, prompts, n: _samples(prompts, n),
        "sleep": Slept(freed_gib=1.0, memory=MEM),
        "sleep_kv_cache": Slept(freed_gib=0.5, memory=MEM),
        "stay_awake": Slept(freed_gib=0.0, memory=MEM),
        "wake_up": wake_up,
        "reset_prefix_cache": True,
        "refit_receive": [{}],
    }


class _Cursor:
    def next_batch(self, n: int) -> list:
        return [SimpleNamespace(prompt=f"{i % 10}+1=", answer=str((i % 10 + 1) % 10)) for i in range(n)]


class _Scorer:
    def score(self, prompts: list, completions: list, answers: list) -> list[float]:
        return [float(i % 2) for i in range(len(prompts))]  # mixed rewards: non-zero advantages

    def take_metrics(self) -> dict:
        return {}


class FakeRun(GrpoRun):
    """The driver with fake workers: ``run()`` and every phase are the driver's own code."""

    def __init__(self, cfg: Any, log: list, verify_calls: list[bool]) -> None:
        super().__init__(cfg)
        self.call_log = log
        self.woken: list[list[str]] = []  # the tags of every generation.wake_up, in order
        self.policy_answers = _policy_answers(verify_calls)
        policy = PolicyGroup(fake_group("policy", log, self.policy_answers))
        self._policy = policy
        self.coords = [RankCoords(rank=0, dp_rank=0, dp_size=1, tp_rank=0, pp_rank=0, cp_rank=0, is_last_stage=True,
                                  is_output=True, memory=MEM)]
        self.cursor = _Cursor()  # type: ignore[assignment]
        self.scorer = _Scorer()  # type: ignore[assignment]
        if cfg.generation.backend == "megatron":
            self.backend = MegatronBackend(policy)
        else:
            self._generation = GenerationGroup(fake_group("generation", log, _generation_answers(self.woken)))
            self.backend = VllmBackend(self.generation, cfg.refit)
        self.weight_sync = make_weight_sync(cfg, policy, self._generation, self.session, self.timer)
        self.steps: list[list[str]] = []  # the remote calls of the initial refit, then of each step
        self.logged: list[dict[str, Any]] = []  # each step's metrics

    # the setup that needs Ray, the Hub and a folder of checkpoints is done above
    def start_workers(self) -> None:
        pass

    def resume(self) -> int:
        return 0

    def open_logs(self, start_step: int) -> None:
        run = self

        class Metrics:
            def log(self, step: int, metrics: dict) -> None:
                run.logged.append(dict(metrics))
                run.steps.append([m for m, _ in run.call_log])
                run.call_log.clear()

        self._metrics = Metrics()  # type: ignore[assignment]

    def refit(self, step: int) -> Any:
        done = super().refit(step)
        if step == 0:  # the initial refit: its calls are a list of their own
            self.steps.append([m for m, _ in self.call_log])
            self.call_log.clear()
        return done

    def encode(self, text: str) -> list[int]:
        return [1] + [4 + int(c) if c.isdigit() else 3 for c in text]

    def _put(self, obj: Any) -> Any:
        return obj


def _cfg(tmp_path: Path, backend: str, **megatron: Any) -> Any:
    cfg = load_runtime_config(ROOT / "tests" / "gpu" / "tiny_runtime.yaml")
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, prompts_per_step=4, generations_per_prompt=2),
                              logging=dataclasses.replace(cfg.logging, dir=str(tmp_path / "logs")),
                              checkpointing=dataclasses.replace(cfg.checkpointing, enabled=False))
    if backend == "megatron":
        mcfg = MegatronGenerationConfig(mode=megatron.pop("mode", "shared"), transformer_impl="transformer_engine",
                                        kv_cache="recompute", block_size_tokens=64, max_tokens=None,
                                        max_requests=None, refit_backend="nccl", reset_router_num_groups=False,
                                        router_dtype="auto", mamba_ssm_states_dtype="auto",
                                        mamba_conv_states_dtype="auto")
        cfg = dataclasses.replace(cfg, generation=dataclasses.replace(
            cfg.generation, backend="megatron", megatron=mcfg, kv_cache_memory_bytes=1 << 26))
    refit = megatron.pop("refit", {})
    if refit:
        cfg = dataclasses.replace(cfg, refit=dataclasses.replace(cfg.refit, **refit))
    return runtime_config_from_dict(runtime_config_to_dict(cfg))  # what a runtime.yaml would load into


def _steps(run: FakeRun, steps: int = 2) -> list[list[str]]:
    """The driver's own ``run()`` for ``steps`` steps: the calls of the initial refit and of each step."""
    run.cfg = dataclasses.replace(run.cfg, grpo=dataclasses.replace(run.cfg.grpo, max_steps=steps))
    run.run()
    return run.steps


def test_vllm_refit_and_step_order_are_unchanged(tmp_path):
    log: list = []
    run = FakeRun(_cfg(tmp_path, "vllm"), log, [])
    assert isinstance(run.weight_sync, VllmIpcSync)
    refit = ["policy.refit_offload", "generation.wake_up", "policy.refit_send", "generation.refit_receive",
             "generation.wake_up", "generation.reset_prefix_cache"]
    initial, step1, step2 = _steps(run)
    assert initial == refit
    assert step1 == step2 == ["generation.generate", "generation.sleep", "policy.compute_logprobs",
                              "policy.train_step", *refit]
    assert run.refits_done == 3
    assert run.woken == [["weights"], ["kv_cache"]] * 3
    last = run.logged[-1]
    assert last["refit/sleep_level"] == 2 and last["refit/weights_awake"] == 0
    assert last["refit/bytes"] == 96 and "timing/vllm_generate_s" in last
    assert last["reward/mean"] == 0.5 and last["loss/total"] == 0.1 and last["memory/after_wake/free_gib"] == 100.0


@pytest.mark.parametrize("refit, release", [
    ({"keep_weights_awake": True, "sleep_level": 1}, "generation.sleep_kv_cache"),  # only the KV cache sleeps
    ({"keep_weights_awake": True, "keep_kv_cache_awake": True, "sleep_level": 1}, "generation.stay_awake"),  # nothing
], ids=["kv-cache-sleeps", "nothing-sleeps"])
def test_vllm_weights_kept_awake_are_never_woken_and_the_prefix_cache_is_reset_after_every_refit(tmp_path, refit,
                                                                                               release):
    log: list = []
    run = FakeRun(_cfg(tmp_path, "vllm", refit=refit), log, [])
    refit_calls = ["policy.refit_offload", "policy.refit_send", "generation.refit_receive", "generation.wake_up",
                   "generation.reset_prefix_cache"]
    initial, step1, step2 = _steps(run)
    assert initial == refit_calls
    assert step1 == step2 == ["generation.generate", release, "policy.compute_logprobs", "policy.train_step",
                              *refit_calls]
    assert run.woken == [["kv_cache"]] * 3  # the initial refit and two steps: the weights never slept
    releases = {"generation.sleep", "generation.sleep_kv_cache", "generation.stay_awake"}
    assert {m for calls in run.steps for m in calls if m in releases} == {release}
    last = run.logged[-1]
    assert last["refit/weights_awake"] == 1 and "timing/wake_weights_s" not in last and "timing/wake_kv_s" in last


def test_the_vllm_workers_direct_copies_reach_the_run_metrics(tmp_path):
    run = FakeRun(_cfg(tmp_path, "vllm", refit={"replay_load": True, "fused_transfer": True}), [], [])
    report = {"fused": {"direct_tensors": 96}, "replay": {"direct_tensors": 531, "loader_tensors": 2}}
    run._generation.group.actors[0].answers["refit_receive"] = [report, report]  # one engine, two workers
    _steps(run)
    last = run.logged[-1]
    assert (last["refit/fused_direct_tensors"], last["refit/replayed_tensors"], last["refit/replay_loader_tensors"]) \
        == (192, 1062, 4)
    plain = FakeRun(_cfg(tmp_path / "plain", "vllm"), [], [])
    _steps(plain)
    assert "refit/replayed_tensors" not in plain.logged[-1]


def _verify_report(**extra: Any) -> dict[str, Any]:
    return {"params_compared": 3, "bytes_compared": 96, "fp32_params": [], "mismatches": [], "not_loaded": [],
            "unchecked": [], "bit_exact": True, **extra}


def test_vllm_checks_a_refit_with_the_export_and_the_reference_load_running_at_once(tmp_path, monkeypatch):
    """``refit.verify_every`` on vLLM: the trainer ranks write their export in shards while the vLLM workers read
    them (both submitted before either is waited for), into a folder of that refit's own."""
    waits: list[list[str]] = []

    def wait_all(pending: list, what: str) -> list:
        waits.append([p.group.role for p in pending])
        return [p.ref for p in pending]

    monkeypatch.setattr(W, "wait_all", wait_all)
    run = FakeRun(_cfg(tmp_path, "vllm", refit={"verify_every": 2}), [], [])
    dirs: list[tuple[str, str]] = []
    run.policy_answers["refit_dump_export"] = lambda rank, d: (dirs.append(("policy", d)), None)[1]
    run._generation.group.actors[0].answers["refit_verify"] = lambda rank, d: (dirs.append(("generation", d)),
                                                                              [_verify_report()])[1]
    initial, step1, step2 = _steps(run)
    check = ["policy.refit_dump_export", "generation.refit_verify"]
    assert initial[-2:] == check and step2[-2:] == check and not set(check) & set(step1)  # refits 0 and 2
    assert ["policy", "generation"] in waits  # one wait for both sides
    assert [d for _, d in dirs[:2]] == [dirs[0][1]] * 2 and dirs[0][1] != dirs[2][1]
    assert run.logged[-1]["refit/verify_mismatches"] == 0


def test_vllm_check_that_could_not_compare_a_parameter_stops_the_run(tmp_path):
    run = FakeRun(_cfg(tmp_path, "vllm", refit={"verify_every": 1}), [], [])
    run.policy_answers["refit_dump_export"] = None
    unchecked = "model.layers.3.mlp.experts.w13_weight"
    run._generation.group.actors[0].answers["refit_verify"] = [_verify_report(unchecked=[unchecked],
                                                                              bit_exact=False)]
    with pytest.raises(RefitVerifyError) as info:
        run.refit(0)
    assert unchecked in str(info.value) and "not compared" in str(info.value)
    assert "writes a layer's tensors into another layer's parameters" in str(info.value)


def test_megatron_shared_moves_nothing_and_releases_before_the_logprob_pass(tmp_path):
    log: list = []
    verify: list[bool] = []
    run = FakeRun(_cfg(tmp_path, "megatron", refit={"verify_every": 1}), log, verify)
    assert isinstance(run.weight_sync, MegatronInProcessSync) and run.weight_sync.kind == "megatron-shared"
    initial, step1, step2 = _steps(run)
    refit = ["policy.refit_offload", "policy.mg_sync"]
    assert initial == refit
    assert step1 == step2 == ["policy.mg_generate", "policy.mg_release", "policy.compute_logprobs",
                              "policy.train_step", *refit]
    assert verify == [False, False, False]  # nothing to compare in shared mode: the engine reads the trainer's tensors
    last = run.logged[-1]
    assert last["refit/megatron_swap"] == 0.0
    assert "timing/megatron_generate_s" in last and "timing/vllm_generate_s" not in last


def test_megatron_dedicated_swaps_every_refit_and_checks_it_when_asked(tmp_path):
    log: list = []
    verify: list[bool] = []
    cfg = _cfg(tmp_path, "megatron", mode="dedicated",
               refit={"verify_every": 2, "offload_params_for_generation": True})
    run = FakeRun(cfg, log, verify)
    assert run.weight_sync.kind == "megatron-swap"
    initial, step1, step2 = _steps(run)
    refit = ["policy.refit_offload", "policy.mg_sync"]
    assert initial == refit
    assert step1 == step2 == ["policy.offload_params", "policy.mg_generate", "policy.mg_release",
                              "policy.onload_params", "policy.compute_logprobs", "policy.train_step", *refit]
    assert verify == [True, False, True]  # refits 0 and 2 of verify_every 2
    run.record.close()
    verified = [line for line in (Path(cfg.logging.dir) / "refit_verify.jsonl").read_text().splitlines()]
    assert len(verified) == 2 and '"bit_exact": true' in verified[0]
    last = run.logged[-1]
    assert last["refit/bytes"] == 96 and last["refit/megatron_swap"] == 1.0 and last["refit/verify_mismatches"] == 0


def test_a_swap_that_is_not_bit_exact_stops_the_run_naming_the_tensor(tmp_path):
    log: list = []
    cfg = _cfg(tmp_path, "megatron", mode="dedicated", refit={"verify_every": 1})
    run = FakeRun(cfg, log, [])
    bias = {"name": "decoder.layers.1.mlp.router.expert_bias", "dtype": "float32", "shape": [8],
            "elements_differing": 8, "max_abs_diff": 0.01, "rounded_to_bf16": True, "mantissa_bits_lost": 16}
    run.policy_answers["mg_sync"] = lambda rank, step, verify: MegatronSynced(
        kind="megatron-swap", seconds=0.01, bytes=96, num_tensors=3, memory=MEM, step=step,
        verify={"params_compared": 3, "bytes_compared": 96, "fp32_params": [bias["name"]], "mismatches": [bias],
                "not_loaded": [], "bit_exact": False})
    with pytest.raises(RefitVerifyError) as info:
        run.refit(0)
    assert "decoder.layers.1.mlp.router.expert_bias" in str(info.value) and "16 mantissa bits" in str(info.value)
    assert run.refits_done == 0
    run.record.close()  # the report that stopped the run is on file
    assert "expert_bias" in (Path(cfg.logging.dir) / "refit_verify.jsonl").read_text()


def test_a_runtime_yaml_compiled_for_vllm_cannot_start_the_megatron_sync(tmp_path):
    cfg = _cfg(tmp_path, "vllm")
    cfg = dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, backend="megatron"))
    policy = PolicyGroup(fake_group("policy", [], {}))
    with pytest.raises(ValueError, match="generation.megatron"):
        make_weight_sync(cfg, policy, None, "session", PhaseTimer())
