"""Given the recipe, re-plan with the log's numbers and say whether the proposed change fits.

Each finding's verdict comes from the compiler itself: the refit math redone at the measured free
memory (:mod:`rlc.compiler.planner.measured`), the memory plan of the recipe with a lever applied,
or the decision the rules make for the recipe's ``auto`` refit switches.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional

from rlc.compiler.doctor.findings import Finding
from rlc.compiler.doctor.model_match import mismatch
from rlc.compiler.doctor.sizes import GIB, gib
from rlc.compiler.planner import plan_memory
from rlc.compiler.planner.measured import free_at_refit_for_stack, refit_at_free
from rlc.compiler.recipe_types import with_value

if TYPE_CHECKING:
    from rlc.compiler.api import CheckResult
    from rlc.compiler.recipe_types import Recipe


def replan(findings: list[Finding], result: CheckResult) -> None:
    """Fill ``replan`` / ``fits`` of each finding from ``result`` (``rlc.compiler.api.CheckResult``)."""
    for f in findings:
        judge = _JUDGES.get(f.pattern)
        recipe = result.recipe
        if result.facts is not None:
            why = next((w for w in (mismatch(m.values, result.facts) for m in f.matches) if w), None)
            if why:
                f.warnings.append(f"the log's model does not match the recipe's: {why}. The log is from another "
                                  "model's job, or the recipe names the wrong model; a re-plan with this recipe says "
                                  "nothing about the log")
                f.replan, f.fits = None, None
                continue
        if judge is None or recipe is None:
            continue
        verdict = judge(f, result, recipe)
        if verdict is not None:
            f.replan, f.fits = verdict


Verdict = Optional[tuple[str, Optional[bool]]]
#: A judge: the finding, the check of the recipe, and its typed recipe (the schema accepted it).
Judge = Callable[[Finding, "CheckResult", "Recipe"], Verdict]


def _window_text(window: Optional[tuple[float, float]]) -> str:
    return f"buffer_memory_ratio {window[0]:.3f}–{window[1]:.3f}" if window else ""


def _refit_verdict(result: CheckResult, recipe: Recipe, free: int, name: str, tensor: int, how: str) -> Verdict:
    m = refit_at_free(recipe, recipe.cluster.gpu, free, name, tensor, result.calibration or None)
    now = ("passes" if m.per_side >= tensor and m.free_at_stack >= tensor else
           "half too small" if m.per_side < tensor else "staging site too small")
    head = (f"re-planned at the log's {gib(free)} free at refit ({how}) for {name} ({gib(tensor)}): the recipe's "
            f"{m.buffer_source} gives halves of {gib(m.per_side)} and leaves {gib(m.free_at_stack)} at the staging "
            f"site: {now}")
    if m.per_side >= tensor and m.free_at_stack >= tensor:
        return head + "; the recipe as written fits at this free memory", True
    if m.ratio_window:
        return head + f"; {_window_text(m.ratio_window)} fits both checks at this free memory", True
    levers = [fx.text for fx in (result.plan.fixes if result.plan is not None else []) if fx.sufficient]
    tail = ("; no buffer_memory_ratio fits at this free memory: free memory first"
            + (f" (planned: {'; or '.join(levers[:2])})" if levers else " (a larger generation EP, "
                                                          "generation.enforce_eager: true)"))
    return head + tail, False


def _judge_buffer(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
    v = f.values
    tensor, half = v["tensor_bytes"], v["half_bytes"]
    name = v.get("name") or "the largest tensor"
    if "free_bytes" in v:
        return _refit_verdict(result, recipe, v["free_bytes"], name, tensor, "from the log")
    refit = recipe.refit
    ratio = refit.buffer_memory_ratio
    if refit.buffer_gb is not None or not ratio:
        return (f"the log's half is {gib(half)}; the tensor needs {gib(tensor)}: a buffer_gb of at least "
                f"{2 * tensor / GIB:.2f} GiB (both halves)", None)
    free = int(2 * half / ratio)
    return _refit_verdict(result, recipe, free, name, tensor, f"= 2 × half {gib(half)} / ratio {ratio:g}")


def _judge_stack(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
    v = f.values
    if "ask_bytes" not in v or "free_bytes" not in v or result.plan is None or result.plan.refit is None:
        return None
    tensor = v["ask_bytes"]
    name = (
        result.plan.refit.largest_name if abs(result.plan.refit.largest - tensor) < GIB // 8 else "the stacked tensor"
    )
    gpu_bytes = int(result.plan.gpu_memory_gib * GIB)
    free = free_at_refit_for_stack(recipe, recipe.cluster.gpu, v["free_bytes"], name, tensor,
                                   gpu_bytes, result.calibration or None)
    if free is None:
        return (f"no free memory at refit leads to {gib(v['free_bytes'])} at the staging site with this recipe; "
                "check that the log and the recipe are of the same job", None)
    return _refit_verdict(result, recipe, free, name, tensor, f"inferred from {gib(v['free_bytes'])} free at the stack")


def _judge_residue(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
    used = [m.values["in_use_gib"] for m in f.matches]
    growth = max(used) - used[0]
    plan = result.plan
    if plan is None or plan.refit is None or plan.refit.tolerance_gib is None or result.facts is None:
        return None
    # enforce_eager removes the CUDA-graph residue; the sleep level does not change it (both levels unmap
    # the weights, and the refit wakes them at either level)
    fixed = with_value(recipe, "generation.enforce_eager", True)
    after = plan_memory(fixed, result.facts, result.gpu, calibration=result.calibration or None)
    tol = after.refit.tolerance_gib if after.refit is not None else None
    text = (f"the recipe's refit tolerates {plan.refit.tolerance_gib:.2f} GiB less free memory; the log's residue grew "
            f"{growth:.2f} GiB")
    if tol is None:
        return text + "; with enforce_eager the plan still fails the refit checks", False
    if f.rule == "RLC212" and not recipe.generation.enforce_eager:
        # the growth is the CUDA graphs' own: enforce_eager removes it together with the graphs
        return (text + f"; with generation.enforce_eager: true there are no CUDA graphs to grow and the refit "
                f"tolerates {tol:.2f} GiB (enough)"), True
    fits = tol >= growth
    return (text + f"; with generation.enforce_eager: true it tolerates {tol:.2f} GiB"
            + (" (enough)" if fits else " (not enough: free memory another way)")), fits


def _decision(key: str) -> Judge:
    def judge(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
        value, reason = result.decisions.get(key, (None, ""))
        if value is None:
            errors = [d for d in result.errors if d.path == key]
            if errors:
                return f"the recipe turns {key} off where it is needed: {errors[0].message}", False
            return None
        if value:
            return f"with this recipe rlc turns {key} on ({reason})", True
        return f"with this recipe {key} is off ({reason}); set {key}: on", False
    return judge


_SWITCHES = {"RLC202": "refit.sync_params_before_refit", "RLC203": "refit.per_rank_ipc_metadata",
             "RLC204": "refit.fp32_params"}


def _cause_ruled_out(rule: str, result: CheckResult, recipe: Recipe) -> Optional[bool]:
    """Whether this recipe rules the cause of ``rule`` out (None: cannot tell)."""
    value, _ = result.decisions.get(_SWITCHES[rule], (None, ""))
    if rule == "RLC202":
        training = recipe.training
        overlapped = training.use_distributed_optimizer and training.overlap_param_gather
        return bool(value) or not overlapped
    if rule == "RLC203":
        return value is True if value is not None else None
    return None  # fp32 parameters: the decision lists patterns; a wrong dtype is not visible here


def _judge_mismatch(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
    parts = []
    for rule in (f.rule, *f.candidates):
        if rule not in _SWITCHES:
            continue
        value, _ = result.decisions.get(_SWITCHES[rule], (None, ""))
        shown = "on" if value is True else "off" if value is False else repr(value)
        parts.append(f"{_SWITCHES[rule]}: {shown} ({rule})")
    kl = recipe.grpo.max_gen_kl
    guard = f"grpo.max_gen_kl {kl:g}" + (" (the guard is off: RLC306)" if kl == 0 else "")
    fits = _cause_ruled_out(f.rule, result, recipe) if f.rule in _SWITCHES else None
    return f"this recipe decides {'; '.join(parts)}; {guard}", fits


def _judge_expandable(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
    hits = [d for d in result.errors if d.rule == "RLC301"]
    if hits:
        return f"the recipe still enables it: {hits[0].path}", False
    return "the recipe's cluster.env has no expandable_segments:True", True


def _judge_wake(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
    plan = result.plan
    if plan is None:
        return None
    failing = [c for c in plan.checks.values() if c.id.startswith("generate") and c.ok is False]
    phase = plan.phases.get("generate")
    used = f"{phase.used_gib:.2f} of {phase.limit_gib:.2f} GiB" if phase and phase.used_gib is not None else "unknown"
    if failing:
        return f"the plan of this recipe fails at generation too: {failing[0].text}", False
    return (f"the plan of this recipe uses {used} awake; the wake-up failed above that: compare the log's free memory "
            "with `rlc plan` (vLLM's memory while asleep)", None)


def _judge_ds(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
    v = f.values
    ds = recipe.grpo.dynamic_sampling
    pps = recipe.grpo.prompts_per_step
    if "hit_rate" not in v or not v["hit_rate"]:
        return (f"the recipe allows {ds.max_gen_batches} batches of "
                f"{math.ceil(pps * ds.batch_multiplier)} prompts; the log gives no hit rate to re-plan with",
                None)
    per_batch = max(1, math.ceil(pps * ds.batch_multiplier - 1e-9))
    need = math.ceil(pps / (v["hit_rate"] * per_batch) - 1e-9)
    allowed = ds.max_gen_batches
    fits = ds.enabled and need <= allowed
    return (f"at the log's hit rate {v['hit_rate']:.1%} filling {pps} groups with batches of {per_batch} prompts "
            f"takes {need} batches; the recipe allows {allowed}" + ("" if fits else " (not enough)")), fits


def _judge_worker(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
    r = recipe
    requeue = r.cluster.slurm.requeue
    ckpt = r.checkpointing
    if requeue and ckpt.enabled:
        return (f"the recipe requeues and resumes from the latest checkpoint (every {ckpt.every_steps} "
                "steps)", True)
    return ("the recipe does not resume after a lost node: set cluster.slurm.requeue: true"
            + ("" if ckpt.enabled else " and checkpointing.enabled: true"), False)


def _judge_bucket(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
    """Another framework's refit bucket: would this recipe's refit buffer hold the log's tensor?"""
    v = f.values
    refit = result.plan.refit if result.plan is not None else None
    if refit is None or "tensor_bytes" not in v:
        return None
    tensor = v["tensor_bytes"]
    fits = refit.per_side >= tensor and refit.free_at_stack >= tensor
    return (
        f"this recipe's refit halves are {gib(refit.per_side)} ({refit.buffer_source}) with {gib(refit.free_at_stack)} "
        f"at the staging site; the log's {v.get('name')} needs {gib(tensor)}: "
        + ("both hold it" if fits else "rlc compile stops on RLC210 / RLC211 with the ratio window")
    ), fits


def _judge_network(f: Finding, result: CheckResult, recipe: Recipe) -> Verdict:
    """A network failure: where this recipe's weights travel, and whether the job resumes after a bad node."""
    path = ("refits over CUDA IPC within each node (colocated): the weights never cross the network; the trainer's "
            "own collectives across nodes still use NCCL" if recipe.colocated else
            "sends weights between nodes")
    resume = _judge_worker(f, result, recipe)
    return f"this recipe {path}; {resume[0] if resume else ''}", None


_JUDGES: dict[str, Judge] = {
    "refit-buffer-too-small": _judge_buffer,
    "export-stack-oom": _judge_stack,
    "vllm-sleep-residue": _judge_residue,
    "mtp-duplicate-owner": _decision("refit.dedupe_mtp_embedding"),
    "tensor-delivered-twice": _decision("refit.dedupe_mtp_embedding"),
    "ipc-metadata-mismatch": _decision("refit.per_rank_ipc_metadata"),
    "logprob-mismatch": _judge_mismatch,
    "expandable-segments": _judge_expandable,
    "cumem-wake-oom": _judge_wake,
    "dynamic-sampling-exhausted": _judge_ds,
    "worker-lost": _judge_worker,
    "refit-bucket-too-small": _judge_bucket,
    "weight-sync-network": _judge_network,
    "nccl-network": _judge_network,
}
