"""What ``rlc import nemo-rl`` prints, and the atomic write of the recipe file."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rlc.compiler.importers.nemo_rl.recipe_writer import unmapped_lines, unmapped_report


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder (no half-written recipe)."""
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def import_report(imported, out: Path) -> str:  # imported: ImportedRecipe
    """The summary on screen: what was mapped, every key that was not, what is still to set."""
    m = imported.mapping
    sources = {s for v in m.values for s in v.sources}
    lines = [f"wrote {out}: {len(m.values)} recipe key(s) from {len(sources)} NeMo-RL key(s) "
             f"({' -> '.join(imported.config.files)})"]
    for note in m.notes:
        lines.append(f"note: {note}")
    lines.extend(unmapped_report(m, imported.config, prefix="", where=f" (also listed at the end of {out})"))
    for missing in imported.still_missing:
        lines.append(f"set {missing.key}: {missing.why}; e.g. --set {missing.example}")
    return "\n".join(lines) + "\n"


def stopped_report(stopped, config_path: str) -> str:  # stopped: ImportStopped
    """Why the import wrote nothing: the settings that change the experiment, and the ways on."""
    lines = [f"rlc import nemo-rl: stopped, nothing written: {len(stopped.dropped)} setting(s) of {config_path} change "
             "the experiment and have no rlc equivalent:"]
    lines.extend(unmapped_lines(stopped.dropped, stopped.config, prefix="  "))
    lines.append("Change them in the NeMo-RL config (OVERRIDE arguments, e.g. grpo.reward_shaping.enabled=false), or "
                 "pass --accept-loss to write the recipe without them (it records what was dropped).")
    return "\n".join(lines) + "\n"
