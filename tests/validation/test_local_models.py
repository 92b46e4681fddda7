"""Models outside the catalog that the suite plans from a local config.json (``model.config``).

Each config carries its sources in ``_provenance``; the planner must read it into the published
parameter count, so a reader that drops a component (e.g. DeepSeek-V2-Lite's full query projection,
which has no query LoRA) shows up here rather than as a silently wrong plan.
"""
from __future__ import annotations

import pytest

from rlc.compiler import catalog

from validation_helpers import HERE

MODELS = HERE / "models"

#: model id -> (config folder, published total parameters, relative tolerance, family read)
PUBLISHED = {
    "Qwen/Qwen3-32B": ("Qwen3-32B", 32.8e9, 0.005, "qwen3"),
    "deepseek-ai/DeepSeek-V2-Lite-Chat": ("DeepSeek-V2-Lite-Chat", 15.7e9, 0.005, "deepseek_v2"),  # model card
}


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_local_config_plans_the_published_parameter_count(model_id):
    folder, total, rel, family = PUBLISHED[model_id]
    facts = catalog.model_facts(model_id, MODELS, config=str(MODELS / folder / "config.json"))
    assert facts.family == family
    assert not facts.unknown, facts.unknown
    assert facts.param_counts()["total_without_mtp"] == pytest.approx(total, rel=rel)


def test_deepseek_v2_has_no_mtp_and_no_expert_bias():
    """DeepSeek-V2 routes with a softmax (topk_method greedy) and has no MTP module: nothing fp32 on the wire."""
    facts = catalog.model_facts("deepseek-ai/DeepSeek-V2-Lite-Chat", MODELS,
                                config=str(MODELS / "DeepSeek-V2-Lite-Chat" / "config.json"))
    assert facts.mtp_num_layers == 0
    assert not facts.expert_bias
    assert facts.param_counts()["mtp"] == 0
