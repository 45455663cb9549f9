"""Shared test setup: float32 at highest matmul precision, small models."""

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def tiny_llada_model():
    """A random tiny LLaDA, sharpened so that threshold samplers commit several tokens
    per step (see reference_samplers.make_model)."""
    from reference_samplers import make_model

    return make_model("llada", lm_scale=40.0)


@pytest.fixture(scope="session")
def tiny_dream_model():
    from reference_samplers import make_model

    return make_model("dream", lm_scale=30.0)


# The files that take longest, in the order they should start: with the suite split
# across two workers one file at a time (pyproject addopts), a long file that starts
# last keeps one worker busy alone at the end.
LONGEST_FIRST = ("test_sharding.py", "test_asynclane.py", "test_asynclane_forking.py",
                 "test_serve_http.py", "test_equal_footing.py", "test_d2f.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable otherwise
