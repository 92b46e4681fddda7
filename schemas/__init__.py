"""Data package: the recipe JSON Schema, generated from the key declarations (``rlc.compiler.declarations``)."""
from pathlib import Path

#: The recipe JSON Schema file (a plain file of the installed package).
RECIPE_SCHEMA = Path(__file__).with_name("recipe.schema.json")
