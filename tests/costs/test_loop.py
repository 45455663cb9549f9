"""costs.loop: the layerless copy of a model that prices a schedule's own work between
its calls, and the overhead measured with it."""

import math

import jax.numpy as jnp
import numpy as np
from reference_samplers import make_prompts

from asynclane_jax.costs.loop import loop_overhead, without_layers


def test_without_layers_keeps_the_embedding_and_the_head(tiny_llada_model):
    model = tiny_llada_model
    bare = without_layers(model)
    assert bare.cfg.n_layers == 0 and len(bare.layers) == 0
    assert model.cfg.n_layers > 0  # the model itself is untouched
    np.testing.assert_array_equal(bare.embed[...], model.embed[...])
    tokens = jnp.asarray([[3, 5, 7, 11]], jnp.int32)
    pos = jnp.arange(4)[None]
    # No layer between the embedding and the head: logits = head(norm(embed)).
    want = model._logits(jnp.take(model.embed[...], tokens, axis=0))
    got, _ = bare.forward(tokens, pos)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Logits read at some columns only: the same rows.
    idx = jnp.asarray([[1, 3]], jnp.int32)
    part, _ = bare.forward(tokens, pos, logits_index=idx)
    np.testing.assert_allclose(part, got[:, [1, 3]], rtol=1e-6, atol=1e-6)


def test_loop_overhead_is_seconds_per_call(tiny_llada_model):
    prompts = make_prompts(tiny_llada_model.cfg.vocab_size, lengths=(6,))
    s = loop_overhead(tiny_llada_model, prompts, sampler="fast-dllm", gen_length=32,
                      cache="dual", bucket=16)
    assert math.isfinite(s) and 0.0 <= s < 1.0
