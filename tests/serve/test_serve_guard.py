"""`asynclane-jax serve` locked, unbreakable by a body, and telling clients at shutdown.

  * Locked (asynclane_jax.serve.guard, cli): the API key (the openai client's 401, the
    key from a flag, a file or the environment, required beyond loopback), the Host and
    Origin of a request (403 unless the server's own or allowed, CORS for those allowed),
    JSON only (415), the body read with its bound (413 before any parsing), the prompt's
    characters bounded before tokenizing, and the header timeout.
  * Every bad body a 400 in OpenAI's error form: the 12 bodies that were plain-text 500s,
    options that name files, no absolute path in any answer or in /health, and a
    hypothesis fuzz test over the request schema (status < 500, a JSON error, the server
    alive after).
  * Shutdown that tells clients: `serve_app` in a subprocess (the fake engine, no model),
    SIGTERM with a 1 s drain: each running stream ends with an error event and [DONE], a
    plain request gets a 503 body, the process exits 0 with no traceback in its log.

The engine is the fake one (no compile) except where a real Engine's option check is
the point; the server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_fakes import (  # noqa: E402
    MODEL,
    PROMPT,
    CharTokenizer,
    FakeEngine,
    ServerThread,
    body,
    chat_body,
    local_client,
    process_serving,
    sse_events,
    wait_for,
)

from asynclane_jax.serve import cli, protocol  # noqa: E402
from asynclane_jax.serve.app import create_app  # noqa: E402
from asynclane_jax.serve.guard import Security, is_loopback, own_hosts  # noqa: E402

KEY = "sk-test-0123456789"


def assert_error(r, status, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


# ------------------------------------------------------------------------ 4. locked

def test_api_key_through_the_openai_client(tok):
    openai = pytest.importorskip("openai")
    eng = FakeEngine(tok, tick=0.001)
    srv = ServerThread(create_app(eng, security=Security(api_key=KEY)))
    try:
        url = srv.url + "/v1"
        for key in ("wrong", KEY + "x", KEY[:-1]):
            bad = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)
            with pytest.raises(openai.AuthenticationError) as e:
                bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        assert eng.submitted == []  # nothing reached the engine
        r = httpx.post(url + "/completions", json=body(max_tokens=4), timeout=30)
        err = assert_error(r, 401, "invalid_api_key")
        assert "missing" in err["message"] and r.headers["www-authenticate"] == "Bearer"
        good = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)
        got = good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 4
        parts = [c.choices[0].delta.content or "" for c in good.chat.completions.create(
            model=MODEL, max_tokens=6, stream=True,
            messages=[{"role": "user", "content": PROMPT}])]
        assert "".join(parts) == tok.decode(eng.reply[:6], skip_special_tokens=True)
        assert [m.id for m in good.models.list()] == [MODEL]
        # The scheme is case-insensitive; /health needs no key and names no key.
        r = httpx.get(url + "/models", headers={"Authorization": f"bearer {KEY}"})
        assert r.status_code == 200
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 200 and KEY not in r.text
    finally:
        srv.stop()


def test_host_and_origin_are_the_servers_own(fake_client):
    c, eng = fake_client
    ok = c.post("/v1/completions", json=body(max_tokens=2))
    assert ok.status_code == 200
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        r = c.get("/v1/models", headers={"Host": host})
        assert_error(r, 403, "host_not_allowed")
    for origin in ("http://evil.example", "null", "http://127.0.0.1:9999",
                   "https://localhost.evil.example"):
        # The issue's case: a web page's text/plain POST (no preflight) is refused too.
        r = c.post("/v1/completions", content=json.dumps(body()),
                   headers={"Origin": origin, "Content-Type": "text/plain"})
        assert_error(r, 403, "origin_not_allowed")
        r = c.get("/v1/models", headers={"Origin": origin})
        assert_error(r, 403, "origin_not_allowed")
    n = len(eng.submitted)
    assert n == 1
    # Its own origin (same host and port), other loopback names, no Origin at all.
    for headers in ({"Origin": "http://127.0.0.1"}, {"Host": "localhost:8000",
                                                     "Origin": "http://localhost:8000"},
                    {"Host": "[::1]:8000"}):
        assert c.get("/v1/models", headers=headers).status_code == 200, headers


def test_allowed_origins_and_hosts_get_cors(tok):
    app = create_app(FakeEngine(tok), security=Security(
        allowed_origins=("https://app.example",), allowed_hosts=("api.example",)))
    with local_client(app) as c:
        r = c.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        pre = c.options("/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200 and "POST" in pre.headers["access-control-allow-methods"]
        pre = c.options("/v1/completions", headers={
            "Origin": "https://other.example", "Access-Control-Request-Method": "POST"})
        assert_error(pre, 403, "origin_not_allowed")
        assert c.get("/v1/models", headers={"Host": "api.example"}).status_code == 200
        assert_error(c.get("/v1/models", headers={"Host": "api2.example"}), 403)


@pytest.fixture
def fake_client(tok):
    eng = FakeEngine(tok, tick=0.001)
    with local_client(create_app(eng, security=Security(max_body_bytes=4096))) as c:
        yield c, eng


def test_json_only_and_the_body_bound(fake_client):
    c, eng = fake_client
    raw = json.dumps(body(max_tokens=2))
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {} if ctype is None else {"Content-Type": ctype}
        assert_error(c.post("/v1/completions", content=raw, headers=headers), 415,
                     "unsupported_media_type")
    ok = c.post("/v1/completions", content=raw,
                headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    # Over the bound: refused before it is parsed (it is not JSON: that would be a 400).
    big = b'{"model": "' + b"x" * 5000
    r = c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert_error(r, 413, "request_too_large")
    # Without a Content-Length (chunked), the bound holds while reading.
    r = c.post("/v1/completions", content=iter([big[:3000], big[3000:]]),
               headers={"Content-Type": "application/json"})
    assert_error(r, 413, "request_too_large")
    assert len(eng.submitted) == 1


def test_prompt_characters_are_bounded_before_tokenizing():
    class Counting(CharTokenizer):
        calls = 0

        def encode(self, text, add_special_tokens=False):
            Counting.calls += 1
            return super().encode(text)

    tok = Counting()
    eng = FakeEngine(tok, max_prompt=64)
    with local_client(create_app(eng)) as c:
        assert c.app.state.spec.max_prompt_chars == 64  # max_prompt x the longest token
        Counting.calls = 0
        r = c.post("/v1/completions", json=body(prompt="x" * 65))
        err = assert_error(r, 400, "context_length_exceeded")
        assert "65 characters" in err["message"]
        r = c.post("/v1/chat/completions", json=chat_body(
            messages=[{"role": "user", "content": "x" * 40}] * 2))
        assert_error(r, 400, "context_length_exceeded")
        r = c.post("/v1/completions", json=body(prompt=[5] * 65))
        assert_error(r, 400, "context_length_exceeded")
        assert Counting.calls == 0 and eng.submitted == []


def test_the_cli_requires_a_key_beyond_loopback(tmp_path, capsys, monkeypatch):
    from asynclane_jax.cli import build_parser, main

    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    rc = main(["serve", "--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert rc == 2 and "--host 0.0.0.0 listens beyond this machine" in err
    assert err.count("\n") == 1

    def security(*argv, env=None):
        args = build_parser().parse_args(["serve", *argv])
        return cli.security_from_args(args, environ=env or {})

    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\nignored\n")
    assert security("--host", "0.0.0.0", "--api-key-file", str(key_file)).api_key == KEY
    assert security("--host", "0.0.0.0", env={cli.API_KEY_ENV: KEY}).api_key == KEY
    assert security("--api-key", "k2", env={cli.API_KEY_ENV: KEY}).api_key == "k2"
    assert security().api_key is None  # loopback: open, but Host/Origin checked
    s = security("--allowed-origins", "https://a.example/, https://b.example",
                 "--allowed-hosts", "api.example", "--max-body-bytes", "100")
    assert s.allowed_origins == ("https://a.example", "https://b.example")
    assert s.allowed_hosts == ("api.example",) and s.max_body_bytes == 100
    for argv, needle in ((["--api-key", "a", "--api-key-file", str(key_file)], "not both"),
                         (["--api-key-file", str(tmp_path / "none")], "cannot read"),
                         (["--api-key", " "], "empty")):
        with pytest.raises(cli.UsageError, match=needle):
            security(*argv)
        # and the message names no file of the machine
    assert main(["serve", "--max-body-bytes", "0"]) == 2
    assert "--max-body-bytes 0" in capsys.readouterr().err
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    hosts, any_ip = own_hosts("0.0.0.0")
    assert any_ip and "localhost" in hosts
    assert own_hosts("10.1.2.3") == (("localhost", "127.0.0.1", "::1", "10.1.2.3"), False)


def test_help_describes_the_security_flags(capsys):
    from asynclane_jax.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--api-key KEY", "--api-key-file FILE", "--allowed-origins",
                 "--allowed-hosts", "--max-body-bytes", "--max-prompt-chars",
                 "--header-timeout", "--body-timeout", "--keep-alive-timeout",
                 cli.API_KEY_ENV):
        assert flag in out, flag


def test_warm_up_is_on_unless_turned_off():
    from asynclane_jax.cli import build_parser

    assert build_parser().parse_args(["serve"]).warm_up is True
    assert build_parser().parse_args(["serve", "--no-warm-up"]).warm_up is False


def test_headers_must_arrive_in_time(tok):
    srv = ServerThread(create_app(FakeEngine(tok)), http=cli._guarded_http_protocol(0.5),
                       timeout_keep_alive=1)
    try:
        for sent in (b"", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                s.sendall(sent)
                t0 = time.monotonic()
                assert s.recv(100) == b""  # closed by the server
                assert time.monotonic() - t0 < 5
        # Requests that send their headers in time are answered, one after another on
        # one connection (the timer re-arms after each response).
        with httpx.Client(base_url=srv.url) as c:
            assert [c.get("/health").status_code for _ in range(3)] == [200] * 3
    finally:
        srv.stop()


def test_headers_are_bounded(tok):
    """Request line and headers past MAX_HEADER_BYTES get a 400 and a closed connection,
    whether they come in one piece or many; headers within it are served."""
    srv = ServerThread(create_app(FakeEngine(tok)), http=cli._guarded_http_protocol(10))

    def ask(pad: int, pieces: int = 1) -> bytes:
        head = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * pad
                + b"\r\nConnection: close\r\n\r\n")
        step = -(-len(head) // pieces)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            for i in range(0, len(head), step):
                s.sendall(head[i:i + step])
                if pieces > 1:
                    time.sleep(0.02)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            return reply

    try:
        for pieces in (1, 4):
            assert ask(cli.MAX_HEADER_BYTES // 2, pieces).startswith(b"HTTP/1.1 200")
            big = ask(cli.MAX_HEADER_BYTES + 1024, pieces)
            assert big.startswith(b"HTTP/1.1 400"), big[:200]
            assert b"connection: close" in big.lower()
    finally:
        srv.stop()


def test_serving_needs_httptools(monkeypatch):
    monkeypatch.setitem(sys.modules, "httptools", None)  # as if not installed
    with pytest.raises(cli.UsageError, match=r"serving needs httptools: pip install"):
        cli._guarded_http_protocol(1)


# ------------------------------------------------------------ 5. every bad body a 400

DEEP = "[" * 100_000 + "]" * 100_000
BIG_INT = "9" * 5000
LONG_NUM = "1" * 400

TWELVE = [
    # (path, raw body, param)
    ("c", f'{{"model": "{MODEL}", "prompt": {DEEP}}}', None),
    ("h", f'{{"model": "{MODEL}", "messages": {DEEP}}}', None),
    ("c", f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": {BIG_INT}}}', None),
    ("c", f'{{"model": "{MODEL}", "prompt": "x", "seed": {BIG_INT}}}', None),
    ("c", f'{{"model": "{MODEL}", "prompt": "x", "temperature": {LONG_NUM}}}', "temperature"),
    ("c", f'{{"model": "{MODEL}", "prompt": "x", "top_p": {LONG_NUM}}}', "top_p"),
    ("c", f'{{"model": "{MODEL}", "prompt": "x", "presence_penalty": {LONG_NUM}}}',
     "presence_penalty"),
    ("c", f'{{"model": "{MODEL}", "prompt": "x", "temperature": {LONG_NUM}.5}}', "temperature"),
    ("c", json.dumps(body(sampler_options={"sampler": "eb"})), "sampler_options"),
    ("c", json.dumps(body(sampler_options={"gen_length": 5})), "sampler_options"),
    ("c", json.dumps(body(prompt="x = \ud800 4")), "prompt"),
    ("h", json.dumps(chat_body(messages=[{"role": "user", "content": "a\ud800"}])),
     "messages[0].content"),
]


@pytest.fixture(scope="module")
def tok_client(tok):
    eng = FakeEngine(tok, tick=0.0005)
    with local_client(create_app(eng), raise_server_exceptions=False) as c:
        yield c, eng


@pytest.mark.parametrize("path,raw,param", TWELVE,
                         ids=[f"{i}-{p or 'body'}" for i, (_, _, p) in enumerate(TWELVE)])
def test_the_issues_bad_bodies_are_400s(tok_client, path, raw, param):
    c, eng = tok_client
    n = len(eng.submitted)
    url = "/v1/completions" if path == "c" else "/v1/chat/completions"
    r = c.post(url, content=raw.encode("utf-8", "surrogatepass"),
               headers={"Content-Type": "application/json"})
    err = assert_error(r, 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert len(err["message"]) < 600  # no 5,000-digit echo
    assert len(eng.submitted) == n
    assert c.get("/health").status_code == 200


def test_options_naming_files_are_refused_and_no_path_leaks(tok):
    class PathEngine(FakeEngine):
        def stats(self):
            return {**super().stats(), "compile_s": [{"options": {
                "routers": "/home/someone/models/tiny/routers", "threshold": 0.9}}]}

    eng = PathEngine(tok, sampler="eb", tick=0.0005)
    eng.model_name = MODEL
    bad = "x = 4 print x"
    eng.fail.add(tuple(tok.encode(bad, add_special_tokens=False)))
    eng.fail_message = "cannot read /home/someone/models/tiny/routers/lbs.npz"
    with local_client(create_app(eng)) as c:
        for folder in ("/home/someone/models", "~/x", "relative/folder"):
            r = c.post("/v1/completions", json=body(sampler_options={"routers": folder}))
            err = assert_error(r, 400)
            assert "names files" in err["message"] and folder not in r.text
        h = c.get("/health")
        assert h.status_code == 200 and "/home" not in h.text
        assert h.json()["compile_s"][0]["options"] == {"routers": "<path>", "threshold": 0.9}
        r = c.post("/v1/completions", json=body(prompt=bad))
        assert r.status_code == 500 and "/home" not in r.text and "<path>" in r.text
    assert eng.submitted[-1][0] == tok.encode(bad, add_special_tokens=False)
    assert cli.public_model_name("/models/llada-8b-instruct/") == "llada-8b-instruct"
    assert cli.public_model_name("tiny-llada") == "tiny-llada"
    assert protocol.scrub("see /v1/completions and /home/a/b.json") == (
        "see /v1/completions and <path>")


def test_engine_refuses_structural_options_as_an_engine_error(loaded):
    from asynclane_jax.serve.engine import Engine, EngineError

    model, tok, _ = loaded
    eng = Engine(model, tok, model_name=MODEL, slots=1, gen_lengths=(64,), max_prompt=64)
    for options in ({"sampler": "eb"}, {"gen_length": 5}, {"threshold": "high"}):
        with pytest.raises(EngineError):
            eng._schedule(options, 64)


def _fuzz_strategy():
    from hypothesis import strategies as st

    text = st.one_of(st.text(max_size=12), st.sampled_from(["\ud800", "a\udfff", "🙂", ""]))
    number = st.one_of(st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([10**400, -(10**40), 2**64, 0.5, 1, 0]))
    scalar = st.one_of(st.none(), st.booleans(), number, text)
    anything = st.recursive(scalar, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=8)
    message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(
        ["user", "system", "assistant", "tool"]), anything), "content": st.one_of(
        text, anything, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                        "text": text}), max_size=2))})
    option_names = st.sampled_from(["threshold", "steps", "sampler", "gen_length", "routers",
                                    "block_length", "nope"])
    fields = {
        "model": st.one_of(st.just(MODEL), anything),
        "prompt": st.one_of(text, st.lists(st.integers(-2, 200), max_size=8), anything),
        "messages": st.one_of(st.lists(message, max_size=3), anything),
        "max_tokens": st.one_of(st.integers(-2, 200), number, anything),
        "max_completion_tokens": number,
        "temperature": number, "top_p": number, "seed": number,
        "presence_penalty": number, "frequency_penalty": number,
        "stop": st.one_of(text, st.lists(text, max_size=3), anything),
        "stream": st.one_of(st.booleans(), anything), "n": number, "best_of": number,
        "logprobs": anything, "echo": anything, "logit_bias": anything, "user": anything,
        "sampler_options": st.one_of(st.dictionaries(option_names, anything, max_size=3),
                                     anything),
        "tools": anything, "response_format": anything, "stream_options": anything,
    }
    names = sorted(fields)
    return st.tuples(st.booleans(), st.lists(st.sampled_from(names), unique=True,
                                             max_size=8).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys})))


def test_fuzz_the_request_schema(tok_client):
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings

    c, _ = tok_client
    seen = {}

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_fuzz_strategy())
    def check(case):
        chat, req = case
        req = {"model": MODEL, **req} if "model" not in req else req
        url = "/v1/chat/completions" if chat else "/v1/completions"
        r = c.post(url, content=json.dumps(req).encode(),
                   headers={"Content-Type": "application/json"})
        assert r.status_code < 500, (req, r.text)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code >= 400:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert "Traceback" not in err["message"]
        elif req.get("stream") is True:
            assert sse_events(r.text)[-1] == "[DONE]"
        else:
            assert r.json()["object"] in ("text_completion", "chat.completion")

    check()
    assert c.get("/health").status_code == 200
    assert seen.get(400, 0) > 50  # the fuzz reached the checks, not only the model's 404


# ------------------------------------------------------- 6. shutdown that tells clients

SERVER = textwrap.dedent("""
    import logging, sys
    sys.path.insert(0, {tests!r})
    from serve_fakes import CharTokenizer, FakeEngine
    from asynclane_jax.serve import cli
    from asynclane_jax.serve.app import create_app

    logging.basicConfig(level=logging.INFO)
    logging.getLogger("asynclane_jax.serve").setLevel(logging.INFO)
    engine = FakeEngine(CharTokenizer(), tick=0.05, slots=4, max_prompt=256,
                        reply="y" * 200)
    app = create_app(engine, drain_timeout=1.0)
    cli.serve_app(app, host="127.0.0.1", port={port}, drain_timeout=1.0)
    print("engine stopped:", engine.stopped, flush=True)
""")


def test_sigterm_tells_streams_and_plain_requests(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER.format(tests=str(pathlib.Path(__file__).parent),
                                                 port=port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        assert wait_for(process_serving(proc, url, log_path), timeout=120), log_path.read_text()
        results, started = {}, threading.Semaphore(0)

        def stream(i):
            with httpx.Client(base_url=url, timeout=30) as c, c.stream(
                    "POST", "/v1/chat/completions",
                    json=chat_body(stream=True, max_tokens=128)) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: ") and not lines:
                        started.release()
                    lines.append(line)
                results[f"stream{i}"] = sse_events("\n\n".join(lines))

        def plain():
            results["plain"] = httpx.post(url + "/v1/completions", json=body(max_tokens=128),
                                          timeout=30)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        threads.append(threading.Thread(target=plain))
        for t in threads:
            t.start()
        assert started.acquire(timeout=30) and started.acquire(timeout=30)

        def all_three_in():  # the plain request too has reached the engine
            h = httpx.get(url + "/health", timeout=5).json()
            return h["slots_busy"] + h["waiting"] >= 3

        assert wait_for(all_three_in, timeout=30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        assert time.monotonic() - t0 < 15  # the 1 s drain, not the 6 s replies
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    for i in range(2):
        events = results[f"stream{i}"]
        assert events[-1] == "[DONE]", events[-3:]
        err = events[-2]["error"]
        assert err["code"] == "shutting_down" and err["type"] == "server_error", err
        assert set(err) == {"message", "type", "param", "code"}
        assert any(e["choices"][0]["delta"].get("content") for e in events[:-2])  # it ran
    plain = results["plain"]
    assert plain.status_code == 503, plain.text
    assert plain.json()["error"]["code"] == "shutting_down"
    assert "Traceback" not in text and "CancelledError" not in text, text
    assert "draining the engine" in text and "engine stopped: True" in text
