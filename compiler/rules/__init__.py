"""Rules over a recipe: layout divisibility (RLC1xx), refit switches and memory (RLC2xx), environment and
algorithm (RLC3xx). ``run_rules`` returns diagnostics and the decisions of every ``auto`` refit switch;
``explain(id)`` prints a rule's rationale and the field report it comes from (docs/rules.md lists all).
"""
from rlc.compiler.rules.engine import (Context, Rule, RulesResult, UnknownRuleError, all_rules, explain, rule,
                                       run_rules)

__all__ = ["Context", "Rule", "RulesResult", "UnknownRuleError", "all_rules", "explain", "rule", "run_rules"]
