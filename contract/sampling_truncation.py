"""The truncation of the sampling distribution (``generation.sampling`` min-p, top-k, top-p): one reading of the
recipe's values for the rollout engine's logprob mode, the trainer's logprobs and the compiler. Pure Python.

The rollout engine samples from the distribution left after the temperature and these cuts, and reports the sampled
token's logprob under it; the trainer scores the same token under the same cuts of its own logits, so the policy
ratio and the importance weights compare two logprobs of one distribution (NeMo-RL does the same:
``apply_top_k_top_p`` in its training logprobs).
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Truncation:
    """The cuts applied after the temperature, in vLLM's order: min-p, then top-k, then top-p (over what top-k kept).

    ``top_k`` 0 = off (the recipe's -1), ``top_p`` 1.0 = off, ``min_p`` 0.0 = off."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @classmethod
    def of(cls, sampling: Any) -> "Truncation":
        """The truncation of a ``generation.sampling`` section (the recipe's or the runtime config's)."""
        top_k = int(sampling.top_k) if sampling.top_k and int(sampling.top_k) > 0 else 0
        top_p = float(sampling.top_p) if float(sampling.top_p) < 1.0 else 1.0
        min_p = float(getattr(sampling, "min_p", 0.0) or 0.0)
        return cls(top_k=top_k, top_p=top_p, min_p=min_p if min_p > 0 else 0.0)

    @property
    def active(self) -> bool:
        """Whether any cut applies (else the trainer scores the full distribution, as before)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def describe(self) -> str:
        """``min_p 0.05, top_k 50, top_p 0.9`` (the cuts that apply), or ``none``."""
        parts = [f"min_p {self.min_p:g}"] * (self.min_p > 0) + [f"top_k {self.top_k}"] * (self.top_k > 0) \
            + [f"top_p {self.top_p:g}"] * (self.top_p < 1.0)
        return ", ".join(parts) or "none"


__all__ = ["Truncation"]
