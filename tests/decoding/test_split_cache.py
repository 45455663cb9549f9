"""`generate` remembers a model's `nnx.split` (api.split_model) only while the model is
unchanged: new weights, a replaced variable or a new model are always seen."""

import gc

import jax.numpy as jnp
import numpy as np
from flax import nnx

from asynclane_jax.decoding import api, generate
from asynclane_jax.models import init_model, tiny_llada

PROMPTS = [[5, 9, 11, 3], [7, 2]]
OPTS = dict(sampler="vanilla", gen_length=8, steps=4, block_length=8)


def test_the_split_is_remembered_while_the_model_is_unchanged():
    model = init_model(tiny_llada(), 0)
    g1, p1 = api.split_model(model)
    g2, p2 = api.split_model(model)
    assert g1 is g2 and p1 is p2
    # It is nnx.split's: the same structure and the model's own variables.
    g3, p3 = nnx.split(model)
    assert g1 == g3
    assert all(a[1] is b[1] for a, b in zip(nnx.to_flat_state(p1), nnx.to_flat_state(p3)))


def test_new_weights_or_a_replaced_variable_are_split_again():
    model = init_model(tiny_llada(), 0)
    _, p1 = api.split_model(model)
    new = model.lm_head.kernel[...] * 2.0
    model.lm_head.kernel[...] = new  # a new array in the same variable
    _, p2 = api.split_model(model)
    assert p2 is not p1
    assert p2["lm_head"]["kernel"][...] is new
    # A variable replaced by another one (the structure is unchanged).
    replaced = nnx.Param(jnp.zeros_like(model.lm_head.kernel[...]))
    model.lm_head.kernel = replaced
    _, p3 = api.split_model(model)
    assert p3 is not p2 and p3["lm_head"]["kernel"] is replaced


def test_generate_decodes_with_the_current_weights():
    model = init_model(tiny_llada(), 0)
    before = generate(model, PROMPTS, **OPTS).tokens
    old = model.lm_head.kernel[...]
    head = np.array(old)
    rng = np.random.default_rng(1)
    model.lm_head.kernel[...] = jnp.asarray(head[:, rng.permutation(head.shape[1])] * 5.0)
    after = generate(model, PROMPTS, **OPTS).tokens
    # What a model built with those weights from the start decodes.
    fresh = init_model(tiny_llada(), 0)
    nnx.update(fresh, nnx.state(model))
    assert np.array_equal(after, generate(fresh, PROMPTS, **OPTS).tokens)
    assert not np.array_equal(before, after)
    # And the old weights back: the first tokens again.
    model.lm_head.kernel[...] = old
    assert np.array_equal(generate(model, PROMPTS, **OPTS).tokens, before)


def test_a_dropped_model_leaves_nothing_behind():
    model = init_model(tiny_llada(), 0)
    api.split_model(model)
    key = id(model)
    assert key in api._SPLITS
    del model
    gc.collect()
    assert key not in api._SPLITS
