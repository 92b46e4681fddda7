"""Replayed load (``refit.replay_load``): vLLM's ``load_weights`` recorded once as copies, replayed every refit.

For an unquantized model vLLM's loader does the same thing at every refit: for each exported tensor it finds the
parameter (a fused ``qkv_proj`` / ``gate_up_proj`` for stacked names, the module's own one otherwise), narrows
it to the shard this tensor fills, narrows the tensor to this rank's part, and copies. The Python around those
copies (name mapping, module lookup, one ``weight_loader`` call per tensor) is what a refit of a dense model
spends most of its load time on: Qwen3-8B's 399 tensors took 0.047 s in ``load_weights`` on an H200, where one
copy of their 16.4 GB takes ~0.009 s.

At the first refit after pairing, the :class:`RecordingLoader` runs vLLM's own loader (the first refit is loaded
exactly as without the switch) under a :class:`torch.overrides.TorchFunctionMode` that sees every torch call the
loader makes and records each write into the model's parameters or buffers:

* a ``copy_`` whose destination is a view of one parameter and whose source is a view of one of the tensors
  being loaded is a *plain copy* of that tensor: recorded as the two views (offset, sizes and strides relative to
  the parameter and to the tensor);
* any other write into the model (a computed value, a dtype-converted temporary, ``fill_``, ``__setitem__``, an
  ``out=`` argument) is blamed on the tensor the loader was handed last, and marks the region it wrote.

A tensor is replayed when the loader only ever copied it, at least once, into regions nothing else of the export
writes; every other tensor keeps vLLM's loader, every refit (the reason is in :meth:`ReplayTable.summary`). From
the second refit on, the :class:`ReplayLoader` issues a bucket's recorded copies in one batched call
(``torch._foreach_copy_``) and hands the rest to ``load_weights``. Like the fused expert table, the replay table is
checked every refit against the export list the producer announced and against the parameters as they are now
(same tensors, same places); a difference stops the refit (``RefitManifestError``) instead of writing into
memory the engine no longer reads. ``refit.verify_every`` compares the result with vLLM's own load, bit for bit.

Not for FP8 rollouts: their loads run inside vLLM's layerwise reload, which quantizes what it loads.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import torch
from torch.overrides import TorchFunctionMode

from rlc.runtime.refit.copy_tables import DirectCopyLoader, LoadWeights, digest, tensor_signature
from rlc.runtime.refit.errors import RefitManifestError
from rlc.runtime.refit.sources import Region, TensorsByAddress, View, byte_range
from rlc.runtime.refit.specs import TensorSpec


#: The tensor the loader was handed last is not known: writes before the first or after the last tensor.
_NO_TENSOR = -1


class ReplayCopy(NamedTuple):
    """One recorded copy: ``View`` of the parameter ``param`` <- ``View`` of the loaded tensor."""

    param: str
    dst: View
    src: View


# --------------------------------------------------------------------------- the model's tensors


def model_tensors(model: Any) -> TensorsByAddress[str]:
    """Every parameter and buffer of a model by address (keyed by name), to find which one a written view is of."""
    return TensorsByAddress((n, t.detach()) for n, t in [*model.named_parameters(), *model.named_buffers()])


# --------------------------------------------------------------------------- recording


#: Python operators that write their left operand in place.
_INPLACE_OPERATORS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__",
                                "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
                                "__ilshift__", "__irshift__"})


def _written(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors a torch call writes: in-place methods (``x.copy_``, ``x.mul_``, ``x[i] = y``, ``x += y``)
    write their first argument, ``out=`` its tensors."""
    name = getattr(func, "__name__", "")
    out: list[torch.Tensor] = []
    inplace = (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_OPERATORS
    if inplace and args and isinstance(args[0], torch.Tensor):
        out.append(args[0])
    target = kwargs.get("out")
    if isinstance(target, torch.Tensor):
        out.append(target)
    elif isinstance(target, (tuple, list)):
        out.extend(t for t in target if isinstance(t, torch.Tensor))
    return out


@dataclass
class _TensorRecord:
    name: str
    copies: list[ReplayCopy] = field(default_factory=list)
    blame: list[str] = field(default_factory=list)  # why this tensor cannot be replayed


class _Recorder(TorchFunctionMode):
    """Sees every torch call of one ``load_weights`` call over ``weights`` and records the writes into ``model``."""

    def __init__(self, model: TensorsByAddress[str], weights: Sequence[tuple[str, torch.Tensor]],
                 records: list[_TensorRecord], foreign: list[tuple[str, tuple[int, int], str]]) -> None:
        super().__init__()
        self.model = model
        self.weights = weights
        self.records = records  # one per tensor of ``weights``
        self.foreign = foreign  # (parameter, element extent, why): writes no tensor's replay reproduces
        self.current = _NO_TENSOR
        self._sources = sorted((byte_range(t) + (i,) for i, (_, t) in enumerate(weights)))
        self._source_starts = [s[0] for s in self._sources]
        self._devices = {t.device for _, t in weights}

    def _source_of(self, view: torch.Tensor) -> int | None:
        """The index of the loaded tensor whose bytes contain every byte of ``view``, else None."""
        if view.numel() == 0:
            return None
        start, end = byte_range(view)
        i = bisect.bisect_right(self._source_starts, start) - 1
        if i < 0:
            return None
        s_start, s_end, index = self._sources[i]
        tensor = self.weights[index][1]
        if s_start <= start and end <= s_end and view.dtype == tensor.dtype and view.device == tensor.device \
                and view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            return index
        return None

    def _overlaps_a_source(self, t: torch.Tensor) -> bool:
        """Whether ``t`` overlaps a tensor being loaded (they do not overlap one another: one bisect)."""
        if t.device not in self._devices:
            return False
        rng = byte_range(t)
        i = bisect.bisect_left(self._source_starts, rng[1]) - 1
        return i >= 0 and self._sources[i][1] > rng[0]

    def _blame(self, why: str) -> None:
        targets = [self.current] if self.current != _NO_TENSOR else range(len(self.records))
        for i in targets:
            self.records[i].blame.append(why)

    def _note(self, func: Any, args: Sequence[Any], written: list[torch.Tensor]) -> None:
        name = getattr(func, "__name__", repr(func))
        for dst in written:
            if self._overlaps_a_source(dst):
                self._blame(f"vLLM's loader writes into the tensor it loads ({name})")
                continue
            owner = self.model.containing(dst)
            touched = [owner] if owner is not None else self.model.overlapping(dst)
            if not touched:
                continue  # a temporary of the loader's
            src = args[1] if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor) else None
            index = self._source_of(src) if src is not None else None
            if owner is not None and index is not None and src is not None:
                self.records[index].copies.append(ReplayCopy(owner.key, View.of(dst, owner.tensor),
                                                             View.of(src, self.weights[index][1])))
                if index != self.current:  # held past its turn: the loader pairs it with others
                    self.records[index].blame.append("vLLM's loader copies it while loading another tensor")
                continue
            why = (f"vLLM's loader writes {', '.join(r.key for r in touched[:2])} with {name} "
                   + ("from a computed or converted tensor" if name == "copy_" else "(not a plain copy)"))
            self._blame(why)
            for r in touched:
                self.foreign.append((r.key, _element_extent(dst, r), why))

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        if written:
            self._note(func, args, written)
        return func(*args, **kwargs)

    def feed(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights, one at a time, noting which tensor the loader holds (writes are blamed on it)."""
        for i, item in enumerate(self.weights):
            self.current = i
            yield item
        self.current = _NO_TENSOR


def _element_extent(view: torch.Tensor, owner: Region[str]) -> tuple[int, int]:
    """The elements of ``owner`` that ``view``'s bytes overlap, counted from ``owner``'s first element (as
    :class:`View` offsets are)."""
    start, end = byte_range(view)
    size = owner.tensor.element_size()
    base = owner.tensor.data_ptr()
    return (max(start, owner.start) - base) // size, -(-(min(end, owner.end) - base) // size)


class RecordingLoader:
    """``load_weights`` for the first refit: vLLM's loader, bucket by bucket, with every write recorded."""

    def __init__(self, load_weights: LoadWeights, model: Any) -> None:
        self.load_weights = load_weights
        self.model = model_tensors(model)
        self.records: dict[str, _TensorRecord] = {}
        self.foreign: list[tuple[str, tuple[int, int], str]] = []

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        records = [_TensorRecord(n) for n, _ in weights]
        recorder = _Recorder(self.model, weights, records, self.foreign)
        with torch.no_grad(), recorder:
            self.load_weights(recorder.feed())
        for r in records:
            if r.name in self.records:
                r.blame.append("loaded twice in one refit")
            self.records[r.name] = r

    def table(self, specs: Sequence[TensorSpec]) -> "ReplayTable":
        """The replay table of what was recorded (after the refit has completed)."""
        return build_table(self.records, self.foreign, specs, self.model)


# --------------------------------------------------------------------------- the table


class _Op(NamedTuple):
    dst: torch.Tensor  # the view of the parameter, built once
    src: View

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.src.on(tensor)


@dataclass(frozen=True)
class Route:
    """The recorded copies of one exported tensor."""

    name: str
    copies: tuple[ReplayCopy, ...]
    ops: tuple[_Op, ...]

    @property
    def nbytes(self) -> int:
        return sum(op.dst.numel() * op.dst.element_size() for op in self.ops)


def specs_key(specs: Sequence[TensorSpec]) -> str:
    return digest((s.name, s.shape, s.dtype) for s in specs)


@dataclass
class ReplayTable:
    """Exported tensor -> the copies vLLM's loader made of it; built once, checked every refit."""

    routes: dict[str, Route]
    not_replayed: dict[str, str]  # tensor -> why it keeps vLLM's loader
    specs_key: str
    destination_signatures: dict[str, tuple[Any, ...]]  # parameter -> its signature when the table was built

    @property
    def fingerprint(self) -> str:
        return digest([self.specs_key, *sorted(self.destination_signatures.items()),
                             *((n, r.copies) for n, r in sorted(self.routes.items())),
                             *sorted(self.not_replayed.items())])

    def check(self, specs: Sequence[TensorSpec], model: Any) -> None:
        """Raise ``RefitManifestError`` when the export list or a destination changed since the table was built."""
        if specs_key(specs) != self.specs_key:
            raise RefitManifestError(
                "replayed load: the producer's export list is not the one the replay table was recorded for; "
                "the table is recorded again only when the producer and consumer pair again (prepare)")
        now = {n: t.detach() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
        changed = sorted(n for n, sig in self.destination_signatures.items()
                         if n not in now or tensor_signature(now[n]) != sig)
        if changed:
            raise RefitManifestError(
                f"replayed load: vLLM's parameters {', '.join(changed[:4])} are not where the replay table points "
                "(moved, resized or replaced since the first refit); copying would write memory the engine no "
                "longer reads. Turn refit.replay_load off if the engine re-allocates its weights between refits")

    def summary(self) -> dict[str, Any]:
        return {"replayed": len(self.routes), "copies": sum(len(r.ops) for r in self.routes.values()),
                "not_replayed": len(self.not_replayed),
                "not_replayed_examples": dict(sorted(self.not_replayed.items())[:4]),
                "fingerprint": self.fingerprint}


def build_table(records: Mapping[str, _TensorRecord], foreign: Sequence[tuple[str, tuple[int, int], str]],
                specs: Sequence[TensorSpec], model: TensorsByAddress[str]) -> ReplayTable:
    """The replay table of one recorded refit: every tensor the loader only copied, into regions nothing else
    writes."""
    not_replayed: dict[str, str] = {}
    extents: dict[str, list[tuple[int, int, str]]] = {}  # parameter -> (first, end, tensor) of every write
    for r in records.values():
        for c in r.copies:
            extents.setdefault(c.param, []).append((*c.dst.extent(), r.name))
    for param, extent, _why in foreign:
        extents.setdefault(param, []).append((*extent, ""))
    shared: dict[str, str] = {}
    for param, spans in extents.items():
        spans.sort()
        reach, last = -1, ""
        for first, end, name in spans:
            if first < reach:
                for n in (name, last):
                    if n:
                        shared.setdefault(n, f"{param} is also written by another tensor or a loader computation")
            if end > reach:
                reach, last = end, name
    by_name = {r.key: r.tensor for r in model.regions}
    routes: dict[str, Route] = {}
    used: dict[str, tuple[Any, ...]] = {}
    for name, r in sorted(records.items()):
        why = r.blame[0] if r.blame else shared.get(name)
        if why is None and not r.copies:
            why = "vLLM's loader made no copy of it (skipped, or written by other means)"
        if why is None:
            try:
                ops = tuple(_Op(c.dst.on(by_name[c.param]), c.src) for c in r.copies)
            except (KeyError, RuntimeError) as exc:
                why = f"its recorded destination cannot be rebuilt ({exc})"
            else:
                routes[name] = Route(name, tuple(r.copies), ops)
                for c in r.copies:
                    used[c.param] = tensor_signature(by_name[c.param])
                continue
        not_replayed[name] = why
    return ReplayTable(routes, not_replayed, specs_key(specs), used)


# --------------------------------------------------------------------------- replay


class ReplayLoader(DirectCopyLoader):
    """``load_weights`` for every later refit: a bucket's recorded copies in one call, vLLM's loader for the rest."""

    def __init__(self, load_weights: LoadWeights, table: ReplayTable) -> None:
        super().__init__(load_weights, table.routes)
        self.table = table


__all__ = ["RecordingLoader", "ReplayCopy", "ReplayLoader", "ReplayTable", "Route",
           "build_table", "model_tensors", "specs_key"]
