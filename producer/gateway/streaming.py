"""Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``.

The stream answers once the first event arrives (or FIRST_EVENT_WAIT_S passes), so an error
the worker finds at once (too_long, invalid_request) still gets its proper status code; a
request still queued after that gets its 200 and keep-alive comments meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from producer.gateway.errors import error_body, generation_error, not_started
from producer.gateway.events import Events
from producer.gateway.replies import Reply
from producer.types import Result

FIRST_EVENT_WAIT_S = 10.0  # a stream's status waits this long for the request's first entry
KEEPALIVE_S = 15.0  # an SSE comment goes out after this long without an event


class SSEResponse(StreamingResponse):
    """A stream whose generator is always closed (so its ``finally`` cancels what is left)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def first_event(events: Events, watcher: asyncio.Future) -> tuple | None:
    """The first event, within FIRST_EVENT_WAIT_S; raises the APIError of an immediate failure."""
    first = await events.get(timeout=FIRST_EVENT_WAIT_S, watcher=watcher)
    if first is not None and first[0] == "error":
        raise generation_error(first[2])
    if first is not None and first[0] == "done" and first[2].finish_reason == "timeout":
        raise not_started(first[2].id)
    return first


def stream(reply: Reply, events: Events, first: tuple | None, usage: Callable[[list[Result]], dict],
           headers: dict[str, str], on_close: Callable[[], None]) -> SSEResponse:
    return SSEResponse(_events(reply, events, first, usage, on_close), media_type="text/event-stream",
                       headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(reply: Reply, events: Events, ev: tuple | None, usage: Callable[[list[Result]], dict],
                  on_close: Callable[[], None]) -> AsyncIterator[str]:
    finished: list[Result] = []
    try:
        if reply.chat:
            yield sse(reply.chunk([reply.delta(i, "", None, role=True) for i in range(len(reply.handles))]))
        while True:
            if ev is None:  # nothing for a while (still queued?): keep proxies from timing out
                yield ": keep-alive\n\n"
                ev = await events.get(timeout=KEEPALIVE_S)
                continue
            kind, i, val = ev
            if kind == "chunk":
                if val.text:
                    yield sse(reply.chunk([reply.delta(i, val.text, None)]))
            elif kind == "done":
                finished.append(val)
                yield sse(reply.chunk([reply.delta(i, None if reply.chat else "", val.finish_reason)]))
            else:
                e = generation_error(val)
                yield sse(error_body(e.message, e.type, e.param, e.code))
                break
            if not events.left:
                break
            ev = await events.get(timeout=KEEPALIVE_S)
        if reply.include_usage and not events.left and len(finished) == len(reply.handles):
            yield sse(reply.chunk([], usage(finished)))
        elif finished:
            usage(finished)
        yield "data: [DONE]\n\n"
    finally:
        on_close()
