"""Active-batch buckets and the memory budget on the real engine (tiny-llada): a pool
runs at the smallest slot count that holds its rows (one request compiles and runs one
row), growth stops at the budget, an idle pool's state is released for another pool,
a request that cannot fit is refused (503 in OpenAI's form); and the host work off the
event loop: /health answers while a long prompt is tokenized."""

from __future__ import annotations

import threading
import time

import pytest
from serve_fakes import MODEL, FakeEngine, ServerThread, answer, body, local_client

from asynclane_jax.decoding import generate
from asynclane_jax.serve.engine import Engine, OverBudget
from asynclane_jax.testbed import evaluate as ev
from asynclane_jax.testbed import tasks


class Done:
    def __init__(self):
        self.tokens, self.reason, self.event = [], None, threading.Event()

    def __call__(self, u):
        self.tokens += u.token_ids
        if u.finished:
            self.reason = u.finish_reason
            self.event.set()


def expected(model, tok, prompt, gen_length):
    return answer(model, generate(model, [prompt], gen_length=gen_length,
                                  tokenizer=tok).tokens[0])


def run_all(eng, prompts, gen_length):
    got = [Done() for _ in prompts]
    for p, d in zip(prompts, got):
        eng.submit(p, max_tokens=gen_length, on_update=d)
    assert all(d.event.wait(300) for d in got)
    return got


@pytest.mark.slow
def test_slot_buckets_follow_the_rows_within_the_budget(loaded):
    model, tok, _ = loaded
    prompts = ev.prompts_for(tasks.heldout(5))
    probe = Engine(model, tok, model_name=MODEL, slots=4, gen_lengths=(32, 64),
                   max_prompt=64, precompile="none")
    key64 = probe._key(None, 64, 64)
    shape64 = probe._layout(key64)[0]
    # Two rows of the 64 bucket, not four.
    eng = Engine(model, tok, model_name=MODEL, slots=4, gen_lengths=(32, 64), chunk=2,
                 max_prompt=64, precompile="none", kv_budget=shape64.bytes(2))
    assert eng.kv_budget == shape64.bytes(2) and eng.slot_buckets == (1, 2, 4)
    eng.start()
    try:
        # One request: its pool compiles and runs one row.
        (one,) = run_all(eng, prompts[:1], 64)
        pool64 = eng.pools[key64]
        assert sorted(pool64.programs) == [1] and pool64.size == 1
        assert one.tokens == expected(model, tok, prompts[0], 64)
        # Four at once: the budget holds two rows, so the pool never runs at four; every
        # request still gets generate's tokens (rows move between slot counts).
        sizes = []
        resize = pool64.resize
        pool64.resize = lambda b: (sizes.append(b), resize(b))[1]
        got = run_all(eng, prompts[1:5], 64)
        assert sorted(pool64.programs) == [1, 2] and max(sizes) == 2
        for p, d in zip(prompts[1:5], got):
            assert d.tokens == expected(model, tok, p, 64) and d.reason == "stop"
        assert eng.stats()["pool_bytes"] <= eng.kv_budget
        # The last two may finish in one chunk, leaving the idle pool at two rows; a lone
        # request runs at one row again, and the idle pool keeps that size. With a budget
        # of just that, another bucket's request gets the idle pool's state released.
        (alone,) = run_all(eng, prompts[:1], 64)
        assert pool64.size == 1 and alone.tokens == one.tokens
        eng.kv_budget = pool64.held_bytes
        (short,) = run_all(eng, prompts[:1], 32)
        pool32 = eng.pools[eng._key(None, 32, 64)]
        assert pool64.size == 0 and pool32.size == 1
        assert eng.gauges()["evicted"] >= 1
        assert short.tokens == expected(model, tok, prompts[0], 32)
        g = eng.gauges()
        assert g["pool_bytes"] == pool32.shape.bytes(1) <= g["kv_budget"]
        # A request whose pool cannot hold one row within the whole budget.
        eng.kv_budget = shape64.bytes(1) - 1
        with pytest.raises(OverBudget, match="budget"):
            eng.submit(prompts[0], max_tokens=64, on_update=lambda u: None)
    finally:
        eng.shutdown()
    with pytest.raises(OverBudget):  # nor does a server start that cannot hold one row
        Engine(model, tok, model_name=MODEL, slots=4, gen_lengths=(64,), max_prompt=64,
               kv_budget=shape64.bytes(1) - 1)


@pytest.mark.slow
def test_pool_bytes_from_shapes_equal_the_state_allocated(loaded):
    """The bytes the budget counts (from `jax.eval_shape`) are the bytes of the state
    the pool holds on the device, at every slot count."""
    import jax

    model, tok, _ = loaded
    eng = Engine(model, tok, model_name=MODEL, slots=2, gen_lengths=(32,), max_prompt=32,
                 precompile="none", sampler="fast-dllm", options={"cache": "dual"})
    pool = eng._pool(eng._key(None, 32, 32))
    assert pool.shape.kv_per_row > 0
    for b in (1, 2):
        pool.resize(b)
        nbytes = sum(x.nbytes if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                     else jax.random.key_data(x).nbytes
                     for x in jax.tree.leaves(pool.state))
        assert nbytes == pool.held_bytes == pool.shape.bytes(b)
    pool.resize(0)
    assert pool.state is None and pool.held_bytes == 0


class OverBudgetEngine(FakeEngine):
    def submit(self, prompt_ids, **kw):
        raise OverBudget("a request at generation length 128 needs 9.00 GiB")


def test_over_budget_is_a_503_in_openais_form(tok):
    with local_client(create_app(OverBudgetEngine(tok))) as c:
        r = c.post("/v1/completions", json=body(max_tokens=100))
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "kv_budget_exceeded" and err["type"] == "server_error"
    assert err["param"] == "max_tokens" and "9.00 GiB" in err["message"]


def test_the_openai_client_sees_the_503(tok):
    openai = pytest.importorskip("openai")
    srv = ServerThread(create_app(OverBudgetEngine(tok)))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="x = 1 print x", max_tokens=8)
        assert e.value.status_code == 503
        assert e.value.body["code"] == "kv_budget_exceeded"
    finally:
        srv.stop()


class SlowTokenizer:
    """The test tokenizer, taking `delay` seconds per encode (a huge prompt's)."""

    def __init__(self, tok, delay):
        self.tok, self.delay = tok, delay

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __len__(self):
        return len(self.tok)

    def encode(self, *a, **kw):
        time.sleep(self.delay)
        return self.tok.encode(*a, **kw)


def test_health_answers_while_a_prompt_is_tokenized(tok):
    """Parsing and tokenizing run off the event loop: a prompt that takes a second to
    tokenize does not hold /health (nor the other requests) for that second."""
    import httpx

    eng = FakeEngine(tok)
    app = create_app(eng, max_prompt_chars=10**6)
    eng.tokenizer = SlowTokenizer(tok, 1.5)
    srv = ServerThread(app)
    try:
        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=httpx.post(
            srv.url + "/v1/completions", json=body(max_tokens=8), timeout=60)))
        t.start()
        time.sleep(0.3)  # the request is being tokenized now
        t0 = time.perf_counter()
        health = httpx.get(srv.url + "/health", timeout=60)
        waited = time.perf_counter() - t0
        t.join(60)
        assert health.status_code == 200 and waited < 0.75, waited
        assert answer["r"].status_code == 200
    finally:
        srv.stop()


def create_app(engine, **kw):
    from asynclane_jax.serve.app import create_app as make

    return make(engine, **kw)


def failing_decode(tokens):
    raise RuntimeError("the tokenizer failed (on purpose)")


def test_detokenizing_runs_on_the_emitter_thread(loaded):
    """The engine's thread hands progress to the emitter: on_update runs on the emitter's
    thread, not the one that runs the chunks; a tokenizer that fails there ends that
    request with an error, and the engine serves on."""
    model, tok, _ = loaded
    eng = Engine(model, tok, model_name=MODEL, slots=1, gen_lengths=(32,), max_prompt=32,
                 chunk=4)
    threads, done = set(), threading.Event()
    prompts = ev.prompts_for(tasks.heldout(2))

    def on_update(u):
        threads.add(threading.current_thread().name)
        if u.finished:
            done.set()

    eng.start()
    try:
        eng.submit(prompts[0], max_tokens=32, on_update=on_update)
        assert done.wait(120)
        eng._text = failing_decode  # detokenizing, on the emitter's thread
        failed = Done()
        eng.submit(prompts[1], max_tokens=32, on_update=failed)
        assert failed.event.wait(120) and failed.reason in ("error", "cancelled")
        del eng._text
        again = Done()
        eng.submit(prompts[1], max_tokens=32, on_update=again)
        assert again.event.wait(120) and again.reason in ("stop", "length")
        assert again.tokens == expected(model, tok, prompts[1], 32)
    finally:
        eng.shutdown()
    assert threads == {"asynclane-emitter"}
    assert all(t.name != "asynclane-engine" for t in threading.enumerate())


@pytest.mark.slow
def test_idle_pools_beyond_max_pools_are_dropped(loaded):
    """Each allowed structural configuration is a pool of its own (a threshold is not:
    see test_serve_options.py); beyond max_pools the idle ones are dropped (least
    recently used first) with their programs, and a configuration used again is built
    again, with the same tokens."""
    model, tok, _ = loaded
    prompt = ev.prompts_for(tasks.heldout(1))[0]
    eng = Engine(model, tok, model_name=MODEL, slots=2, gen_lengths=(32,), max_prompt=32,
                 chunk=8, precompile="none", max_pools=1, allow_options=[{"block_length": 16}])
    eng.start()
    try:
        got = {}
        for block in (None, 16, None):
            d = Done()
            opts = None if block is None else {"block_length": block}
            eng.submit(prompt, max_tokens=32, options=opts, on_update=d)
            assert d.event.wait(120)
            got.setdefault(block, []).append(d.tokens)
            assert len(eng.pools) == 1
            (pool,) = eng.pools.values()
            assert pool.schedule.block_length == (block or 32)
        assert eng.gauges()["evicted"] >= 2
    finally:
        eng.shutdown()
    assert got[None][0] == got[None][1]
    want = generate(model, [prompt], gen_length=32, tokenizer=tok, block_length=16)
    assert got[16][0] == answer(model, want.tokens[0])
