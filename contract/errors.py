"""The error of a ``runtime.yaml`` this runtime does not read (raised by the contract's loader and file reader)."""


class RuntimeConfigError(ValueError):
    """A ``runtime.yaml`` that does not match this runtime's contract."""
