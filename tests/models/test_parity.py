"""Parity of the Flax model with an independent PyTorch reference.

The reference is transformers' LlamaForCausalLM (LLaDA) / Qwen2ForCausalLM (Dream) with
`config.is_causal = False`, built from the Hugging Face config.json and holding random
tiny weights under the real checkpoint tensor names; our model gets the same tensors
through the converter's name tables. Everything runs in float32 at the highest matmul
precision; logits must agree to 1e-4.
"""

from __future__ import annotations

import chex
import hf_reference as H
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

jax.config.update("jax_default_matmul_precision", "highest")

TOL = 1e-4

CASES = {
    "llada": H.llada_hf_config(),
    "llada-tied-gqa-bias": H.llada_hf_config(weight_tying=True, n_kv_heads=2,
                                             include_qkv_bias=True),
    "dream": H.dream_hf_config(),  # GQA (4 query / 2 kv heads) with q/k/v biases
    "dream-tied": H.dream_hf_config(tie_word_embeddings=True, num_key_value_heads=1),
}


# Jitted entry points: one compile per shape instead of op-by-op dispatch.
@nnx.jit
def forward(model, tokens, positions=None, key_mask=None):
    return model(tokens, positions=positions, key_mask=key_mask)


@nnx.jit
def forward_kv(model, tokens):
    return model(tokens, return_kv=True)


@nnx.jit
def forward_cached(model, tokens, positions, write_index, cache, key_mask=None):
    return model.forward_cached(tokens, positions, write_index, cache, key_mask=key_mask)


_BUILT = {}


def _build(name):
    if name not in _BUILT:
        hf = CASES[name]
        tensors = H.random_tensors(hf, seed=len(name))
        _BUILT[name] = (name, hf, tensors, H.reference(hf, tensors), H.ours_from(hf, tensors))
    return _BUILT[name]


@pytest.fixture(params=list(CASES))
def case(request):
    return _build(request.param)


# The cache / padding / sensitivity checks exercise code shared by all variants; one
# case per family keeps the suite fast.
@pytest.fixture(params=["llada", "dream"])
def family_case(request):
    return _build(request.param)


def tokens_for(hf, b=2, t=12, seed=0):
    vocab = hf.get("embedding_size") or hf["vocab_size"]
    return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


def max_diff(model, ref, tokens):
    from checkpoints_convert.verify import reference_logits

    ours = np.asarray(forward(model, jnp.asarray(tokens)))
    return float(np.max(np.abs(ours - reference_logits(ref, tokens)))), ours


def test_reference_is_bidirectional(case):
    """is_causal=False must really remove the causal mask (and ours must agree)."""
    from checkpoints_convert.verify import reference_logits

    _, hf, _, ref, model = case
    tokens = tokens_for(hf, b=1)
    changed = tokens.copy()
    changed[0, -1] = (changed[0, -1] + 1) % 60
    ref_delta = np.abs(reference_logits(ref, tokens)[0, 0] - reference_logits(ref, changed)[0, 0])
    ours_delta = np.abs(np.asarray(forward(model, jnp.asarray(tokens))[0, 0]
                                   - forward(model, jnp.asarray(changed))[0, 0]))
    assert ref_delta.max() > 1e-3, "the reference ignored a later token: still causal"
    assert ours_delta.max() > 1e-3


def test_logits_match_reference(case):
    name, hf, _, ref, model = case
    diff, ours = max_diff(model, ref, tokens_for(hf))
    print(f"\n{name}: max |logit diff| = {diff:.3g} (logit scale {np.abs(ours).max():.3g})")
    assert diff <= TOL


def test_check_fails_when_one_weight_is_perturbed(family_case):
    """The parity check is sensitive: one changed weight entry breaks it."""
    name, hf, tensors, ref, _ = family_case
    perturbed = dict(tensors)
    key = next(k for k in tensors if k.endswith(("blocks.1.up_proj.weight",
                                                 "layers.1.mlp.up_proj.weight")))
    w = perturbed[key].clone()
    w[3, 5] += 0.05
    perturbed[key] = w
    diff, _ = max_diff(H.ours_from(hf, perturbed), ref, tokens_for(hf))
    print(f"\n{name}: one up_proj entry +0.05 -> max |logit diff| = {diff:.3g}")
    assert diff > 10 * TOL


def test_cached_forward_matches_full_forward(family_case):
    _, hf, _, _, model = family_case
    tokens = jnp.asarray(tokens_for(hf))
    b, t = tokens.shape
    full, cache = forward_kv(model, tokens)
    idx = jnp.asarray([[1, 4, 7, 10], [0, 2, 3, 11]], jnp.int32)
    rows = jnp.arange(b)[:, None]
    got, new_cache = forward_cached(model, tokens[rows, idx], idx, idx, cache,
                                    key_mask=jnp.ones((b, t), bool))
    # The logits of the queried columns, and the cache: the fresh cache already held
    # these K/V, so rewriting them changes nothing.
    chex.assert_trees_all_close((got, new_cache), (full[rows, idx], cache), atol=1e-5,
                                rtol=1e-7)
    # An unused query slot (index >= T) is dropped and does not disturb the others.
    idx2 = idx.at[:, -1].set(t)
    got2, cache2 = forward_cached(model, tokens[rows, jnp.minimum(idx2, t - 1)], idx2, idx2,
                                  cache)
    chex.assert_trees_all_close((got2[:, :-1], cache2), (full[rows, idx[:, :-1]], cache),
                                atol=1e-5, rtol=1e-7)


def test_left_padding_with_key_mask_and_shifted_positions(family_case):
    _, hf, _, ref, model = family_case
    real = tokens_for(hf, b=1, t=9, seed=3)[0]
    pad = 4
    pad_id = hf["pad_token_id"]
    padded = np.concatenate([np.full(pad, pad_id), real])[None].astype(np.int32)
    unpadded = np.concatenate([real, np.full(pad, pad_id)])[None].astype(np.int32)
    key_mask = np.arange(padded.shape[1])[None] >= pad
    positions = np.maximum(np.arange(padded.shape[1]) - pad, 0)[None].astype(np.int32)
    batch = jnp.asarray(np.concatenate([padded, unpadded]))
    masks = jnp.asarray(np.concatenate([key_mask, key_mask[:, ::-1]]))
    pos = jnp.asarray(np.concatenate([positions, np.arange(padded.shape[1])[None]]))
    logits = np.asarray(forward(model, batch, positions=pos, key_mask=masks))
    alone = np.asarray(forward(model, jnp.asarray(real[None])))
    chex.assert_trees_all_close((logits[0, pad:], logits[1, :-pad]), (alone[0], alone[0]),
                                atol=1e-5, rtol=1e-7)
    # And the reference agrees on the padded row given the same mask and positions.
    from checkpoints_convert.verify import reference_logits

    want = reference_logits(ref, padded, attention_mask=key_mask, position_ids=positions)
    chex.assert_trees_all_close(logits[0, pad:], want[0, pad:], atol=TOL, rtol=0.0)
