"""The version of the resolved ``runtime.yaml`` contract between compiler and runtime (``version:`` in it)."""

RUNTIME_CONFIG_VERSION = 1
