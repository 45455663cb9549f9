"""The serving engine: continuous batching over the compiled loop's row slots gives
every request `generate`'s tokens, whatever else is in flight and whenever it was
admitted; cancelled rows free their slot; the queue is bounded."""

from __future__ import annotations

import collections
import contextlib
import logging
import threading

import jax
import numpy as np
import pytest
from serve_fakes import answer

import asynclane_jax as aj
from asynclane_jax.decoding import generate
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.serve.engine import Engine, EngineError, QueueFull, _Pool
from asynclane_jax.testbed import evaluate as ev
from asynclane_jax.testbed import tasks


@pytest.fixture(scope="module")
def tiny():
    model, tok, _ = aj.load("tiny-llada")
    return model, tok


class Collector:
    """The updates of one request, and an event set when it is finished."""

    def __init__(self):
        self.updates, self.done = [], threading.Event()

    def __call__(self, u):
        self.updates.append(u)
        if u.finished:
            self.done.set()

    @property
    def tokens(self):
        return [t for u in self.updates for t in u.token_ids]

    @property
    def text(self):
        return "".join(u.text for u in self.updates)


def _expected(model, tok, prompt, gen_length, max_tokens, **options):
    res = generate(model, [prompt], gen_length=gen_length, tokenizer=tok, **options)
    want = answer(model, res.tokens[0], max_tokens)
    # Shorter than max_tokens: a stop token (or the row's end) came first.
    return want, ("stop" if len(want) < max_tokens else "length")


def _serve(eng, prompts, max_tokens):
    """Submits every prompt at once (max_tokens: one for all, or one each); their
    Collectors once all are finished."""
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    got = [Collector() for _ in prompts]
    for p, m, c in zip(prompts, max_tokens, got):
        eng.submit(p, max_tokens=m, on_update=c)
    assert all(c.done.wait(300) for c in got)
    return got


@pytest.mark.parametrize("sampler,options", [("asynclane", {}),
                                             ("fast-dllm", {"cache": "dual"})])
def test_requests_get_generates_tokens_under_continuous_batching(tiny, sampler, options):
    model, tok = tiny
    prompts = ev.prompts_for(tasks.heldout(7))
    # Two slots and chunks of 2 iterations: requests are admitted while others are
    # half-way through, into rows that other requests used before.
    eng = Engine(model, tok, model_name="tiny-llada", sampler=sampler, options=options,
                 slots=2, gen_lengths=(64,), chunk=2, max_prompt=64, precompile="none")
    eng.start()
    try:
        max_tokens = [64, 64, 20, 64, 5, 64, 64]
        got = _serve(eng, prompts, max_tokens)
    finally:
        eng.shutdown()
    for p, m, c in zip(prompts, max_tokens, got):
        want, reason = _expected(model, tok, p, 64, m, sampler=sampler, **options)
        assert c.tokens == want
        assert sum(u.finished for u in c.updates) == 1 and c.updates[-1].finished
        assert c.updates[-1].finish_reason == reason
        assert c.updates[-1].completion_tokens == len(want)
        assert c.text == tok.decode(want, skip_special_tokens=True)
    # Tokens arrive in several updates (the committed prefix grows between chunks).
    assert max(len(c.updates) for c in got) > 2
    assert eng.stats()["slots_busy"] == 0 and eng.stats()["requests_done"] == len(prompts)


@contextlib.contextmanager
def backend_compiles():
    """The seconds of each program XLA compiles meanwhile (in any thread)."""
    seen = []

    def listener(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def record_chunks(monkeypatch) -> list:
    """Each run of a chunk program from now on, as (slots, rows admitted, rows retired,
    iterations asked)."""
    runs = []
    program = _Pool.program

    def spy(self, b):
        init, fn = program(self, b)

        def run(*a):
            runs.append((b, int(np.sum(a[3])), int(np.sum(a[5])), int(a[6])))
            return fn(*a)
        return init, run

    monkeypatch.setattr(_Pool, "program", spy)
    return runs


def test_cancel_frees_the_slot_and_the_queue_is_bounded(tiny, monkeypatch, caplog):
    model, tok = tiny
    prompts = ev.prompts_for(tasks.heldout(3))
    # The default precompile ("all": every slot count of every bucket at start), here
    # where it is one program; no warm-up.
    eng = Engine(model, tok, model_name="tiny-llada", slots=1, gen_lengths=(64,), chunk=1,
                 queue_size=1, max_prompt=64, warm_up=False)
    with pytest.raises(EngineError, match="not running"):
        eng.submit(prompts[0], max_tokens=8, on_update=lambda u: None)
    runs = record_chunks(monkeypatch)
    with caplog.at_level(logging.INFO, logger="asynclane_jax.serve"):
        eng.start()
    assert runs == []  # warm_up=False: no program ran at start
    # The start says how far it is, pool by pool.
    ready = [r.getMessage() for r in caplog.records if "ready" in r.getMessage()]
    assert len(ready) == 1 and ready[0].startswith(
        "pool 1 of 1 ready: gen length 64, prompts up to 64 tokens, slot counts 1 (compiled),")
    # Serving compiles nothing once started: chunks that admit and chunks that do not
    # (whose all-mask canvas is made with the program), cancels, refusals.
    with backend_compiles() as compiled:
        try:
            first = Collector()
            started, release = threading.Event(), threading.Event()

            def hold(u):  # the first update holds the engine's thread until released
                first(u)
                if not started.is_set():
                    started.set()
                    release.wait(60)

            h = eng.submit(prompts[0], max_tokens=64, on_update=hold)
            assert started.wait(120) and not first.updates[0].finished  # it holds the slot
            second = Collector()
            eng.submit(prompts[1], max_tokens=64, on_update=second)  # waits
            with pytest.raises(QueueFull):
                eng.submit(prompts[2], max_tokens=64, on_update=lambda u: None)
            h.cancel()
            release.set()
            assert first.done.wait(60) and first.updates[-1].finish_reason == "cancelled"
            assert second.done.wait(120) and second.updates[-1].finish_reason == "stop"
            with pytest.raises(EngineError, match="exceeds the largest"):
                eng.submit(prompts[0], max_tokens=65, on_update=lambda u: None)
            with pytest.raises(EngineError, match="at most"):
                eng.submit(list(range(10)) * 60, max_tokens=8, on_update=lambda u: None)
            with pytest.raises(EngineError, match="unknown option"):
                eng.submit(prompts[0], max_tokens=8, options={"nonsense": 1},
                           on_update=lambda u: None)
        finally:
            eng.shutdown()
    assert compiled == [], f"{len(compiled)} program(s) compiled while serving"
    assert eng.stats()["slots_busy"] == 0
    np.testing.assert_equal(second.tokens, _expected(model, tok, prompts[1], 64, 64)[0])


def test_rows_moving_between_slot_counts_compile_nothing(tiny, monkeypatch):
    """With every slot count compiled at start (the default), rows admitted and moved
    between counts (two at once, then one as the other finishes) compile nothing. The
    warm-up at start (the default) runs each program down its paths and leaves the
    pools as they were."""
    model, tok = tiny
    prompts = ev.prompts_for(tasks.heldout(3))
    eng = Engine(model, tok, model_name="tiny-llada", slots=2, gen_lengths=(32,), chunk=2,
                 max_prompt=32, admission_window=0)
    runs = record_chunks(monkeypatch)
    eng.start()
    # At each slot count, 1, 2, ... rows admitted at once and decoded for a chunk (each
    # count's full forward is a path of its own), then retired.
    assert runs == [(1, 1, 0, 2), (1, 0, 1, 0), (2, 1, 0, 2), (2, 0, 1, 0), (2, 2, 0, 2),
                    (2, 0, 2, 0)]
    assert eng.chunks == 0 and eng.stats()["model_calls"] == []
    assert all(p.size == 0 and p.state is None and p.live == 0 for p in eng.pools.values())
    moves = []  # (slots before, slots after) with rows in flight
    for pool in eng.pools.values():
        def resize(b, pool=pool, resize=pool.resize):
            if pool.live and b != pool.size:
                moves.append((pool.size, b))
            resize(b)

        pool.resize = resize
    with backend_compiles() as compiled:
        try:
            _serve(eng, prompts, 32)
        finally:
            eng.shutdown()
    assert (2, 1) in moves, moves  # a row in flight moved from two slots to one
    assert compiled == [], f"{len(compiled)} program(s) compiled while serving"


def test_model_calls_are_counted_by_shape_as_generate_counts_them(tiny):
    """stats()["model_calls"] (what a cost model prices): requests served one at a
    time in a one-slot pool, at generate's prompt bucket, make the calls of their
    batch-1 `generate` decodes, shape by shape (AsyncLane's rows finish at the iteration
    their answer completes, so the server stops where generate does)."""
    model, tok = tiny
    prompts = ev.prompts_for(tasks.heldout(4))
    eng = Engine(model, tok, model_name="tiny-llada", slots=1, gen_lengths=(64,),
                 max_prompt=32)
    want = collections.Counter()
    eng.start()
    try:
        for p in prompts:
            c = Collector()
            eng.submit(p, max_tokens=64, on_update=c)
            assert c.done.wait(300)
            res = generate(model, [p], gen_length=64, tokenizer=tok)
            for shape, n in zip(res.stats.call_shapes, res.stats.shape_calls):
                want[shape] += int(n)
    finally:
        eng.shutdown()
    got = {CallShape.from_dict(c): c["calls"] for c in eng.stats()["model_calls"]}
    assert got == {shape: n for shape, n in want.items() if n}
    assert {s.kind for s in got} == {"full", "cached"} and all(s.rows == 1 for s in got)


@pytest.mark.slow
def test_a_llada2_model_is_served_as_generate_decodes_it():
    """The LLaDA2-style testbed model under its own sampler (block diffusion, a cached
    call per step after each row's first full forward): continuous batching gives each
    request `generate`'s tokens, rows admitted while another is mid-answer."""
    model, tok, cfg = aj.load("tiny-llada2-v4")
    assert cfg.family == "llada2" and cfg.block_causal
    prompts = ev.prompts_for(tasks.heldout(3, "v4"))
    eng = Engine(model, tok, model_name="tiny-llada2-v4", sampler="llada2", slots=2,
                 gen_lengths=(128,), chunk=3, max_prompt=64, precompile="none")
    eng.start()
    try:
        got = _serve(eng, prompts, 128)
    finally:
        eng.shutdown()
    for p, c in zip(prompts, got):
        want, reason = _expected(model, tok, p, 128, 128, sampler="llada2")
        assert c.tokens == want and c.updates[-1].finish_reason == reason
