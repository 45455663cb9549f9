"""The attention implementations: the written-out reference equals the XLA path
(`_xla_attention`), and decoding with either gives the same tokens; "auto" runs the XLA
path on a CPU (cuDNN's fused kernel only on GPUs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import asynclane_jax
from asynclane_jax.decoding import generate
from asynclane_jax.models.model import attention, resolve_attention
from asynclane_jax.testbed import evaluate, tasks


def test_reference_equals_xla_with_padding_and_block_masks():
    ks = jax.random.split(jax.random.key(0), 3)
    b, Q, T, H, K, h = 2, 5, 9, 6, 2, 8
    q = jax.random.normal(ks[0], (b, Q, H, h))
    k = jax.random.normal(ks[1], (b, T, K, h))
    v = jax.random.normal(ks[2], (b, T, K, h))
    key_mask = jnp.arange(T)[None, :] >= jnp.array([[0], [3]])
    k_block = jnp.broadcast_to(jnp.arange(T) // 3, (b, T))
    q_block = jnp.broadcast_to(jnp.array([0, 1, 1, 2, 2]), (b, Q))
    for kw in ({}, {"key_mask": key_mask},
               {"key_mask": key_mask, "q_block": q_block, "k_block": k_block}):
        ref = attention(q, k, v, implementation="reference", **kw)
        xla = attention(q, k, v, implementation="xla", **kw)
        np.testing.assert_allclose(np.asarray(ref), np.asarray(xla), atol=1e-5, rtol=1e-5)
    # The masks matter: with them, the output is not the unmasked one.
    assert not np.allclose(attention(q, k, v, key_mask=key_mask),
                           attention(q, k, v), atol=1e-3)


def test_auto_choice_and_bad_names():
    assert jax.default_backend() == "cpu"
    assert resolve_attention(None, jnp.bfloat16) == "xla"
    assert resolve_attention("auto", jnp.float32) == "xla"
    assert resolve_attention("reference", jnp.float32) == "reference"
    with pytest.raises(ValueError, match="flash"):
        resolve_attention("flash", jnp.float32)


@pytest.mark.parametrize("sampler", ["fast-dllm", "asynclane"])
def test_tokens_equal_with_the_reference_attention(sampler):
    model, tok, _ = asynclane_jax.load("tiny-llada")
    prompts = evaluate.prompts_for(tasks.heldout(3))
    base = generate(model, prompts, sampler=sampler, gen_length=64)
    plain = nnx.clone(model)
    plain.attention_implementation = "reference"
    res = generate(plain, prompts, sampler=sampler, gen_length=64)
    assert res.stats.compiled  # its own program, not the cached XLA one
    np.testing.assert_array_equal(res.tokens, base.tokens)
