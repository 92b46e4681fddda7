"""Data package: the recipe JSON Schema (found with ``importlib.resources``)."""
