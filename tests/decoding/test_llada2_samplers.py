"""Samplers other than `llada2` on a block-causal LLaDA2 model, through the one driver:
D2F (made for block-causal students) decodes the tiny random LLaDA2 model as its
restatement of the public D2F decoding does, token for token and call for call; a sampler
with no attention layout of its own (fast-dllm) gets the model's, LLaDA2's blocks."""

from __future__ import annotations

import numpy as np
import pytest
from reference_samplers import d2f, make_prompts
from test_llada2_decode import tiny_llada2

from asynclane_jax.decoding import generate


@pytest.mark.slow
def test_d2f_decodes_llada2_as_its_restatement():
    model = tiny_llada2(lm_scale=60.0)
    assert model.cfg.block_causal
    prompts = make_prompts(model.cfg.vocab_size)
    kw = dict(block_add_threshold=0.5, decoded_token_threshold=0.5, skip_threshold=0.5)
    res = generate(model, prompts, sampler="d2f", gen_length=16, block_length=8,
                   max_active_blocks=2, **kw)
    assert res.stats.nfe_full == 0  # every call cached, block-causal
    assert not np.any(res.tokens == model.cfg.mask_token_id)
    for i, p in enumerate(prompts):
        tokens, info = d2f(model, p, gen_length=16, block_length=8, **kw)
        assert info["logit_margin"] > 1e-4 and info["conf_margin"] > 1e-5
        np.testing.assert_array_equal(res.tokens[i], tokens, err_msg=f"row {i}")
        assert res.stats.row_nfe_partial[i] == info["steps"]



def _threshold_block_causal(model, prompt, *, gen_length, block_length, threshold):
    """Fast-dLLM's threshold rule without a cache (every step a forward over the
    canvas), restated on LLaDA2's attention: blocks of 32 columns from the first prompt
    token, a query seeing its own block and the earlier ones. Returns (tokens, steps,
    smallest gap between a confidence and the threshold)."""
    import jax
    import jax.numpy as jnp

    mask = model.cfg.mask_token_id
    P = len(prompt)
    canvas = np.asarray(list(prompt) + [mask] * gen_length, np.int32)
    blocks = np.arange(P + gen_length, dtype=np.int32) // 32
    forward = jax.jit(lambda c: model(c[None], block_ids=jnp.asarray(blocks)[None])[0])
    steps, gap = 0, np.inf
    for start in range(P, P + gen_length, block_length):
        span = np.arange(start, start + block_length)
        while np.any(canvas[span] == mask):
            probs = np.asarray(jax.nn.softmax(forward(jnp.asarray(canvas)), axis=-1))
            steps += 1
            cand = span[canvas[span] == mask]
            conf = probs[cand].max(-1)
            commit = conf >= threshold
            commit[np.argmax(conf)] = True
            gap = min(gap, float(np.min(np.abs(conf - threshold))))
            canvas[cand[commit]] = probs[cand[commit]].argmax(-1)
    return canvas[P:], steps, gap


@pytest.mark.slow
def test_a_sampler_without_a_layout_decodes_llada2_with_its_blocks():
    """fast-dllm sets no attention layout; on a LLaDA2 model the driver gives it the
    model's own (blocks of 32 from the first prompt token), so it decodes as its
    threshold rule restated on that attention, row by row in a left-padded batch."""
    model = tiny_llada2(lm_scale=60.0)
    prompts = make_prompts(model.cfg.vocab_size)
    res = generate(model, prompts, sampler="fast-dllm", cache="none", gen_length=40,
                   block_length=8, threshold=0.7)
    for i, p in enumerate(prompts):
        assert (len(p) + 40) > 32  # every row spans two attention blocks
        tokens, steps, gap = _threshold_block_causal(model, p, gen_length=40,
                                                     block_length=8, threshold=0.7)
        assert gap > 1e-5
        np.testing.assert_array_equal(res.tokens[i], tokens, err_msg=f"row {i}")
        assert res.stats.row_nfe_full[i] == steps
