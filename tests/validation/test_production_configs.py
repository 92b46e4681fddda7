"""Public production GRPO configurations, hand-translated into recipes, compile with no error.

Each recipe in ``recipes/`` is a configuration that ran and whose result was published (step time,
throughput); ``extensions.provenance`` names the repository, commit, file and published result. A
configuration known to work must not be rejected: every one compiles with no error.

Where one fails today because of a false alarm that is being fixed, the test is an expected
failure (``strict``: it turns into a failure the day the recipe compiles clean, so the mark is
removed then), and :func:`test_only_the_known_false_alarms_fire` keeps the mark honest: no other
error may hide behind it.
"""
from __future__ import annotations

from collections import Counter

import pytest

from rlc.compiler import api

from validation_helpers import COMMIT, PRODUCTION, provenance, recipes, rules

#: Why each rule fires falsely on configurations that ran (the planner's remaining error, with numbers).
#: Empty today. DeepSeek-V3 on 32 x 8 H100 (RLC210, 1.44 GiB short at the refit) was the last entry until
#: NCCL's NVLS buffers were planned per layout: the calibration reference ran with NVLS on (1.5 GiB of
#: communicator buffers in its contexts), the published DeepSeek-V3 run with NCCL_NVLS_ENABLE=0.
WHY_FALSE: dict[str, str] = {}

#: Recipes that fail today, with the rule ids that fire falsely on each.
FALSE_ALARMS: dict[str, tuple[str, ...]] = {}

SUITE = recipes(PRODUCTION)


def _param(path):
    alarms = FALSE_ALARMS.get(path.stem)
    if not alarms:
        return pytest.param(path, id=path.stem)
    reason = "; ".join(f"{rule}: {WHY_FALSE[rule]}" for rule in alarms)
    return pytest.param(path, id=path.stem, marks=pytest.mark.xfail(strict=True, reason=reason))


def test_the_suite_covers_at_least_twelve_published_configurations():
    assert len(SUITE) >= 12
    models = {api.check(str(p)).recipe.model.id for p in SUITE}
    assert {"deepseek-ai/DeepSeek-V3", "Qwen/Qwen3-235B-A22B", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-32B",
            "meta-llama/Llama-3.1-8B"} <= models


#: Frameworks whose published configurations the suite holds, with the fewest recipes each must keep.
FRAMEWORKS = {"NVIDIA-NeMo/RL": 12, "volcengine/verl": 2, "THUDM/slime": 2, "NovaSky-AI/SkyRL": 2}


def test_the_suite_spans_several_frameworks():
    """Not only one framework's own benchmarks: each framework keeps its share of the suite."""
    repositories = Counter(provenance(p).get("repository") for p in SUITE)
    assert set(repositories) <= set(FRAMEWORKS), repositories
    assert all(repositories[repo] >= least for repo, least in FRAMEWORKS.items()), repositories


@pytest.mark.parametrize("path", SUITE, ids=lambda p: p.stem)
def test_every_recipe_names_its_public_source_and_result(path):
    source = provenance(path)
    assert source.get("repository", "").count("/") == 1, source
    assert COMMIT.match(str(source.get("commit", ""))), source
    assert str(source.get("path", "")).endswith((".yaml", ".sh", ".py")), source
    assert source.get("published"), "the published result that shows the configuration ran"


@pytest.mark.parametrize("path", [_param(p) for p in SUITE])
def test_published_configuration_compiles_with_no_error(path):
    result = api.check(str(path))
    errors = [f"{d.rule}: {d.message}" for d in result.errors]
    assert result.recipe is not None and not errors, errors


@pytest.mark.parametrize("path", SUITE, ids=lambda p: p.stem)
def test_only_the_known_false_alarms_fire(path):
    """An expected failure may only be one of the listed false alarms, never a new error."""
    result = api.check(str(path))
    assert result.recipe is not None, [d.message for d in result.diagnostics]
    assert rules(result, "error") <= set(FALSE_ALARMS.get(path.stem, ())), rules(result, "error")


@pytest.mark.parametrize("path", SUITE, ids=lambda p: p.stem)
def test_the_planner_knows_every_fact_it_needs(path):
    """A production model gets a full plan: per-GPU shards and the refit math, nothing unknown."""
    result = api.check(str(path))
    assert result.plan is not None and not result.plan.unknown, result.plan and result.plan.unknown
    assert result.plan.refit is not None
