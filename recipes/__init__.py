"""Data package: recipes shipped with rlc (found with ``importlib.resources``)."""
