"""``refit.verify_every`` at model size: the trainer's export crosses to the vLLM worker in shards, and each shard
is checked on its own, so the check holds a shard at a time in host memory instead of three copies of the model.

The trainer rank writes its export (the stream the refit just sent) as numbered shard files of about
``shard_bytes`` each, cut between decoder layers, and waits while ``max_pending`` of them are on disk; the vLLM
worker on the same GPU reads each shard as it arrives, deletes it, snapshots the parameters of the layers the shard
touches, loads the shard through vLLM's own ``load_weights`` and compares those parameters with their snapshot
(:func:`verify_streamed`). A parameter whose sources span two shards is compared after each (the part a shard did not
load is unchanged on both sides). A parameter the reference load wrote outside the layers the shard names could not
be compared: it is reported as ``unchecked`` and the check fails. Either side's failure reaches the other as a file
(``.failed``, ``.reader-failed``) at once; either side gives up after ``wait_s`` without progress from the other.

Disk holds at most ``max_pending`` shards; host memory is ``rlc.contract.verify_check.streamed_check_host_bytes``
(the compiler's host plan counts it). Pure torch and files here
(CPU-tested across processes); the workers' sides are ``rlc.runtime.policy.megatron_worker.refit_dump_export`` and
``rlc.runtime.generation.extension.rlc_refit_verify``.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from rlc.contract.verify_check import MAX_PENDING, SHARD_BYTES, layer_of
from rlc.runtime.refit.errors import RefitError
from rlc.runtime.worker_api import ExportWritten
from rlc.runtime.refit.verify import ParamMismatch, VerifyReport, compare_parameters

#: How long either side waits for the other's next shard (or for room on disk) before it gives up.
WAIT_S = 600.0


class ExportStreamError(RefitError):
    """The trainer's export and the vLLM worker's check lost each other (a side failed, stalled or left files)."""


@dataclass(frozen=True)
class ShardFiles:
    """Where one trainer rank's export shards go (``directory`` is node-local and unique to one check)."""

    directory: str
    rank: int

    def shard(self, index: int) -> str:
        return os.path.join(self.directory, f"export-rank{self.rank}-{index:05d}.pt")

    @property
    def done(self) -> str:
        return os.path.join(self.directory, f"export-rank{self.rank}.done")

    @property
    def failed(self) -> str:
        return os.path.join(self.directory, f"export-rank{self.rank}.failed")

    @property
    def reader_failed(self) -> str:
        return os.path.join(self.directory, f"export-rank{self.rank}.reader-failed")

    def tell_writer(self, exc: BaseException) -> None:
        """The reader's failure, for the writer (which stops waiting for room at once instead of after its wait)."""
        message = f"{type(exc).__name__}: {exc}"
        try:
            os.makedirs(self.directory, exist_ok=True)
            _atomic_write(self.reader_failed, lambda p: _write_text(p, message))
        except OSError:
            pass

    def pending(self) -> int:
        prefix = f"export-rank{self.rank}-"
        try:
            return sum(1 for f in os.listdir(self.directory) if f.startswith(prefix) and f.endswith(".pt"))
        except FileNotFoundError:
            return 0


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    write(path + ".tmp")
    os.replace(path + ".tmp", path)


def write_export_shards(files: ShardFiles, tensors: Iterable[tuple[str, torch.Tensor]], *,
                        shard_bytes: int = SHARD_BYTES, max_pending: int = MAX_PENDING, wait_s: float = WAIT_S,
                        poll_s: float = 0.005) -> ExportWritten:
    """Write ``tensors`` (the export stream, any device) as CPU shard files, cut where the layer changes once a shard
    holds ``shard_bytes``; blocks while ``max_pending`` shards wait for the reader. A failure (of the stream too)
    leaves ``files.failed`` with its message for the reader, then raises."""
    t0 = time.perf_counter()
    os.makedirs(files.directory, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    held = index = count = total = largest = most = 0
    last_layer: int | None = None

    def flush() -> None:
        nonlocal shard, held, index, largest, most
        deadline = time.monotonic() + wait_s
        while files.pending() >= max_pending:
            if os.path.exists(files.reader_failed):
                with open(files.reader_failed, encoding="utf-8") as f:
                    raise ExportStreamError(f"refit.verify_every: the vLLM worker paired with trainer rank "
                                            f"{files.rank} stopped checking after {index} shard(s): {f.read()}")
            if time.monotonic() > deadline:
                raise ExportStreamError(
                    f"refit.verify_every: the vLLM worker paired with trainer rank {files.rank} read no export shard "
                    f"for {wait_s:.0f} s ({files.pending()} waiting in {files.directory}); its own error, if any, is "
                    "in the generation worker's log")
            time.sleep(poll_s)
        _atomic_write(files.shard(index), lambda p: torch.save(shard, p))
        most = max(most, files.pending())
        largest = max(largest, held)
        index += 1
        shard, held = {}, 0

    try:
        for name, t in tensors:
            layer = layer_of(name)
            if shard and held >= shard_bytes and layer != last_layer:
                flush()
            shard[name] = t.detach().to("cpu", copy=True)
            nbytes = t.numel() * t.element_size()
            held += nbytes
            total += nbytes
            count += 1
            last_layer = layer
        if shard:
            flush()
        written = ExportWritten(directory=files.directory, shards=index, tensors=count, bytes=total,
                                largest_shard_bytes=largest, most_pending=most, seconds=time.perf_counter() - t0)
        _atomic_write(files.done, lambda p: _write_text(p, json.dumps({"shards": index, "tensors": count})))
        return written
    except BaseException as exc:
        if not isinstance(exc, ExportStreamError) or not os.path.exists(files.reader_failed):
            message = f"{type(exc).__name__}: {exc}"
            try:
                _atomic_write(files.failed, lambda p: _write_text(p, message))
            except OSError:
                pass
        raise


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_export_shards(files: ShardFiles, *, wait_s: float = WAIT_S,
                       poll_s: float = 0.005) -> Iterator[dict[str, torch.Tensor]]:
    """The shards of ``files`` in order as they arrive, each deleted once read; ends after the writer's last shard
    and removes its markers. Raises :class:`ExportStreamError` with the writer's message if it failed, or after
    ``wait_s`` without a new shard."""
    index = 0
    deadline = time.monotonic() + wait_s
    while True:
        path = files.shard(index)
        if os.path.exists(path):
            shard = torch.load(path, map_location="cpu", weights_only=True)
            os.remove(path)
            yield shard
            index += 1
            deadline = time.monotonic() + wait_s
            continue
        if os.path.exists(files.failed):
            with open(files.failed, encoding="utf-8") as f:
                raise ExportStreamError(f"refit.verify_every: trainer rank {files.rank}'s export failed after "
                                        f"{index} shard(s): {f.read()}")
        if os.path.exists(files.done):
            with open(files.done, encoding="utf-8") as f:
                total = int(json.load(f)["shards"])
            if index >= total:
                os.remove(files.done)
                return
            if not os.path.exists(path):  # written before the marker: it cannot still be coming
                raise ExportStreamError(f"refit.verify_every: export shard {index} of {total} of trainer rank "
                                        f"{files.rank} is missing from {files.directory} (removed by another process?)")
            continue
        if time.monotonic() > deadline:
            raise ExportStreamError(
                f"refit.verify_every: trainer rank {files.rank} wrote no export shard for {wait_s:.0f} s "
                f"(shard {index} expected in {files.directory}); its own error, if any, is in the policy worker's log")
        time.sleep(poll_s)


@dataclass
class _Tally:
    """The streamed check's running totals (one entry per parameter, however many shards touched it)."""

    compared: dict[str, int]
    mismatches: dict[str, ParamMismatch]
    fp32: set[str]
    loaded: set[str]
    unchecked: set[str]
    loaded_known: bool = True
    shards: int = 0
    tensors: int = 0
    peak_host_bytes: int = 0

    def add(self, report: VerifyReport, sizes: dict[str, int]) -> None:
        for m in report.mismatches:
            old = self.mismatches.get(m.name)
            if old is None or m.elements_differing > old.elements_differing:
                self.mismatches[m.name] = m
        self.fp32.update(report.fp32_params)
        for name in sizes:
            self.compared[name] = sizes[name]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def verify_streamed(model: Any, shards: Iterable[dict[str, torch.Tensor]],
                    load: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None) -> dict[str, Any]:
    """Compare ``model``'s parameters (after a refit) with its own load of ``shards`` (the trainer's export), a shard
    at a time. ``load``: how to load a shard (default ``model.load_weights``; it returns the names it wrote, or
    anything else when it cannot say). Returns :meth:`VerifyReport.to_dict` plus ``shards``, ``exported_tensors`` and
    ``peak_host_bytes`` (the most host memory one shard's check held: shard, snapshot and reference)."""
    params = dict(model.named_parameters())
    by_layer: dict[int | None, list[str]] = {}
    for name in params:
        by_layer.setdefault(layer_of(name), []).append(name)
    tally = _Tally(compared={}, mismatches={}, fp32=set(), loaded=set(), unchecked=set())
    for shard in shards:
        names = [n for key in {layer_of(n) for n in shard} for n in by_layer.get(key, [])]
        with torch.no_grad():
            refitted = {n: params[n].detach().to("cpu", copy=True) for n in names}
            items = list(shard.items())
            loaded = model.load_weights(weights=items) if load is None else load(items)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if isinstance(loaded, (set, list, tuple, frozenset)):
                written = set(loaded)
                tally.loaded |= written
                tally.unchecked |= written - set(names)
            else:
                written, tally.loaded_known = set(names), False
            reference = {n: params[n].detach().to("cpu", copy=True) for n in names if n in written}
        report = compare_parameters(refitted, reference)
        tally.add(report, {n: t.numel() * t.element_size() for n, t in reference.items()})
        tally.shards += 1
        tally.tensors += len(shard)
        tally.peak_host_bytes = max(tally.peak_host_bytes, _nbytes(shard.values()) + _nbytes(refitted.values())
                                    + _nbytes(reference.values()))
        del shard, items, refitted, reference
    not_loaded = sorted(set(params) - tally.loaded) if tally.loaded_known else []
    final = VerifyReport(params_compared=len(tally.compared), bytes_compared=sum(tally.compared.values()),
                         fp32_params=sorted(tally.fp32),
                         mismatches=[tally.mismatches[n] for n in sorted(tally.mismatches)],
                         not_loaded=not_loaded, unchecked=sorted(tally.unchecked))
    return {**final.to_dict(), "shards": tally.shards, "exported_tensors": tally.tensors,
            "peak_host_bytes": tally.peak_host_bytes}


def gather_export_shards(files: ShardFiles, *, wait_s: float = WAIT_S) -> dict[str, torch.Tensor]:
    """Every shard of the export in one dict (FP8 engines, whose reload needs whole layers and checks once); a
    failure on this side is left for the writer before it is raised."""
    exported: dict[str, torch.Tensor] = {}
    try:
        for shard in read_export_shards(files, wait_s=wait_s):
            exported.update(shard)
    except BaseException as exc:
        files.tell_writer(exc)
        raise
    return exported


def check_streamed(model: Any, files: ShardFiles, load: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
                   *, wait_s: float = WAIT_S) -> dict[str, Any]:
    """The vLLM worker's side of the check: :func:`verify_streamed` over :func:`read_export_shards`; a failure on
    this side is left for the writer (:meth:`ShardFiles.tell_writer`) before it is raised."""
    try:
        return verify_streamed(model, read_export_shards(files, wait_s=wait_s), load=load)
    except BaseException as exc:
        files.tell_writer(exc)
        raise
