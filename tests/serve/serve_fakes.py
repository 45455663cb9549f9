"""The serve tests' stand-ins: an engine without a model (`FakeEngine`, the Engine's
interface) and a tokenizer of one token per character (`CharTokenizer`, for a server
started in a subprocess without loading a model), the request bodies and the loopback
test client the tests share (`body`, `chat_body`, `local_client`), /metrics read
back (`metric_samples`, `metric`), what a `serve` command line hands the engine
(`engine_arguments`), and what a request is sent of `generate`'s row (`answer`)."""

from __future__ import annotations

import json
import socket
import threading
import time

from asynclane_jax.serve.engine import EngineError, EngineStopped, QueueFull, Update

MODEL = "tiny-llada"
REPLY = "(1) 7 + 2 = 9 \n (2) 9 - 5 = 4 \n answer : 4"
PROMPT = "x = 4 y = 7 (1) x = y + 2 (2) y = x - 5 print y"
# The TestClient's address: a loopback name (its default "testserver" is not one of the
# server's own names, so its requests would be refused with 403).
LOCAL = "http://127.0.0.1"


def answer(model, row, max_tokens: int | None = None) -> list[int]:
    """What a request is sent of `generate`'s row of tokens: the tokens before the
    first stop token, at most max_tokens (None: no bound)."""
    row = list(row.tolist() if hasattr(row, "tolist") else row)
    stop = set(model.cfg.stop_token_ids)
    cut = next((j for j, t in enumerate(row) if t in stop), len(row))
    return row[:cut if max_tokens is None else min(cut, max_tokens)]


def body(**kw):
    """A completions request for the test model and prompt."""
    return {"model": MODEL, "prompt": PROMPT, **kw}


def chat_body(**kw):
    """A chat request for the test model and prompt."""
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], **kw}


def local_client(app, **kw):
    """A starlette TestClient of `app` that reaches it by a loopback name."""
    from starlette.testclient import TestClient

    return TestClient(app, base_url=LOCAL, **kw)


class CharTokenizer:
    """One token per character (its code point); a chat template that joins the turns."""

    chat_template = "turns joined"

    def __len__(self):
        return 0x110000

    def get_vocab(self):
        return {"a": 0}

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))

    def apply_chat_template(self, turns, add_generation_prompt=True, tokenize=False):
        return "".join(f"<{t['role']}>{t['content']}" for t in turns) + "<assistant>"


class FakeHandle:
    def __init__(self, req):
        self.request_id = req["id"]
        self._req = req

    def cancel(self):
        self._req["cancel"] = True


class FakeEngine:
    """The Engine's interface without a model. A request's reply is REPLY's tokens,
    one per `tick` seconds, cut at max_tokens; a prompt in `fail` gets an error update
    after its first token. `submitted` records (prompt, max_tokens, options)."""

    POOL_BYTES = 3 << 20
    COMPILE_S = 1.25
    KV_BUDGET = 64 << 20

    def __init__(self, tokenizer, *, sampler="asynclane", options=None, gen_lengths=(64, 128),
                 max_prompt=64, slots=2, queue_size=4, tick=0.002, reply=REPLY):
        self.tokenizer, self.sampler, self.options = tokenizer, sampler, dict(options or {})
        self.model_name, self.gen_lengths, self.max_prompt = MODEL, tuple(gen_lengths), max_prompt
        self.slots, self.queue_size, self.tick = slots, queue_size, tick
        self.reply = tokenizer.encode(reply, add_special_tokens=False)
        self.fail: set[tuple] = set()
        self.fail_message = "the engine failed (on purpose)"
        self.submitted: list[tuple] = []
        self.finished: dict[str, str] = {}  # request id -> finish reason
        self._reqs: list[dict] = []
        self._lock = threading.Lock()
        self._n = 0
        self._accepting = False
        self._running = False
        self.started = self.stopped = False

    def start(self):
        self.started = self._accepting = self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, prompt_ids, *, max_tokens, options=None, on_update):
        from asynclane_jax.decoding.registry import get_schedule_class, option_fields

        if not self._accepting:
            raise EngineStopped("the server is shutting down")
        if len(prompt_ids) > self.max_prompt:
            raise EngineError("prompt too long")
        if not 1 <= max_tokens <= max(self.gen_lengths):
            raise EngineError(f"max_tokens={max_tokens} out of range")
        fields = option_fields(get_schedule_class(self.sampler))
        bad = [k for k in (options or {}) if k not in fields]
        if bad:
            raise EngineError(f"unknown option(s) {bad} of sampler {self.sampler!r}")
        with self._lock:
            if sum(r["slot"] is None for r in self._reqs) >= self.queue_size:
                raise QueueFull(f"{self.queue_size} requests are already waiting")
            self._n += 1
            req = {"id": f"fake-{self._n}", "prompt": list(prompt_ids), "max": max_tokens,
                   "cb": on_update, "sent": 0, "cancel": False, "slot": None}
            self._reqs.append(req)
            self.submitted.append((list(prompt_ids), max_tokens, dict(options or {})))
        return FakeHandle(req)

    def shutdown(self, drain=True, timeout=None):
        """As Engine.shutdown: stop admitting, let what is in flight finish for up to
        `timeout` seconds, cancel the rest (each gets its "cancelled" update), stop."""
        self._accepting = False
        deadline = time.monotonic() + (timeout or 30)
        while drain and self._reqs and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._lock:
            for req in self._reqs:
                req["cancel"] = True
        while self._reqs and self._running:
            time.sleep(0.005)
        self._running = False
        self._thread.join()
        self.stopped = True

    def stats(self):
        with self._lock:
            return {"slots": self.slots,
                    "slots_busy": sum(r["slot"] is not None for r in self._reqs),
                    "waiting": sum(r["slot"] is None for r in self._reqs),
                    "requests_done": len(self.finished)}

    def gauges(self):
        """As Engine.gauges: the requests' state, and one pool per generation bucket of
        POOL_BYTES bytes that took COMPILE_S seconds each to compile, within KV_BUDGET
        bytes, one of them evicted once."""
        reqs = list(self._reqs)
        n = len(self.gen_lengths)
        return {"slots": self.slots, "slots_busy": sum(r["slot"] is not None for r in reqs),
                "waiting": sum(r["slot"] is None for r in reqs), "pools": n,
                "pool_bytes": n * self.POOL_BYTES, "compiles": n,
                "compile_seconds": n * self.COMPILE_S, "kv_budget": self.KV_BUDGET,
                "evicted": 1}

    def _end(self, req, reason, error=None, new=()):
        self._reqs.remove(req)
        self.finished[req["id"]] = reason
        req["cb"](Update(list(new), self._text(req, new), True, reason, len(req["prompt"]),
                         req["sent"], error))

    def _text(self, req, new):
        done = self.reply[:req["sent"]]
        before = self.tokenizer.decode(done[:len(done) - len(new)], skip_special_tokens=True)
        return self.tokenizer.decode(done, skip_special_tokens=True)[len(before):]

    def _loop(self):
        while self._running:
            time.sleep(self.tick)
            with self._lock:
                for req in list(self._reqs):
                    if req["cancel"]:
                        self._end(req, "cancelled")
                        continue
                    if req["slot"] is None:
                        busy = {r["slot"] for r in self._reqs} - {None}
                        free = [i for i in range(self.slots) if i not in busy]
                        if not free:
                            continue
                        req["slot"] = free[0]
                    new = self.reply[req["sent"]:req["sent"] + 1]
                    req["sent"] += len(new)
                    if tuple(req["prompt"]) in self.fail:
                        self._end(req, "error", error=self.fail_message, new=new)
                    elif req["sent"] >= req["max"]:
                        self._end(req, "length", new=new)
                    elif req["sent"] >= len(self.reply):
                        self._end(req, "stop", new=new)
                    else:
                        req["cb"](Update(new, self._text(req, new), False, None,
                                         len(req["prompt"]), req["sent"]))


def sse_events(text: str) -> list:
    """The data of each server-sent event (JSON decoded, except [DONE])."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


class ServerThread:
    """uvicorn serving `app` on a free port of 127.0.0.1, in a thread."""

    def __init__(self, app, timeout=300, **config):
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=30, **config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no server"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive()


def process_serving(proc, url, log_path):
    """A `wait_for` condition: the server process `proc` answers /health at `url` (its
    death fails the test with its log)."""
    import httpx

    def up():
        assert proc.poll() is None, log_path.read_text()
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    return up


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def metric_samples(text: str) -> dict:
    """/metrics' exposition parsed (prometheus_client's parser): {(sample name, labels as
    sorted pairs): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: dict, name: str, **labels) -> float:
    """A sample's value (0 when the exposition has none, as for a series never counted)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def engine_arguments(monkeypatch, argv) -> dict:
    """The keyword arguments `asynclane-jax serve ARGV` gives the Engine, with the
    model load and the Engine stood in for (nothing is loaded or compiled)."""
    import pytest

    import asynclane_jax
    from asynclane_jax.cli import main
    from asynclane_jax.serve import engine

    class Reached(Exception):
        pass

    seen = {}

    def fake_engine(model, tokenizer, **kwargs):
        seen.update(kwargs)
        raise Reached

    monkeypatch.setattr(asynclane_jax, "load", lambda name, **kw: (None, object(), None))
    monkeypatch.setattr(engine, "Engine", fake_engine)
    with pytest.raises(Reached):
        main(["serve", *argv])
    return seen
