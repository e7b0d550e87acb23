"""The worker heartbeat (docs/protocol.md, "Heartbeat") and the token rate it reports."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from common.protocol import Heartbeat
from common.protocol.heartbeat import ttl_s

if TYPE_CHECKING:
    from worker.service.loop import Service

RATE_WINDOW_S = 10.0


class TokenRate:
    """Tokens generated per second over the last RATE_WINDOW_S."""

    def __init__(self) -> None:
        self.window: list[tuple[float, int]] = []  # (monotonic time, tokens)

    def add(self, mono: float, n: int) -> None:
        self.window.append((mono, n))

    def per_s(self) -> float:
        mono = time.monotonic()
        self.window = [(t, n) for t, n in self.window if t > mono - RATE_WINDOW_S]
        if not self.window:
            return 0.0
        span = min(RATE_WINDOW_S, max(1e-3, mono - self.window[0][0]))
        return sum(n for _, n in self.window) / span


def beat(svc: Service) -> None:
    """Write the heartbeat hash and its TTL."""
    st = svc.engine.stats
    hb = Heartbeat(
        name=svc.name, model=svc.model_name, device=svc.device, pid=os.getpid(),
        pages_total=st.num_total_pages, pages_free=st.num_free_pages, running=st.num_running,
        waiting=st.num_waiting, tokens_per_s=svc.rate.per_s(), last_step_s=st.last_step_s,
        last_step=time.time(), steps=st.num_steps, preemptions=st.num_preemptions,
        served=svc.counts["served"], started=svc.started, stopping=svc.stopping,
        prefix_cache_queries=st.prefix_cache_queries, prefix_cache_hits=st.prefix_cache_hits,
    )
    key = svc.keys.worker(svc.name)
    pipe = svc.r.pipeline(transaction=False)
    pipe.hset(key, mapping=hb.to_fields())
    pipe.expire(key, ttl_s(svc.s.heartbeat_s))
    pipe.execute()
