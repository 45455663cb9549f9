"""The ASGI app of `asynclane-jax serve`: OpenAI's completions API over the engine.

  POST /v1/completions         text completion (stream=true: server-sent events)
  POST /v1/chat/completions    chat completion through the tokenizer's chat template
  GET  /v1/models              the one served model (and /v1/models/{name})
  GET  /health                 200 with the engine's stats
  GET  /metrics                Prometheus metrics (`metrics`; behind the API key when set)

Requests are checked by `protocol.parse_request` (every field honoured or a 400 naming
it), then submitted to the engine, whose updates (tokens newly final, as a text delta)
arrive from its thread and are handed to the request's coroutine through its event
loop. A streamed request sends what each wake-up of its coroutine found (the deltas that
arrived together merged into one event, a chat stream's first chunk with the first
text, the last chunk with [DONE]) as one write (`stream.EventStream`); a plain one
collects them. Both watch for the client going away and cancel the engine request then,
which frees its slot at the next chunk boundary.

Every request is counted (`metrics.RequestMetrics`, outermost) by endpoint and status.
Before a request reaches an endpoint, `guard` checks its Host and Origin (403), its API
key (401), its content type (415) and reads its body with a bound (413, 408).

Errors are OpenAI's error body, {"error": {"message", "type", "param", "code"}}: 400 for
a refused request (bad JSON, a body that is not UTF-8, nested too deep, holding a lone
surrogate, an unknown field, a field that cannot be honoured, a prompt too long, a
structural sampler option the operator did not allow: code option_not_allowed, its
message naming the allowed values and the options a request may set freely), 404 for
another model, 429 when the engine's queue is full, 500 for a request the engine failed
(that request only), 503 while the engine is shutting down (and for a request the drain
cancelled; in a stream, an error event then [DONE]) and for a request that the memory
budget cannot hold even alone (code kv_budget_exceeded; one that fits later waits).

Host work stays off the event loop: a request is parsed and tokenized, and submitted,
on a worker thread (asyncio.to_thread, one hand-off per request); the engine's own
threads decode and detokenize. No answer and no /health names a path of the server's
machine.
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations
# (`request: fastapi.Request`), and fastapi is imported inside create_app.
import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from asynclane_jax.serve import protocol, require
from asynclane_jax.serve.engine import (
    EngineError,
    EngineStopped,
    OptionNotAllowed,
    OverBudget,
    QueueFull,
)
from asynclane_jax.serve.guard import Guard, HostGate, Security
from asynclane_jax.serve.metrics import START_KEY, Metrics, RequestMetrics, endpoint
from asynclane_jax.serve.protocol import RequestError

log = logging.getLogger("asynclane_jax.serve")

# How often a waiting request checks whether its client is still there (seconds).
DISCONNECT_POLL_S = 0.25
# At SIGTERM, seconds past the drain for the requests the drain cancelled to tell their
# clients (the engine cancels at its next chunk boundary) before uvicorn cuts them.
DRAIN_MARGIN_S = 10.0


def _longest_token(tok) -> int | None:
    """The most characters one token of `tok` stands for (its vocabulary's longest
    entry), or None when the tokenizer does not say."""
    try:
        return max(len(t) for t in tok.get_vocab()) or None
    except Exception:  # no get_vocab, an empty one
        return None


def _spec(engine, default_max_tokens: int | None, server_options: dict | None,
          max_prompt_chars: int | None = None):
    from asynclane_jax.decoding.registry import get_schedule_class, option_fields

    fields = {n: f.default for n, f in option_fields(get_schedule_class(engine.sampler)).items()}
    largest = max(engine.gen_lengths)
    if default_max_tokens is None:
        default_max_tokens = largest
    if not 1 <= default_max_tokens <= largest:
        raise ValueError(f"default max_tokens {default_max_tokens} must be in [1, {largest}] "
                         "(the largest generation bucket)")
    tok = engine.tokenizer
    vocab = None
    if tok is not None:
        with contextlib.suppress(TypeError):
            vocab = len(tok)
    if server_options is None:
        server_options = dict(getattr(engine, "options", None) or {})
    if max_prompt_chars is None and tok is not None:
        # No prompt of at most max_prompt tokens is longer than this.
        longest = _longest_token(tok)
        if longest is not None:
            max_prompt_chars = engine.max_prompt * max(longest, 1)
    return protocol.ServingSpec(
        model_name=engine.model_name, sampler=engine.sampler, sampler_fields=fields,
        server_options=server_options, max_tokens=largest,
        default_max_tokens=default_max_tokens, max_prompt=engine.max_prompt,
        vocab_size=vocab, max_prompt_chars=max_prompt_chars)


def _cancel_submitted(task) -> None:
    if not task.cancelled() and task.exception() is None and task.result()[1] is not None:
        task.result()[1].cancel()


class _Submitted:
    """One request in the engine: its updates on this event loop, cut at stop strings.

    `close()` is synchronous (it may run while the task is being cancelled) and cancels
    the engine request unless it has finished. The tokens it receives and its time to
    the first one go to `metrics` (from the request's arrival, as RequestMetrics saw it).
    """

    def __init__(self, engine, http_request, metrics: Metrics | None = None, *,
                 parsed: protocol.ParsedRequest | None = None):
        self.loop = asyncio.get_running_loop()
        self.engine = engine
        self.metrics = metrics
        self.endpoint = endpoint(http_request.url.path)
        self.start = http_request.scope.get(START_KEY, time.perf_counter())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.http_request = http_request
        self.done = False
        self.gone = False  # the client went away (seen by the response)
        self.handle = None
        self.parsed, self.cutter, self.prompt_tokens = None, None, 0
        if parsed is not None:
            self._read(parsed)
        self.completion_tokens = 0

    def _read(self, parsed: protocol.ParsedRequest) -> None:
        self.parsed = parsed
        self.cutter = protocol.StopCutter(parsed.stop)
        self.prompt_tokens = len(parsed.prompt_ids)

    async def submit(self, parse: Callable[[], protocol.ParsedRequest]) -> None:
        """Parses the request (`parse()`: decoding the JSON, checking, tokenizing) and
        submits it to the engine, both on one worker thread (a long prompt, or a new
        pool's shapes traced, never stall the event loop; one hand-off per request).

        Raises:
          RequestError: parse's (400), 429 (queue full), 503 (shutting down, or over the
            memory budget), 400 (a request the engine refuses).
        """
        def work():
            parsed = parse()
            try:
                return parsed, self.engine.submit(
                    parsed.prompt_ids, max_tokens=parsed.max_tokens,
                    options=parsed.options or None, on_update=self._on_update), None
            except EngineError as e:
                return parsed, None, e

        task = asyncio.ensure_future(asyncio.to_thread(work))
        try:
            parsed, self.handle, error = await asyncio.shield(task)
        except asyncio.CancelledError:  # the client left while it was submitted:
            task.add_done_callback(_cancel_submitted)  # cancel it once it is in
            raise
        self._read(parsed)
        if error is not None:
            raise self._refusal(error) from None
        if self.done:  # closed (the client left) while it was being submitted
            self.handle.cancel()
        self.request_id = self.handle.request_id
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(self.prompt_tokens)

    def _refusal(self, e: EngineError) -> RequestError:
        """The HTTP error of a request the engine did not take."""
        if isinstance(e, QueueFull):
            return RequestError(f"the server is busy: {e}; retry later",
                                code="rate_limit_exceeded", type="rate_limit_error",
                                status=429, headers={"Retry-After": "1"})
        if isinstance(e, OverBudget):
            return RequestError(f"the server cannot hold this request: {e}",
                                type="server_error", code="kv_budget_exceeded",
                                param="max_tokens", status=503)
        if isinstance(e, EngineStopped):  # stopping, or not started
            return RequestError(f"the server is not taking requests: {e}",
                                type="server_error", code="shutting_down", status=503)
        param = "sampler_options" if self.parsed.options else None
        code = "option_not_allowed" if isinstance(e, OptionNotAllowed) else None
        return RequestError(protocol.scrub(str(e)), param=param, code=code)

    def _on_update(self, update) -> None:
        # On the engine's thread: hand the update to the request's event loop.
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)

    def close(self) -> None:
        if not self.done:
            self.done = True
            if self.handle is not None:
                self.handle.cancel()

    def left(self) -> None:
        """The client went away (the streamed response saw it): cancels the engine
        request and ends events() at its next wake-up, which this is."""
        self.gone = True
        self.close()
        self.queue.put_nowait(None)

    def _tick(self) -> None:
        # On the event loop, every DISCONNECT_POLL_S while events() runs: wakes it to
        # look for a gone client even when the engine sends nothing.
        self.queue.put_nowait(None)
        self._ticker = self.loop.call_later(DISCONNECT_POLL_S, self._tick)

    async def events(self):
        """Yields a list of events per wake-up: ("text", delta) for what the committed
        text gained (the updates that arrived together merged into one delta), then, in
        the last list, one of ("end", finish_reason) or ("error", status, message); an
        empty list after stream.PING_S seconds without an event. Returns early
        (cancelling the engine request) when the client disconnects."""
        from asynclane_jax.serve.stream import PING_S

        now = self.loop.time()
        next_check, quiet_since = now + DISCONNECT_POLL_S, now
        self._ticker = self.loop.call_later(DISCONNECT_POLL_S, self._tick)
        try:
            while True:
                updates = [await self.queue.get()]
                while not self.queue.empty():
                    updates.append(self.queue.get_nowait())
                now = self.loop.time()
                if now >= next_check and not self.gone:  # however busy the stream is
                    next_check = now + DISCONNECT_POLL_S
                    self.gone = await self.http_request.is_disconnected()
                if self.gone:
                    log.info("request %s: the client went away; cancelled", self.request_id)
                    return
                text, end = "", None
                for update in updates:
                    if update is None:  # a tick
                        continue
                    end = self._take(update)
                    text += end[0]
                    if end[1] is not None:
                        break
                batch = [("text", text)] if text else []
                if end is not None and end[1] is not None:
                    yield batch + [end[1]]
                    return
                if batch or now - quiet_since >= PING_S:
                    quiet_since = now
                    yield batch
        finally:
            self._ticker.cancel()
            self.close()

    def _take(self, update) -> tuple[str, tuple | None]:
        """One engine update: the text it adds after stop strings, and the stream's
        last event when it ends it (else None)."""
        self._count(update.completion_tokens)
        self.prompt_tokens = update.prompt_tokens
        self.completion_tokens = update.completion_tokens
        text, stopped = self.cutter.feed(update.text or "")
        if stopped:
            self.close()  # a stop string: the rest is not wanted
            return text, ("end", "stop")
        if not update.finished:
            return text, None
        self.done = True
        if update.finish_reason in ("stop", "length"):
            return text + self.cutter.flush(), ("end", update.finish_reason)
        if update.finish_reason == "cancelled":  # an error drops the update's text
            return "", ("error", 503, "the request was cancelled by the server "
                                        "(shutting down)")
        return "", ("error", 500, protocol.scrub(update.error or "the engine failed "
                                                                   "this request"))

    def _count(self, completion_tokens: int) -> None:
        new = completion_tokens - self.completion_tokens
        if self.metrics is None or new <= 0:
            return
        if self.completion_tokens == 0:
            self.metrics.ttft.labels(self.endpoint).observe(time.perf_counter() - self.start)
        self.metrics.generated_tokens.inc(new)

    def usage(self) -> dict:
        return protocol.usage(self.prompt_tokens, self.completion_tokens)


def create_app(engine, *, default_max_tokens: int | None = None,
               server_options: dict | None = None, drain_timeout: float | None = 120.0,
               manage_engine: bool = True, security: Security | None = None,
               max_prompt_chars: int | None = None):
    """The FastAPI app serving `engine`.

    Args:
      engine: an `asynclane_jax.serve.engine.Engine` (or an object with its interface).
      default_max_tokens: max_tokens of a request that gives none (default: the largest
        generation bucket).
      server_options: the sampler options the engine was built with (default: its
        `options` attribute), for the seed / temperature rules.
      drain_timeout: at shutdown, the engine's drain timeout: seconds the requests in
        flight get to finish before they are cancelled, their clients told (None: no
        limit). `cli.serve_app` lets uvicorn cut a stream only past it and a margin.
      manage_engine: start the engine at app startup and shut it down (draining) at app
        shutdown; False when the caller does both.
      security: the API key, the accepted Host names and origins and the body bound
        (`guard.Security`; default: no key, loopback names, 1 MiB).
      max_prompt_chars: the longest prompt text (characters), refused before it is
        tokenized (default: max_prompt times the tokenizer's longest token).

    At SIGTERM the server calls `app.state.begin_drain()` (asynclane-jax serve does, as
    uvicorn starts its graceful shutdown): the engine stops admitting, finishes what is
    in flight for up to drain_timeout seconds and then cancels the rest, whose clients
    get an error (a 503 body, or an error event and [DONE] in a stream).

    Returns:
      The app (an ASGI application).
    """
    fastapi = require("fastapi")
    require("prometheus_client")
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from asynclane_jax.serve.stream import DONE, EventStream

    spec = _spec(engine, default_max_tokens, server_options, max_prompt_chars)
    security = security or Security()
    created = protocol.now()
    drain_lock = threading.Lock()
    drain_thread: list[threading.Thread] = []

    def begin_drain() -> threading.Thread | None:
        """Starts the engine's drain on a thread of its own (once); returns it."""
        if not manage_engine:
            return None
        with drain_lock:
            if not drain_thread:
                log.info("draining the engine (up to %s s)", drain_timeout)
                t = threading.Thread(target=engine.shutdown, name="asynclane-drain",
                                     kwargs={"drain": True, "timeout": drain_timeout},
                                     daemon=True)
                t.start()
                drain_thread.append(t)
            return drain_thread[0]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            log.info("starting the engine (compiling %s at gen lengths %s)", engine.sampler,
                     ", ".join(map(str, engine.gen_lengths)))
            await asyncio.to_thread(engine.start)
            log.info("serving %s", engine.model_name)
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(begin_drain().join)

    app = fastapi.FastAPI(title="asynclane-jax", lifespan=lifespan, docs_url=None,
                          redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.spec = spec
    app.state.security = security
    app.state.begin_drain = begin_drain
    metrics = app.state.metrics = Metrics(engine)
    # Outermost first: Host and Origin, then CORS for the allowed origins, then the key,
    # the content type and the bounded body (add_middleware puts each outside the last).
    app.add_middleware(Guard, security=security)
    if security.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(security.allowed_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(HostGate, security=security)
    app.add_middleware(RequestMetrics, metrics=metrics)  # outermost: refusals counted too

    def error_response(err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestError)
    async def _request_error(request, exc: RequestError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(protocol.error_body(str(exc.detail), code=kind),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request, exc):  # a bug: still JSON, and no detail leaks
        log.error("internal error (%s) answering %s", type(exc).__name__, request.url.path)
        return JSONResponse(protocol.error_body("internal server error", type="server_error"),
                            status_code=500)

    def decode_json(raw: bytes) -> Any:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"the request body is not UTF-8 ({e.reason} at byte "
                               f"{e.start}); send JSON in UTF-8") from None
        if not text.strip():
            raise RequestError("the request body is empty; send a JSON object")
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise RequestError("the request body nests too deeply") from None
        except ValueError as e:  # e.g. an integer past Python's digit limit
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        protocol.check_tree(body)
        return body

    @app.get("/health")
    async def health():  # unauthenticated: nothing in it names a file of the machine
        return protocol.redact_paths({
            "status": "ok", "model": engine.model_name, "sampler": engine.sampler,
            "gen_lengths": list(engine.gen_lengths), **engine.stats()})

    @app.get("/metrics")
    async def prometheus_metrics():  # behind the API key, like every path but /health
        from fastapi.responses import Response

        body, content_type = metrics.exposition()
        return Response(body, headers={"Content-Type": content_type})

    def model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": created,
                "owned_by": "asynclane-jax"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != engine.model_name:
            raise RequestError(f"The model {name!r} does not exist; this server serves "
                               f"{engine.model_name!r}", param="model",
                               code="model_not_found", status=404)
        return model_card()

    async def complete(request, chat: bool):
        raw = await request.body()
        sub = _Submitted(engine, request, metrics)
        await sub.submit(lambda: protocol.parse_request(decode_json(raw), spec,
                                                        engine.tokenizer, chat=chat))
        parsed = sub.parsed
        rid = ("chatcmpl-" if chat else "cmpl-") + str(sub.request_id)
        made = protocol.now()
        name = engine.model_name
        if parsed.stream:
            # At SIGTERM a stream runs on through the drain (it ends itself: its text, or
            # an error event once the drain cancels it); uvicorn cuts it only past the
            # drain and a margin (cli.serve_app).
            return EventStream(_stream(sub, rid, made, name, chat), on_disconnect=sub.left)
        try:
            parts, finish = [], None
            async for batch in sub.events():
                for ev in batch:
                    if ev[0] == "text":
                        parts.append(ev[1])
                    elif ev[0] == "end":
                        finish = ev[1]
                    else:
                        return error_response(RequestError(
                            ev[2], type="server_error", status=ev[1],
                            code="shutting_down" if ev[1] == 503 else None))
            if finish is None:  # the client went away: nobody reads the answer
                return JSONResponse(protocol.error_body("the client disconnected"),
                                    status_code=499)
        finally:
            sub.close()
        make = protocol.chat_body if chat else protocol.completion_body
        return make(rid, made, name, "".join(parts), finish, sub.usage())

    async def _stream(sub: _Submitted, rid, made, name, chat):
        """The stream's batches of event data (stream.EventStream): a chat stream's
        first chunk (its role) goes with the first batch."""
        def chunk(text=None, finish=None, use=None):
            if chat:
                delta = {} if text is None else {"content": text}
                return protocol.chat_chunk(rid, made, name, delta, finish, use)
            return protocol.completion_chunk(rid, made, name, text or "", finish, use)

        first = []
        if chat:
            first.append(json.dumps(protocol.chat_chunk(rid, made, name,
                                                        {"role": "assistant", "content": ""})))
        try:
            async for batch in sub.events():
                data, first = first, []
                for ev in batch:
                    if ev[0] == "text":
                        data.append(json.dumps(chunk(ev[1])))
                    elif ev[0] == "end":
                        data.append(json.dumps(chunk(None, ev[1], sub.usage())))
                    else:
                        code = "shutting_down" if ev[1] == 503 else None
                        data.append(json.dumps(protocol.error_body(
                            ev[2], type="server_error", code=code)))
                if batch and batch[-1][0] != "text":  # the last batch
                    data.append(DONE)
                yield data
        finally:
            sub.close()  # also when the client went away and the stream was cancelled

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        return await complete(request, chat=True)

    return app
