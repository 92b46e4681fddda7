"""The trainer side of ``refit.direct_export``: tensors Megatron-Bridge's conversion only renames, slices or
reorders by rows, exported as views (or one row gather) of the trainer's parameters.

At trainer tensor and pipeline parallelism 1, most of what Bridge's export yields is a parameter as it is (norms,
``o_proj``, ``down_proj``, the embedding, the LM head), a slice of one (``gate_proj`` and ``up_proj`` are the two
halves of Megatron's ``linear_fc1``), or a selection of its rows (``q_proj``, ``k_proj``, ``v_proj`` out of
Megatron's interleaved ``linear_qkv``). Bridge still runs its per-tensor conversion for each of them at every
refit: mapping lookups, a broadcast of the layer's config per QKV tensor, a new tensor per q, k and v. For a dense
model that is most of the export's time (Qwen3-8B: 0.051 s for 399 tensors, against ~0.01 s of copying).

Nothing here knows Bridge's mapping classes. When the refit pairs, the export pass that lists the tensors also
looks at each tensor Bridge yields:

* a *view*: it shares storage with one of the trainer's parameters (same dtype): recorded as a :class:`View` of
  that parameter;
* *rows*: a 2-D tensor whose rows are, bit for bit, rows of the parameter its conversion task reads (found by an
  exact integer hash of every row, ambiguous rows refused, the gather then compared with Bridge's tensor with
  ``torch.equal``): recorded as the row index, which the producer gathers straight into its buffer
  (:class:`rlc.runtime.refit.sources.RowsOf`);
* anything else (a computed, gathered or converted tensor): Bridge's export keeps it.

A conversion task is exported directly when every tensor it yields is a view or rows; the rest of the tasks keep
Bridge's export, which a second pass checks yields exactly the other tensors. Every refit then yields the direct
tensors first (rebuilt on the parameters as they are at that moment: an offloaded and restored parameter is read
where it now lives), then Bridge's export of the remaining tasks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch

from rlc.runtime.refit.sources import RowsOf, TensorsByAddress, View, is_plain_tensor
from rlc.runtime.refit.specs import TensorSpec

_EXPERT_TASK = re.compile(r"(?:^|\.)mlp\.experts\.")
#: Rows hashed at once (bounds the int64 copy the exact row hash makes).
_HASH_ROWS = 4096
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}


class DirectExportError(RuntimeError):
    """The direct export's tensors and Bridge's remaining export do not add up to Bridge's full export."""


def why_not_direct(*, tp: int, pp: int) -> str | None:
    """Why the trainer's layout keeps Bridge's export for every tensor (None: tensors may be exported directly)."""
    if tp > 1:
        return f"trainer tensor parallelism {tp}: Bridge gathers each tensor over the tensor-parallel group"
    if pp > 1:
        return f"trainer pipeline parallelism {pp}: Bridge broadcasts each stage's tensors to every stage"
    return None


# --------------------------------------------------------------------------- finding a tensor's source


@dataclass(frozen=True)
class ParamView:
    """An exported tensor that is a view of one trainer parameter."""

    param: torch.Tensor
    view: View

    def tensor(self) -> torch.Tensor:
        return self.view.on(self.param.detach())


@dataclass(frozen=True)
class ParamRows:
    """An exported 2-D tensor whose rows are rows ``index`` of one 2-D trainer parameter."""

    param: torch.Tensor
    index: torch.Tensor

    def tensor(self) -> RowsOf:
        return RowsOf(self.param.detach(), self.index)


Source = ParamView | ParamRows


class ParamsByStorage:
    """The trainer's parameters by address, to find the one an exported view shares memory with (Megatron's DDP
    holds every parameter of a bucket group as a view of one contiguous buffer)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        # a wrapper subclass: Bridge dequantizes or gathers it, no view
        self.index: TensorsByAddress[torch.Tensor] = TensorsByAddress(
            (p, p) for p in params if is_plain_tensor(p))

    def view_of(self, tensor: torch.Tensor) -> ParamView | None:
        """``tensor`` as a view of a parameter of its dtype that holds all of its elements, else None."""
        region = self.index.containing(tensor)
        return ParamView(region.key, View.of(tensor, region.key)) if region is not None else None


def row_hashes(t: torch.Tensor) -> torch.Tensor:
    """An exact hash of every row of a 2-D floating tensor (int64, computed on the raw bits with wrapping integer
    arithmetic, so equal rows hash equal wherever they sit)."""
    as_int = _INT_VIEW[t.dtype]
    cols = int(t.shape[1])
    gen = torch.Generator(device="cpu").manual_seed(cols)
    coeff = (torch.randint(1, 2**62, (cols,), generator=gen, dtype=torch.int64) | 1).to(t.device)
    out = torch.empty(int(t.shape[0]), dtype=torch.int64, device=t.device)
    for start in range(0, int(t.shape[0]), _HASH_ROWS):
        rows = t[start:start + _HASH_ROWS].contiguous().view(as_int).to(torch.int64)
        out[start:start + rows.shape[0]] = (rows * coeff).sum(dim=1)
    return out


def rows_of(tensor: torch.Tensor, param: torch.Tensor) -> Source | None:
    """``tensor``'s rows as rows of ``param`` (each found exactly once; the gather equals ``tensor`` bit for bit),
    else None. All of ``param``'s rows in order (a clone of it) are a view of it."""
    if tensor.dim() != 2 or param.dim() != 2 or tensor.shape[1] != param.shape[1] or tensor.dtype != param.dtype \
            or tensor.dtype not in _INT_VIEW or tensor.device != param.device or tensor.shape[0] > param.shape[0]:
        return None
    with torch.no_grad():
        want = row_hashes(tensor)
        have = row_hashes(param.detach())
        order = torch.argsort(have)
        sorted_have = have[order]
        at = torch.searchsorted(sorted_have, want).clamp_(max=sorted_have.numel() - 1)
        if not bool((sorted_have[at] == want).all()):
            return None  # a row the parameter does not hold
        duplicate = sorted_have[1:] == sorted_have[:-1]
        if bool(duplicate.any()) and bool(torch.isin(want, sorted_have[1:][duplicate]).any()):
            return None  # a row the parameter holds twice: which one is ambiguous
        index = order[at].contiguous()
        if int(torch.unique(index).numel()) != int(index.numel()):
            return None  # the same row twice in the tensor
        if not torch.equal(param.detach().index_select(0, index), tensor):
            return None
    if index.numel() == param.shape[0] and param.is_contiguous() and bool(
            torch.equal(index, torch.arange(index.numel(), device=index.device))):
        return ParamView(param, View.of(param.detach(), param.detach()))  # every row in order: a copy of it
    return ParamRows(param, index)


# --------------------------------------------------------------------------- the plan


def task_names(task: Any) -> list[str]:
    """The HF names a Bridge conversion task exports (its mapping's ``hf_param``: one name or a dict of them)."""
    hf = getattr(getattr(task, "mapping", None), "hf_param", None)
    if isinstance(hf, str):
        return [hf]
    if isinstance(hf, dict):
        return [v for v in hf.values() if isinstance(v, str)]
    return []


@dataclass
class DirectFinder:
    """Looks at Bridge's export, tensor by tensor, during the pass that lists it (``observe``).

    Bridge exports task after task; a tensor whose name is none of the tasks' own names (the LM head a tied
    embedding's task also yields, a rename by an export hook) belongs to the task exported last."""

    tasks: list
    params: ParamsByStorage
    skip_experts: bool = False  # expert parallelism: Bridge gathers each expert task over the expert group
    sources: dict[str, Source] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # name -> why Bridge keeps it
    _task_of: dict[str, int] = field(default_factory=dict)  # a task's own names (names two tasks share: none)
    _outputs: dict[int, list[str]] = field(default_factory=dict)  # task -> every name it yielded
    _current: int | None = None
    _all_names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        counts: dict[str, int] = {}
        for i, t in enumerate(self.tasks):
            for n in task_names(t) if t is not None else []:
                counts[n] = counts.get(n, 0) + 1
                self._task_of[n] = i
        for n, c in counts.items():
            if c > 1:
                del self._task_of[n]
        self._all_names = set(counts)

    def _why_not_eligible(self, index: int) -> str | None:
        task = self.tasks[index]
        if getattr(task, "param_weight", None) is None:
            return "its conversion task has no parameter on this rank"
        if self.skip_experts and _EXPERT_TASK.search(getattr(task, "global_param_name", "") or ""):
            return "an expert task: Bridge gathers it over the expert-parallel group"
        return None

    def observe(self, name: str, tensor: Any) -> None:
        index = self._task_of.get(name)
        if index is not None:
            self._current = index
        elif name in self._all_names:
            self._current = None  # a name several tasks share: which task yields what is unknown from here on
        index = self._current
        if index is None:
            self.refused[name] = "no single conversion task of this rank exports it"
            return
        self._outputs.setdefault(index, []).append(name)
        why = self._why_not_eligible(index)
        source: Source | None = None
        if why is None and is_plain_tensor(tensor):
            source = self.params.view_of(tensor) or rows_of(tensor, self.tasks[index].param_weight)
            why = None if source is not None else "Bridge computes it (not a view or a row selection of its parameter)"
        if source is None:
            self.refused[name] = why or "not a plain tensor"
        else:
            self.sources[name] = source

    def plan(self, tasks: list, specs: Sequence[TensorSpec]) -> "DirectExport":
        """Of ``tasks`` (the conversion tasks Bridge would export), those whose every tensor has a source go
        direct; the others stay with Bridge. ``specs``: the export list the refit sends."""
        exported = {s.name for s in specs}
        allowed = {id(t) for t in tasks}
        chosen: dict[str, Source] = {}
        direct: set[int] = set()
        for i, names in self._outputs.items():
            task = self.tasks[i]
            whole = set(task_names(task)) <= set(names)  # every name of its own was yielded, and by it
            if id(task) in allowed and whole and all(n in self.sources and n in exported for n in names):
                direct.add(id(task))
                chosen.update((n, self.sources[n]) for n in names)
        for n in self.sources:
            if n not in chosen:
                self.refused.setdefault(n, "another tensor of its conversion task is computed by Bridge")
        order = [s.name for s in specs if s.name in chosen]
        return DirectExport({n: chosen[n] for n in order}, [t for t in tasks if id(t) not in direct], self.refused)


@dataclass
class DirectExport:
    """The tensors exported directly (in Bridge's order) and the conversion tasks left to Bridge."""

    sources: dict[str, Source]
    bridge_tasks: list
    refused: dict[str, str] = field(default_factory=dict)

    def wire_specs(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        """The export list in stream order: the direct tensors first, then everything else as it was."""
        return [s for s in specs if s.name in self.sources] + [s for s in specs if s.name not in self.sources]

    def stream(self) -> Iterator[tuple[str, Any]]:
        for name, source in self.sources.items():
            yield name, source.tensor()

    def in_place_views(self) -> list[str]:
        """The direct tensors a consumer can read where the trainer holds them (``refit.zero_copy_views``): views
        that are contiguous, so one mapping of the parameter's storage and a byte offset describe them."""
        return [name for name, source in self.sources.items()
                if isinstance(source, ParamView) and source.tensor().is_contiguous()]

    def check_rest(self, specs: Sequence[TensorSpec], rest_names: Iterable[str]) -> None:
        """Bridge's export of the remaining tasks must yield exactly the tensors not exported directly."""
        want = [s.name for s in specs if s.name not in self.sources]
        got = list(rest_names)
        if sorted(got) != sorted(want):
            extra = sorted(set(got) - set(want))[:3]
            missing = sorted(set(want) - set(got))[:3]
            raise DirectExportError(
                "Megatron-Bridge's export of the remaining conversion tasks does not yield exactly the other tensors "
                f"(extra {extra}, missing {missing}), so it keeps every tensor")

    def summary(self) -> dict[str, Any]:
        views = sum(isinstance(s, ParamView) for s in self.sources.values())
        return {"tensors": len(self.sources), "views": views, "row_gathers": len(self.sources) - views,
                "bridge_tasks": len(self.bridge_tasks), "kept_by_bridge": len(self.refused),
                "kept_examples": dict(sorted(self.refused.items())[:4])}


__all__ = ["DirectExport", "DirectExportError", "DirectFinder", "ParamRows", "ParamView", "ParamsByStorage",
           "row_hashes", "rows_of", "task_names", "why_not_direct"]
