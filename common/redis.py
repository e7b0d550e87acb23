"""Redis connections with the retry and timeout settings every tokenq part uses."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

_RETRYABLE = (redis.ConnectionError, redis.TimeoutError)


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for ``url`` (redis://, rediss://, with user:password@ when AUTH is on).

    Replies stay bytes: prompts may be binary (msgpack) and ids are decoded where needed.
    """
    opts = dict(
        socket_connect_timeout=5,
        socket_keepalive=True,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 3),
        retry_on_error=list(_RETRYABLE),
    )
    opts.update(kwargs)
    return redis.Redis.from_url(url, **opts)


def redact_url(url: str) -> str:
    """The URL without its password (for logs and messages): ``redis://user:***@host:port/db``."""
    try:
        parts = urlsplit(url)
        if parts.password:
            host = parts.netloc.rsplit("@", 1)[-1]
            return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
    except ValueError:
        pass
    return url


def connect_async(url: str, **kwargs) -> redis.asyncio.Redis:
    opts = dict(socket_connect_timeout=5, socket_keepalive=True, health_check_interval=15)
    opts.update(kwargs)
    return redis.asyncio.Redis.from_url(url, **opts)


def xautoclaim_entries(reply) -> tuple[bytes, list]:
    """(next start id, claimed entries) from XAUTOCLAIM; Redis 6.2 replies with 2 items, 7 with 3."""
    if isinstance(reply, (list, tuple)):
        nxt, entries = reply[0], reply[1]
    else:  # pragma: no cover - redis-py may parse it into a dict in some versions
        nxt, entries = reply.get("next"), reply.get("entries", [])
    return nxt, [e for e in entries if e and e[1] is not None]
