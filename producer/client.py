"""The synchronous Python client: submit requests, stream their tokens, wait, cancel.

    from producer import Client

    client = Client("redis://localhost:6379/0")
    h = client.submit(prompt="Once upon a time", max_tokens=32, temperature=0, priority="high")
    for chunk in h:                       # text deltas and token ids, as they are generated
        print(chunk.text, end="", flush=True)
    r = h.result()                        # Result: text, token_ids, finish_reason, usage, timings

Everything travels over the public protocol of docs/protocol.md: one XADD on
``{prefix}:requests:{level}``, then XREAD on ``{prefix}:result:{id}``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import redis
from typing_extensions import Unpack

from common.protocol import Limits, RequestOptions
from common.redis import connect
from producer.base import BLOCK_MS, READ_COUNT, ClientBase, HandleBase, block_ms, deadline_of, wait_timeout
from producer.types import Chunk, Result, prepare_many, stream_entries

__all__ = ["BLOCK_MS", "READ_COUNT", "Client", "Handle"]


class Handle(HandleBase):
    """One submitted request. Iterate it for :class:`Chunk` s; ``result()`` waits for the end.

    Reading is resumable: the handle keeps the id of the last entry it read, so a loop that
    stops early (``break``) and a later loop or ``result()`` carry on where it left off, and
    a ``seq`` already received is never delivered twice.
    """

    client: Client

    def _pull(self, block: int | None) -> None:
        self._state.feed(stream_entries(self.client.redis.xread(**self._xread(block)), self.key))

    def poll(self) -> list[Chunk]:
        """What has arrived, without waiting (an empty list when nothing has)."""
        if not self.done:
            self._pull(None)
        return self._take_pending()

    def chunks(self, timeout: float | None = None) -> Iterator[Chunk]:
        """Yield chunks as they arrive until the request ends.

        Raises :class:`GenerationError` when the request ends with an error entry, and
        :class:`GenerationTimeout` when ``timeout`` seconds pass before it ends (the request
        keeps running; iterate again to go on).
        """
        deadline = deadline_of(timeout)
        while True:
            while (c := self._next_chunk()) is not None:
                yield c
            if self.done:
                return
            self._pull(block_ms(deadline, self.id))

    def __iter__(self) -> Iterator[Chunk]:
        return self.chunks()

    def wait(self, timeout: float | None = None) -> bool:
        """Read until the final entry (True) or ``timeout`` seconds (False); chunks stay iterable."""
        deadline = deadline_of(timeout)
        while not self.done:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._pull(block_ms(deadline, self.id, raise_=False))
        return True

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the end and return the whole :class:`Result`.

        Raises :class:`GenerationError` (with the worker's ``code`` and ``message``) on an
        error entry, :class:`GenerationTimeout` when ``timeout`` seconds pass first. A
        request that timed out in the queue or was cancelled returns normally with that
        ``finish_reason``; call ``.check()`` on the result to turn those into exceptions.
        """
        if not self.wait(timeout):
            raise wait_timeout(timeout, self.id)
        return self._whole()

    def cancel(self) -> None:
        """Ask every worker to stop this request (``XADD {prefix}:control type cancel id <id>``)."""
        self.client.cancel(self.id)


class Client(ClientBase):
    """A connection to a tokenq queue. ``redis_url`` and ``prefix`` default to
    ``TOKENQ_REDIS_URL`` / ``TOKENQ_PREFIX`` (then ``redis://localhost:6379/0`` / ``tokenq``).

    ``limits`` are the request caps checked before sending (default: the TOKENQ_MAX_* settings,
    the same the workers use unless they were started with others).
    """

    handle_type = Handle

    def __init__(self, redis_url: str | None = None, prefix: str | None = None, *,
                 redis_client: redis.Redis | None = None, limits: Limits | None = None):
        super().__init__(redis_url, prefix, redis_client, limits, connect)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._own:
            self.redis.close()

    def submit(self, prompt: str | None = None, **options: Unpack[RequestOptions]) -> Handle:
        """Queue one request; returns its :class:`Handle` at once.

        Exactly one of ``prompt``, ``input_ids`` or ``messages`` (chat, ``[{"role", "content"}]``).
        Unset sampling arguments take the protocol's defaults (max_tokens 256, temperature 1).
        ``priority`` is ``high``, ``normal`` or ``low``; ``timeout_s`` makes the worker give up
        (``finish_reason timeout``) if the request has not started by then. Bad arguments
        raise ValueError before anything is sent. The arguments: :class:`common.protocol.RequestOptions`.
        """
        rid, stream, fields = self.prepare(prompt=prompt, **options)
        self.redis.xadd(stream, fields)
        return Handle(self, rid)

    def submit_many(self, requests: list[Mapping[str, Any]]) -> list[Handle]:
        """Queue several requests (each a dict of ``submit`` arguments) in one round trip.

        All are validated first: one bad request raises ValueError (naming its index) and
        none is sent.
        """
        prepared = prepare_many(self.keys, self.limits, requests)
        if not prepared:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for _, stream, fields in prepared:
            pipe.xadd(stream, fields)
        pipe.execute()
        return [Handle(self, rid) for rid, _, _ in prepared]

    def cancel(self, request_id: str) -> None:
        """Cancel a request by id (it ends with ``finish_reason cancelled``)."""
        args, kw = self._cancel_xadd(request_id)
        self.redis.xadd(*args, **kw)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> Result:
        """``submit(...)`` and wait for the result; cancels the request if the wait is interrupted."""
        h = self.submit(prompt, **kwargs)
        try:
            return h.result(timeout=timeout)
        except BaseException:
            if not h.done:
                try:
                    h.cancel()
                except redis.RedisError:
                    pass
            raise
