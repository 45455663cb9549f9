"""Chunks end when an answer is complete: `serve_chunk(..., until_answer=True)` returns
after the iteration in which a row's answer (its committed prefix up to a stop token or
its max_tokens, or the whole row) became complete, so the engine sends it and admits a
waiting request into the freed slot while the long rows decode on; every request still
gets `generate`'s tokens."""

from __future__ import annotations

import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serve_fakes import answer

import asynclane_jax as aj
from asynclane_jax.decoding import generate
from asynclane_jax.decoding.api import build_canvas
from asynclane_jax.serve.engine import Engine, _Emitter, _Pool
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
                 chunk=BOUND, max_prompt=32, precompile="none", admission_window=0)
    return model, tok, prompts, want, eng


def collector(got: dict, name: str, order: list | None = None):
    """(on_update, done) of one request: its tokens gathered in got[name], its name
    appended to `order` when it finishes, and `done` set then."""
    tokens = got.setdefault(name, [])
    done = threading.Event()

    def on_update(u):
        tokens.extend(u.token_ids)
        if u.finished:
            if order is not None:
                order.append(name)
            done.set()
    return on_update, done


def test_a_chunk_ends_at_the_iteration_that_completes_an_answer(setup):
    model, tok, prompts, want, eng = setup
    cfg = model.cfg
    pool = eng._pool(eng._key(None, G, 32))
    init, chunk = pool.program(2)
    canvas, pad_len, P = build_canvas(prompts, G, cfg, pool.P)
    assert P == pool.P
    no = np.zeros(2, bool)

    def run(state, admit, canvas_in, pad, limit):
        return chunk(eng.param_leaves, state, jnp.asarray(pad), jnp.asarray(admit),
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

    eng.start()
    try:
        events = []
        # The three arrive together (the engine's thread takes them in one round): the
        # long one and a short one decode, the other short one waits for a slot.
        with eng._lock:
            for name, p, m in (("long", prompts[0], G), ("short", prompts[1], SHORT),
                               ("waiting", prompts[2], SHORT)):
                on_update, done = collector(got, name, order)
                events.append(done)
                eng.submit(p, max_tokens=m, on_update=on_update)
        assert all(e.wait(300) for e in events)
    finally:
        eng.shutdown()
    # The waiting request got the short one's slot and finished before the long one;
    # each of the three chunks ended at an answer (none at the bound).
    assert order == ["short", "waiting", "long"]
    assert eng.chunks == 3
    for name, row, m in (("long", want[0], G), ("short", want[1], SHORT),
                         ("waiting", want[2], SHORT)):
        assert got[name] == answer(model, row, m)


def test_the_admission_window_runs_one_iteration_chunks_only_while_a_slot_is_free():
    # Engine._short on stand-ins (no model): a window is open while requests are
    # expected and its time has not passed; the chunk is short only if, once the
    # waiting requests are admitted, a slot is still free for the expected ones.
    now = time.monotonic()
    eng = types.SimpleNamespace(_expected=1, _window_end=now + 60)
    eng._window_open = types.MethodType(Engine._window_open, eng)
    pool = types.SimpleNamespace(waiting=[], live=1, size=2)
    assert Engine._short(eng, pool, 0)
    pool.waiting = ["a"]  # admitted now, and then no slot is free: a whole chunk
    assert not Engine._short(eng, pool, 1)
    pool.waiting = ["a", "b"]  # one admitted, one left waiting: a whole chunk
    pool.live, pool.size = 0, 4
    assert not Engine._short(eng, pool, 1)
    pool.waiting, pool.live = [], 1
    eng._expected = 0  # nobody expected: a whole chunk
    assert not Engine._short(eng, pool, 0)
    eng._expected, eng._window_end = 2, now - 1  # the window passed: closed for good
    assert not Engine._short(eng, pool, 0)
    assert eng._expected == 0


def test_a_request_sent_when_an_answer_ends_is_admitted_at_the_next_iteration(
        setup, monkeypatch):
    model, tok, prompts, want, eng = setup
    chunks = []  # (iterations asked, loop iterations run, requests admitted)
    run_chunk = _Pool.run_chunk

    def spy(self, admit_n, iterations=None):
        waiting, step = len(self.waiting), int(self.state.step)
        run_chunk(self, admit_n, iterations)
        chunks.append((iterations, int(self.state.step) - step,
                       waiting - len(self.waiting)))

    monkeypatch.setattr(_Pool, "run_chunk", spy)
    monkeypatch.setattr(eng, "admission_window", 300.0)  # open until "next" comes
    got, ends = {}, {}

    def collect(name, then=None):
        tokens = got.setdefault(name, [])
        ends[name] = threading.Event()

        def on_update(u):
            tokens.extend(u.token_ids)
            if u.finished:
                ends[name].set()
                if then is not None:  # a client that sends its next request at once
                    then()
        return on_update

    def send_next():
        # The client's next request, once a chunk after short's answer has run (so
        # that it finds the window open, not the round that freed the slot).
        deadline = time.monotonic() + 300
        while len(chunks) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        eng.submit(prompts[2], max_tokens=SHORT, on_update=collect("next"))

    eng.start()
    try:
        with eng._lock:  # the two arrive together
            eng.submit(prompts[0], max_tokens=G, on_update=collect("long"))
            eng.submit(prompts[1], max_tokens=SHORT, on_update=collect("short", send_next))
        assert ends["short"].wait(300)
        assert ends["long"].wait(300) and ends["next"].wait(300)
    finally:
        eng.shutdown()
    for name, row, m in (("long", want[0], G), ("short", want[1], SHORT),
                         ("next", want[2], SHORT)):
        assert got[name] == answer(model, row, m)
    # The first chunk (both admitted) runs to short's answer; until "next" is admitted,
    # each chunk is one iteration of the long row (the pool keeps its two slots while
    # a request is expected, one of them free); the chunk that admits it runs to the
    # next answer again.
    assert chunks[0][0] is None and chunks[0][2] == 2
    k = next(i for i in range(1, len(chunks)) if chunks[i][2])  # admits "next"
    assert k > 1 and all(c[:2] == (1, 1) for c in chunks[1:k])
    assert chunks[k][0] is None
    # Its answer opens the window again (its client may send another): one-iteration
    # chunks of the long row to its end.
    assert all(c[0] == 1 and c[1] <= 1 for c in chunks[k + 1:])


def test_a_chunks_progress_is_sent_once_the_next_chunk_is_dispatched(setup, monkeypatch):
    """The updates read after a chunk wait until the next chunk is dispatched (the
    threads they wake then run while the device decodes), or until the engine has
    nothing to dispatch; none is lost or reordered."""
    model, tok, prompts, want, eng = setup
    log = []  # "dispatch" per chunk program call, "send" per batch handed to the emitter
    program, put_many = _Pool.program, _Emitter.put_many

    def spy_program(self, b):
        init, fn = program(self, b)

        def run(*a):
            out = fn(*a)
            log.append("dispatch")
            return out
        return init, run

    def spy_put_many(self, items):
        log.append("send")
        put_many(self, items)

    monkeypatch.setattr(_Pool, "program", spy_program)
    monkeypatch.setattr(_Emitter, "put_many", spy_put_many)
    got = {}
    eng.start()
    try:
        (on_long, long_done), (on_short, short_done) = (collector(got, "long"),
                                                        collector(got, "short"))
        with eng._lock:  # both in the first chunk
            eng.submit(prompts[0], max_tokens=G, on_update=on_long)
            eng.submit(prompts[1], max_tokens=SHORT, on_update=on_short)
        assert short_done.wait(300) and long_done.wait(300)
    finally:
        eng.shutdown()
    for name, row, m in (("long", want[0], G), ("short", want[1], SHORT)):
        assert got[name] == answer(model, row, m)
    # The first chunk ends at short's answer; short's last update (and long's progress)
    # go out only after the second chunk is dispatched. Every batch follows a dispatch
    # directly, but the last: long's answer, sent when nothing was left to run.
    assert log[:2] == ["dispatch", "dispatch"] and log[-1] == "send"
    sends = [i for i, e in enumerate(log) if e == "send"]
    assert len(sends) >= 2 and all(log[i - 1] == "dispatch" for i in sends[:-1])
