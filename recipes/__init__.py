"""Data package: recipes shipped with rlc."""
from pathlib import Path

#: The folder of the shipped recipes (plain files of the installed package).
FOLDER = Path(__file__).parent
