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
from typing import Any, Unpack

import redis

from common.keys import Keys
from common.protocol import Limits, RequestOptions
from common.redis import connect
from common.settings import Settings
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

BLOCK_MS = 1000  # longest single XREAD BLOCK; waits are made of these so Ctrl-C and timeouts stay prompt
READ_COUNT = 256


def _settings(redis_url: str | None, prefix: str | None) -> Settings:
    return Settings.from_env(redis_url=redis_url, prefix=prefix)


class Handle(ReaderView):
    """One submitted request. Iterate it for :class:`Chunk` s; ``result()`` waits for the end.

    Reading is resumable: the handle keeps the id of the last entry it read, so a loop that
    stops early (``break``) and a later loop or ``result()`` carry on where it left off, and
    a ``seq`` already received is never delivered twice.
    """

    def __init__(self, client: Client, request_id: str, key: str | None = None, last_id: str = START_ID,
                 next_seq: int = 0):
        self.client = client
        self.id = request_id
        self.key = key or client.keys.result(request_id)
        self._state = ResultReader(request_id, self.key, last_id, next_seq)

    def __repr__(self) -> str:
        return f"<Handle {self.id} {'done' if self.done else 'running'} tokens={self._state.next_seq}>"

    # -------------------------------------------------------------- state
    # -------------------------------------------------------------- reading
    def _pull(self, block_ms: int) -> None:
        reply = self.client.redis.xread({self.key: self._state.last_id}, count=READ_COUNT, block=max(1, block_ms))
        self._state.feed(stream_entries(reply, self.key))

    def poll(self) -> list[Chunk]:
        """What has arrived, without waiting (an empty list when nothing has)."""
        if not self.done:
            reply = self.client.redis.xread({self.key: self._state.last_id}, count=READ_COUNT)
            self._state.feed(stream_entries(reply, self.key))
        return self._take_pending()

    def chunks(self, timeout: float | None = None) -> Iterator[Chunk]:
        """Yield chunks as they arrive until the request ends.

        Raises :class:`GenerationError` when the request ends with an error entry, and
        :class:`GenerationTimeout` when ``timeout`` seconds pass before it ends (the request
        keeps running; iterate again to go on).
        """
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
            self._pull(_block_ms(deadline, self.id))

    def __iter__(self) -> Iterator[Chunk]:
        return self.chunks()

    def wait(self, timeout: float | None = None) -> bool:
        """Read until the final entry (True) or ``timeout`` seconds (False); chunks stay iterable."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._pull(_block_ms(deadline, self.id, raise_=False))
        return True

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the end and return the whole :class:`Result`.

        Raises :class:`GenerationError` (with the worker's ``code`` and ``message``) on an
        error entry, :class:`GenerationTimeout` when ``timeout`` seconds pass first. A
        request that timed out in the queue or was cancelled returns normally with that
        ``finish_reason``; call ``.check()`` on the result to turn those into exceptions.
        """
        if not self.wait(timeout):
            raise GenerationTimeout("wait_timeout", f"no final entry within {timeout} s", self.id)
        self._state.pending.clear()
        return self._state.result()

    def cancel(self) -> None:
        """Ask every worker to stop this request (``XADD {prefix}:control type cancel id <id>``)."""
        self.client.cancel(self.id)


def _block_ms(deadline: float | None, rid: str, raise_: bool = True) -> int:
    if deadline is None:
        return BLOCK_MS
    left = deadline - time.monotonic()
    if left <= 0:
        if raise_:
            raise GenerationTimeout("wait_timeout", "no new result entry before the timeout", rid)
        return 1
    return max(1, min(BLOCK_MS, int(left * 1000)))


class Client:
    """A connection to a tokenq queue. ``redis_url`` and ``prefix`` default to
    ``TOKENQ_REDIS_URL`` / ``TOKENQ_PREFIX`` (then ``redis://localhost:6379/0`` / ``tokenq``).

    ``limits`` are the request caps checked before sending (default: the TOKENQ_MAX_* settings,
    the same the workers use unless they were started with others).
    """

    def __init__(self, redis_url: str | None = None, prefix: str | None = None, *,
                 redis_client: redis.Redis | None = None, limits: Limits | None = None):
        s = _settings(redis_url, prefix)
        self.redis_url = s.redis_url
        self.prefix = s.prefix
        self.keys = Keys(s.prefix)
        self.limits = limits or s.limits
        self._own = redis_client is None
        self.redis = redis_client if redis_client is not None else connect(s.redis_url)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._own:
            self.redis.close()

    # -------------------------------------------------------------- sending
    def prepare(self, **kwargs: Any) -> tuple[str, str, dict[str, str]]:
        """(request id, stream key, fields) for ``submit(**kwargs)``, validated; sends nothing."""
        return build_request(keys=self.keys, limits=self.limits, **kwargs)

    def submit(
        self,
        prompt: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> Handle:
        """Queue one request; returns its :class:`Handle` at once.

        Exactly one of ``prompt``, ``input_ids`` or ``messages`` (chat, ``[{"role", "content"}]``).
        Unset sampling arguments take the protocol's defaults (max_tokens 256, temperature 1).
        ``priority`` is ``high``, ``normal`` or ``low``; ``timeout_s`` makes the worker give up
        (``finish_reason timeout``) if the request has not started by then. Bad arguments
        raise ValueError before anything is sent.
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

    def attach(self, request_id: str, last_id: str = START_ID, next_seq: int = 0) -> Handle:
        """A handle for a request submitted elsewhere (or earlier). To resume a reader, pass the
        ``last_id`` and the number of tokens it had (``next_seq``, i.e. ``len(handle.token_ids)``)."""
        cancel_fields(request_id)  # validates the id
        return Handle(self, request_id, last_id=last_id, next_seq=next_seq)

    def cancel(self, request_id: str) -> None:
        """Cancel a request by id (it ends with ``finish_reason cancelled``)."""
        self.redis.xadd(self.keys.control, cancel_fields(request_id), maxlen=CONTROL_MAXLEN, approximate=True)

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
