"""The streamed response's host path: updates that arrive together go out as one event,
a batch of events as one body message, the last one ending the response, and a quiet
stream sends keep-alive comments."""

from __future__ import annotations

import asyncio
import json
import threading
import types

import pytest

from asynclane_jax.serve import app as app_lib
from asynclane_jax.serve import protocol
from asynclane_jax.serve.engine import Update

pytest.importorskip("fastapi")

from asynclane_jax.serve import stream  # noqa: E402  (needs starlette, which fastapi brings)


def _submitted(stop=None):
    """A _Submitted for a request with these stop strings, on the running loop, whose
    client never goes away."""
    async def connected():
        return False

    http_request = types.SimpleNamespace(url=types.SimpleNamespace(path="/v1/completions"),
                                         scope={}, is_disconnected=connected)
    parsed = types.SimpleNamespace(stop=list(stop or []), prompt_ids=[1, 2, 3])
    sub = app_lib._Submitted(None, http_request, parsed=parsed)
    sub.request_id = "cmpl-test"
    return sub


def _update(text, n, finished=False, reason=None, error=None):
    return Update(token_ids=[0] * n, text=text, finished=finished, finish_reason=reason,
                  prompt_tokens=3, completion_tokens=n, error=error)


def _batches(updates, *, later=(), stop=None):
    """The batches events() yields when `updates` are queued before it runs and
    `later` ones after its first batch; and the request (_Submitted)."""
    async def run():
        sub = _submitted(stop)
        for u in updates:
            sub.queue.put_nowait(u)
        out, pending = [], list(later)
        async for batch in sub.events():
            out.append(batch)
            while pending:
                sub.queue.put_nowait(pending.pop(0))
        return out, sub

    return asyncio.run(run())


def test_updates_that_arrive_together_are_one_event():
    got, sub = _batches([_update("The ", 1), _update("answer ", 2), _update("is 4", 3)],
                   later=[_update(".", 4, finished=True, reason="stop")])
    assert got == [[("text", "The answer is 4")], [("text", "."), ("end", "stop")]]
    assert sub.completion_tokens == 4


def test_a_stop_string_ends_the_merged_batch_and_drops_what_follows():
    got, _ = _batches([_update("The ", 1), _update("answer is", 3), _update(" 4", 4)],
                      stop=["is"])
    assert got == [[("text", "The answer "), ("end", "stop")]]


def test_an_engine_error_drops_its_own_text_but_keeps_earlier_text():
    got, _ = _batches([_update("The ", 1),
                       _update("x", 2, finished=True, reason="error", error="boom")])
    assert got == [[("text", "The "), ("error", 500, "boom")]]


def test_a_quiet_stream_yields_an_empty_batch_for_a_keepalive(monkeypatch):
    monkeypatch.setattr(app_lib, "DISCONNECT_POLL_S", 0.01)
    monkeypatch.setattr(stream, "PING_S", 0.03)
    async def run():
        sub, out = _submitted(), []
        async for batch in sub.events():
            out.append(batch)
            if len(out) == 2:
                sub.queue.put_nowait(_update("done", 1, finished=True, reason="stop"))
        return out

    got = asyncio.run(asyncio.wait_for(run(), 5))
    assert got[:2] == [[], []]  # two keep-alives while nothing came
    assert got[-1] == [("text", "done"), ("end", "stop")]


def _sent(batches):
    """The ASGI messages EventStream sends for these batches."""
    async def gen():
        for b in batches:
            yield b

    messages = []

    async def send(message):
        messages.append(message)

    async def receive():  # a client that stays
        await asyncio.Event().wait()

    async def run():
        await stream.EventStream(gen())({"type": "http"}, receive, send)

    asyncio.run(run())
    return messages


def test_a_batch_is_one_body_message_and_done_ends_the_response():
    first = json.dumps(protocol.chat_chunk("c", 0, "m", {"role": "assistant", "content": ""}))
    messages = _sent([[first, '{"a": 1}'], [], ['{"b": 2}', stream.DONE]])
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in messages[0]["headers"]
    bodies = messages[1:]
    assert len(bodies) == 3  # three batches, three writes: no empty terminator after DONE
    assert bodies[0]["body"].count(b"data: ") == 2 and bodies[0]["more_body"]
    assert bodies[1]["body"] == b": ping\r\n\r\n" and bodies[1]["more_body"]
    assert bodies[2]["body"] == b'data: {"b": 2}\r\n\r\ndata: [DONE]\r\n\r\n'
    assert bodies[2]["more_body"] is False


def test_a_stream_cut_short_still_ends_the_response():
    messages = _sent([['{"a": 1}']])  # the client went away: no DONE
    assert [m.get("more_body") for m in messages[1:]] == [True, False]
    assert messages[-1]["body"] == b""


def test_the_response_sees_the_client_leave_and_the_request_ends_at_once():
    cancelled = []

    async def run():
        sub = _submitted()
        sub.handle = types.SimpleNamespace(cancel=lambda: cancelled.append(True))
        first_sent = asyncio.Event()
        messages = []

        async def batches():
            async for batch in sub.events():  # waits: the engine sends nothing
                yield batch

        async def receive():  # the client leaves once it has the first bytes
            await first_sent.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            messages.append(message)
            first_sent.set()

        response = stream.EventStream(batches(), on_disconnect=sub.left)
        await asyncio.wait_for(response({"type": "http"}, receive, send), 2)
        return sub, messages

    sub, messages = asyncio.run(run())
    assert sub.gone and cancelled == [True]  # the engine request was cancelled
    # The fake request's own disconnect poll never sees the client leave, so only the
    # response's watcher can have ended it: the headers, then the empty end.
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_request_whose_client_leaves_while_it_is_submitted_is_cancelled_once_in():
    release, cancelled = threading.Event(), threading.Event()
    parsed = types.SimpleNamespace(stop=[], prompt_ids=[1, 2], max_tokens=8, options={})

    class Engine:
        def submit(self, prompt_ids, *, max_tokens, options, on_update):
            return types.SimpleNamespace(request_id="r", cancel=cancelled.set)

    def parse():  # parsing and submitting take a while, on the worker thread
        release.wait(5)
        return parsed

    async def run():
        sub = _submitted()
        sub.engine = Engine()
        task = asyncio.ensure_future(sub.submit(parse))
        await asyncio.sleep(0.05)
        task.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not cancelled.is_set()  # not in the engine yet
        release.set()
        for _ in range(200):  # once it is in, it is cancelled
            if cancelled.is_set():
                return
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert cancelled.is_set()
