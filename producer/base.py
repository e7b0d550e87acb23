"""What the sync and the asyncio client share: the handle's view of its reader, and the client's
settings, request building and attach (only the I/O differs between the two)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from common.keys import Keys
from common.protocol import CONTROL_MAXLEN, Limits, build_request, cancel_fields
from common.settings import Settings
from producer.types import START_ID, Chunk, GenerationTimeout, Result, ResultReader

READ_COUNT = 256  # result entries read per XREAD
BLOCK_MS = 1000  # longest single XREAD BLOCK; waits are made of these so Ctrl-C and timeouts stay prompt


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def block_ms(deadline: float | None, rid: str, raise_: bool = True) -> int:
    """How long the next XREAD may block before ``deadline``; GenerationTimeout once it passed
    (or 1 ms with ``raise_=False``)."""
    if deadline is None:
        return BLOCK_MS
    left = deadline - time.monotonic()
    if left <= 0:
        if raise_:
            raise GenerationTimeout("wait_timeout", "no new result entry before the timeout", rid)
        return 1
    return max(1, min(BLOCK_MS, int(left * 1000)))


def wait_timeout(timeout: float | None, rid: str) -> GenerationTimeout:
    return GenerationTimeout("wait_timeout", f"no final entry within {timeout} s", rid)


class HandleBase:
    """One submitted request's state, read through its :class:`ResultReader`."""

    def __init__(self, client: Any, request_id: str, key: str | None = None, last_id: str = START_ID,
                 next_seq: int = 0):
        self.client = client
        self.id = request_id
        self.key = key or client.keys.result(request_id)
        self._state = ResultReader(request_id, self.key, last_id, next_seq)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {'done' if self.done else 'running'} tokens={self._state.next_seq}>"

    @property
    def done(self) -> bool:
        """True once the final (``done`` or ``error``) entry has been read."""
        return self._state.done

    @property
    def last_id(self) -> str:
        """Id of the last result-stream entry read; ``client.attach(id, last_id=...)`` resumes from it."""
        return self._state.last_id

    @property
    def text(self) -> str:
        """The text received so far."""
        return self._state.text

    @property
    def token_ids(self) -> list[int]:
        return list(self._state.token_ids)

    @property
    def finish_reason(self) -> str | None:
        f = self._state.final
        return None if f is None else (f.finish_reason if f.type == "done" else "error")

    def _xread(self, block_ms: int | None = None) -> dict[str, Any]:
        """XREAD arguments for the next entries (blocking ``block_ms`` when given)."""
        kw: dict[str, Any] = {"streams": {self.key: self._state.last_id}, "count": READ_COUNT}
        if block_ms is not None:
            kw["block"] = max(1, block_ms)
        return kw

    def _take_pending(self) -> list[Chunk]:
        out = list(self._state.pending)
        self._state.pending.clear()
        return out

    def _next_chunk(self) -> Chunk | None:
        """A chunk received and not handed out yet; None when there is none, raising the
        request's GenerationError once it ended with one."""
        st = self._state
        if st.pending:
            return st.pending.popleft()
        if st.done:
            err = st.error()
            if err is not None:
                raise err
        return None

    def _whole(self) -> Result:
        self._state.pending.clear()
        return self._state.result()


class ClientBase:
    """Settings, request building and attach, for either client."""

    handle_type: type[HandleBase] = HandleBase

    def __init__(self, redis_url: str | None, prefix: str | None, redis_client: Any, limits: Limits | None,
                 connect: Callable[[str], Any]):
        s = Settings.from_env(redis_url=redis_url, prefix=prefix)
        self.redis_url = s.redis_url
        self.prefix = s.prefix
        self.keys = Keys(s.prefix)
        self.limits = limits or s.limits
        self._own = redis_client is None
        self.redis = redis_client if redis_client is not None else connect(s.redis_url)

    def prepare(self, **kwargs: Any) -> tuple[str, str, dict[str, str]]:
        """(request id, stream key, fields) for ``submit(**kwargs)``, validated; sends nothing."""
        return build_request(keys=self.keys, limits=self.limits, **kwargs)

    def attach(self, request_id: str, last_id: str = START_ID, next_seq: int = 0) -> Any:
        """A handle for a request submitted elsewhere (or earlier). To resume a reader, pass the
        ``last_id`` and the number of tokens it had (``next_seq``, i.e. ``len(handle.token_ids)``)."""
        cancel_fields(request_id)  # validates the id
        return self.handle_type(self, request_id, last_id=last_id, next_seq=next_seq)

    def _cancel_xadd(self, request_id: str) -> tuple[tuple, dict[str, Any]]:
        """XADD arguments of the control entry that cancels ``request_id``."""
        return (self.keys.control, cancel_fields(request_id)), {"maxlen": CONTROL_MAXLEN, "approximate": True}
