"""Dynamic sampling: fill each step with groups whose rewards differ.

A group whose rewards are all equal (all right or all wrong) has zero advantage and teaches nothing.
With ``grpo.dynamic_sampling.enabled`` the driver generates batches of
``ceil(grpo.prompts_per_step * batch_multiplier)`` prompts, keeps the groups with non-zero reward
std, and stops as soon as ``grpo.prompts_per_step`` groups are kept (the surplus of the last batch is
dropped: it would be reused off-policy otherwise). If ``max_gen_batches`` batches do not fill the
step, ``DynamicSamplingExhausted`` says how far it got, the measured hit rate, and which setting to
change to what.

Disabled, the first batch (``prompts_per_step`` prompts) is the step's batch, as generated.

Use::

    sampler = DynamicSampler.from_config(cfg.grpo)
    sampler.start_step(step)
    while not sampler.full:
        prompts = data.next_batch(sampler.prompts_per_batch)
        groups, rewards = generate_and_score(prompts)   # rewards: [len(prompts), G]
        sampler.add_batch(groups, rewards)              # logs a line; raises when exhausted
    groups, rewards = sampler.take()                    # exactly prompts_per_step groups
    metrics.update(sampler.metrics())

or ``sampler.collect(step, generate_batch)`` with ``generate_batch(num_prompts) -> (groups, rewards)``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rlc.contract.runtime_config import GrpoConfig

T = TypeVar("T")

log = logging.getLogger("rlc.runtime.grpo.dynamic_sampling")

#: Safety factor applied to the suggested settings: the hit rate varies from step to step.
SUGGESTION_MARGIN = 1.25


class DynamicSamplingExhausted(RuntimeError):
    """``max_gen_batches`` generation batches did not fill the step with groups that carry signal."""


@dataclass(frozen=True)
class BatchStats:
    """Bookkeeping of one generation batch."""

    step: int
    batch: int  # 1-based index within the step
    generated_groups: int
    kept_groups: int  # groups with non-zero reward std in this batch
    cumulative_kept: int  # kept so far this step (before truncation to the target)
    target: int

    @property
    def hit_rate(self) -> float:
        """Fraction of this batch's groups that had differing rewards."""
        return self.kept_groups / self.generated_groups if self.generated_groups else 0.0

    @property
    def fill(self) -> float:
        """Fraction of the step's target filled so far (can exceed 1 before truncation)."""
        return self.cumulative_kept / self.target if self.target else 1.0


@dataclass
class _StepState(Generic[T]):
    step: int
    groups: list[T] = field(default_factory=list)
    rewards: list[list[float]] = field(default_factory=list)
    batches: list[BatchStats] = field(default_factory=list)
    generated: int = 0
    with_signal: int = 0  # groups with non-zero reward std seen this step (kept or surplus)
    # constant reward value -> number of discarded groups that had it (all-0 = too hard, all-1 = too easy)
    discarded_by_value: Counter = field(default_factory=Counter)


def _rows(rewards: Any) -> list[list[float]]:
    if hasattr(rewards, "tolist"):
        rewards = rewards.tolist()
    return [[float(x) for x in row] for row in rewards]


class DynamicSampler(Generic[T]):
    """Accumulates generation batches into one step's batch; see the module docstring."""

    def __init__(
        self,
        *,
        prompts_per_step: int,
        enabled: bool,
        max_gen_batches: int,
        batch_multiplier: float,
        logger: Callable[[str], None] | None = None,
    ) -> None:
        if prompts_per_step < 1:
            raise ValueError(f"grpo.prompts_per_step must be >= 1, got {prompts_per_step}")
        if enabled:
            if max_gen_batches < 1:
                raise ValueError(f"grpo.dynamic_sampling.max_gen_batches must be >= 1, got {max_gen_batches}")
            if not batch_multiplier > 0:
                raise ValueError(f"grpo.dynamic_sampling.batch_multiplier must be > 0, got {batch_multiplier}")
        self.prompts_per_step = prompts_per_step
        self.enabled = enabled
        self.max_gen_batches = max_gen_batches if enabled else 1
        self.batch_multiplier = batch_multiplier if enabled else 1.0
        self._log = logger or log.info
        self._state: _StepState[T] | None = None

    @classmethod
    def from_config(cls, grpo: GrpoConfig, logger: Callable[[str], None] | None = None) -> DynamicSampler[T]:
        """Build from a ``GrpoConfig`` (``grpo`` section of ``runtime.yaml``)."""
        ds = grpo.dynamic_sampling
        return cls(
            prompts_per_step=grpo.prompts_per_step,
            enabled=ds.enabled,
            max_gen_batches=ds.max_gen_batches,
            batch_multiplier=ds.batch_multiplier,
            logger=logger,
        )

    # ------------------------------------------------------------------ state

    @property
    def prompts_per_batch(self) -> int:
        """How many prompts to generate for in each batch."""
        if not self.enabled:
            return self.prompts_per_step
        return max(1, math.ceil(self.prompts_per_step * self.batch_multiplier - 1e-9))

    def start_step(self, step: int) -> None:
        """Forget the previous step's groups and start filling ``step``."""
        self._state = _StepState(step=step)

    def _require_state(self) -> _StepState[T]:
        if self._state is None:
            raise RuntimeError("DynamicSampler: call start_step(step) first")
        return self._state

    @property
    def full(self) -> bool:
        """The step has its ``prompts_per_step`` groups."""
        st = self._require_state()
        if not self.enabled:
            return bool(st.batches)
        return len(st.groups) >= self.prompts_per_step

    @property
    def batches(self) -> list[BatchStats]:
        return list(self._require_state().batches)

    # ------------------------------------------------------------------ filling

    def add_batch(self, groups: Sequence[T], rewards: Any) -> BatchStats:
        """Add one generation batch: ``groups[i]`` is any payload whose rewards are ``rewards[i]``.

        Logs one line. Raises ``DynamicSamplingExhausted`` when this was the last allowed batch and the
        step is still not full.
        """
        st = self._require_state()
        rows = _rows(rewards)
        if len(rows) != len(groups):
            raise ValueError(f"add_batch: {len(groups)} groups but {len(rows)} reward rows")
        if self.full:
            raise RuntimeError("add_batch: the step is already full; call take()")
        with_signal = 0
        for payload, row in zip(groups, rows, strict=True):
            has_signal = any(x != row[0] for x in row)
            with_signal += has_signal
            if self.enabled and not has_signal:
                st.discarded_by_value[row[0] if row else 0.0] += 1
                continue
            st.groups.append(payload)
            st.rewards.append(row)
        st.with_signal += with_signal
        st.generated += len(rows)
        stats = BatchStats(
            step=st.step,
            batch=len(st.batches) + 1,
            generated_groups=len(rows),
            kept_groups=with_signal,
            cumulative_kept=len(st.groups),
            target=self.prompts_per_step,
        )
        st.batches.append(stats)
        self._log(self._batch_line(stats))
        if self.enabled and not self.full and stats.batch >= self.max_gen_batches:
            raise DynamicSamplingExhausted(self.exhausted_message())
        return stats

    def take(self) -> tuple[list[T], list[list[float]]]:
        """The step's groups and their rewards: exactly ``prompts_per_step`` when enabled."""
        st = self._require_state()
        if not self.full:
            raise RuntimeError(
                f"take: step {st.step} has {len(st.groups)}/{self.prompts_per_step} groups; keep adding batches"
            )
        if not self.enabled:
            return list(st.groups), [list(r) for r in st.rewards]
        n = self.prompts_per_step
        return list(st.groups[:n]), [list(r) for r in st.rewards[:n]]

    def collect(
        self, step: int, generate_batch: Callable[[int], tuple[Sequence[T], Any]]
    ) -> tuple[list[T], list[list[float]]]:
        """Run a whole step: call ``generate_batch(num_prompts)`` until full, then ``take()``."""
        self.start_step(step)
        while not self.full:
            groups, rewards = generate_batch(self.prompts_per_batch)
            self.add_batch(groups, rewards)
        return self.take()

    # ------------------------------------------------------------------ reporting

    def cumulative_hit_rate(self) -> float:
        st = self._require_state()
        return st.with_signal / st.generated if st.generated else 0.0

    def batches_needed(self, hit_rate: float | None = None) -> int | None:
        """Batches that fill the step at ``hit_rate`` (default: measured); None when it is 0."""
        h = self.cumulative_hit_rate() if hit_rate is None else hit_rate
        if h <= 0:
            return None
        return math.ceil(self.prompts_per_step / (h * self.prompts_per_batch) - 1e-9)

    def _batch_line(self, s: BatchStats) -> str:
        if not self.enabled:
            return (
                f"[dynamic-sampling] step {s.step}: off; {s.generated_groups} groups, "
                f"{s.kept_groups} with differing rewards ({s.hit_rate:.1%})"
            )
        target = self.prompts_per_step
        line = (
            f"[dynamic-sampling] step {s.step} batch {s.batch}/{self.max_gen_batches}: kept "
            f"{s.kept_groups}/{s.generated_groups} groups (hit rate {s.hit_rate:.1%}, cumulative "
            f"{self.cumulative_hit_rate():.1%}); filled {min(s.cumulative_kept, target)}/{target} "
            f"({min(s.fill, 1.0):.0%})"
        )
        if s.cumulative_kept < target:
            need = self.batches_needed()
            if need is None:
                line += "; no group with differing rewards yet"
            else:
                line += f"; projected {need} batches"
                if need > self.max_gen_batches:
                    line += f" > max_gen_batches={self.max_gen_batches} (will be exhausted unless the hit rate rises)"
        return line

    def exhausted_message(self) -> str:
        """The report raised with ``DynamicSamplingExhausted``: fill, hit rate, levers, suggestions."""
        st = self._require_state()
        target, per_batch, k = self.prompts_per_step, self.prompts_per_batch, self.max_gen_batches
        h = self.cumulative_hit_rate()
        lines = [
            f"dynamic sampling exhausted at step {st.step}: {len(st.batches)} generation batches "
            f"(grpo.dynamic_sampling.max_gen_batches={k}) of {per_batch} prompts kept {len(st.groups)}/{target} "
            f"groups with differing rewards (fill {len(st.groups) / target:.0%}).",
            f"Measured hit rate: {h:.1%} ({st.with_signal} of {st.generated} generated groups had non-zero reward std; "
            "per batch: " + ", ".join(f"{b.kept_groups}/{b.generated_groups}" for b in st.batches) + ").",
        ]
        if st.discarded_by_value:
            top = ", ".join(
                f"{n} all-{v:g}" for v, n in sorted(st.discarded_by_value.items(), key=lambda kv: -kv[1])[:4]
            )
            lines.append(f"Discarded groups (every generation got the same reward): {top}.")
        if h <= 0:
            lines.append(
                "No group had differing rewards: check that reward.function scores this data (e.g. the "
                "answer format it expects) and that sampling is not greedy (generation.sampling.temperature "
                "> 0); dynamic sampling cannot help until some groups differ."
            )
            return "\n".join(lines)
        need = self.batches_needed()
        assert need is not None
        margin = SUGGESTION_MARGIN
        suggest_batches = max(k + 1, math.ceil(need * margin))
        # kept per batch = h * ceil(P * m); filling P within k batches needs m >= 1 / (h * k)
        suggest_mult = max(self.batch_multiplier, math.ceil(margin / (h * k) * 10) / 10)
        lines += [
            f"At this hit rate filling {target} groups with batches of {per_batch} prompts takes ~{need} batches. "
            "Levers (suggested values include a x" + f"{margin:g} margin because the rate varies by step):",
            f"  - grpo.dynamic_sampling.max_gen_batches: {k} -> {suggest_batches}",
            f"  - grpo.dynamic_sampling.batch_multiplier: {self.batch_multiplier:g} -> {suggest_mult:g} "
            f"(larger generation batches, same max_gen_batches)",
            f"  - grpo.prompts_per_step: {target} sets both the target and the batch size "
            f"(= prompts_per_step x batch_multiplier), so lowering it alone does not help; it only shortens "
            "each batch",
            "  - grpo.generations_per_prompt: more generations per prompt make a mixed group more likely",
            "  - or pick data that suits the policy: mostly all-0 groups mean too hard, all-1 too easy.",
        ]
        return "\n".join(lines)

    def metrics(self) -> dict[str, float | int]:
        """Scalar telemetry of the current step, for the metrics log."""
        st = self._require_state()
        kept_in_step = min(len(st.groups), self.prompts_per_step) if self.enabled else len(st.groups)
        return {
            "dynamic_sampling/num_gen_batches": len(st.batches),
            "dynamic_sampling/generated_groups": st.generated,
            "dynamic_sampling/groups_with_signal": st.with_signal,
            "dynamic_sampling/hit_rate": self.cumulative_hit_rate(),
            "dynamic_sampling/discarded_zero_std_groups": sum(st.discarded_by_value.values()),
            "dynamic_sampling/discarded_surplus_groups": len(st.groups) - kept_in_step,
        }
