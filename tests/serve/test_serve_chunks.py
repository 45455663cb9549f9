"""Chunks end when an answer is complete: `serve_chunk(..., until_answer=True)` returns
after the iteration in which a row's answer (its committed prefix up to a stop token or
its max_tokens, or the whole row) became complete, so the engine sends it and admits a
waiting request into the freed slot while the long rows decode on; every request still
gets `generate`'s tokens."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asynclane_jax as aj
from asynclane_jax.decoding import generate
from asynclane_jax.decoding.api import build_canvas
from asynclane_jax.serve.engine import Engine
from asynclane_jax.testbed import evaluate as ev
from asynclane_jax.testbed import tasks

G = 64
SHORT = 3  # the short request's max_tokens
BOUND = 10_000  # a chunk bound no decode reaches


@pytest.fixture(scope="module")
def setup():
    model, tok, _ = aj.load("tiny-llada")
    prompts = ev.prompts_for(tasks.heldout(3))
    # Each prompt decoded alone (rows never see each other): what serving must give.
    want = np.asarray(generate(model, prompts, gen_length=G, tokenizer=tok).tokens)
    # Two slots, one prompt bucket and a chunk bound no decode reaches: only an answer
    # ends a chunk. Both tests run its programs (each compiled on first use, once).
    eng = Engine(model, tok, model_name="tiny-llada", slots=2, gen_lengths=(G,),
                 chunk=BOUND, max_prompt=32, precompile="none", admission_grace=0)
    return model, tok, prompts, want, eng


def test_a_chunk_ends_at_the_iteration_that_completes_an_answer(setup):
    model, tok, prompts, want, eng = setup
    cfg = model.cfg
    pool = eng._pool(eng._key(None, G, 32))
    init, chunk = pool.program(2)
    canvas, pad_len, P = build_canvas(prompts, G, cfg, pool.P)
    assert P == pool.P
    no = np.zeros(2, bool)

    def run(state, admit, canvas_in, pad, limit):
        return chunk(eng.params, state, jnp.asarray(pad), jnp.asarray(admit),
                     jnp.asarray(canvas_in), jnp.asarray(no), jnp.asarray(BOUND, jnp.int32),
                     pool.operands, traced, jnp.asarray(limit, jnp.int32))

    traced = {n: jnp.full((2,), v, jnp.float32) for n, v in pool.defaults.items()} or None
    state = init(eng.params, jax.random.key(0), pool.operands)
    # Row 0 wants SHORT tokens, row 1 all of them: the chunk returns at the iteration
    # that committed the last of row 0's SHORT tokens, far below the bound, while row 1
    # still has masks.
    state = run(state, np.ones(2, bool), canvas[:2], pad_len[:2], [SHORT, G])
    gen = np.asarray(state.canvas)[:, P:]
    assert (gen[0, :SHORT] != cfg.mask_token_id).all()
    assert not set(gen[0, :SHORT].tolist()) & set(cfg.stop_token_ids)
    np.testing.assert_array_equal(gen[0, :SHORT], want[0, :SHORT])
    assert int(np.asarray(state.commit_step)[0, :SHORT].max()) == int(state.row_steps[0]) - 1
    assert int(state.step) < BOUND
    assert not bool(state.finished[1]) and (gen[1] == cfg.mask_token_id).any()
    # A waiting request takes slot 0 at once; row 1 decodes on. Each later chunk ends
    # at an answer too, and every row ends with generate's tokens.
    canvas_in = np.concatenate([canvas[2:3], canvas[1:2]])
    pad = np.array([pad_len[2], pad_len[1]], np.int32)
    state = run(state, np.array([True, False]), canvas_in, pad, [G, G])
    chunks = 1
    while not np.asarray(state.finished).all():
        state = run(state, no, canvas_in, pad, [G, G])
        chunks += 1
        assert chunks < 50
    gen = np.asarray(state.canvas)[:, P:]
    np.testing.assert_array_equal(gen[0], want[2])
    np.testing.assert_array_equal(gen[1], want[1])


def test_a_waiting_request_is_admitted_while_a_long_row_decodes(setup):
    model, tok, prompts, want, eng = setup
    order, got = [], {}

    def collect(name):
        tokens = got.setdefault(name, [])
        done = threading.Event()

        def on_update(u):
            tokens.extend(u.token_ids)
            if u.finished:
                order.append(name)
                done.set()
        return on_update, done

    eng.start()
    try:
        events = []
        # The three arrive together (the engine's thread takes them in one round): the
        # long one and a short one decode, the other short one waits for a slot.
        with eng._lock:
            for name, p, m in (("long", prompts[0], G), ("short", prompts[1], SHORT),
                               ("waiting", prompts[2], SHORT)):
                on_update, done = collect(name)
                events.append(done)
                eng.submit(p, max_tokens=m, on_update=on_update)
        assert all(e.wait(300) for e in events)
    finally:
        eng.shutdown()
    # The waiting request got the short one's slot and finished before the long one;
    # each of the three chunks ended at an answer (none at the bound).
    assert order == ["short", "waiting", "long"]
    assert eng.chunks == 3
    stop = set(model.cfg.stop_token_ids)
    for name, row, m in (("long", want[0], G), ("short", want[1], SHORT),
                         ("waiting", want[2], SHORT)):
        cut = next((j for j, t in enumerate(row.tolist()) if t in stop), len(row))
        assert got[name] == row[:min(cut, m)].tolist()
