"""The planner's calibration table (``calibration.yaml``) and the runtime's calibration records.

The table holds every constant the planner does not derive from parameter bytes, keyed by GPU
type and library versions, each with the report line it comes from. :func:`calibration_for` picks
the entry for a GPU (falling back to the first entry, and saying so).

The runtime logs measured memory per phase as JSON lines (``calibration.jsonl``) in the format of
:mod:`rlc.contract.calibration_record`; :func:`parse_record` reads one with the same class the
runtime writes it with.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import yaml

from rlc.compiler.files import read_text_capped
from rlc.compiler.tables import parse_table

from rlc.contract.calibration_record import CalibrationRecord, CalibrationRecordError

CALIBRATION_FILE = Path(__file__).with_name("calibration.yaml")
#: Calibration files written by ``rlc calibrate`` and shipped with rlc (``cluster.calibration: NAME``).
SHIPPED_DIR = Path(__file__).with_name("calibrations")


class CalibrationError(ValueError):
    """A calibration table or record that does not match the documented format."""


@dataclass(frozen=True)
class Calibration:
    """One entry of the table, typed. GiB unless named otherwise."""

    id: str
    gpu: str
    versions: dict[str, str]
    source: str
    megatron_context_gib: float
    megatron_master_params_stay_at_refit: bool
    megatron_refit_residual_gib: float
    megatron_cpu_offload_extra_gib: float
    megatron_engine_context_gib: float
    megatron_train_workspace_gib: float
    vllm_base_gib: float
    vllm_awake_extra_gib: float
    vllm_cuda_graph_gib: float
    vllm_cuda_graph_uncertainty_gib: float
    export_staging_overhead_gib: float
    fragmentation_points: tuple[tuple[float, float], ...]  # (headroom fraction, GiB), sorted
    fragmentation_tensor_gib: float  # the largest tensor the points were measured with
    sources: dict[str, str] = field(default_factory=dict)  # constant -> its source line
    meanings: dict[str, str] = field(default_factory=dict)  # constant -> what it is (``what:``)
    derivations: dict[str, str] = field(default_factory=dict)  # constant -> the arithmetic that gave it (``derived:``)
    reference: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)
    fallback_note: Optional[str] = None  # set when this entry was measured on another GPU

    def fragmentation_gib(self, headroom: float, largest_gib: Optional[float] = None) -> float:
        """Fragmentation for a ping-pong half ``headroom`` (fraction) above the largest tensor.

        The caching allocator's unusable remainders are pieces of the segments the staging site
        allocates (two halves, the gathered pieces, the stacked tensor), all sized like the largest
        tensor; so the measured points scale with it: ``largest_gib / fragmentation_tensor_gib``
        (1 for the tensor they were measured with, or when ``largest_gib`` is not given).
        """
        pts = self.fragmentation_points
        scale = 1.0 if largest_gib is None else largest_gib / self.fragmentation_tensor_gib
        if headroom <= pts[0][0]:
            return pts[0][1] * scale
        if headroom >= pts[-1][0]:
            return pts[-1][1] * scale
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x0 <= headroom <= x1:
                return (y0 + (y1 - y0) * (headroom - x0) / (x1 - x0)) * scale
        return pts[-1][1] * scale


#: Constants of ``generation.backend: megatron``'s plan. A file written before rlc planned that backend has none of
#: them: they are then taken from the shipped table (``calibration.yaml``) and their source says so.
MEGATRON_BACKEND_CONSTANTS = ("megatron_engine_context_gib", "megatron_train_workspace_gib")


def _entry(raw: Mapping[str, Any], fallback: Optional[Calibration] = None) -> Calibration:
    consts = dict(raw["constants"])
    if fallback is not None:
        for key in MEGATRON_BACKEND_CONSTANTS:
            if key not in consts:
                consts[key] = {"value": getattr(fallback, key), "what": fallback.meanings.get(key, ""),
                               "source": f"not in this file: from the shipped entry {fallback.id} "
                                         f"({fallback.sources.get(key, '')})"}

    def value(key: str) -> Any:
        if key not in consts or "value" not in consts[key]:
            raise CalibrationError(f"calibration entry {raw.get('id')}: constant {key} missing")
        return consts[key]["value"]

    points = tuple(sorted((float(p["headroom"]), float(p["gib"])) for p in value("fragmentation_points")))
    if len(points) < 1:
        raise CalibrationError("fragmentation_points needs at least one point")
    return Calibration(
        id=str(raw["id"]),
        gpu=str(raw["gpu"]),
        versions={k: str(v) for k, v in raw.get("versions", {}).items()},
        source=str(raw.get("source", "")),
        megatron_context_gib=float(value("megatron_context_gib")),
        megatron_master_params_stay_at_refit=bool(value("megatron_master_params_stay_at_refit")),
        megatron_refit_residual_gib=float(value("megatron_refit_residual_gib")),
        megatron_cpu_offload_extra_gib=float(value("megatron_cpu_offload_extra_gib")),
        megatron_engine_context_gib=float(value("megatron_engine_context_gib")),
        megatron_train_workspace_gib=float(value("megatron_train_workspace_gib")),
        vllm_base_gib=float(value("vllm_base_gib")),
        vllm_awake_extra_gib=float(value("vllm_awake_extra_gib")),
        vllm_cuda_graph_gib=float(value("vllm_cuda_graph_gib")),
        vllm_cuda_graph_uncertainty_gib=float(value("vllm_cuda_graph_uncertainty_gib")),
        export_staging_overhead_gib=float(value("export_staging_overhead_gib")),
        fragmentation_points=points,
        fragmentation_tensor_gib=float(value("fragmentation_tensor_gib")),
        sources={k: str(v.get("source", "")) for k, v in consts.items() if isinstance(v, dict)},
        meanings={k: str(v.get("what", "")) for k, v in consts.items() if isinstance(v, dict)},
        derivations={k: str(v["derived"]) for k, v in consts.items() if isinstance(v, dict) and "derived" in v},
        reference=dict(raw.get("reference", {})),
        measured=dict(raw.get("measured", {})),
    )


@lru_cache(maxsize=8)
def load_table(path: Optional[str] = None) -> tuple[Calibration, ...]:
    """All entries of a calibration table (the shipped ``calibration.yaml`` unless ``path`` is given).

    A file that is not a table (YAML error, wrong format, a constant missing or of the wrong type)
    raises ``CalibrationError`` naming the file and the entry.
    """
    where = str(path or CALIBRATION_FILE)
    try:
        raw = parse_table(read_text_capped(where))
    except UnicodeDecodeError:
        raise CalibrationError(f"{where}: not UTF-8 text") from None
    except OSError as exc:
        raise CalibrationError(f"{where}: cannot read the calibration file ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:  # its problem only: the file's text is not echoed (it may be a secret)
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise CalibrationError(f"{where}: not YAML{at} (a calibration table is written by `rlc calibrate`)") from None
    except (ValueError, TypeError, RecursionError):  # a tagged value PyYAML cannot build (`!!int text`): not shown
        raise CalibrationError(f"{where}: not a calibration table (a value that is not plain YAML data; a "
                               "calibration table is written by `rlc calibrate`)") from None
    if not isinstance(raw, dict) or raw.get("format") != 1 or not isinstance(raw.get("entries"), list) \
            or not raw["entries"]:
        raise CalibrationError(f"{where}: a calibration table has 'format: 1' and a non-empty 'entries' list "
                               "(write one with `rlc calibrate`)")
    entries = []
    for i, entry in enumerate(raw["entries"]):
        try:
            entries.append(_entry(entry, _fallback(entry) if path is not None else None))
        except CalibrationError as exc:
            raise CalibrationError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            name = entry.get("id", f"#{i + 1}") if isinstance(entry, dict) else f"#{i + 1}"
            raise CalibrationError(f"{where}: calibration entry {name}: malformed ({type(exc).__name__}: {exc})") \
                from None
    return tuple(entries)


def _fallback(entry: Any) -> Optional[Calibration]:
    """The shipped table's entry that fills the constants a file lacks (:data:`MEGATRON_BACKEND_CONSTANTS`): the
    one measured on the entry's GPU, else the first; None when the file has them all (nothing to fill)."""
    consts = entry.get("constants") if isinstance(entry, dict) else None
    if not isinstance(consts, dict) or all(k in consts for k in MEGATRON_BACKEND_CONSTANTS):
        return None
    shipped = load_table()
    return next((c for c in shipped if c.gpu == entry.get("gpu")), shipped[0])


def shipped_calibrations() -> dict[str, Path]:
    """Calibration files shipped with rlc, by name (``rlc/compiler/planner/calibrations/NAME.yaml``)."""
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.yaml"))}


def calibration_path(ref: str, base_dir: Path) -> Path:
    """The file a ``cluster.calibration`` value names: a shipped name, or a path relative to ``base_dir``."""
    shipped = shipped_calibrations()
    if ref in shipped:
        return shipped[ref]
    path = Path(ref).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        names = ", ".join(shipped) or "none"
        raise CalibrationError(f"calibration file {ref!r} not found (looked for {path}); give a file written by "
                               f"`rlc calibrate` or a shipped calibration name ({names})")
    return path


def calibration_for(gpu: str, versions: Optional[Mapping[str, str]] = None,
                    table: Optional[Sequence[Calibration]] = None) -> Calibration:
    """The entry measured on ``gpu`` (matching ``versions`` if given), else the first entry with a note.

    ``table`` is the entries to choose from (a file given with ``--calibration`` or
    ``cluster.calibration``); the shipped table by default.
    """
    table = tuple(table) if table else load_table()
    same_gpu = [c for c in table if c.gpu == gpu]
    if versions:
        exact = [c for c in same_gpu if all(c.versions.get(k) == v for k, v in versions.items())]
        if exact:
            return exact[0]
    if same_gpu:
        return same_gpu[0]
    base = table[0]
    note = (f"no calibration measured on {gpu}; using {base.id} (measured on {base.gpu}) for contexts, "
            "residues and fragmentation; parameter bytes are exact regardless")
    return dataclasses.replace(base, fallback_note=note)


# --------------------------------------------------------------------------- runtime records


def parse_record(line: str | Mapping[str, Any]) -> CalibrationRecord:
    """One runtime calibration record (a line of ``calibration.jsonl`` or a mapping), typed.

    The format is the contract's :class:`~rlc.contract.calibration_record.CalibrationRecord`, the
    same class the runtime writes with; a record that does not match raises ``CalibrationError``
    naming the key.
    """
    try:
        if isinstance(line, str):
            return CalibrationRecord.from_json(line)
        return CalibrationRecord.from_dict(line)
    except CalibrationRecordError as exc:
        raise CalibrationError(str(exc)) from None
