"""Reading several requests at once: their chunks and ends merged into one stream of events,
with the HTTP client's disconnect as a way out, and the cancel of what is left."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis
from starlette.requests import Request

from producer.aio import AsyncClient, AsyncHandle
from producer.types import GenerationError

log = logging.getLogger("tokenq.gateway")


class ClientDisconnected(Exception):
    pass


async def until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Events:
    """Chunks and ends of several handles merged into one stream of events:
    ("chunk", index, Chunk) | ("done", index, Result) | ("error", index, GenerationError)."""

    def __init__(self, handles: list[AsyncHandle]):
        self.handles = handles
        self.queue: asyncio.Queue = asyncio.Queue()
        self.left = len(handles)  # handles whose end has not been taken yet
        self.tasks = [asyncio.ensure_future(self._run(i, h)) for i, h in enumerate(handles)]
        self._next: asyncio.Future | None = None

    async def _run(self, i: int, h: AsyncHandle) -> None:
        try:
            async for c in h:
                await self.queue.put(("chunk", i, c))
            await self.queue.put(("done", i, await h.result()))
        except GenerationError as e:
            await self.queue.put(("error", i, e))
        except redis.RedisError as e:
            await self.queue.put(("error", i, GenerationError("unavailable", f"lost Redis: {e}", h.id)))
        except Exception as e:  # never leave a reader waiting for an end that will not come
            log.exception("reading %s failed", h.id)
            await self.queue.put(("error", i, GenerationError("internal", f"reading the result failed: {e}", h.id)))

    async def get(self, timeout: float | None = None, watcher: asyncio.Future | None = None) -> tuple | None:
        """The next event; None after ``timeout`` s (the event is not lost: the next call gets it);
        ClientDisconnected when ``watcher`` (a disconnect watch) finishes first."""
        if self._next is None:
            self._next = asyncio.ensure_future(self.queue.get())
        waits = {self._next} if watcher is None else {self._next, watcher}
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._next in done:
            ev, self._next = self._next.result(), None
            if ev[0] != "chunk":
                self.left -= 1
            return ev
        if watcher is not None and watcher in done:
            raise ClientDisconnected()
        return None

    def close(self) -> None:
        for t in [*self.tasks, self._next]:
            if t is not None:
                t.cancel()


def spawn_cancel(client: AsyncClient, handles: list[AsyncHandle], background: set[Any]) -> None:
    """Cancel unfinished requests from a task of its own (safe inside a cancelled scope)."""
    ids = [h.id for h in handles if not h.done]
    if not ids:
        return

    async def go() -> None:
        try:
            for rid in ids:
                await asyncio.wait_for(client.cancel(rid), 5.0)
        except Exception as e:  # best effort: the worker's own timeouts still bound the work
            log.warning("could not cancel %s: %s", ids, e)

    t = asyncio.get_running_loop().create_task(go())
    background.add(t)
    t.add_done_callback(background.discard)
