"""The calls the driver makes per step through the generation backends and the weight synchronizer (CPU).

The driver runs its own phase code (rollout, release, logprobs, train, refit) over fake worker groups that
record every remote call and answer as the real workers do; only Ray is replaced. One test per backend
pins the order:

* vLLM: what the driver did before the weight synchronizer existed (refit offload, wake the weights, IPC
  send/receive, wake the KV cache, reset the prefix cache; generate, sleep at ``refit.sleep_level``);
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
from rlc.runtime.driver import GrpoRun
from rlc.runtime.generation.backend import MegatronBackend, VllmBackend
from rlc.runtime.refit.verify import RefitVerifyError
from rlc.runtime.weight_sync import MegatronInProcessSync, VllmIpcSync, make_weight_sync
from rlc.runtime.worker_groups import GenerationGroup, Memory, PolicyGroup, RankCoords
from rlc.runtime.workers import WorkerInfo

ROOT = Path(__file__).resolve().parents[2]
MEM = {"free_gib": 100.0, "used_gib": 40.0, "total_gib": 140.0}
EOS = 2


# --------------------------------------------------------------------------- fakes (Ray replaced, answers real)


class _Remote:
    def __init__(self, group: FakeWorkers, rank: int, method: str) -> None:
        self.group, self.rank, self.method = group, rank, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.group.answer(self.rank, self.method, args)


class _Actor:
    def __init__(self, group: FakeWorkers, rank: int) -> None:
        self.group, self.rank = group, rank

    def __getattr__(self, method: str) -> _Remote:
        return _Remote(self.group, self.rank, method)


class FakeWorkers:
    """A ``WorkerGroup`` whose remote calls are answered at once (the answer is the "object ref")."""

    def __init__(self, role: str, log: list[tuple[str, Any]], answers: dict[str, Any], ranks: int = 1) -> None:
        self.role, self.log, self.answers, self.ranks = role, log, answers, ranks
        self.actors = [_Actor(self, r) for r in range(ranks)]
        self.infos = [WorkerInfo(role, r) for r in range(ranks)]

    def __len__(self) -> int:
        return self.ranks

    def answer(self, rank: int, method: str, args: tuple) -> Any:
        if method != "memory":
            self.log.append((f"{self.role}.{method}", args[0] if len(args) == 1 and method in ("wake_up", "sleep")
                             else None))
        fn = self.answers[method]
        return fn(rank, *args) if callable(fn) else fn

    def submit(self, method: str, *args: Any, ranks: Any = None, per_rank: Any = None, **kwargs: Any) -> list:
        idx = list(range(self.ranks)) if ranks is None else list(ranks)
        return [(i, self.answer(i, method, per_rank(i) if per_rank is not None else args)) for i in idx]

    def wait(self, refs: list, what: str) -> list:
        return [r for _, r in refs]

    def call(self, method: str, *args: Any, ranks: Any = None, **kwargs: Any) -> list:
        return self.wait(self.submit(method, *args, ranks=ranks), method)


def _samples(prompts: list[list[int]], n: int) -> dict:
    """What a generating worker returns: ``n`` samples of the answer digit then EOS, with logprobs."""
    sample = {"token_ids": [5, EOS], "logprobs": [-0.3, -0.3], "text": "1", "finish_reason": "stop"}
    return {"samples": [[dict(sample) for _ in range(n)] for _ in prompts], "seconds": 0.01, "memory": MEM}


def _policy_answers(log_verify: list[bool]) -> dict[str, Any]:
    def logprobs(rank: int, batch: dict) -> torch.Tensor:
        return torch.full((batch["tokens"].shape[0], batch["tokens"].shape[1] - 1), -0.3)

    def mg_sync(rank: int, step: int, verify: bool) -> dict:
        log_verify.append(verify)
        report = None
        if verify:
            report = {"params_compared": 3, "bytes_compared": 96, "fp32_params": ["decoder.router.expert_bias"],
                      "mismatches": [], "not_loaded": [], "bit_exact": True}
        return {"kind": "megatron-swap", "seconds": 0.01, "bytes": 96, "num_tensors": 3, "memory": MEM,
                "verify": report, "step": step}

    moved = {"bytes": 1 << 20, "seconds": 0.01, "memory": MEM}
    return {
        "memory": MEM,
        "refit_offload": {"synced_params": True, "offloaded": True, "seconds": 0.01, "memory": MEM},
        "compute_logprobs": logprobs,
        "train_step": lambda rank, batch, step: {"loss_sums": {"loss/total": 0.1}, "weighted_sums": {},
                                                 "maxes": {}, "num_tokens": 8.0, "grad_norm": 1.0, "lr": 1e-4,
                                                 "optimizer_steps": 1},
        "offload_params": moved, "onload_params": moved,
        "mg_sync": mg_sync,
        "mg_generate": lambda rank, prompts, n: _samples(prompts, n),
        "mg_release": {"seconds": 0.01, "memory": MEM, "freed_gib": 1.0},
        "refit_send": {"bytes": 96, "gbps": 1.0, "num_buckets": 1, "num_tensors": 3, "half_bytes": 64,
                       "free_before_bytes": 1 << 30, "min_free_bytes": 1 << 30},
    }


def _generation_answers() -> dict[str, Any]:
    return {
        "generate": lambda rank, prompts, n: _samples(prompts, n),
        "sleep": {"freed_gib": 1.0, "memory": MEM},
        "wake_up": {"memory": MEM},
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
    """The driver with fake workers: every phase is the driver's own code."""

    def __init__(self, cfg: Any, log: list, verify_calls: list[bool]) -> None:
        super().__init__(cfg)
        policy = PolicyGroup(FakeWorkers("policy", log, _policy_answers(verify_calls)))  # type: ignore[arg-type]
        self._policy = policy
        self.coords = [RankCoords(0, 0, 1, 0, 0, True, True, Memory(**MEM))]
        self.cursor = _Cursor()  # type: ignore[assignment]
        self.scorer = _Scorer()  # type: ignore[assignment]
        if cfg.generation.backend == "megatron":
            self.backend = MegatronBackend(policy)
        else:
            self._generation = GenerationGroup(FakeWorkers("generation", log, _generation_answers()))  # type: ignore[arg-type]
            self.backend = VllmBackend(self.generation, cfg.refit.sleep_level)
        self.weight_sync = make_weight_sync(self)
        self.step_metrics = {}

    def encode(self, text: str) -> list[int]:
        return [1] + [4 + int(c) if c.isdigit() else 3 for c in text]

    def _put(self, obj: Any) -> Any:
        return obj

    def log_calibration(self, *args: Any, **kwargs: Any) -> None:
        pass


def _cfg(tmp_path: Path, backend: str, **megatron: Any) -> Any:
    cfg = load_runtime_config(ROOT / "tests" / "gpu" / "tiny_runtime.yaml")
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, prompts_per_step=4, generations_per_prompt=2),
                              logging=dataclasses.replace(cfg.logging, dir=str(tmp_path / "logs")))
    if backend == "megatron":
        mcfg = MegatronGenerationConfig(mode=megatron.pop("mode", "shared"), transformer_impl="transformer_engine",
                                        kv_cache="recompute", block_size_tokens=64, max_tokens=None,
                                        max_requests=None, refit_backend="nccl", reset_router_num_groups=False)
        cfg = dataclasses.replace(cfg, generation=dataclasses.replace(
            cfg.generation, backend="megatron", megatron=mcfg, kv_cache_memory_bytes=1 << 26))
    refit = megatron.pop("refit", {})
    if refit:
        cfg = dataclasses.replace(cfg, refit=dataclasses.replace(cfg.refit, **refit))
    return runtime_config_from_dict(runtime_config_to_dict(cfg))  # what a runtime.yaml would load into


def _steps(run: FakeRun, log: list, steps: int = 2) -> list[list[str]]:
    """The calls of the initial refit and of each step (methods only)."""
    out = []
    run.refit(0)
    out.append([m for m, _ in log])
    for step in range(1, steps + 1):
        log.clear()
        run.step_metrics = {}
        run.run_step(step)
        out.append([m for m, _ in log])
    return out


def test_vllm_refit_and_step_order_are_unchanged(tmp_path, monkeypatch):
    import rlc.runtime.workers as W

    monkeypatch.setattr(W, "wait_all", lambda pending, what: [r for _, _, r in pending])
    log: list = []
    run = FakeRun(_cfg(tmp_path, "vllm"), log, [])
    assert isinstance(run.weight_sync, VllmIpcSync)
    refit = ["policy.refit_offload", "generation.wake_up", "policy.refit_send", "generation.refit_receive",
             "generation.wake_up", "generation.reset_prefix_cache"]
    initial, step1, step2 = _steps(run, log)
    assert initial == refit
    assert step1 == step2 == ["generation.generate", "generation.sleep", "policy.compute_logprobs",
                              "policy.train_step", *refit]
    assert run.refits_done == 3
    assert run.step_metrics["refit/sleep_level"] == 2 and run.step_metrics["refit/bytes"] == 96
    assert "timing/vllm_generate_s" in run.timer.drain()


def test_megatron_shared_moves_nothing_and_releases_before_the_logprob_pass(tmp_path):
    log: list = []
    verify: list[bool] = []
    run = FakeRun(_cfg(tmp_path, "megatron", refit={"verify_every": 1}), log, verify)
    assert isinstance(run.weight_sync, MegatronInProcessSync) and run.weight_sync.kind == "megatron-shared"
    initial, step1, step2 = _steps(run, log)
    refit = ["policy.refit_offload", "policy.mg_sync"]
    assert initial == refit
    assert step1 == step2 == ["policy.mg_generate", "policy.mg_release", "policy.compute_logprobs",
                              "policy.train_step", *refit]
    assert verify == [False, False, False]  # nothing to compare in shared mode: the engine reads the trainer's tensors
    assert run.step_metrics["refit/megatron_swap"] == 0.0
    timings = run.timer.drain()
    assert "timing/megatron_generate_s" in timings and "timing/vllm_generate_s" not in timings


def test_megatron_dedicated_swaps_every_refit_and_checks_it_when_asked(tmp_path):
    log: list = []
    verify: list[bool] = []
    cfg = _cfg(tmp_path, "megatron", mode="dedicated",
               refit={"verify_every": 2, "offload_params_for_generation": True})
    run = FakeRun(cfg, log, verify)
    assert run.weight_sync.kind == "megatron-swap"
    initial, step1, step2 = _steps(run, log)
    refit = ["policy.refit_offload", "policy.mg_sync"]
    assert initial == refit
    assert step1 == step2 == ["policy.offload_params", "policy.mg_generate", "policy.mg_release",
                              "policy.onload_params", "policy.compute_logprobs", "policy.train_step", *refit]
    assert verify == [True, False, True]  # refits 0 and 2 of verify_every 2
    verified = [line for line in (Path(cfg.logging.dir) / "refit_verify.jsonl").read_text().splitlines()]
    assert len(verified) == 2 and '"bit_exact": true' in verified[0]
    assert run.step_metrics["refit/bytes"] == 96 and run.step_metrics["refit/megatron_swap"] == 1.0


def test_a_swap_that_is_not_bit_exact_stops_the_run_naming_the_tensor(tmp_path):
    log: list = []
    cfg = _cfg(tmp_path, "megatron", mode="dedicated", refit={"verify_every": 1})
    run = FakeRun(cfg, log, [])
    bias = {"name": "decoder.layers.1.mlp.router.expert_bias", "dtype": "float32", "shape": [8],
            "elements_differing": 8, "max_abs_diff": 0.01, "rounded_to_bf16": True, "mantissa_bits_lost": 16}
    answers = run.policy.group.answers  # type: ignore[attr-defined]
    answers["mg_sync"] = lambda rank, step, verify: {
        "kind": "megatron-swap", "seconds": 0.01, "bytes": 96, "num_tensors": 3, "memory": MEM,
        "verify": {"params_compared": 3, "bytes_compared": 96, "fp32_params": [bias["name"]], "mismatches": [bias],
                   "not_loaded": [], "bit_exact": False}}
    with pytest.raises(RefitVerifyError) as info:
        run.refit(0)
    assert "decoder.layers.1.mlp.router.expert_bias" in str(info.value) and "16 mantissa bits" in str(info.value)
    assert run.refits_done == 0


def test_a_runtime_yaml_compiled_for_vllm_cannot_start_the_megatron_sync(tmp_path):
    cfg = _cfg(tmp_path, "vllm")
    cfg = dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, backend="megatron"))
    run = GrpoRun.__new__(GrpoRun)
    run.cfg = cfg
    with pytest.raises(ValueError, match="generation.megatron"):
        make_weight_sync(run)
