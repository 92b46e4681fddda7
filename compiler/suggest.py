"""Did-you-mean suggestions for misspelt keys and values (``difflib`` does the matching)."""
from __future__ import annotations

from typing import Any, Iterable


def _norm(text: str) -> str:
    return text.lower().replace("-", "_")


def closest(word: Any, candidates: Iterable[Any], cutoff: float = 0.6) -> Any | None:
    """The candidate closest to ``word``, or ``None`` when nothing is close enough.

    Exact matches after lower-casing and ``-``→``_`` win first (``Bfloat16``, ``sleep-level``);
    then the best :class:`difflib.SequenceMatcher` ratio (at least ``cutoff``, like
    :func:`difflib.get_close_matches`) on that normalised spelling, ties going to the earlier
    candidate. Non-string candidates
    (e.g. enum value ``1``) are compared through their text, so ``'1'`` suggests ``1``.
    """
    pool = list(candidates)
    if not pool:
        return None
    by_norm: dict[str, Any] = {}
    for cand in pool:
        by_norm.setdefault(_norm(str(cand)), cand)
    key = _norm(str(word))
    if key in by_norm and by_norm[key] != word:
        return by_norm[key]
    import difflib  # noqa: PLC0415 - only for a did-you-mean (a recipe without typos never loads it)

    # difflib.get_close_matches breaks ties by the larger string; keep the candidates' order
    # instead (schemas list the usual value first).
    matcher = difflib.SequenceMatcher(b=key)
    best, best_score = None, cutoff
    for norm, cand in by_norm.items():
        matcher.set_seq1(norm)
        if matcher.real_quick_ratio() < best_score or matcher.quick_ratio() < best_score:
            continue
        score = matcher.ratio()
        if score > best_score or (best is None and score >= best_score):
            best, best_score = cand, score
    return None if best is None or best == word else best


def close_matches(word: Any, candidates: Iterable[Any], n: int = 3, cutoff: float = 0.6) -> list[Any]:
    """Up to ``n`` candidates close to ``word``, best first, compared on the normalised spelling as in
    :func:`closest` (an exact match after normalising comes first); none when nothing is close enough."""
    by_norm: dict[str, Any] = {}
    for cand in candidates:
        by_norm.setdefault(_norm(str(cand)), cand)
    import difflib  # noqa: PLC0415 - only for a did-you-mean (a recipe without typos never loads it)

    found = difflib.get_close_matches(_norm(str(word)), list(by_norm), n=n, cutoff=cutoff)
    return [by_norm[f] for f in found]


def did_you_mean(word: Any, candidates: Iterable[Any], render=repr) -> str:
    """``"; did you mean 'tp'?"`` or ``""`` — ready to append to a message."""
    found = closest(word, candidates)
    return "" if found is None else f"; did you mean {render(found)}?"
