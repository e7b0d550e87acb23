"""What the worker has to write to Redis, as typed operations kept in order until Redis takes
them (they survive an outage), and written as one MULTI/EXEC per flush.

Each operation knows the commands it queues and what it writes to a result stream, so a
request dropped (another worker owns it now) takes its own pending writes out of the outbox
(:meth:`Outbox.drop`) and leaves the others'.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import redis

from common.keys import Keys
from common.protocol.entries import DEAD_MAXLEN
from worker.service.scripts import Scripts

log = logging.getLogger("tokenq.service")


@dataclass(frozen=True)
class Wire:
    """What every operation needs to know to write itself."""

    scripts: Scripts
    keys: Keys
    consumer: str
    maxlen: int
    ttl_s: int


@dataclass
class Publish:
    """One result entry (XADD + EXPIRE), not final for the request's ownership (an error for a bad entry)."""

    key: str
    entry: dict[str, str]

    def queue(self, pipe: Any, w: Wire) -> int:
        pipe.xadd(self.key, self.entry, maxlen=w.maxlen, approximate=True)
        pipe.expire(self.key, w.ttl_s)
        return 2

    def without(self, key: str) -> Publish | None:
        return None if self.key == key else self

    def report(self, results: list[Any]) -> None:
        _report_errors("xadd", self.key, results)


@dataclass
class PublishTokens:
    """One step's token entries, one per result stream, as one script call."""

    entries: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def queue(self, pipe: Any, w: Wire) -> int:
        w.scripts.publish_tokens(pipe, self.entries, maxlen=w.maxlen, ttl_s=w.ttl_s)
        return 1

    def without(self, key: str) -> PublishTokens | None:
        kept = [(k, e) for k, e in self.entries if k != key]
        if len(kept) == len(self.entries):
            return self
        return PublishTokens(kept) if kept else None

    def report(self, results: list[Any]) -> None:
        _report_errors("publish_tokens", self.entries[0][0], results)


@dataclass
class Finalize:
    """A request's final entry with the XACK + XDEL of its request entry, only while it is ours."""

    stream: str
    entry_id: str
    reply_to: str
    entry: dict[str, str]

    def queue(self, pipe: Any, w: Wire) -> int:
        w.scripts.finalize(pipe, stream=self.stream, entry_id=self.entry_id, reply_to=self.reply_to,
                           group=w.keys.group, consumer=w.consumer, maxlen=w.maxlen, ttl_s=w.ttl_s, entry=self.entry)
        return 1

    def without(self, key: str) -> Finalize | None:
        return None if self.reply_to == key else self

    def report(self, results: list[Any]) -> None:
        if results[0] == 0:
            log.warning("event=final_skipped entry=%s key=%s reason='entry owned by another worker or already answered'",
                        self.entry_id, self.reply_to)
        _report_errors("finalize", self.reply_to, results)


@dataclass
class Ack:
    """XACK + XDEL of a request entry that needs no (further) result entry."""

    stream: str
    entry_id: str

    def queue(self, pipe: Any, w: Wire) -> int:
        pipe.xack(self.stream, w.keys.group, self.entry_id)
        pipe.xdel(self.stream, self.entry_id)
        return 2

    def without(self, key: str) -> Ack:
        return self

    def report(self, results: list[Any]) -> None:
        _report_errors("xack", self.stream, results)


@dataclass
class DeadLetter:
    """An entry of the dead-letter stream (docs/protocol.md, "Dead letters")."""

    entry: dict[str, str]

    def queue(self, pipe: Any, w: Wire) -> int:
        pipe.xadd(w.keys.dead, self.entry, maxlen=DEAD_MAXLEN, approximate=True)
        return 1

    def without(self, key: str) -> DeadLetter:
        return self

    def report(self, results: list[Any]) -> None:
        _report_errors("dead_letter", self.entry.get("stream", ""), results)


Op = Publish | PublishTokens | Finalize | Ack | DeadLetter


def _report_errors(op: str, key: str, results: list[Any]) -> None:
    for res in results:
        if isinstance(res, Exception):
            log.warning("event=publish_failed op=%s key=%s error=%r", op, key, res)


class Outbox:
    """Operations waiting to be written, in order."""

    def __init__(self) -> None:
        self.ops: list[Op] = []

    def __len__(self) -> int:
        return len(self.ops)

    def add(self, op: Op) -> None:
        self.ops.append(op)

    def drop(self, key: str) -> None:
        """Take out everything still to be written to the result stream ``key``."""
        self.ops = [kept for op in self.ops if (kept := op.without(key)) is not None]

    def flush(self, r: redis.Redis, w: Wire) -> None:
        """Write everything as one transaction. Raises (and keeps every operation) when Redis is
        down or refuses the whole transaction (e.g. OOM); a single refused command is logged."""
        if not self.ops:
            return
        ops = self.ops
        pipe = r.pipeline(transaction=True)
        counts = [op.queue(pipe, w) for op in ops]
        try:
            results = pipe.execute(raise_on_error=False)
        except redis.ResponseError as e:
            log.warning("event=publish_failed ops=%d error=%r", len(ops), e)
            raise
        self.ops = []
        at = 0
        for op, n in zip(ops, counts):
            op.report(results[at:at + n])
            at += n
