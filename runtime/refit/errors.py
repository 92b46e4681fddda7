"""Error types of the refit engine (pure Python, no torch).

Every message names the tensor / rank / GPU involved and the fix, because a refit failure in a
2000-GPU job is read from a log line, not a debugger.
"""
from __future__ import annotations


class RefitError(RuntimeError):
    """Base class of every refit failure."""


class RefitPlanError(RefitError, ValueError):
    """The buffers cannot be sized or a tensor cannot be placed; raised before any byte moves."""


class RefitManifestError(RefitError):
    """Metadata or the set of delivered tensors does not match what this consumer's producer announced.

    This is the check that turns SkyRL #1816 ("correct bytes under the wrong names, no crash") into a
    loud failure.
    """


class RefitProtocolError(RefitError):
    """A message arrived out of order, from the wrong peer, or with the wrong session/refit id."""


class RefitTimeoutError(RefitError, TimeoutError):
    """The peer did not answer within the timeout, or its process is gone."""


class RefitRemoteError(RefitError):
    """The peer reported a failure (its message is included)."""


class RefitLeakError(RefitError):
    """``load_weights`` kept references to views of the refit buffer past its return."""
