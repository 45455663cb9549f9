"""Server-sent events with little host work per event: the streamed completions' response.

A stream's events come in batches (`EventStream`): what one wake-up of the request's
coroutine has to send (the updates that arrived together, already merged into one text
delta; the final chunk with [DONE]) goes out as one body message, so one socket write
and one wake-up of the client, and the last batch ends the response in the same write.
There is one task per response (it waits for the client to go away, and tells the
request then) and no timeout scope per send; an empty batch, which the request's
coroutine yields after `PING_S` seconds without an event, is sent as a comment line that
keeps proxies from closing an idle connection.

At the server's shutdown a stream runs on as long as its coroutine does: uvicorn waits
for it up to its graceful timeout (the drain and a margin; `cli.serve_app`), then
cancels it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response

# The data of a stream's last event (OpenAI's end of stream).
DONE = "[DONE]"
# Seconds without an event after which a stream sends a keep-alive comment.
PING_S = 15.0
_PING = b": ping\r\n\r\n"
HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
           (b"cache-control", b"no-store"),
           (b"x-accel-buffering", b"no")]


def encode(batch: list[str]) -> bytes:
    """One body message: each item a `data:` line of its own event (an empty batch: a
    keep-alive comment). Items are single lines (JSON, or DONE)."""
    if not batch:
        return _PING
    return "".join(f"data: {data}\r\n\r\n" for data in batch).encode("utf-8")


class EventStream(Response):
    """A response streaming `batches` (lists of event data) as server-sent events, a
    batch per body message; a batch ending with DONE ends the response. One task per
    response waits for the client to go away and calls `on_disconnect` then."""

    media_type = "text/event-stream"

    def __init__(self, batches: AsyncIterator[list[str]], status_code: int = 200,
                 on_disconnect: Callable[[], None] | None = None):
        self.batches, self.status_code = batches, status_code
        self.on_disconnect = on_disconnect
        self.background = None
        self.raw_headers = list(HEADERS)

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self.on_disconnect is not None:
            self.on_disconnect()

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        last = False
        try:
            async for batch in self.batches:
                last = bool(batch) and batch[-1] == DONE
                await send({"type": "http.response.body", "body": encode(batch),
                            "more_body": not last})
                if last:
                    break
        finally:
            watcher.cancel()
            aclose = getattr(self.batches, "aclose", None)
            if aclose is not None:  # runs the generator's cleanup now, not at collection
                await aclose()
        if not last:  # the events ended without DONE (the client went away)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
