"""What the worker has to write to Redis, as typed operations kept in order until Redis takes
them (they survive an outage), and written as one MULTI/EXEC per flush.

Each operation knows the commands it queues and what it writes to a result stream, so a
request dropped (another worker owns it now) takes its own pending writes out of the outbox
(:meth:`Outbox.drop`) and leaves the others'.

After a step the service writes in a thread of its own (:meth:`Outbox.write_behind`) while the
engine runs the next step: a small model's step takes a few ms and its flush round trip was a
tenth of that on the loop's critical path. (Not where the engine's math threads take every
core: the writer would preempt one of them; the loop then flushes between steps, see
worker/tuning.py.) One write at a time, in order: a write waits for the one before, and what a
failed write did not write goes back in front of what came after it.

Writes hold to a lease (:attr:`Outbox.lease_until`): the service renews it each time it
refreshes its entries' idle time, for ``claim_idle_s``. A worker frozen past it (SIGSTOP, a
stalled VM) may have lost its requests to another worker, and the writes it had queued, or
that its writer thread was about to send, would interleave with the new owner's: nothing is
written until the service has refreshed again and dropped what it lost.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from common.keys import Keys, fence_key
from common.protocol.entries import DEAD_MAXLEN
from worker.service.scripts import Scripts, next_field

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
    """One step's token entries, one per result stream, as one script call (on a cluster, one
    fenced call per entry)."""

    entries: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    remembered: bool = False  # on a cluster: kept in Outbox.sent already (sent before, or a refill)
    gap_ok: bool = False  # a refill that cannot cover the whole gap: write after it anyway

    def queue(self, pipe: Any, w: Wire) -> int:
        if not w.scripts.cluster:
            w.scripts.publish_tokens(pipe, self.entries, maxlen=w.maxlen, ttl_s=w.ttl_s)
            return 1
        for key, entry in self.entries:  # one call per result stream (its slot), fenced
            w.scripts.fenced_tokens(pipe, reply_to=key, fence=fence_key(key), owner=w.consumer, seq=int(entry["seq"]),
                                    n_ids=len(json.loads(entry["ids"])), maxlen=w.maxlen, ttl_s=w.ttl_s, entry=entry,
                                    gap_ok=self.gap_ok)
        return len(self.entries)

    def without(self, key: str) -> PublishTokens | None:
        kept = [(k, e) for k, e in self.entries if k != key]
        if len(kept) == len(self.entries):
            return self
        return PublishTokens(kept, self.remembered, self.gap_ok) if kept else None

    def report(self, results: list[Any]) -> None:
        _report_errors("publish_tokens", self.entries[0][0], results)
        for (key, entry), res in zip(self.entries, results if len(results) == len(self.entries) else []):
            if res == 4:
                log.error("event=result_gap key=%s seq=%s reason='token entries before it were lost (failover) and "
                          "this worker does not hold them'", key, entry["seq"])

    def gaps(self, results: list[Any]) -> list[tuple[str, int, int]]:
        """(result stream, choice, the seq the stream stopped at) of each entry refused for a gap."""
        return [(key, _index(entry), int(res[1])) for (key, entry), res in zip(self.entries, results)
                if isinstance(res, list) and res and res[0] == 3]


def _index(entry: dict[str, str]) -> int:
    return int(entry.get("index", 0))


@dataclass
class Finalize:
    """A request's final entry with the XACK + XDEL of its request entry, only while it is ours.

    On a cluster ``expect`` (set by the outbox when it is sent) holds, per fence field, the
    seq this worker's token entries reached: the final entry is refused while any is missing."""

    stream: str
    entry_id: str
    reply_to: str
    entry: dict[str, str]
    expect: dict[str, int] | None = None
    tries: int = 0

    def queue(self, pipe: Any, w: Wire) -> int:
        if w.scripts.cluster:  # the result stream's half; the XACK + XDEL follow (then())
            w.scripts.fenced_final(pipe, reply_to=self.reply_to, fence=fence_key(self.reply_to), owner=w.consumer,
                                   maxlen=w.maxlen, ttl_s=w.ttl_s, entry=self.entry, expect=self.expect)
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

    def gap(self, results: list[Any]) -> tuple[str, int, int] | None:
        """(result stream, choice, seq reached) when refused for missing token entries."""
        res = results[0]
        if isinstance(res, list) and res and res[0] == 3:
            name = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
            return self.reply_to, 0 if name == "next" else int(name.split(":")[1]), int(res[2])
        return None

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
    """Operations waiting to be written, in order.

    On a cluster it also keeps every token entry it sent per result stream until the stream's
    final entry is out: asynchronous replication may lose a master's last writes in a
    failover, the fence tells (a gap), and the lost entries are re-sent from here."""

    MAX_FINAL_TRIES = 4  # a final refused for a gap that many times goes out without the check

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.sent: dict[str, list[dict[str, str]]] = {}
        self._writer: concurrent.futures.Future | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # one thread, kept: no start per step
        self._writing: list[Op] = []  # what the writer thread has still to write (kept when it fails)
        self._error: Exception | None = None  # the writer's failure, raised by the next flush
        self.lease_until = float("inf")  # time.monotonic() until which our entries cannot have been claimed

    def leased(self) -> bool:
        return time.monotonic() < self.lease_until

    def __len__(self) -> int:
        """Operations not yet written (the writer's included)."""
        return len(self.ops) + len(self._writing)

    def add(self, op: Op) -> None:
        self.ops.append(op)

    def drop(self, key: str) -> None:
        """Take out everything still to be written to the result stream ``key``."""
        self._join()
        self.ops = [kept for op in self.ops if (kept := op.without(key)) is not None]
        self.sent.pop(key, None)

    def flush(self, r: redis.Redis, w: Wire) -> None:
        """Write everything as one transaction. Raises (and keeps every operation) when Redis is
        down or refuses the whole transaction (e.g. OOM); a single refused command is logged."""
        self.wait()
        while self.ops and self.leased():
            self.ops = self._flush_once(self.ops, r, w)

    def write_behind(self, r: redis.Redis, w: Wire) -> None:
        """Start writing everything in the writer thread and return (after the previous write,
        raising its failure as :meth:`flush` would). ``r`` is the writer's own client: on a
        cluster, WAIT must run on the connection that wrote (:func:`wait_replicas`)."""
        self.wait()
        if self.ops and self.leased():
            self._writing, self.ops = self.ops, []
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenq-writer")
            self._writer = self._pool.submit(self._write, r, w)

    def wait(self) -> None:
        """Wait for the writer; raise its failure (what it did not write is back in the outbox)."""
        if (e := self.settle()) is not None:
            raise e

    def settle(self) -> Exception | None:
        """Wait for the writer; its failure, now forgotten (Redis answers again: it is stale)."""
        self._join()
        e, self._error = self._error, None
        return e

    def _write(self, r: redis.Redis, w: Wire) -> None:
        try:
            while self._writing and self.leased():  # checked again: the writer may wake from a freeze
                self._writing = self._flush_once(self._writing, r, w)
        except Exception as e:  # noqa: BLE001  (handed to the service's thread by wait())
            self._error = e

    def _join(self) -> None:
        if self._writer is not None:
            self._writer.result()
            self._writer = None
            self.ops, self._writing = self._writing + self.ops, []

    def _flush_once(self, ops: list[Op], r: redis.Redis, w: Wire) -> list[Op]:
        """One round trip (one per node on a cluster, where it is no transaction); the
        operations that must follow it (a cluster's acks after their final entries, entries
        a failover lost and the finals waiting on them)."""
        cluster = w.scripts.cluster
        if cluster:
            self._remember(ops)
        pipe = r.pipeline(transaction=not cluster)
        counts = [op.queue(pipe, w) for op in ops]
        try:
            results = pipe.execute(raise_on_error=False)
        except redis.ResponseError as e:
            log.warning("event=publish_failed ops=%d error=%r", len(ops), e)
            raise
        at, after, finals, noscript = 0, [], [], []
        gaps: dict[tuple[str, int], int] = {}
        waiting: list[Finalize] = []
        for op, n in zip(ops, counts):
            res = results[at:at + n]
            at += n
            if any(isinstance(x, redis.exceptions.NoScriptError) for x in res):
                noscript.append(op)  # refused whole (a script is its only command): load and re-send
                continue
            op.report(res)
            if not cluster:
                continue
            found = op.gaps(res) if isinstance(op, PublishTokens) else []
            if isinstance(op, Finalize):
                if (g := op.gap(res)) is not None:
                    found.append(g)
                    op.tries += 1
                    waiting.append(op)
                else:
                    self.sent.pop(op.reply_to, None)
                    if (nxt := op.then(res)) is not None:
                        after.append(nxt)
                        finals.append(op.reply_to)
            for key, index, reached in found:
                gaps[key, index] = min(reached, gaps.get((key, index), reached))
        if finals and w.replica_wait_ms > 0:
            wait_replicas(r, finals, w.replica_wait_ms)
        if noscript:
            log.warning("event=scripts_reloaded ops=%d reason='NOSCRIPT: the server restarted or was flushed'",
                        len(noscript))
            w.scripts.load(r)
        return noscript + self._refills(gaps) + waiting + after

    def _remember(self, ops: list[Op]) -> None:
        """Keep the token entries about to be sent (once each) and set each final's ``expect``."""
        for op in ops:
            if isinstance(op, PublishTokens) and not op.remembered:
                for key, entry in op.entries:
                    self.sent.setdefault(key, []).append(entry)
                op.remembered = True  # a flush re-sent after a lost connection must not add it again
            elif isinstance(op, Finalize):
                op.expect = {} if op.tries >= self.MAX_FINAL_TRIES else _reached(self.sent.get(op.reply_to, []))

    def _refills(self, gaps: dict[tuple[str, int], int]) -> list[Op]:
        """The entries to send again, from where each stream stopped."""
        ops: list[Op] = []
        for (key, index), reached in gaps.items():
            entries = [e for e in self.sent.get(key, []) if _index(e) == index and int(e["seq"]) >= reached]
            covered = bool(entries) and int(entries[0]["seq"]) == reached
            log.warning("event=result_refill key=%s index=%d from_seq=%d entries=%d covered=%s", key, index, reached,
                        len(entries), covered)
            if entries:
                ops.append(PublishTokens([(key, e) for e in entries], remembered=True, gap_ok=not covered))
        return ops


def _reached(entries: list[dict[str, str]]) -> dict[str, int]:
    """Per fence field, the seq after the last of these token entries."""
    out: dict[str, int] = {}
    for e in entries:
        f = next_field(_index(e))
        out[f] = max(out.get(f, 0), int(e["seq"]) + len(json.loads(e["ids"])))
    return out


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
