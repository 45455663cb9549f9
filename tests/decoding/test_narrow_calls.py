"""Narrow calls (driver.py, `ModelCalls.cached`; `Schedule.narrow_queries`; on by
default, `driver.NARROW_CALLS`): a cached call whose served rows plan no more columns
than the schedule's narrow width queries only those, moved to the first slots, and
gives the logits the wide call gives, in the plan's slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import asynclane_jax
from asynclane_jax.decoding import driver, generate
from asynclane_jax.decoding.api import build_canvas, make_schedule
from asynclane_jax.decoding.schedule import Plan
from asynclane_jax.testbed import evaluate, tasks

# AsyncLane forking on a short canvas: extra query slots used in some cached calls and
# not in others (a window cut short by the text's end, no refine lane).
OPTS = dict(sampler="asynclane", bucket=64, gen_length=64, max_lanes=16, extra_queries=8)


def narrow(on: bool):
    return driver.switched(driver.NARROW_CALLS, on)


@pytest.fixture(scope="module")
def shipped():
    model, tokenizer, _ = asynclane_jax.load("tiny-llada")
    prompts = evaluate.prompts_for(tasks.split("heldout", 4), tokenizer)
    return model, tokenizer, prompts


def cached_widths(stats) -> dict[int, int]:
    """{queries: calls} of a decode's cached calls."""
    return {s.queries: int(stats.shape_calls[i]) for i, s in enumerate(stats.call_shapes)
            if s.kind == "cached" and stats.shape_calls[i]}


def test_narrow_calls_decode_as_wide_ones(shipped):
    model, tokenizer, prompts = shipped
    with narrow(False):
        wide = generate(model, prompts, tokenizer=tokenizer, **OPTS)
    with narrow(True):
        got = generate(model, prompts, tokenizer=tokenizer, **OPTS)
    assert got.stats.compiled, "the switch is part of the program's key"
    np.testing.assert_array_equal(got.tokens, wide.tokens)
    for f in ("commit_step", "row_steps", "row_nfe_full", "row_nfe_partial", "forks",
              "refreshes"):
        np.testing.assert_array_equal(getattr(got.stats, f), getattr(wide.stats, f))
    assert cached_widths(wide.stats).keys() == {32 + 8}
    widths = cached_widths(got.stats)
    assert set(widths) == {32, 32 + 8}, widths  # some calls narrow, some not
    assert sum(widths.values()) == cached_widths(wide.stats)[32 + 8]


def test_a_schedule_without_extra_slots_makes_one_width(shipped):
    """AsyncLane as Fast-dLLM's dual cache (no extra queries): no narrow width, so its
    cached calls are all B wide, as Fast-dLLM's are."""
    model, tokenizer, prompts = shipped
    opts = dict(OPTS, max_lanes=1, extra_queries=0)
    assert make_schedule("asynclane", gen_length=64, max_lanes=1,
                         extra_queries=0).narrow_queries is None
    res = generate(model, prompts[:1], tokenizer=tokenizer, **opts)
    assert set(cached_widths(res.stats)) == {32}


def test_a_narrow_call_puts_each_columns_logits_in_its_slot(shipped):
    """One cached call of a hand-made plan whose used slots are scattered (a window's
    slots cut short, stale columns in the extra slots, a row not served): the narrow
    call's logits equal the wide call's in every used slot of the served rows, and the
    cache it writes is the wide call's."""
    model, tokenizer, prompts = shipped
    sch = make_schedule("asynclane", gen_length=64, max_lanes=16,
                        extra_queries=8).bind(tokenizer, model.cfg)
    canvas, pad_len, P = build_canvas(prompts[:3], 64, model.cfg, 64)
    canvas = jnp.asarray(canvas).at[:, P:P + 20].set(7)  # some generated columns filled
    b, T = canvas.shape
    graphdef, params = nnx.split(model)
    loop = driver.build_loop(graphdef, params, canvas, jnp.asarray(pad_len),
                             jnp.ones((b,), bool), jax.random.key(0), schedule=sch,
                             pieces=True)
    first = loop.first_call(loop.state, jnp.ones((b,), bool))  # a full forward: a cache
    used = np.full((b, 40), T, np.int32)
    used[0, :10] = P + 22 + np.arange(10)  # a window cut short
    used[0, 32:37] = P + np.arange(5)  # stale columns before it
    used[1, 3:30:3] = P + 30 + np.arange(9)
    used[2, :] = P + np.arange(40)  # too many for a narrow call, but not served
    positions = jnp.asarray(used)
    serve = jnp.array([True, True, False])
    plan = Plan(positions=positions, full=jnp.asarray(False), serve=serve)

    def call(on):
        """(logits, state, {queries: calls} of the one call counted)."""
        with narrow(on):
            calls = driver.ModelCalls(model, sch, loop.ctx, jnp.asarray(pad_len),
                                      n_live=jnp.int32(b))
            logits, st = jax.jit(lambda st: calls.cached(st, plan, serve))(first)
        made = np.asarray(st.shape_calls - first.shape_calls)
        return logits, st, {s.queries: int(made[i]) for i, s in enumerate(calls.sites.shapes)
                            if made[i]}

    (lw, sw, made_w), (ln, sn, made_n) = call(False), call(True)
    assert made_w == {40: 1} and made_n == {32: 1}
    slots = (used < T) & np.asarray(serve)[:, None]
    np.testing.assert_allclose(np.asarray(ln)[slots], np.asarray(lw)[slots], atol=1e-5)
    np.testing.assert_array_equal(np.argmax(ln, -1)[slots], np.argmax(lw, -1)[slots])
    np.testing.assert_allclose(sn.cache.k, sw.cache.k, atol=1e-5)
    np.testing.assert_allclose(sn.cache.v, sw.cache.v, atol=1e-5)
    # Row 2 served too: 40 planned columns do not fit 32, so the call is wide.
    plan = plan.replace(serve=jnp.ones((b,), bool))
    serve = plan.serve
    assert call(True)[2] == {40: 1}
