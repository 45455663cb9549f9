"""Shared test setup: float32 at highest matmul precision, small models."""

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def sharpened_model(cfg, seed=0, scale=200.0):
    """A random model whose output head is scaled up, so that softmax confidences often
    exceed 0.9 and threshold samplers commit several tokens per step."""
    from flax import nnx

    from asynclane_jax.models import init_model

    model = init_model(cfg, seed)
    state = nnx.state(model, nnx.Param)
    head = state["lm_head"]["kernel"] if "lm_head" in state else state["embed"]
    head.value = head.value * scale
    nnx.update(model, state)
    return model


@pytest.fixture(scope="session")
def tiny_llada_model():
    from asynclane_jax.models import tiny_llada

    return sharpened_model(tiny_llada(), seed=0)


@pytest.fixture(scope="session")
def tiny_dream_model():
    from asynclane_jax.models import tiny_dream

    return sharpened_model(tiny_dream(), seed=1)
