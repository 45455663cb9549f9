"""AsyncLane's renewal calls: cached calls of two widths in the one decode loop.

- The driver: a wide call writes the K/V of the columns after the plan's first
  `narrow_queries` and a narrow call leaves them as they were; both give the schedule
  the logits of the first `narrow_queries` queries only.
- The schedule: with renew > 0 the refreshes that follow the window are renewals, so a
  row makes one full forward (its first call) unless full_travel asks for more; rows of
  a batch decode as they do alone. The block samplers' `renew` does the same at their
  block starts, and both keep full forwards where a renewal call would be wider than
  the canvas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from reference_samplers import make_model, make_prompts
from test_asynclane import check_invariants

from asynclane_jax.decoding import driver, generate
from asynclane_jax.decoding.asynclane import AsyncLaneSchedule


def _loop(model, schedule, prompt, G):
    cfg = model.cfg
    canvas = jnp.asarray([list(prompt) + [cfg.mask_token_id] * G], jnp.int32)
    graphdef, params = nnx.split(model)
    loop = driver.build_loop(graphdef, params, canvas, jnp.zeros((1,), jnp.int32),
                             jnp.ones((1,), bool), jax.random.key(0),
                             schedule=schedule.bind(None, cfg), pieces=True)
    st = loop.first_call(loop.state, jnp.ones((1,), bool))
    return loop, loop.body(st)  # the row's first call: a full forward


def test_a_wide_call_re_encodes_the_renewal_columns_and_a_narrow_one_does_not():
    model = make_model("llada", lm_scale=30.0, seed=1)
    G, B, R = 48, 8, 8
    schedule = AsyncLaneSchedule(gen_length=G, block_length=B, renew=R, renew_back=B,
                                 max_lanes=1, threshold=0.99)
    prompt = make_prompts(model.cfg.vocab_size, lengths=(5,), seed=0)[0]
    loop, st = _loop(model, schedule, prompt, G)
    assert int(st.nfe_full) == 1 and bool(np.any(np.asarray(st.canvas[0, 5:]) !=
                                                 model.cfg.mask_token_id))
    P = loop.ctx.prompt_len
    after = np.arange(P + B, P + B + R)  # the renewal columns after the first window
    far = np.arange(P + B + R, P + G)  # never queried by either call

    def step(need_renew: bool):
        s = st.replace(sched=st.sched.replace(need_renew=jnp.asarray([need_renew])))
        return loop.body(s)

    wide, narrow = step(True), step(False)
    k0 = np.asarray(st.cache.k)
    kw, kn = np.asarray(wide.cache.k), np.asarray(narrow.cache.k)
    # The first window committed since the full forward, so re-encoding the masked
    # columns after it gives other K/V; the narrow call leaves them as they were.
    assert not np.allclose(kw[:, 0, after], k0[:, 0, after])
    np.testing.assert_array_equal(kn[:, 0, after], k0[:, 0, after])
    np.testing.assert_array_equal(kw[:, 0, far], k0[:, 0, far])
    # Both are one cached call; the wide one processed R more positions, and only it
    # counts as a renewal.
    assert int(wide.nfe_partial) == int(narrow.nfe_partial) == 1
    assert int(wide.tokens_processed) - int(narrow.tokens_processed) == R
    assert int(wide.sched.renewals[0]) == 1 and int(narrow.sched.renewals[0]) == 0


def test_renewals_replace_the_full_forwards_after_the_first():
    model = make_model("llada", lm_scale=30.0, seed=0)
    cfg = model.cfg
    prompts = make_prompts(cfg.vocab_size, lengths=(4, 7, 11), seed=3)
    base = dict(sampler="asynclane", gen_length=64, block_length=8, max_lanes=1,
                threshold=0.6, cascade=False, bucket=16)
    full = generate(model, prompts, **base)
    renew = generate(model, prompts, renew=16, renew_back=8, **base)
    every32 = generate(model, prompts, renew=16, renew_back=8, full_travel=32, **base)
    for res in (full, renew, every32):
        check_invariants(res, cfg, cascade=False)
    assert np.all(full.stats.renewals == 0) and np.all(full.stats.refreshes >= 4)
    # One full forward per row (the first call); each travel refresh became a renewal.
    np.testing.assert_array_equal(renew.stats.refreshes, 1)
    np.testing.assert_array_equal(renew.stats.row_nfe_full, 1)
    assert np.all(renew.stats.renewals >= 3), renew.stats.renewals
    # full_travel brings back a full forward every 32 positions travelled.
    assert np.all(every32.stats.refreshes > 1)
    assert np.all(every32.stats.refreshes < full.stats.refreshes)
    # Rows of a batch decode as they do alone while others renew or refresh.
    for i, p in enumerate(prompts):
        alone = generate(model, [p], renew=16, renew_back=8, full_travel=32, **base)
        np.testing.assert_array_equal(every32.tokens[i], alone.tokens[0])
        for f in ("refreshes", "renewals", "row_nfe_full", "row_nfe_partial"):
            np.testing.assert_array_equal(getattr(every32.stats, f)[i],
                                          getattr(alone.stats, f)[0], err_msg=f)


def test_block_samplers_renew_at_block_starts():
    model = make_model("dream", lm_scale=30.0, seed=2)  # the logit shift included
    cfg = model.cfg
    prompts = make_prompts(cfg.vocab_size, lengths=(4, 7, 11), seed=5)
    base = dict(sampler="fast-dllm", gen_length=64, block_length=8, cache="dual",
                threshold=0.6, bucket=16)
    full = generate(model, prompts, **base)
    renew = generate(model, prompts, renew=16, **base)
    assert not np.any(renew.tokens == cfg.mask_token_id)
    np.testing.assert_array_equal(full.stats.row_nfe_full, 8)  # one per block
    np.testing.assert_array_equal(renew.stats.row_nfe_full, 1)  # the first block's only
    # A renewal call is one cached call per block start: the calls are as many.
    np.testing.assert_array_equal(renew.stats.row_steps, renew.stats.row_nfe_full
                                  + renew.stats.row_nfe_partial)
    for i, p in enumerate(prompts):
        alone = generate(model, [p], renew=16, **base)
        np.testing.assert_array_equal(renew.tokens[i], alone.tokens[0])
        np.testing.assert_array_equal(renew.stats.row_nfe_partial[i],
                                      alone.stats.row_nfe_partial[0])
    # A renewal call as wide as the canvas (8 + 8 + 64 > 64 + 16) is not made.
    wide = generate(model, prompts, **{**base, "renew": 64})
    np.testing.assert_array_equal(wide.tokens, full.tokens)
    np.testing.assert_array_equal(wide.stats.row_nfe_full, 8)
