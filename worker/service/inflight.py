"""The requests a worker has read from Redis and not yet answered, and entry-id arithmetic."""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.protocol import Request


@dataclass
class InFlight:
    """A request this worker has read from Redis and not yet acknowledged."""

    req: Request
    stream: str
    entry_id: str
    enqueued_wall: float  # from the entry id (milliseconds since the epoch)
    prompt_tokens: int = 0
    resumed_tokens: int = 0
    cancelled: bool = False


def by_stream(inflight: dict[str, InFlight]) -> dict[str, list[InFlight]]:
    out: dict[str, list[InFlight]] = {}
    for f in inflight.values():
        out.setdefault(f.stream, []).append(f)
    return out


def entry_time(entry_id: str) -> float:
    """Wall time (s) at which Redis appended an entry, from its id."""
    try:
        return int(entry_id.split("-", 1)[0]) / 1000.0
    except ValueError:
        return time.time()


def id_key(entry_id: str) -> tuple[int, int]:
    """An entry id as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return (0, 0)


def text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
