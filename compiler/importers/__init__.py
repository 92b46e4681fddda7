"""Importers: turn another framework's configuration into an rlc recipe (``rlc import``)."""
