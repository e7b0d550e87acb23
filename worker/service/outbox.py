"""What the worker has to write to Redis, as typed operations kept in order until Redis takes
them (they survive an outage), and written as one MULTI/EXEC per flush.

Each operation knows the commands it queues and what it writes to a result stream, so a
request dropped (another worker owns it now) takes its own pending writes out of the outbox
(:meth:`Outbox.drop`) and leaves the others'.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import redis

from common.keys import Keys, fence_key
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
    replica_wait_ms: int = 0  # on a cluster: WAIT for a replica between final entries and their acks


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
        if not w.scripts.cluster:
            w.scripts.publish_tokens(pipe, self.entries, maxlen=w.maxlen, ttl_s=w.ttl_s)
            return 1
        for key, entry in self.entries:  # one call per result stream (its slot), fenced
            w.scripts.fenced_tokens(pipe, reply_to=key, fence=fence_key(key), owner=w.consumer, seq=int(entry["seq"]),
                                    n_ids=len(json.loads(entry["ids"])), maxlen=w.maxlen, ttl_s=w.ttl_s, entry=entry)
        return len(self.entries)

    def without(self, key: str) -> PublishTokens | None:
        kept = [(k, e) for k, e in self.entries if k != key]
        if len(kept) == len(self.entries):
            return self
        return PublishTokens(kept) if kept else None

    def report(self, results: list[Any]) -> None:
        _report_errors("publish_tokens", self.entries[0][0], results)
        for (key, entry), res in zip(self.entries, results if len(results) == len(self.entries) else []):
            if res == 3:
                log.error("event=result_gap key=%s seq=%s reason='earlier token entries lost (failover)'", key,
                          entry["seq"])


@dataclass
class Finalize:
    """A request's final entry with the XACK + XDEL of its request entry, only while it is ours."""

    stream: str
    entry_id: str
    reply_to: str
    entry: dict[str, str]

    def queue(self, pipe: Any, w: Wire) -> int:
        if w.scripts.cluster:  # the result stream's half; the XACK + XDEL follow (then())
            w.scripts.fenced_final(pipe, reply_to=self.reply_to, fence=fence_key(self.reply_to), owner=w.consumer,
                                   maxlen=w.maxlen, ttl_s=w.ttl_s, entry=self.entry)
            return 1
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

    def then(self, results: list[Any]) -> Op | None:
        """On a cluster: the request entry's XACK + XDEL, once the final entry is out (1: now,
        2: by us before, e.g. a flush re-sent after its reply was lost)."""
        return Ack(self.stream, self.entry_id) if results[0] in (1, 2) else None


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
        while self.ops:
            self.ops = self._flush_once(r, w)

    def _flush_once(self, r: redis.Redis, w: Wire) -> list[Op]:
        """One round trip (one per node on a cluster, where it is no transaction); the
        operations that must follow it (a cluster's acks after their final entries)."""
        ops = self.ops
        cluster = w.scripts.cluster
        pipe = r.pipeline(transaction=not cluster)
        counts = [op.queue(pipe, w) for op in ops]
        try:
            results = pipe.execute(raise_on_error=False)
        except redis.ResponseError as e:
            log.warning("event=publish_failed ops=%d error=%r", len(ops), e)
            raise
        at, after, finals, noscript = 0, [], [], []
        for op, n in zip(ops, counts):
            if any(isinstance(res, redis.exceptions.NoScriptError) for res in results[at:at + n]):
                noscript.append(op)  # refused whole (a script is its only command): load and re-send
                at += n
                continue
            op.report(results[at:at + n])
            if cluster and isinstance(op, Finalize) and (nxt := op.then(results[at:at + n])) is not None:
                after.append(nxt)
                finals.append(op.reply_to)
            at += n
        if finals and w.replica_wait_ms > 0:
            wait_replicas(r, finals, w.replica_wait_ms)
        if noscript:
            log.warning("event=scripts_reloaded ops=%d reason='NOSCRIPT: the server restarted or was flushed'",
                        len(noscript))
            w.scripts.load(r)
        return noscript + after


def wait_replicas(r: Any, keys: list[str], timeout_ms: int) -> None:
    """WAIT 1 on the node of each key, so a failover cannot lose a final entry whose request
    entry is then acknowledged (the request would be gone unanswered).

    WAIT covers the writes of the connection it runs on: the worker is one thread, and each
    node's pool hands back its last connection (LIFO), the one the pipeline wrote on."""
    nodes = {r.get_node_from_key(k).name: r.get_node_from_key(k) for k in keys}
    for node in nodes.values():
        got = r.execute_command("WAIT", 1, timeout_ms, target_nodes=node)
        if not got:
            log.warning("event=replica_wait_timeout node=%s timeout_ms=%d", node.name, timeout_ms)
