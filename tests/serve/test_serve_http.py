"""`asynclane-jax serve`: the HTTP layer (asynclane_jax.serve.app, protocol, cli).

Two halves:
  * A fake engine (the Engine's interface, no model: each request's reply is a fixed
    token sequence, one token per tick) behind Starlette's TestClient and behind uvicorn
    on 127.0.0.1: every 4xx rule, the response and chunk bodies, stop strings, errors of
    one request, a client that goes away.
  * The real engine on tiny-llada (2 slots, buckets 64 and 128, chunk 4) behind uvicorn
    in a thread, through the official openai client: answers equal `generate` at the
    request's bucket cut at max_tokens, streamed equals non-streamed, concurrent
    requests equal their solo answers, a disconnect frees the slot, 429 at the queue
    bound, /metrics' tokens and the pools' count, bytes and compiles; and
    `asynclane-jax serve` as a subprocess drains a stream on SIGTERM and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_fakes import (  # noqa: E402
    LOCAL,
    MODEL,
    PROMPT,
    REPLY,
    FakeEngine,
    ServerThread,
    body,
    chat_body,
    engine_arguments,
    metric,
    metric_samples,
    process_serving,
    sse_events,
    wait_for,
)

import asynclane_jax  # noqa: E402
from asynclane_jax.serve import protocol  # noqa: E402
from asynclane_jax.serve.app import create_app  # noqa: E402
from asynclane_jax.serve.engine import QueueFull  # noqa: E402


def expected_text(tok, n=None):
    ids = tok.encode(REPLY, add_special_tokens=False)[:n]
    return tok.decode(ids, skip_special_tokens=True)


@pytest.fixture
def fake(tok):
    return FakeEngine(tok)


@pytest.fixture
def client(fake):
    from starlette.testclient import TestClient

    with TestClient(create_app(fake), base_url=LOCAL) as c:
        yield c
    assert fake.stopped  # the lifespan shut the engine down


def test_models_and_health(client, fake):
    got = client.get("/v1/models").json()
    assert got["object"] == "list" and [m["id"] for m in got["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["slots_busy"] == 0 and h["gen_lengths"] == [64, 128]
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param",
                                                              "code"}


def test_completion_body_and_usage(client, fake, tok):
    r = client.post("/v1/completions", json=body(max_tokens=128))
    assert r.status_code == 200, r.text
    got = r.json()
    n_reply = len(fake.reply)
    assert got["object"] == "text_completion" and got["model"] == MODEL
    assert got["choices"] == [{"index": 0, "text": expected_text(tok), "logprobs": None,
                               "finish_reason": "stop"}]
    n_prompt = len(tok.encode(PROMPT, add_special_tokens=False))
    assert got["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_reply,
                            "total_tokens": n_prompt + n_reply}
    # Cut at max_tokens: finish_reason "length".
    got = client.post("/v1/completions", json=body(max_tokens=5)).json()
    assert got["choices"][0]["text"] == expected_text(tok, 5)
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 5
    # No max_tokens: the largest bucket. A prompt as token ids, and a batch of one.
    ids = tok.encode(PROMPT, add_special_tokens=False)
    client.post("/v1/completions", json=body(prompt=ids))
    client.post("/v1/completions", json=body(prompt=[PROMPT], user="u"))
    assert [s[:2] for s in fake.submitted[-2:]] == [(ids, 128), (ids, 128)]


def test_chat_uses_the_chat_template(client, fake, tok):
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "x = 4 "},
                                         {"type": "text", "text": "print x"}]}]
    got = client.post("/v1/chat/completions",
                      json={"model": MODEL, "messages": msgs, "max_completion_tokens": 64}).json()
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == {"role": "assistant", "content": expected_text(tok)}
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "x = 4 print x"}],
                                   add_generation_prompt=True, tokenize=False)
    assert fake.submitted[-1][:2] == (tok.encode(text, add_special_tokens=False), 64)


def test_streams_equal_the_plain_answer(client, tok):
    for path, make, obj in (("/v1/completions", body, "text_completion"),
                            ("/v1/chat/completions", chat_body, "chat.completion.chunk")):
        plain = client.post(path, json=make(max_tokens=64)).json()
        with client.stream("POST", path, json=make(max_tokens=64, stream=True,
                                                  stream_options={"include_usage": True})) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r.read().decode())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == obj and c["id"] == chunks[0]["id"] for c in chunks)
        if obj == "text_completion":
            text = "".join(c["choices"][0]["text"] for c in chunks)
            want = plain["choices"][0]["text"]
        else:
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            want = plain["choices"][0]["message"]["content"]
        assert text == want == expected_text(tok)
        assert len(chunks) > 3  # it did stream, token by token
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (
            len(chunks) - 1) + ["stop"]
        assert chunks[-1]["usage"] == plain["usage"]
        assert all("usage" not in c for c in chunks[:-1])


def test_stop_strings_cut_the_text_and_cancel(client, fake, tok):
    full = expected_text(tok)
    for stop in ("= 4", ["answer", "\n"], "9 -"):
        stops = [stop] if isinstance(stop, str) else stop
        cut = full[:min(full.find(s) for s in stops if s in full)]
        got = client.post("/v1/completions", json=body(stop=stop)).json()
        assert got["choices"][0]["text"] == cut and got["choices"][0]["finish_reason"] == "stop"
        with client.stream("POST", "/v1/completions", json=body(stop=stop, stream=True)) as r:
            chunks = sse_events(r.read().decode())[:-1]
        assert "".join(c["choices"][0]["text"] for c in chunks) == cut
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    deadline = time.monotonic() + 5
    while len(fake.finished) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(fake.finished.values()) == ["cancelled"] * 6  # each engine request


def test_stop_cutter_holds_back_a_possible_stop():
    c = protocol.StopCutter(["abc", "xy"])
    assert c.feed("12a") == ("12", False)
    assert c.feed("b") == ("", False)
    assert c.feed("d x") == ("abd ", False)
    assert c.feed("yz") == ("", True)
    c = protocol.StopCutter(["abc"])
    assert c.feed("ab") == ("", False) and c.flush() == "ab"
    assert protocol.StopCutter([]).feed("abc") == ("abc", False)


def test_temperature_top_p_seed_and_sampler_options(tok):
    from starlette.testclient import TestClient

    # A sampler with a temperature option: temperature maps onto it; a seed is refused
    # when sampling.
    eng = FakeEngine(tok, sampler="vanilla")
    with TestClient(create_app(eng), base_url=LOCAL) as c:
        assert c.post("/v1/completions", json=body(temperature=0.5)).status_code == 200
        assert eng.submitted[-1][2] == {"temperature": 0.5}
        assert c.post("/v1/completions", json=body(temperature=0, seed=3)).status_code == 200
        assert c.post("/v1/completions", json=body(seed=3)).status_code == 200
        r = c.post("/v1/completions", json=body(temperature=0.5, seed=3))
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
        assert "not honoured" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json=body(temperature=0.5,
                                                sampler_options={"temperature": 0.7}))
        assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json=body(top_p=0.9))
        assert r.status_code == 400 and "'vanilla'" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json=body(top_p=1)).status_code == 200
        assert eng.submitted[-1][2] == {}
        ok = c.post("/v1/completions", json=body(sampler_options={"steps": 32}))
        assert ok.status_code == 200 and eng.submitted[-1][2] == {"steps": 32}
    # The server's own temperature counts for the seed rule.
    eng = FakeEngine(tok, sampler="vanilla", options={"temperature": 0.8})
    with TestClient(create_app(eng), base_url=LOCAL) as c:
        r = c.post("/v1/completions", json=body(seed=1))
        assert r.status_code == 400 and "temperature 0.8" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json=body(seed=1, temperature=0)).status_code == 200
    # dream has top_p too.
    eng = FakeEngine(tok, sampler="dream")
    with TestClient(create_app(eng), base_url=LOCAL) as c:
        assert c.post("/v1/completions", json=body(top_p=0.9)).status_code == 200
        assert eng.submitted[-1][2] == {"top_p": 0.9}


BAD = [
    # (path, body, status, param, a piece of the message)
    ("c", body(n=2), 400, "n", "n=2"),
    ("c", body(best_of=3), 400, "best_of", "best_of"),
    ("c", body(logprobs=1), 400, "logprobs", "log-probabilities"),
    ("c", body(logprobs=0), 400, "logprobs", "log-probabilities"),
    ("c", body(echo=True), 400, "echo", "echo"),
    ("c", body(suffix="x"), 400, "suffix", "suffix"),
    ("c", body(presence_penalty=0.5), 400, "presence_penalty", "only 0"),
    ("c", body(frequency_penalty=-1), 400, "frequency_penalty", "only 0"),
    ("c", body(logit_bias={"5": 10}), 400, "logit_bias", "logit_bias"),
    ("c", body(foo=1, bar=2), 400, "foo", "unknown fields 'foo', 'bar'"),
    ("c", body(messages=[]), 400, "messages", "unknown field 'messages'"),
    ("c", body(model="gpt-4"), 404, "model", "does not exist"),
    ("c", {"prompt": PROMPT}, 400, "model", "'model' is required"),
    ("c", body(max_tokens=0), 400, "max_tokens", "positive integer"),
    ("c", body(max_tokens=129), 400, "max_tokens", "at most 128"),
    ("c", body(max_tokens=12.5), 400, "max_tokens", "positive integer"),
    ("c", body(max_tokens=True), 400, "max_tokens", "positive integer"),
    ("c", body(prompt="x = 4 " * 40), 400, "prompt", "at most 64"),
    ("c", body(prompt=[PROMPT, PROMPT]), 400, "prompt", "one prompt per request"),
    ("c", body(prompt=[5, 10**6]), 400, "prompt", "outside the vocabulary"),
    ("c", body(prompt=""), 400, "prompt", "empty"),
    ("c", body(prompt=None), 400, "prompt", "'prompt' is required"),
    ("c", body(stop=""), 400, "stop", "empty string"),
    ("c", body(stop=["a"] * 17), 400, "stop", "at most 16"),
    ("c", body(stop=3), 400, "stop", "string"),
    ("c", body(stream="yes"), 400, "stream", "boolean"),
    ("c", body(temperature=0.7), 400, "temperature", "sampler 'asynclane'"),
    ("c", body(temperature=3), 400, "temperature", "[0, 2]"),
    ("c", body(top_p=0.5), 400, "top_p", "sampler 'asynclane'"),
    ("c", body(seed="s"), 400, "seed", "integer"),
    ("c", body(sampler_options={"no_such_option": 1}), 400, "sampler_options",
     "no_such_option"),
    ("c", body(sampler_options=[1]), 400, "sampler_options", "object"),
    ("c", [1, 2], 400, None, "JSON object"),
    ("h", chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools",
     "tool calls"),
    ("h", chat_body(functions=[{"name": "f"}]), 400, "functions", "function calls"),
    ("h", chat_body(tool_choice="auto"), 400, "tool_choice", "tool calls"),
    ("h", chat_body(response_format={"type": "json_object"}), 400, "response_format",
     "only {'type': 'text'}"),
    ("h", chat_body(logprobs=True), 400, "logprobs", "log-probabilities"),
    ("h", chat_body(top_logprobs=2), 400, "top_logprobs", "log-probabilities"),
    ("h", chat_body(n=3), 400, "n", "n=3"),
    ("h", chat_body(max_tokens=10, max_completion_tokens=20), 400, "max_tokens", "disagree"),
    ("h", chat_body(prompt="x"), 400, "prompt", "unknown field 'prompt'"),
    ("h", chat_body(store=True), 400, "store", "unknown field 'store'"),
    ("h", {"model": MODEL, "messages": []}, 400, "messages", "non-empty"),
    ("h", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].role", "must be one of"),
    ("h", {"model": MODEL, "messages": [{"role": "user", "content": "x", "name": "a"}]},
     400, "messages[0].name", "not supported"),
    ("h", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content",
     "only text parts"),
]


@pytest.mark.parametrize("path,req,status,param,needle", BAD)
def test_refused_requests(client, fake, path, req, status, param, needle):
    url = "/v1/completions" if path == "c" else "/v1/chat/completions"
    n = len(fake.submitted)
    r = client.post(url, json=req)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert needle in err["message"], err["message"]
    assert len(fake.submitted) == n  # nothing reached the engine
    if status == 404:
        assert err["code"] == "model_not_found"


def test_accepted_off_values(client):
    ok = body(n=1, best_of=1, echo=False, suffix="", logprobs=None, presence_penalty=0,
              frequency_penalty=0.0, logit_bias={}, temperature=0, top_p=1, seed=7, user="u",
              stream=False, stream_options={"include_usage": True}, max_tokens=8)
    assert client.post("/v1/completions", json=ok).status_code == 200
    ok = chat_body(n=1, logprobs=False, tools=[], tool_choice="none",
                   response_format={"type": "text"}, parallel_tool_calls=False, max_tokens=8)
    assert client.post("/v1/chat/completions", json=ok).status_code == 200


@pytest.mark.parametrize("raw,needle", [
    (b"{not json", "not valid JSON"),
    (b"", "empty"),
    (b'{"model": "tiny-llada", "prompt": "\xff\xfe"}', "not UTF-8"),
])
def test_bad_bodies(client, raw, needle):
    r = client.post("/v1/completions", content=raw,
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_queue_full_is_429(tok):
    from starlette.testclient import TestClient

    eng = FakeEngine(tok, slots=1, queue_size=1, tick=0.05)
    with TestClient(create_app(eng), base_url=LOCAL) as c:
        handles = []
        while True:  # fill the one slot and the one queue place behind the app's back
            try:
                handles.append(eng.submit([5], max_tokens=128, on_update=lambda u: None))
            except QueueFull:
                break
        r = c.post("/v1/completions", json=body())
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        for h in handles:
            h.cancel()


def test_engine_error_fails_that_request_only(client, fake, tok):
    bad = "x = 4 print x"
    fake.fail.add(tuple(tok.encode(bad, add_special_tokens=False)))
    results = {}

    def go(name, prompt, stream):
        with client.stream("POST", "/v1/completions",
                           json=body(prompt=prompt, stream=stream)) as r:
            results[name] = (r.status_code, r.read().decode())

    threads = [threading.Thread(target=go, args=(f"{p}-{s}", p, s))
               for p in (bad, PROMPT) for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status, text = results[f"{bad}-False"]
    assert status == 500 and json.loads(text)["error"]["type"] == "server_error"
    status, text = results[f"{bad}-True"]
    events = sse_events(text)
    assert status == 200 and events[-1] == "[DONE]" and "error" in events[-2]
    assert "on purpose" in events[-2]["error"]["message"]
    assert json.loads(results[f"{PROMPT}-False"][1])["choices"][0]["text"] == expected_text(tok)
    ok = sse_events(results[f"{PROMPT}-True"][1])
    assert "".join(c["choices"][0]["text"] for c in ok[:-1]) == expected_text(tok)


def test_after_shutdown_requests_get_503(tok):
    from starlette.testclient import TestClient

    eng = FakeEngine(tok)
    with TestClient(create_app(eng), base_url=LOCAL) as c:
        eng._accepting = False  # what Engine.shutdown does first
        r = c.post("/v1/completions", json=body())
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        eng._accepting = True


# ----------------------------------------------------------- a server on 127.0.0.1

def test_fake_disconnect_mid_stream_cancels(tok):
    eng = FakeEngine(tok, tick=0.05)  # slow: the reply takes about a second
    srv = ServerThread(create_app(eng))
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=body(stream=True)) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
            # closed after the first event; plain requests too:
        assert wait_for(lambda: list(eng.finished.values()) == ["cancelled"])
        assert eng.stats()["slots_busy"] == 0
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body(), timeout=0.3)
        assert wait_for(lambda: list(eng.finished.values()) == ["cancelled"] * 2)
    finally:
        srv.stop()


# ----------------------------------------------------------------------- real engine

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory):
    """`asynclane-jax serve` in a subprocess on a free port of 127.0.0.1 (started first,
    so that it compiles while this process does): (process, url, log path)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "asynclane_jax.cli", "serve", "--model", MODEL, "--port",
         str(port), "--slots", "2", "--gen-lengths", "64", "--chunk", "2", "--max-prompt",
         "64", "--log-level", "info"], stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    yield proc, f"http://127.0.0.1:{port}", log_path
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture(scope="module")
def real(loaded, serve_process):
    """The real engine behind uvicorn in a thread; while it compiles, a second thread
    compiles and runs `generate` for REF_PROMPT at both buckets (the reference)."""
    from asynclane_jax.serve.engine import Engine

    model, tokenizer, cfg = loaded
    refs = {}
    ids = chat_ids(tokenizer, REF_PROMPT)

    def reference():
        for bucket in (64, 128):
            res = asynclane_jax.generate(model, [ids], sampler="asynclane", gen_length=bucket,
                                         tokenizer=tokenizer)
            refs[bucket] = [int(t) for t in res.tokens[0]]

    ref_thread = threading.Thread(target=reference)
    ref_thread.start()
    engine = Engine(model, tokenizer, model_name=MODEL, slots=2, gen_lengths=(64, 128),
                    chunk=4, queue_size=8, max_prompt=64)
    srv = ServerThread(create_app(engine))
    ref_thread.join()
    yield engine, srv, refs
    srv.stop()


@pytest.fixture(scope="module")
def oai(real):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=real[1].url + "/v1", api_key="x", max_retries=0,
                         timeout=60)


def problems(n):
    from asynclane_jax.testbed import tasks

    return [p.prompt for p in tasks.heldout(n)]


def chat_ids(tok, text):
    s = tok.apply_chat_template([{"role": "user", "content": text}],
                                add_generation_prompt=True, tokenize=False)
    return tok.encode(s, add_special_tokens=False)


REF_PROMPT = "tom has 5 books . (1) loses 3 (2) eats 2 (3) gets 1 (4) loses 1 . how many books ?"


def reference(loaded, tokens, max_tokens):
    """`generate`'s tokens at the bucket, cut at the first end-of-text and at max_tokens:
    (text, tokens, finish_reason)."""
    _, tok, cfg = loaded
    stops = [j for j, t in enumerate(tokens) if t in set(cfg.stop_token_ids)]
    end = min(stops[0] if stops else len(tokens), max_tokens)
    reason = "stop" if stops and stops[0] < max_tokens else "length"
    return tok.decode(tokens[:end], skip_special_tokens=True), end, reason


@pytest.mark.slow
def test_real_answers_equal_generate_at_the_bucket(real, oai, loaded):
    engine, _, refs = real
    tok = loaded[1]
    ids = chat_ids(tok, REF_PROMPT)
    reasons = []
    for max_tokens, bucket in ((20, 64), (64, 64), (65, 128), (128, 128)):
        assert engine.bucket(max_tokens) == bucket
        text, n, reason = reference(loaded, refs[bucket], max_tokens)
        reasons.append(reason)
        got = oai.chat.completions.create(model=MODEL, max_tokens=max_tokens,
                                          messages=[{"role": "user", "content": REF_PROMPT}])
        assert got.choices[0].message.content == text
        assert got.choices[0].finish_reason == reason
        assert got.usage.completion_tokens == n and got.usage.prompt_tokens == len(ids)
        got = oai.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens)
        assert got.choices[0].text == text and got.choices[0].finish_reason == reason
    assert reasons == ["length", "stop", "stop", "stop"]  # the 31-token answer, cut at 20


def stream_text(oai, chat, prompt, max_tokens=128, **kw):
    """(text, finish_reason, usage, chunks) of a streamed request."""
    if chat:
        it = oai.chat.completions.create(model=MODEL, max_tokens=max_tokens, stream=True,
                                         messages=[{"role": "user", "content": prompt}], **kw)
    else:
        it = oai.completions.create(model=MODEL, max_tokens=max_tokens, stream=True,
                                    prompt=prompt, **kw)
    parts, finish, use, n = [], None, None, 0
    for ch in it:
        n += 1
        c = ch.choices[0]
        parts.append((c.delta.content or "") if chat else c.text)
        finish = finish or c.finish_reason
        use = use or ch.usage
    return "".join(parts), finish, use, n


@pytest.mark.slow
def test_real_streamed_equals_plain(oai):
    prompt = problems(2)[1]
    for chat in (True, False):
        if chat:
            plain = oai.chat.completions.create(
                model=MODEL, max_tokens=128, messages=[{"role": "user", "content": prompt}])
            want = plain.choices[0].message.content
        else:
            plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=128)
            want = plain.choices[0].text
        text, finish, use, n = stream_text(oai, chat, prompt)
        assert text == want and want.strip()
        assert finish == plain.choices[0].finish_reason
        assert use.completion_tokens == plain.usage.completion_tokens
        assert n >= (3 if chat else 2)  # the role chunk, text, the final chunk


@pytest.mark.slow
def test_real_concurrent_streams_each_equal_their_solo_answer(real, oai):
    engine = real[0]
    prompts = problems(8)
    solo = [oai.chat.completions.create(model=MODEL, max_tokens=100,
                                        messages=[{"role": "user", "content": p}])
            .choices[0].message.content for p in prompts]
    done0 = engine.stats()["requests_done"]
    got: dict[int, list] = {i: [] for i in range(len(prompts))}

    def go(i):
        got[i].append(stream_text(oai, True, prompts[i], max_tokens=100)[0])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {i: v for i, v in got.items()} == {i: [s] for i, s in enumerate(solo)}
    assert engine.stats()["requests_done"] - done0 == len(prompts)  # each exactly once
    assert wait_for(lambda: engine.stats()["slots_busy"] == 0)


@pytest.mark.slow
def test_real_disconnect_frees_the_slot(real, monkeypatch):
    engine, srv = real[:2]
    reasons = []
    submit = engine.submit

    def recording(*a, on_update, **kw):
        def cb(u):
            if u.finished:
                reasons.append(u.finish_reason)
            on_update(u)
        return submit(*a, on_update=cb, **kw)

    monkeypatch.setattr(engine, "submit", recording)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for _ in range(3):
            with c.stream("POST", "/v1/chat/completions",
                          json=chat_body(stream=True, max_tokens=128)) as r:
                assert r.status_code == 200  # the stream is open: leave it at once
    assert wait_for(lambda: len(reasons) == 3)
    assert "cancelled" in reasons, reasons  # at least one was still decoding
    assert wait_for(lambda: engine.stats()["slots_busy"] == 0 and engine.stats()["waiting"] == 0)
    r = httpx.post(srv.url + "/v1/completions", json=body(max_tokens=64), timeout=30)
    assert r.status_code == 200  # and it serves on


@pytest.mark.slow
def test_real_queue_bound_gives_429(real, oai, tok):
    import openai

    engine = real[0]
    for _ in range(5):
        handles = []

        def fill(handles=handles):
            try:
                while True:
                    handles.append(engine.submit(chat_ids(tok, PROMPT), max_tokens=128,
                                                 on_update=lambda u: None))
            except QueueFull:
                pass

        fill()  # the queue, then (once the engine has admitted them) the rows
        time.sleep(0.05)
        fill()  # the queue again, behind full rows
        try:
            oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
        except openai.RateLimitError as e:
            assert e.status_code == 429 and "busy" in str(e)
            break
        finally:
            for h in handles:
                h.cancel()
    else:
        pytest.fail("no 429 in five tries")
    assert wait_for(lambda: engine.stats()["slots_busy"] == 0 and engine.stats()["waiting"] == 0)


@pytest.mark.slow
def test_real_metrics_match_the_engine(real, oai, loaded):
    """/metrics on the real engine: a request's tokens and its histograms' observations,
    and the pools' count, held bytes (from the model's shapes), budget and compiles as
    the engine holds them."""
    import numpy as np

    pytest.importorskip("prometheus_client")
    engine, srv, _ = real
    cfg = loaded[2]

    def scrape():
        return metric_samples(httpx.get(srv.url + "/metrics", timeout=30).text)

    before = scrape()
    got = oai.chat.completions.create(model=MODEL, max_tokens=20,
                                      messages=[{"role": "user", "content": REF_PROMPT}])
    after = scrape()

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    chat = "/v1/chat/completions"
    assert got.usage.completion_tokens == 20
    assert delta("asynclane_requests_total", endpoint=chat, status="200") == 1
    assert delta("asynclane_generated_tokens_total") == 20
    assert delta("asynclane_prompt_tokens_total") == got.usage.prompt_tokens
    assert delta("asynclane_request_latency_seconds_count", endpoint=chat) == 1
    assert delta("asynclane_time_to_first_token_seconds_count", endpoint=chat) == 1
    pools = list(engine.pools.values())  # buckets 64 and 128 at prompt length 64
    itemsize = np.dtype(cfg.jnp_dtype).itemsize
    # Each pool's state from its shapes: the K/V cache's share per row is the model's
    # arithmetic; the pools hold their state at their current slot count.
    for p in pools:
        assert p.shape.kv_per_row == (2 * cfg.n_layers * p.T * cfg.n_kv_heads * cfg.head_dim
                                      * itemsize)
    held = sum(p.shape.bytes(p.size) for p in pools)
    assert metric(after, "asynclane_pools") == len(pools) == 2
    assert metric(after, "asynclane_pool_bytes") == held > 0
    assert held <= metric(after, "asynclane_kv_budget_bytes") == engine.kv_budget
    # Every pool compiled at each slot count (1, 2) at start.
    assert metric(after, "asynclane_compiles_total") == engine.compiles == 2 * 2
    assert metric(after, "asynclane_compile_seconds_total") == pytest.approx(
        sum(p.compile_time for p in pools))
    assert metric(after, "asynclane_pool_slots") == 2


@pytest.mark.slow
def test_real_thresholds_need_no_pool_and_structural_options_get_400(real, oai, loaded):
    """Clients at many thresholds at once run in the pool that exists, each row at its
    own (no new pool, no compile: /metrics' counter stays); an answer is `generate`'s at
    its threshold; a structural option is a 400 that names the allowed value."""
    import openai

    pytest.importorskip("prometheus_client")
    engine, srv, _ = real
    model, tok, _ = loaded

    def compiles():
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        return metric(metric_samples(text), "asynclane_compiles_total")

    pools, before = set(engine.pools), compiles()
    got = {}

    def go(t):
        got[t] = oai.chat.completions.create(
            model=MODEL, max_tokens=64, messages=[{"role": "user", "content": REF_PROMPT}],
            extra_body={"sampler_options": {"threshold": t}}).choices[0].message.content

    thresholds = (0.5, 0.7, 0.81, 0.811, 0.99)
    threads = [threading.Thread(target=go, args=(t,)) for t in thresholds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(got) == set(thresholds)
    assert set(engine.pools) == pools and compiles() == before == engine.compiles
    ids = chat_ids(tok, REF_PROMPT)
    for t in (0.5, 0.99):  # one program: the fixture's reference at this bucket
        res = asynclane_jax.generate(model, [ids], sampler="asynclane", gen_length=64,
                                     tokenizer=tok, threshold=t)
        assert got[t] == reference(loaded, [int(x) for x in res.tokens[0]], 64)[0]
    assert got[0.5] != got[0.99]  # on this prompt the two thresholds' texts differ
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt="x = 1 print x", max_tokens=8,
                               extra_body={"sampler_options": {"block_length": 16}})
    e = err.value
    assert e.status_code == 400 and e.code == "option_not_allowed"
    assert e.param == "sampler_options"
    assert "block_length=16" in e.message and "block_length=32" in e.message
    assert "threshold" in e.message
    assert set(engine.pools) == pools and compiles() == before


@pytest.mark.slow
def test_sigterm_drains_the_stream_and_exits_0(serve_process):
    proc, url, log_path = serve_process

    assert wait_for(process_serving(proc, url, log_path), timeout=240), log_path.read_text()
    # The command line's guard is on: a foreign Host or Origin is a 403, text/plain a 415,
    # and /health names no path.
    r = httpx.get(url + "/v1/models", headers={"Host": "evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    r = httpx.post(url + "/v1/completions", content=json.dumps(body()),
                   headers={"Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.post(url + "/v1/completions", content=json.dumps(body()),
                   headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert os.path.expanduser("~") not in httpx.get(url + "/health").text
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions",
                      json=chat_body(stream=True, max_tokens=64)) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [first] + list(lines)
    events = sse_events("\n\n".join(rest))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]).strip()
    assert proc.wait(timeout=60) == 0, log_path.read_text()
    text = log_path.read_text()
    assert "draining the engine" in text and "Traceback" not in text
    with pytest.raises(httpx.ConnectError):  # it is gone
        httpx.get(url + "/health", timeout=2)


def test_serve_without_the_extra_is_one_line(monkeypatch, capsys):
    from asynclane_jax.cli import main

    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` fails
    try:
        rc = main(["serve"])
    except SystemExit as e:  # the entry point is not installed: argparse refuses
        pytest.skip(f"the serve entry point is not installed (pip install -e .): {e}")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "pip install 'asynclane-jax[serve]'" in err


def test_the_command_line_does_not_import_the_server_packages():
    code = ("import sys, asynclane_jax.cli\n"
            "asynclane_jax.cli.build_parser()\n"
            "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'openai',\n"
            "                   'prometheus_client')\n"
            "       if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("argv,buckets", [
    ([], (128, 256, 512)),
    (["--max-tokens", "300"], (128, 256, 300)),
    (["--max-tokens", "64"], (64,)),
    (["--gen-lengths", "128,64"], (64, 128)),
    (["--max-tokens", "300", "--default-max-tokens", "300"], (128, 256, 300)),
])
def test_serve_cli_buckets(argv, buckets, monkeypatch):
    """A command line that passes the checks reaches the engine with these buckets (the
    engine is stood in for, so that nothing is loaded or compiled)."""
    assert engine_arguments(monkeypatch, argv)["gen_lengths"] == buckets


@pytest.mark.parametrize("argv,needle", [
    (["--gen-lengths", "64,128", "--max-tokens", "256"], "give one"),
    (["--gen-length", "64"], "--gen-length is per request"),
    (["--slots", "0"], "--slots 0"),
    (["--default-max-tokens", "600"], "more than the largest bucket"),
    (["--max-tokens", "300", "--default-max-tokens", "301"], "more than the largest bucket"),
    (["--allow-options", "block_length"], "--allow-options 'block_length': comma-separated"),
])
def test_serve_cli_checks(argv, needle, capsys):
    from asynclane_jax.cli import main

    rc = main(["serve", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1
