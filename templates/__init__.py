"""Data package: the jinja2 templates of a launch bundle."""
from pathlib import Path

#: The bundle's templates (plain files of the installed package, as the recipe schema is).
BUNDLE_TEMPLATES = Path(__file__).with_name("bundle")
