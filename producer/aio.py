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
from typing import Any, Unpack

import redis
import redis.asyncio

from common.keys import Keys
from common.protocol import Limits, RequestOptions
from common.redis import connect_async
from common.settings import Settings
from producer.client import READ_COUNT, _block_ms
from producer.types import (
    CONTROL_MAXLEN,
    START_ID,
    Chunk,
    GenerationTimeout,
    ReaderView,
    Result,
    ResultReader,
    build_request,
    cancel_fields,
    prepare_many,
    stream_entries,
)

__all__ = ["AsyncClient", "AsyncHandle"]


class AsyncHandle(ReaderView):
    """One submitted request: ``async for chunk in handle``, ``await handle.result()``,
    ``await handle`` (the same), ``await handle.cancel()``. Resumable like :class:`producer.Handle`."""

    def __init__(self, client: AsyncClient, request_id: str, key: str | None = None, last_id: str = START_ID,
                 next_seq: int = 0):
        self.client = client
        self.id = request_id
        self.key = key or client.keys.result(request_id)
        self._state = ResultReader(request_id, self.key, last_id, next_seq)

    def __repr__(self) -> str:
        return f"<AsyncHandle {self.id} {'done' if self.done else 'running'} tokens={self._state.next_seq}>"

    async def _pull(self, block_ms: int) -> None:
        reply = await self.client.redis.xread({self.key: self._state.last_id}, count=READ_COUNT,
                                              block=max(1, block_ms))
        self._state.feed(stream_entries(reply, self.key))

    async def poll(self) -> list[Chunk]:
        if not self.done:
            reply = await self.client.redis.xread({self.key: self._state.last_id}, count=READ_COUNT)
            self._state.feed(stream_entries(reply, self.key))
        return self._take_pending()

    async def chunks(self, timeout: float | None = None) -> AsyncIterator[Chunk]:
        """Chunks as they arrive; raises GenerationError on an error entry, GenerationTimeout
        when ``timeout`` seconds pass before the end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        st = self._state
        while True:
            while st.pending:
                yield st.pending.popleft()
            if st.done:
                err = st.error()
                if err is not None:
                    raise err
                return
            await self._pull(_block_ms(deadline, self.id))

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self.chunks()

    async def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await self._pull(_block_ms(deadline, self.id, raise_=False))
        return True

    async def result(self, timeout: float | None = None) -> Result:
        """The whole :class:`Result`; raises GenerationError on an error entry,
        GenerationTimeout when ``timeout`` seconds pass first."""
        if not await self.wait(timeout):
            raise GenerationTimeout("wait_timeout", f"no final entry within {timeout} s", self.id)
        self._state.pending.clear()
        return self._state.result()

    def __await__(self) -> Generator[Any, None, Result]:
        return self.result().__await__()

    async def cancel(self) -> None:
        await self.client.cancel(self.id)


class AsyncClient:
    """Asyncio client; same arguments as :class:`producer.Client`."""

    def __init__(self, redis_url: str | None = None, prefix: str | None = None, *,
                 redis_client: redis.asyncio.Redis | None = None, limits: Limits | None = None):
        s = Settings.from_env(redis_url=redis_url, prefix=prefix)
        self.redis_url = s.redis_url
        self.prefix = s.prefix
        self.keys = Keys(s.prefix)
        self.limits = limits or s.limits
        self._own = redis_client is None
        self.redis = redis_client if redis_client is not None else connect_async(s.redis_url)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own:
            await self.redis.aclose()

    def prepare(self, **kwargs: Any) -> tuple[str, str, dict[str, str]]:
        return build_request(keys=self.keys, limits=self.limits, **kwargs)

    async def submit(
        self,
        prompt: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncHandle:
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

    def attach(self, request_id: str, last_id: str = START_ID, next_seq: int = 0) -> AsyncHandle:
        """A handle for a request submitted elsewhere (or earlier). To resume a reader, pass the
        ``last_id`` and the number of tokens it had (``next_seq``, i.e. ``len(handle.token_ids)``)."""
        cancel_fields(request_id)  # validates the id
        return AsyncHandle(self, request_id, last_id=last_id, next_seq=next_seq)

    async def cancel(self, request_id: str) -> None:
        await self.redis.xadd(self.keys.control, cancel_fields(request_id), maxlen=CONTROL_MAXLEN, approximate=True)

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
