"""Early-Bird over a dual K/V cache (cache=dual): the plan (refreshes, cached queries of
the block), the max_block cut on hand-made logits, the option checks; without its
routers, Fast-dLLM's dual-cache threshold decoding token for token on a tiny LLaDA and a
restatement of it on a tiny Dream; with the shipped routers on tiny-llada, every row
decoded with fewer full forwards than without the cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from asynclane_jax.decoding import generate
from asynclane_jax.decoding.early_bird import EarlyBirdSchedule
from asynclane_jax.decoding.schedule import CallOutput, Context, SamplerError

try:  # pytest puts tests/ on sys.path while it is not a package
    import reference_samplers as ref
except ImportError:  # pragma: no cover
    from tests import reference_samplers as ref

M, EOS, V = 9, 8, 10  # the hand-made cases' mask id, end-of-text, vocabulary
P, G = 2, 12
GEN, BLOCK = 64, 32


def _ctx(batch=1, shift=0):
    return Context(batch=batch, prompt_len=P, gen_length=G, shift=shift, mask_id=M,
                   eos_id=EOS, stop_ids=(EOS,), pad_len=jnp.zeros((batch,), jnp.int32))


def _sched(**kw):
    kw = {"lbs": False, "lps": False, "g_max": 2, "l_min": 3, "fallback_length": 6,
          "cache": "dual", **kw}
    return EarlyBirdSchedule(gen_length=G, **kw)


def _full_call(conf_at, batch=1):
    """A full call predicting every generated position: token 5, at probability
    conf_at.get(pos, 0.3)."""
    probs = np.full((batch, G, V), 0.0)
    for i in range(G):
        c = conf_at.get(i, 0.3)
        probs[:, i] = (1 - c) / (V - 1)
        probs[:, i, 5] = c
    cols = P + np.arange(G)
    return CallOutput(logits=jnp.log(jnp.asarray(probs, jnp.float32)),
                      targets=jnp.asarray(np.broadcast_to(cols, (batch, G)), jnp.int32),
                      serve=jnp.ones((batch,), bool), full=jnp.asarray(True))


# ----------------------------------------------------------------------------- rules

def test_options_are_validated():
    for bad, what in ((dict(cache="prefix"), "cache"), (dict(cache="Dual"), "cache"),
                      (dict(max_block=0), "max_block"), (dict(max_block=2.5), "max_block"),
                      (dict(max_block=True), "max_block"), (dict(lbs="yes"), "lbs")):
        with pytest.raises(SamplerError, match=f"eb: {what}="):
            EarlyBirdSchedule(gen_length=G, **bad)
    from asynclane_jax.bench.spec import validate
    from asynclane_jax.decoding.api import make_schedule

    assert make_schedule("eb", gen_length=G, cache="dual").uses_cache
    assert not make_schedule("eb", gen_length=G).uses_cache  # the default: no cache
    assert validate(["eb:cache=dual"], [128])[0][2] == [{"cache": "dual"}]
    with pytest.raises(SamplerError, match="cache="):
        make_schedule("eb", gen_length=G, cache="bogus")


def test_plan_refreshes_rows_that_need_a_block_and_queries_the_block_otherwise():
    for shift in (0, 1):
        sched, ctx = _sched(), _ctx(batch=2, shift=shift)
        state = sched.init(ctx)
        canvas = jnp.asarray([[1, 2] + [M] * G] * 2)
        live = jnp.ones((2,), bool)
        plan = sched.plan(ctx, canvas, state, live)
        # No row has a block yet: a refresh of both, every generated column predicted.
        assert bool(plan.full) and np.asarray(plan.serve).all()
        np.testing.assert_array_equal(plan.full_read[0], P + np.arange(G) - shift)
        # Row 0 gets the block 2, 3, 7 (4..6 committed); row 1's block is resolved.
        block = np.zeros((2, G), bool)
        block[0, [2, 3, 7]] = True
        block[1, [0, 1]] = True
        canvas = np.asarray(canvas).copy()
        canvas[0, P + np.array([4, 5, 6])] = 3
        canvas[1, P + np.array([0, 1])] = 3
        state = state.replace(block=jnp.asarray(block))
        plan = sched.plan(ctx, jnp.asarray(canvas), state, live)
        assert bool(plan.full) and np.asarray(plan.serve).tolist() == [False, True]
        # Once row 1 is finished, a cached call serves row 0 and queries its block.
        plan = sched.plan(ctx, jnp.asarray(canvas), state, jnp.asarray([True, False]))
        assert not bool(plan.full) and np.asarray(plan.serve).tolist() == [True, False]
        want = [P + j - shift for j in (2, 3, 7)] + [P + G] * (G - 3)
        assert np.asarray(plan.positions[0]).tolist() == want
        # The cached query width is max_block (a refresh still reads all G columns).
        narrow = _sched(max_block=4)
        plan = narrow.plan(ctx, jnp.asarray(canvas), state, jnp.asarray([True, False]))
        assert np.asarray(plan.positions[0]).tolist() == want[:3] + [P + G]
        assert plan.full_read.shape == (2, G) and narrow.query_size() == 4


def test_blocks_are_cut_to_max_block_with_the_cache_only():
    # lbs=false: the fallback, the first 6 masked positions; max_block=4 cuts it.
    canvas = jnp.asarray([[1, 2] + [M] * G])
    conf = {i: 0.95 for i in range(G)}  # everything passes the threshold
    for cache, want_block, want_cut in (("none", 6, 0), ("dual", 4, 1)):
        sched = _sched(cache=cache, max_block=4)
        out, state = sched.update(_ctx(), canvas, sched.init(_ctx()), _full_call(conf), None)
        assert int(state.size[0]) == want_block and int(state.cut[0]) == want_cut
        gen = np.asarray(out)[0, P:]
        assert (gen[:want_block] == 5).all() and (gen[want_block:] == M).all()
    # The default max_block (64) leaves a block of 6 whole.
    sched = _sched()
    _, state = sched.update(_ctx(), canvas, sched.init(_ctx()), _full_call(conf), None)
    assert int(state.size[0]) == 6 and int(state.cut[0]) == 0


def test_a_cached_call_decodes_the_block_and_chooses_none():
    sched = _sched()
    canvas = jnp.asarray([[1, 2] + [M] * G])
    # Refresh: block 0..5; only position 1 passes.
    canvas, state = sched.update(_ctx(), canvas, sched.init(_ctx()), _full_call({1: 0.95}),
                                 None)
    assert np.asarray(state.block)[0].tolist() == [True] * 6 + [False] * 6
    # A cached call predicts the block's columns only (the others: no prediction).
    cols = np.asarray(sched.plan(_ctx(), canvas, state, jnp.ones((1,), bool)).positions)
    assert cols[0, :6].tolist() == (P + np.arange(6)).tolist()
    probs = np.full((1, G, V), 0.7 / (V - 1))
    probs[0, :, 5] = 0.3
    probs[0, 3] = 0.05 / (V - 1)
    probs[0, 3, 4] = 0.95
    out = CallOutput(logits=jnp.log(jnp.asarray(probs, jnp.float32)),
                     targets=jnp.asarray(cols, jnp.int32), serve=jnp.ones((1,), bool),
                     full=jnp.asarray(False))
    canvas, state = sched.update(_ctx(), canvas, state, out, None)
    gen = np.asarray(canvas)[0, P:]
    assert gen[1] == 5 and gen[3] == 4 and (gen[[0, 2, 4, 5]] == M).all()
    assert int(state.blocks[0]) == 1  # the block is kept; no block was chosen


# ----------------------------------------------------------------------------- tiny models

def _restated(model, prompt, *, gen_length, block, threshold=0.9):
    """eb lbs=false lps=false cache=dual at batch 1, in plain Python: Fast-dLLM's
    dual-cache threshold loop (tests/reference_samplers.py) on blocks of `block`, its
    cached window moved to the block's columns minus the logit shift ([s - 1, e - 1) on a
    Dream model: every block position predicted in every call), the refresh decoding with
    the threshold rule too (Fast-dLLM's Dream code commits only column s there).
    Returns (tokens, full calls, cached calls)."""
    run = ref.runner(model)
    mask, shift = model.cfg.mask_token_id, int(model.cfg.logit_shift)
    x, p_len = ref._canvas(model, prompt, gen_length)
    full = cached = 0
    for s in range(p_len, p_len + gen_length, block):
        e, kv = s + block, None
        while (x[s:e] == mask).any():
            pos = np.flatnonzero(x[s:e] == mask) + s
            if kv is None:
                logits, kv = run.full_kv(x)
                rows, full = logits[pos - shift], full + 1
            else:
                rows = run.cached(x, s - shift, e - shift, s - shift, kv)[pos - s]
                cached += 1
            x0 = rows.argmax(-1)
            conf = ref.softmax(rows, np.float32)[np.arange(len(pos)), x0]
            sel = conf >= threshold
            sel[np.argmax(conf)] = True
            x[pos[sel]] = x0[sel]
    return x[p_len:].copy(), full, cached


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_without_routers_it_is_dual_cache_threshold_decoding(family):
    """lbs=false lps=false cache=dual (blocks of 32, max_block 32, threshold 0.9): every
    row of a batch of three prompts equals the restatement at batch 1, calls included;
    on LLaDA it is also Fast-dLLM's cache=dual decoding, token for token and call for
    call."""
    model = ref.make_model(family, lm_scale=ref.LM_SCALE_THRESHOLD[family])
    prompts = ref.make_prompts(model.cfg.vocab_size)
    eb = dict(sampler="eb", gen_length=GEN, lbs=False, lps=False, cache="dual",
              fallback_length=BLOCK, threshold=0.9, max_block=BLOCK)
    # max_block < GEN: cached calls query BLOCK columns, refreshes read all GEN.
    res = generate(model, prompts, **eb)
    tokens = np.asarray(res.tokens)
    several = False
    for r, prompt in enumerate(prompts):
        want, full, cached = _restated(model, prompt, gen_length=GEN, block=BLOCK)
        np.testing.assert_array_equal(tokens[r], want, err_msg=f"row {r}")
        assert (int(res.stats.row_nfe_full[r]), int(res.stats.row_nfe_partial[r])) == \
            (full, cached), f"row {r}"
        several |= np.bincount(np.asarray(res.stats.commit_step[r])).max() > 1
    assert several, "the threshold path was never exercised"
    assert (res.stats.row_nfe_partial > 0).all() and not res.stats.hit_step_cap
    assert (res.stats.row_blocks == GEN // BLOCK).all() and (res.stats.row_cut == 0).all()
    if family == "llada":
        fd = generate(model, prompts, sampler="fast-dllm", gen_length=GEN,
                      block_length=BLOCK, cache="dual", threshold=0.9)
        np.testing.assert_array_equal(tokens, np.asarray(fd.tokens))
        np.testing.assert_array_equal(res.stats.row_nfe_full, fd.stats.row_nfe_full)
        np.testing.assert_array_equal(res.stats.row_nfe_partial, fd.stats.row_nfe_partial)
        # Rows equal singles (the restatement is batch 1; the engine too, here).
        one = generate(model, prompts[2:], **eb)
        np.testing.assert_array_equal(np.asarray(one.tokens)[0], tokens[2])


# ----------------------------------------------------------------------------- shipped routers

@pytest.fixture(scope="module")
def tiny_llada():
    import asynclane_jax as aj

    return aj.load("tiny-llada")[0]


def test_shipped_routers_with_the_dual_cache(tiny_llada):
    from asynclane_jax.testbed import evaluate as ev
    from asynclane_jax.testbed import tasks

    problems = tasks.heldout(4)
    prompts = ev.prompts_for(problems)
    none = generate(tiny_llada, prompts, sampler="eb", gen_length=128)
    dual = generate(tiny_llada, prompts, sampler="eb", gen_length=128, cache="dual")
    s = dual.stats
    assert not s.hit_step_cap
    assert not (np.asarray(dual.tokens) == tiny_llada.cfg.mask_token_id).any()
    assert (s.row_blocks >= 1).all() and (s.row_fallbacks <= s.row_blocks).all()
    assert (s.row_cut <= s.row_blocks).all()
    assert s.row_fallbacks.sum() < s.row_blocks.sum()  # the LBS chose some blocks
    # One refresh per block, cached calls otherwise; every served call is counted.
    np.testing.assert_array_equal(s.row_nfe_full, s.row_blocks)
    assert (s.row_nfe_partial > 0).all()
    np.testing.assert_array_equal(s.row_nfe_full + s.row_nfe_partial, s.row_steps)
    # Fewer full forwards per generated token than without the cache (every call full).
    full_per_token = lambda st: st.row_nfe_full.sum() / st.commit_step.size
    assert full_per_token(s) < full_per_token(none.stats)
    assert (none.stats.row_nfe_partial == 0).all() and (none.stats.row_cut == 0).all()
    assert sum(tasks.check(p, row) for p, row in zip(problems, dual.tokens)) >= 2
