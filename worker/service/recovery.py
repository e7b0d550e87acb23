"""Recovery: resume what this worker's consumer still holds, claim the entries of dead workers,
keep our own entries fresh, let go of the ones another worker took, hand entries back.

Ownership: a worker publishes a request's final entry only while its consumer owns the
entry, and its refresh never takes back an entry another worker claimed: a worker frozen
past ``claim_idle_s`` (GC pause, SIGSTOP, a stalled VM) drops the requests it lost, so
every request gets exactly one final entry. A resumed request carries on from the tokens
already on its result stream (docs/protocol.md, "Delivery guarantees").
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from common.errors import INTERNAL
from common.protocol import decode_result, reply_key_for
from common.redis import xautoclaim_entries
from worker.service import answers, intake
from worker.service.answers import BadEntry
from worker.service.connection import REDIS_DOWN
from worker.service.inflight import InFlight, by_stream, text
from worker.service.scripts import touched

if TYPE_CHECKING:
    from worker.service.loop import Service

log = logging.getLogger("tokenq.service")
RELEASE_IDLE_MS = 10**9  # a released entry looks this idle: the next XAUTOCLAIM takes it at once
MAX_CLAIM = 16  # entries claimed per level per pass


def published(svc: Service, reply_to: str) -> tuple[dict[int, list[int]], dict[int, str], bool]:
    """What a previous owner already published: per choice its tokens (contiguous from seq 0),
    the choices it ended (n > 1: index -> finish_reason), and whether the request finished."""
    by_seq: dict[int, dict[int, tuple[list[int], str | None]]] = {}
    final = False
    for _, fields in svc.r.xrange(reply_to):
        try:
            e = decode_result(fields)
        except (ValueError, KeyError):
            continue
        if e.final:
            final = True
        elif e.type == "token":
            by_seq.setdefault(e.index, {}).setdefault(e.seq, (e.ids, e.finish_reason))
    choices: dict[int, list[int]] = {}
    ended: dict[int, str] = {}
    for index, entries in by_seq.items():
        out = choices[index] = []
        while len(out) in entries:
            ids, reason = entries[len(out)]
            out.extend(ids)
            if reason:
                ended[index] = reason
    return choices, ended, final


def resume_own(svc: Service) -> None:
    """Entries our consumer name still holds from an earlier run: resume them."""
    for stream in svc.keys.request_streams:
        reply = svc.r.xreadgroup(svc.keys.group, svc.name, {stream: "0"}, count=1000)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                entry_id = text(entry_id)
                if fields is None:
                    svc.r.xack(stream, svc.keys.group, entry_id)
                elif not any(f.entry_id == entry_id for f in svc.inflight.values()):
                    intake.accept(svc, stream, entry_id, fields, resume=True)


def claim(svc: Service) -> None:
    """Take over entries idle past claim_idle_s (their worker died), most urgent level first;
    one delivered more than ``max_attempts`` times is dead-lettered instead."""
    idle_ms = int(svc.s.claim_idle_s * 1000)
    for stream in svc.keys.request_streams:  # most urgent level first, every shard
        n = min(svc.engine.budget().free_seqs, MAX_CLAIM)
        if n <= 0:
            return
        _, entries = xautoclaim_entries(svc.r.xautoclaim(stream, svc.keys.group, svc.name, idle_ms, "0-0", count=n))
        for entry_id, fields in entries:
            entry_id = text(entry_id)
            delivered = _times_delivered(svc, stream, entry_id)
            svc.counts["claimed"] += 1
            log.warning("event=claimed stream=%s entry=%s deliveries=%d", stream, entry_id, delivered)
            if delivered > svc.s.max_attempts:
                rid, reply = reply_key_for(fields, entry_id, svc.keys)
                message = f"gave up after {delivered} deliveries (the worker serving it failed each time)"
                answers.answer_bad(svc, BadEntry(stream, entry_id, rid, reply, INTERNAL, message, dead_letter=True))
            else:
                intake.accept(svc, stream, entry_id, fields, resume=True)


def _times_delivered(svc: Service, stream: str, entry_id: str) -> int:
    info = svc.r.xpending_range(stream, svc.keys.group, min=entry_id, max=entry_id, count=1)
    return int(info[0]["times_delivered"]) if info else 1


def refresh(svc: Service) -> None:
    """Reset the idle time of our in-flight entries, so no live request looks abandoned.

    Only entries our consumer still owns: one another worker claimed (we were frozen
    past claim_idle_s) is dropped here, not taken back, so two workers never serve it.
    """
    # Idle times are reset from here on: nobody can claim our entries before claim_idle_s has passed.
    lease = time.monotonic() + svc.s.claim_idle_s
    groups = by_stream(svc.inflight)
    if not groups:
        svc.outbox.lease_until = lease
        return
    pipe = svc.r.pipeline(transaction=False)
    for stream, fs in groups.items():
        svc.scripts.touch(pipe, stream, [f.entry_id for f in fs], group=svc.keys.group, consumer=svc.name)
    for fs, reply in zip(groups.values(), pipe.execute()):
        lost, gone = touched(reply)
        for f in fs:
            if f.entry_id in lost:
                drop(svc, f, "claimed by another worker")
            elif f.entry_id in gone and published(svc, f.req.reply_to)[2]:
                drop(svc, f, "answered by another worker")
    svc.outbox.lease_until = lease  # what is left is ours: its writes may go out again


def drop(svc: Service, f: InFlight, why: str) -> None:
    """Stop serving a request that is no longer ours; publish nothing more for it."""
    if svc.inflight.get(f.req.id) is not f:
        return
    svc.engine.abort(f.req.id)
    del svc.inflight[f.req.id]
    svc.outbox.drop(f.req.reply_to)
    log.warning("event=lost_entry id=%s entry=%s why=%r", f.req.id, f.entry_id, why)


def release(svc: Service, left: list[InFlight]) -> None:
    """Hand entries back, marked long idle, so the next claim pass (any worker's) takes them."""
    if not left or not svc.conn.connected:
        return
    try:
        pipe = svc.r.pipeline(transaction=False)
        for f in left:
            svc.scripts.touch(pipe, f.stream, [f.entry_id], group=svc.keys.group, consumer=svc.name,
                              idle_ms=RELEASE_IDLE_MS)
        pipe.execute()
        log.info("event=released count=%d", len(left))
    except REDIS_DOWN as e:
        log.warning("event=release_failed error=%r", e)


def data_lost(svc: Service, streams: list[str]) -> None:
    """Redis came back without our consumer groups (restarted without persistence, or the
    keys were deleted): say what is lost. Requests running here continue and are answered."""
    ids = sorted(svc.inflight)
    log.error("event=redis_data_lost streams=%s inflight=%d inflight_ids=%s lost='entries waiting in Redis, "
              "other workers' in-flight entries and result entries written before the loss'; "
              "note='groups recreated; in-flight requests here continue'",
              ",".join(streams), len(ids), ",".join(ids[:50]))
    svc.counts["data_lost"] = svc.counts.get("data_lost", 0) + 1
