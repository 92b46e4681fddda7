"""The rule engine: a registry of rules with stable ids, run over (recipe, model facts, memory plan).

A rule is a function ``check(ctx) -> None`` registered with :func:`rule`. It reports through the
:class:`Context` (``ctx.error/warning/info``, each with the recipe key path, a message with the
actual numbers, and the cheapest fix as ``hint``) and settles ``auto`` switches with
``ctx.decide``. Ids: ``RLC0xx`` meta (catalog, lint.ignore), ``RLC1xx`` layout/divisibility,
``RLC2xx`` refit and memory, ``RLC3xx`` environment, sampling and algorithm, ``RLC4xx`` the Megatron
generation backend.

``lint.ignore: [{rule, reason}]`` silences a rule's warnings and infos; an error cannot be
silenced, and trying is itself an error (RLC002).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from rlc.compiler.diagnostics import Diagnostic, Severity
from rlc.compiler.suggest import close_matches, closest

if TYPE_CHECKING:
    from rlc.compiler.recipe_types import Recipe


@dataclass(frozen=True)
class Rule:
    """One rule: its id, what it can report, why it exists (``explain``) and where that came from."""

    id: str
    title: str
    severities: tuple[str, ...]  # what it can emit: "error" | "warning" | "info"
    rationale: str
    seed: str  # the field report / source it comes from
    fixes: str
    check: Optional[Callable[["Context"], None]] = None
    needs: tuple[str, ...] = ()  # "facts", "plan": skipped when missing

    @property
    def silenceable(self) -> bool:
        return "error" not in self.severities or len(self.severities) > 1


_REGISTRY: dict[str, Rule] = {}


def rule(id: str, title: str, *, severities: tuple[str, ...], rationale: str, seed: str, fixes: str,
         needs: tuple[str, ...] = ()) -> Callable[[Callable[["Context"], None]], Callable[["Context"], None]]:
    """Decorator registering a check function as rule ``id``."""

    def wrap(fn: Callable[["Context"], None]) -> Callable[["Context"], None]:
        if id in _REGISTRY:
            raise ValueError(f"rule {id} registered twice")
        _REGISTRY[id] = Rule(id, title, severities, rationale.strip(), seed.strip(), fixes.strip(), fn, needs)
        return fn

    return wrap


def register(r: Rule) -> None:
    """Register a rule that other stages emit (no check function), so ``explain`` knows it."""
    _REGISTRY[r.id] = r


@dataclass
class RulesResult:
    """What the rules found and decided. ``decisions``: ``refit.<switch>`` -> (value, reason)."""

    diagnostics: list[Diagnostic] = field(default_factory=list)
    decisions: dict[str, tuple[Any, str]] = field(default_factory=dict)


@dataclass
class Context:
    """What a rule sees: the typed recipe (schema defaults filled), facts and plan (``None`` if unknown)."""

    recipe: Recipe
    facts: Any
    plan: Any
    raw: Optional[dict[str, Any]] = None  # the recipe before defaults, when the caller has it
    current: str = ""
    diagnostics: list[Diagnostic] = field(default_factory=list)
    decisions: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def user_set(self, path: str) -> Optional[bool]:
        """Whether the recipe itself set ``path`` (``None`` when the caller gave no raw recipe)."""
        if self.raw is None:
            return None
        node: Any = self.raw
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    def _emit(self, severity: Severity, message: str, path: str, hint: Optional[str]) -> None:
        self.diagnostics.append(Diagnostic(severity, message, path=path, rule=self.current, hint=hint))

    def error(self, message: str, path: str, hint: Optional[str] = None) -> None:
        self._emit("error", message, path, hint)

    def warning(self, message: str, path: str, hint: Optional[str] = None) -> None:
        self._emit("warning", message, path, hint)

    def info(self, message: str, path: str, hint: Optional[str] = None) -> None:
        self._emit("info", message, path, hint)

    def decide(self, key: str, value: Any, reason: str) -> None:
        self.decisions[key] = (value, f"{self.current}: {reason}")


def all_rules() -> list[Rule]:
    """Every registered rule, by id."""
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


class UnknownRuleError(KeyError):
    """``explain`` of an id no rule has; the message suggests close ids."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown rule"


def explain(rule_id: str) -> str:
    """Rationale, seed, severities and fixes of ``rule_id`` (what ``rlc explain ID`` prints)."""
    key = str(rule_id).strip().upper()
    r = _REGISTRY.get(key)
    if r is None:
        close = close_matches(key, _REGISTRY, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UnknownRuleError(f"unknown rule {rule_id!r}{hint} (`rlc explain --list` shows all)")
    silence = (
        "its warnings can be silenced with lint.ignore (with a reason)"
        if r.silenceable and "error" in r.severities
        else "it can be silenced with lint.ignore (with a reason)"
        if r.silenceable
        else "errors cannot be silenced"
    )
    return (f"{r.id}: {r.title}\n"
            f"severity: {' / '.join(r.severities)} ({silence})\n\n"
            f"why:\n  {_indent(r.rationale)}\n\n"
            f"from:\n  {_indent(r.seed)}\n\n"
            f"fix:\n  {_indent(r.fixes)}\n")


def _indent(text: str) -> str:
    return "\n  ".join(text.splitlines())


def run_rules(recipe: Recipe, facts: Any, plan: Any, raw: Optional[dict[str, Any]] = None) -> RulesResult:
    """Run every rule on the typed ``recipe``; ``facts``/``plan`` may be ``None``.

    Rules that need facts or a plan are skipped without them (the stage that failed to produce
    them already reported why). ``raw`` (the recipe before defaults) lets RLC206 tell a
    user-set ``buffer_memory_ratio`` from the schema default.
    """
    ctx = Context(recipe=recipe, facts=facts, plan=plan, raw=raw)
    for r in all_rules():
        if r.check is None:
            continue
        if ("facts" in r.needs and facts is None) or ("plan" in r.needs and plan is None):
            continue
        ctx.current = r.id
        r.check(ctx)
    diags = ctx.diagnostics
    ignored: dict[str, str] = {}
    extra: list[Diagnostic] = []
    for i, item in enumerate(recipe.lint.ignore):
        rule_id, reason, path = item.rule, item.reason, f"lint.ignore[{i}].rule"
        known = _REGISTRY.get(rule_id)
        if known is None:
            close = closest(rule_id, _REGISTRY, cutoff=0.5)
            extra.append(Diagnostic("warning", f"lint.ignore names {rule_id}, which is not a rule"
                                    + (f"; did you mean {close}?" if close else ""), path=path, rule="RLC003"))
            continue
        fired_errors = [d for d in diags if d.rule == rule_id and d.severity == "error"]
        if not known.silenceable or fired_errors:
            what = f"{len(fired_errors)} error(s)" if fired_errors else "errors only"
            extra.append(Diagnostic("error", f"lint.ignore cannot silence {rule_id}: it reports {what}, and errors "
                                    "cannot be silenced", path=path, rule="RLC002",
                                    hint=f"fix the recipe instead (`rlc explain {rule_id}`)"))
        ignored[rule_id] = reason
    kept = [d for d in diags if not (d.rule in ignored and d.severity != "error")]
    return RulesResult(diagnostics=kept + extra, decisions=dict(ctx.decisions))
