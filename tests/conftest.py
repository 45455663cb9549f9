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
