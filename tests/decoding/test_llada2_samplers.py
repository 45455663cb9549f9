"""Samplers other than `llada2` on a block-causal LLaDA2 model, through the one driver:
D2F (made for block-causal students) decodes the tiny random LLaDA2 model as its
restatement of the public D2F decoding does, token for token and call for call."""

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

