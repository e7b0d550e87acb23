"""The worker's view of its Redis connection: up or down, when to retry, and the consumer groups."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis

from common.keys import Keys

log = logging.getLogger("tokenq.service")

# Errors that mean "Redis is away": keep the engine running and retry later.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
# Redis refused (OOM, READONLY, MISCONF, BUSY script): treated the same, never a crash.
REDIS_TROUBLE = (*REDIS_DOWN, redis.ResponseError)
BACKOFF_S = (0.1, 1.0)  # first and longest wait between reconnection attempts


@dataclass
class Connection:
    connected: bool = False
    ever_connected: bool = False
    retry_at: float = 0.0
    backoff: float = BACKOFF_S[0]

    def due(self, now: float) -> bool:
        """Time to try connecting again."""
        return not self.connected and now >= self.retry_at

    def up(self, buffered: int) -> None:
        if not self.connected and self.retry_at:
            log.warning("event=redis_up buffered=%d", buffered)
        self.connected = self.ever_connected = True
        self.backoff = BACKOFF_S[0]

    def down(self, e: Exception, buffered: int) -> None:
        if self.connected:
            log.warning("event=redis_down error=%r buffered=%d", e, buffered)
        self.connected = False
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, BACKOFF_S[1])

    def reset(self) -> None:
        """Force a reconnection (with its group checks and resume) on the next loop."""
        self.connected = False
        self.retry_at = 0.0

    def wait_s(self) -> float:
        return min(0.5, max(0.0, self.retry_at - time.monotonic()))


def ensure_groups(r: redis.Redis, keys: Keys) -> list[str]:
    """Create the consumer group on every request stream; the streams where it was missing."""
    r.ping()
    created = []
    for stream in keys.request_streams:
        try:
            r.xgroup_create(stream, keys.group, id="0", mkstream=True)
            created.append(stream)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
    return created
