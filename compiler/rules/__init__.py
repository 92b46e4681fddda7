"""Rules over a recipe: layout divisibility (RLC1xx), refit switches and memory (RLC2xx), environment and
algorithm (RLC3xx). ``run_rules`` returns diagnostics and the decisions of every ``auto`` refit switch;
``explain(id)`` prints a rule's rationale and the field report it comes from (docs/rules.md lists all).
"""
from rlc.compiler.rules.engine import (Context, Rule, RulesResult, UnknownRuleError, all_rules, explain, rule,
                                       run_rules)

# Each rule module registers its rules with the engine as it loads; importing any part of this package loads
# them all (a submodule's package runs first), so the engine's registry is complete before it is read.
from rlc.compiler.rules import (  # noqa: F401
    engine_rules, env_rules, fp8_rules, layout_rules, megatron_rules, memory_rules, meta, refit_rules, replay_rules,
)

__all__ = ["Context", "Rule", "RulesResult", "UnknownRuleError", "all_rules", "explain", "rule", "run_rules"]
