"""asynclane_jax.bench.project: the preset a bench's model is projected onto, by family,
LLaDA2 (mixture of experts) included."""

from __future__ import annotations

import pytest

from asynclane_jax.bench import project
from asynclane_jax.costs import call_cost
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.models import preset


@pytest.mark.parametrize("family, name", [("llada", "llada-8b-instruct"),
                                          ("dream", "dream-7b-instruct"),
                                          ("llada2", "llada2-mini")])
def test_each_family_projects_onto_its_preset(family, name):
    assert project.DEFAULT_PROJECT_MODELS[family] == name
    cfg = project.project_model_config(None, family)
    assert cfg == preset(name) and cfg.family == family
    # Every family's preset is priced (LLaDA2-mini's experts included).
    cost = call_cost(cfg, CallShape("cached", 1, 32, 640, 32, True, 640))
    assert cost.flops > 0 and (cost.moe_layers > 0) == (family == "llada2")


@pytest.mark.parametrize("model, family", [
    ("tiny-llada2-test", "llada2"), ("testbed-llada2-block", "llada2"),
    ("inclusionAI/LLaDA2.0-mini", "llada2"), ("tiny-llada", "llada"),
    ("llada-8b-instruct", "llada"), ("tiny-dream", "dream"),
    ("Dream-org/Dream-v0-Instruct-7B", "dream"), ("some-model", "llada")])
def test_family_of_a_bench_model_name(model, family):
    """llada2 is checked before llada, whose name it contains."""
    assert project.family_of_name(model) == family
