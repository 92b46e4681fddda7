"""Verdicts of the GPU proofs: measured values against thresholds stated here (pure Python).

Each function takes what a GPU script measured and returns ``(passed, reasons)``; ``reasons`` names
every threshold that was missed, with the numbers. The GPU scripts call these and exit non-zero when
``passed`` is False; ``tests/gpu/test_verdicts.py`` checks them on CPU with passing and failing
evidence, so a verdict cannot silently pass without its numbers.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

# --------------------------------------------------------------------------- vLLM sleep calibration

#: sleep(1) drops the KV cache, which is most of vLLM's budget (gpu_memory_utilization x GPU memory)
#: on a small model: it must free at least this fraction of the budget.
SLEEP1_MIN_FREED_FRACTION = 0.5
#: sleep(2) drops the weights too, so it never frees less than sleep(1); allocator noise allowance.
SLEEP2_NOISE_GIB = 0.25


def calibration_verdict(records: Sequence[dict], *, gpu_memory_utilization: float) -> tuple[bool, list[str]]:
    """The six sleep-calibration records (enforce_eager on/off x start, sleep 1, sleep 2), checked."""
    reasons: list[str] = []
    by_key = {}
    for r in records:
        key = (bool(r.get("enforce_eager")), r.get("phase"), int(r.get("sleep_level", -1)))
        by_key[key] = r
        free, total = r.get("free_gib"), r.get("total_gib")
        if not (isinstance(free, (int, float)) and isinstance(total, (int, float)) and math.isfinite(free)
                and 0 < free <= total):
            reasons.append(f"record {key}: free_gib {free} not in (0, total_gib {total}]")
    for eager in (True, False):
        start = by_key.get((eager, "vllm_started", 0))
        s1, s2 = by_key.get((eager, "refit_free", 1)), by_key.get((eager, "refit_free", 2))
        if start is None or s1 is None or s2 is None:
            reasons.append(f"enforce_eager={eager}: missing records (need vllm_started, refit_free at sleep 1 and 2)")
            continue
        if reasons:
            continue
        budget = gpu_memory_utilization * float(start["total_gib"])
        freed1 = float(s1["free_gib"]) - float(start["free_gib"])
        if not freed1 >= SLEEP1_MIN_FREED_FRACTION * budget:
            reasons.append(f"enforce_eager={eager}: sleep(1) freed {freed1:.2f} GiB < "
                           f"{SLEEP1_MIN_FREED_FRACTION} x budget {budget:.2f} GiB")
        if not float(s2["free_gib"]) >= float(s1["free_gib"]) - SLEEP2_NOISE_GIB:
            reasons.append(f"enforce_eager={eager}: free after sleep(2) {s2['free_gib']:.2f} GiB < after sleep(1) "
                           f"{s1['free_gib']:.2f} GiB - {SLEEP2_NOISE_GIB}")
    if len(records) != 6:
        reasons.append(f"{len(records)} records, expected 6")
    return not reasons, reasons


# --------------------------------------------------------------------------- foreign refit metadata

#: The consumer's manifest check raises this class with one of these messages on foreign metadata.
MANIFEST_ERROR = "RefitManifestError"
MANIFEST_MESSAGES = ("carries slicing metadata from producer rank", "did not announce at prepare")


def foreign_metadata_caught(errors: Sequence[dict]) -> tuple[bool, list[str]]:
    """Legacy (rank-0) slicing metadata on two GPUs: a consumer must stop with the manifest error.

    ``errors``: ``{"who": "consumer1", "type": exception class name, "error": message}`` per failed
    task. Any other exception (a crash, a timeout) is not the manifest check catching the fault.
    """
    caught = [e for e in errors if str(e.get("who", "")).startswith("consumer") and e.get("type") == MANIFEST_ERROR
              and any(m in str(e.get("error", "")) for m in MANIFEST_MESSAGES)]
    if caught:
        return True, []
    seen = ", ".join(f"{e.get('who')}: {e.get('type')}: {str(e.get('error', ''))[:120]}" for e in errors) or "none"
    return False, [f"no consumer raised {MANIFEST_ERROR} ({' / '.join(MANIFEST_MESSAGES)}); errors seen: {seen}"]


# --------------------------------------------------------------------------- GRPO restart

#: The toy task's chance reward is 0.1 (a digit mod 10); the trained policy is at >= 0.8. A restart
#: that resumed its checkpoint stays well above chance: at least this mean reward over its steps.
RESUME_MIN_REWARD = 0.5


def resume_verdict(rc: int | None, steps_after: Sequence[int], rewards_after: Sequence[float], *,
                   steps: int, resume_steps: int) -> tuple[bool, list[str]]:
    """The restart exits 0, logs exactly the steps after the checkpoint, and does not start from chance."""
    reasons = []
    if rc != 0:
        reasons.append(f"restart exit code {rc}, expected 0")
    expected = list(range(steps + 1, steps + resume_steps + 1))
    if list(steps_after) != expected:
        reasons.append(f"restart logged steps {list(steps_after)}, expected {expected} (resumed after step {steps})")
    mean = sum(rewards_after) / len(rewards_after) if rewards_after else float("nan")
    if not mean >= RESUME_MIN_REWARD:
        reasons.append(f"restart mean reward {mean:.3f} < {RESUME_MIN_REWARD} (chance is 0.1: it did not resume)")
    return not reasons, reasons


# --------------------------------------------------------------------------- free memory at refit

#: How far the measured free memory at refit may be from the plan's prediction: the calibration's
#: CUDA-graph uncertainty (vllm_cuda_graph_uncertainty_gib, 5.0 GiB), the largest stated error term.
FREE_AT_REFIT_TOLERANCE_GIB = 5.0


def free_at_refit_verdict(measured_gib: float | None, plan_gib: float) -> tuple[bool, list[str]]:
    if measured_gib is None or not math.isfinite(measured_gib):
        return False, ["no free-at-refit measurement"]
    if not plan_gib > 0:
        return False, [f"plan predicts {plan_gib} GiB free at refit"]
    gap = measured_gib - plan_gib
    if not abs(gap) <= FREE_AT_REFIT_TOLERANCE_GIB:
        return False, [f"measured {measured_gib:.2f} GiB vs plan {plan_gib:.2f} GiB: off by {gap:+.2f} GiB "
                       f"(tolerance {FREE_AT_REFIT_TOLERANCE_GIB} GiB)"]
    return True, []


# --------------------------------------------------------------------------- sequence packing vs padding

#: bf16 unit roundoff: 8 significant bits, so one rounding moves a value by at most 2^-8 of it.
BF16_U = 2.0 ** -8
#: The packed and padded passes compute the same function with different kernels (Transformer Engine's
#: varlen ``thd`` attention, GEMMs of other shapes), so in bf16 they differ by rounding, not by math. How
#: far bf16 rounding takes the padded pass from the exact result is measured: ``E``, its difference from
#: the same pass in fp32 on the same (bf16-representable) weights and batch. Two bf16 evaluations that
#: are each within ``E`` of the exact result differ by at most ``2 E``: the tolerance for packed against
#: padded, and for packed against the fp32 result (packing may not add error beyond bf16's own)...
PACKING_TOL_FACTOR = 2.0
#: ...never below the rounding of one bf16 operation (a logprob z_y - logsumexp(z) of bf16 logits |z| ~ 1
#: carries up to 2u; a mean over many tokens u / 4; the loss and the gradients u relative), so that a
#: figure the padded pass happens to get exact does not demand a bound of zero.
PACKING_FLOORS = {"logprob_max_abs": 2 * BF16_U, "logprob_mean_abs": BF16_U / 4, "loss_rel": BF16_U,
                  "grad_rel_l2": BF16_U}
#: The negative control (the packed rows with their sequence boundaries removed, so attention leaks across
#: sequences) must miss the logprob tolerance by at least this factor, or the comparison could not tell a
#: packing bug from rounding.
PACKING_LEAK_MIN = 5.0


def packing_tolerances(padded_error: dict[str, float]) -> dict[str, float]:
    """Each figure's tolerance from the padded bf16 pass's measured error against fp32 (``padded_error``)."""
    return {k: max(PACKING_TOL_FACTOR * float(padded_error[k]), floor) for k, floor in PACKING_FLOORS.items()}


def packing_verdict(padded_error: dict[str, float], packed_vs_padded: dict[str, float],
                    packed_error: dict[str, float] | None = None,
                    leak: dict[str, float] | None = None) -> tuple[bool, list[str]]:
    """Packed against padded, and against the fp32 result, within the tolerances; the leak control far out.

    Each dict holds ``logprob_max_abs`` / ``logprob_mean_abs`` (response tokens), ``loss_rel`` and
    ``grad_rel_l2`` (all parameters): ``padded_error`` the padded bf16 pass against fp32,
    ``packed_vs_padded`` and ``packed_error`` (against fp32) the packed pass, ``leak`` the control
    against padded.
    """
    reasons = []
    tol = packing_tolerances(padded_error)
    for name, got in (("packed vs padded", packed_vs_padded), ("packed vs fp32", packed_error)):
        if got is None:
            continue
        for key, bound in tol.items():
            value = got.get(key)
            if value is None or not float(value) <= bound:  # NaN fails
                reasons.append(f"{name} {key} = {value} > tolerance {bound:.3g} (max({PACKING_TOL_FACTOR:g} x the "
                               f"padded bf16 error {padded_error[key]:.3g}, floor {PACKING_FLOORS[key]:.3g}))")
    if leak is not None:
        need = PACKING_LEAK_MIN * tol["logprob_max_abs"]
        if not float(leak.get("logprob_max_abs", 0.0)) >= need:
            reasons.append(f"negative control: attention leaking across packed sequences moved logprobs by only "
                           f"{leak.get('logprob_max_abs')} < {PACKING_LEAK_MIN:g} x tolerance = {need:.3g}: the "
                           "comparison cannot tell a packing bug from rounding")
    return not reasons, reasons
