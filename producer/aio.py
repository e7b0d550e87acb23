"""The asyncio twin of :mod:`producer.client`.

    from producer import AsyncClient

    async with AsyncClient() as client:
        h = await client.submit(prompt="Once upon a time", max_tokens=32)
        async for chunk in h:
            print(chunk.text, end="", flush=True)
        r = await h.result()          # or simply: r = await h
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Generator, Mapping
from typing import Any

import redis
import redis.asyncio
from typing_extensions import Unpack

from common.protocol import Limits, RequestOptions
from common.redis import connect_async
from producer.base import ClientBase, HandleBase, block_ms, deadline_of, wait_timeout
from producer.types import Chunk, Result, prepare_many, stream_entries

__all__ = ["AsyncClient", "AsyncHandle"]


class AsyncHandle(HandleBase):
    """One submitted request: ``async for chunk in handle``, ``await handle.result()``,
    ``await handle`` (the same), ``await handle.cancel()``. Resumable like :class:`producer.Handle`."""

    client: AsyncClient

    async def _pull(self, block: int | None) -> None:
        self._state.feed(stream_entries(await self.client.redis.xread(**self._xread(block)), self.key))

    async def poll(self) -> list[Chunk]:
        if not self.done:
            await self._pull(None)
        return self._take_pending()

    async def chunks(self, timeout: float | None = None) -> AsyncIterator[Chunk]:
        """Chunks as they arrive; raises GenerationError on an error entry, GenerationTimeout
        when ``timeout`` seconds pass before the end."""
        deadline = deadline_of(timeout)
        while True:
            while (c := self._next_chunk()) is not None:
                yield c
            if self.done:
                return
            await self._pull(block_ms(deadline, self.id))

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self.chunks()

    async def wait(self, timeout: float | None = None) -> bool:
        deadline = deadline_of(timeout)
        while not self.done:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await self._pull(block_ms(deadline, self.id, raise_=False))
        return True

    async def result(self, timeout: float | None = None) -> Result:
        """The whole :class:`Result`; raises GenerationError on an error entry,
        GenerationTimeout when ``timeout`` seconds pass first."""
        if not await self.wait(timeout):
            raise wait_timeout(timeout, self.id)
        return self._whole()

    def __await__(self) -> Generator[Any, None, Result]:
        return self.result().__await__()

    async def cancel(self) -> None:
        await self.client.cancel(self.id)


class AsyncClient(ClientBase):
    """Asyncio client; same arguments as :class:`producer.Client`."""

    handle_type = AsyncHandle

    def __init__(self, redis_url: str | None = None, prefix: str | None = None, *,
                 redis_client: redis.asyncio.Redis | None = None, limits: Limits | None = None):
        super().__init__(redis_url, prefix, redis_client, limits, connect_async)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own:
            await self.redis.aclose()

    async def submit(self, prompt: str | None = None, **options: Unpack[RequestOptions]) -> AsyncHandle:
        """Queue one request (see :meth:`producer.Client.submit`)."""
        rid, stream, fields = self.prepare(prompt=prompt, **options)
        await self.redis.xadd(stream, fields)
        return AsyncHandle(self, rid)

    async def submit_many(self, requests: list[Mapping[str, Any]]) -> list[AsyncHandle]:
        """Queue several requests in one round trip; all validated first, none sent if one is bad."""
        prepared = prepare_many(self.keys, self.limits, requests)
        if not prepared:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for _, stream, fields in prepared:
            pipe.xadd(stream, fields)
        await pipe.execute()
        return [AsyncHandle(self, rid) for rid, _, _ in prepared]

    async def cancel(self, request_id: str) -> None:
        args, kw = self._cancel_xadd(request_id)
        await self.redis.xadd(*args, **kw)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> Result:
        """``submit`` and wait; cancels the request if the wait is interrupted or times out."""
        h = await self.submit(prompt, **kwargs)
        try:
            return await h.result(timeout=timeout)
        except BaseException:
            if not h.done:
                try:
                    await asyncio.shield(self.cancel(h.id))
                except (redis.RedisError, asyncio.CancelledError):
                    pass
            raise
