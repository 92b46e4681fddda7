"""What ``rlc import nemo-rl`` prints, and the atomic write of the recipe file."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rlc.compiler.importers.nemo_rl.recipe_writer import unmapped_lines


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
    active = [u for u in m.unmapped if not u.inactive]
    inactive = [u for u in m.unmapped if u.inactive]
    lines = [f"wrote {out}: {len(m.values)} recipe key(s) from {len(sources)} NeMo-RL key(s) "
             f"({' -> '.join(imported.config.files)})"]
    for note in m.notes:
        lines.append(f"note: {note}")
    if active:
        lines.append(f"not mapped ({len(active)}; also listed at the end of {out}):")
        lines.extend(unmapped_lines(active, imported.config, prefix="  "))
    if inactive:
        lines.append(f"ignored ({len(inactive)}; components this config turns off):")
        lines.extend(unmapped_lines(inactive, imported.config, prefix="  "))
    for missing in imported.still_missing:
        lines.append(f"set {missing.key}: {missing.why}; e.g. --set {missing.example}")
    return "\n".join(lines) + "\n"
