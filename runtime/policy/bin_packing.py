"""Bin packing of sequences into micro batches of at most ``capacity`` tokens (pure Python).

The algorithms are those ``training.sequence_packing.algorithm`` names, after NeMo-RL's
``nemo_rl/data/packing/algorithms.py``:

* ``concatenative``: in order, a new bin whenever the next sequence does not fit;
* ``first_fit_decreasing``: longest first, each into the first bin with room;
* ``first_fit_shuffle``: first fit in a shuffled order (seeded: every rank must pack alike);
* ``modified_first_fit_decreasing`` (``modified_ffd``): Johnson & Garey's MFFD (1985): items are
  large (> C/2), medium (> C/3), small (> C/6) or tiny; one bin per large item, a medium item
  added to each where it fits, pairs of small items into the bins without a medium one, then
  the rest largest-first into the open bins and first-fit-decreasing for what is left.

Every function returns bins as lists of indices into ``lengths``; every index appears in exactly
one bin, and no bin holds more than ``capacity`` tokens.
"""
from __future__ import annotations

import random
from typing import Callable, Sequence

Bins = list[list[int]]


class PackingError(ValueError):
    """A sequence longer than a micro batch's token budget."""


def _check(lengths: Sequence[int], capacity: int, budget_key: str) -> None:
    if capacity < 1:
        raise PackingError(f"{budget_key} must be at least 1 token (got {capacity})")
    for i, n in enumerate(lengths):
        if n < 1:
            raise PackingError(f"sequence {i} has {n} tokens; every packed sequence needs at least one")
        if n > capacity:
            raise PackingError(f"a sequence of {n} tokens (padded) does not fit a packed micro batch of {capacity} "
                               f"tokens; raise {budget_key} to at least {n}")


def concatenative(lengths: Sequence[int], capacity: int) -> Bins:
    bins: Bins = []
    used = 0
    for i, n in enumerate(lengths):
        if not bins or used + n > capacity:
            bins.append([i])
            used = n
        else:
            bins[-1].append(i)
            used += n
    return bins


def _first_fit(order: Sequence[int], lengths: Sequence[int], capacity: int) -> Bins:
    bins: Bins = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if free >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def _decreasing(lengths: Sequence[int]) -> list[int]:
    """Indices longest first; equal lengths in index order (deterministic)."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> Bins:
    return _first_fit(_decreasing(lengths), lengths, capacity)


def first_fit_shuffle(lengths: Sequence[int], capacity: int, seed: int = 0) -> Bins:
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    return _first_fit(order, lengths, capacity)


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> Bins:
    large, medium, small, tiny = [], [], [], []
    for i in _decreasing(lengths):
        n = lengths[i]
        if n > capacity / 2:
            large.append(i)
        elif n > capacity / 3:
            medium.append(i)
        elif n > capacity / 6:
            small.append(i)
        else:
            tiny.append(i)
    small.reverse()  # ascending: the pairs phase takes the smallest first
    bins: Bins = [[i] for i in large]
    room = [capacity - lengths[i] for i in large]
    # one medium item (the largest that fits) into each large item's bin
    for b in range(len(bins)):
        for k, i in enumerate(medium):
            if lengths[i] <= room[b]:
                bins[b].append(medium.pop(k))
                room[b] -= lengths[i]
                break
    # backward: two small items into each bin without a medium one, the smallest with the largest that fits
    for b in reversed(range(len(bins))):
        if any(capacity / 3 < lengths[i] <= capacity / 2 for i in bins[b]) or len(small) < 2:
            continue
        if lengths[small[0]] + lengths[small[1]] > room[b]:
            continue
        first = small.pop(0)
        for k in range(len(small) - 1, -1, -1):
            if lengths[small[k]] <= room[b] - lengths[first]:
                second = small.pop(k)
                bins[b] += [first, second]
                room[b] -= lengths[first] + lengths[second]
                break
        else:
            small.insert(0, first)
    # forward: the rest, largest first, into the open bins
    rest = sorted(medium + small + tiny, key=lambda i: (-lengths[i], i))
    for b in range(len(bins)):
        k = 0
        while k < len(rest):
            if lengths[rest[k]] <= room[b]:
                i = rest.pop(k)
                bins[b].append(i)
                room[b] -= lengths[i]
            else:
                k += 1
    return bins + _first_fit(rest, lengths, capacity)


ALGORITHMS: dict[str, Callable[..., Bins]] = {
    "concatenative": concatenative,
    "first_fit_decreasing": first_fit_decreasing,
    "first_fit_shuffle": first_fit_shuffle,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
    "modified_ffd": modified_first_fit_decreasing,
}


def pack(lengths: Sequence[int], capacity: int, algorithm: str, *, seed: int = 0,
         budget_key: str = "the packing budget") -> Bins:
    """Bins of ``algorithm`` (a ``training.sequence_packing.algorithm`` name); ``seed`` for the shuffle."""
    try:
        fn = ALGORITHMS[algorithm]
    except KeyError:
        raise PackingError(f"training.sequence_packing.algorithm: {algorithm!r} is not one of "
                           f"{', '.join(ALGORITHMS)}") from None
    lengths = [int(n) for n in lengths]
    _check(lengths, int(capacity), budget_key)
    if not lengths:
        return []
    if fn is first_fit_shuffle:
        return first_fit_shuffle(lengths, int(capacity), seed)
    return fn(lengths, int(capacity))


def split_to(bins: Bins, count: int) -> Bins:
    """``bins`` grown to ``count`` bins by moving single sequences out of the fullest bins (by sequence
    count), as NeMo-RL evens the bins of its data-parallel ranks; stops when every bin holds one
    sequence (the caller fills the rest). Moving a sequence out never overfills a bin."""
    out = [list(b) for b in bins]
    while len(out) < count:
        donor = max(range(len(out)), key=lambda b: (len(out[b]), -b), default=None)
        if donor is None or len(out[donor]) < 2:
            break
        out.append([out[donor].pop()])
    return out


__all__ = ["ALGORITHMS", "Bins", "PackingError", "concatenative", "first_fit_decreasing", "first_fit_shuffle",
           "modified_first_fit_decreasing", "pack", "split_to"]
