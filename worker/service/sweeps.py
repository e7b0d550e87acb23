"""Sweeps over entries no worker has pulled: those sent to a stream that is no priority level,
and those whose ``timeout_s`` passed (or that were cancelled) while they waited unread."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis

from common.errors import INVALID_REQUEST, ProtocolError
from common.protocol import done_entry, parse_request, reply_key_for
from worker.service import answers
from worker.service.answers import BadEntry
from worker.service.inflight import entry_time, id_key, text

if TYPE_CHECKING:
    from worker.service.loop import Service

log = logging.getLogger("tokenq.service")
SWEEP_S = 1.0  # how often (one worker at a time) unread entries are checked for expired deadlines
SWEEP_COUNT = 500  # unread entries looked at per stream per sweep (a cursor walks deeper backlogs)
UNKNOWN_COUNT = 100  # entries answered per unknown stream per sweep


def unknown_streams(svc: Service) -> None:
    """Answer entries sent to a priority stream that does not exist (e.g. requests:urgent)."""
    for key in svc.r.scan_iter(match=svc.keys.request_pattern, count=100, _type="stream"):
        key = text(key)
        if svc.keys.level_of_stream(key) is not None:
            continue
        for entry_id, fields in svc.r.xrange(key, count=UNKNOWN_COUNT):
            entry_id = text(entry_id)
            if not svc.r.xdel(key, entry_id):
                continue  # another worker answered it
            rid, reply = reply_key_for(fields, entry_id, svc.keys)
            message = f"unknown priority stream {key!r}: send to {', '.join(svc.keys.request_streams)}"
            answers.answer_bad(svc, BadEntry(key, entry_id, rid, reply, INVALID_REQUEST, message, acked=False))


def expire_unread(svc: Service) -> None:
    """Answer entries still unread in Redis whose ``timeout_s`` passed, or that were cancelled.

    A worker sees the deadline of an entry only once it pulls it; in a backlog an entry
    could wait far past its deadline. One worker at a time (a lock of SWEEP_S) walks the
    unread part of each stream; a script deletes each expired entry only if no worker has
    read it yet and publishes its final entry in the same step, so no worker can be
    serving it and it is answered exactly once.
    """
    if not svc.r.set(svc.keys.sweep, svc.name, nx=True, px=int(SWEEP_S * 1000)):
        return
    now = time.time()
    for stream in svc.keys.request_streams:
        entries = _unread_batch(svc, stream)
        finals = []
        for entry_id, fields in entries or []:
            entry_id = text(entry_id)
            final = _unread_final(svc, stream, entry_id, fields, now)
            if final is not None:
                finals.append((entry_id, *final))
        if finals:
            for entry_id in svc.scripts.expire_unread(svc.r, stream, finals, group=svc.keys.group,
                                                      maxlen=svc.s.result_maxlen, ttl_s=svc.s.result_ttl_s):
                svc.counts["served"] += 1
                log.info("event=expired_unread stream=%s entry=%s", stream, entry_id)


def _unread_batch(svc: Service, stream: str) -> list | None:
    """The next SWEEP_COUNT unread entries of ``stream``, from the cursor on (it wraps round)."""
    try:
        groups = svc.r.xinfo_groups(stream)
    except redis.ResponseError:
        return None
    last = next((text(g["last-delivered-id"]) for g in groups if text(g["name"]) == svc.keys.group), None)
    if last is None:
        return None
    start = svc.expiry_cursor.get(stream)
    if start is None or id_key(start) < id_key(last):
        start = last
    entries = svc.r.xrange(stream, min="(" + start, count=SWEEP_COUNT)
    svc.expiry_cursor[stream] = text(entries[-1][0]) if len(entries) == SWEEP_COUNT else last
    return entries


def _unread_final(svc: Service, stream: str, entry_id: str, fields: dict,
                  now: float) -> tuple[str, dict[str, str]] | None:
    """(result key, final entry) for an unread entry that is past its deadline or cancelled."""
    has_timeout = any(k in fields for k in (b"timeout_s", "timeout_s", b"payload", "payload"))
    if not has_timeout and not svc.control.cancelled:
        return None
    level = svc.keys.level_of_stream(stream) or "normal"
    try:
        req = parse_request(fields, entry_id=entry_id, level=level, keys=svc.keys, limits=svc.s.limits)
    except ProtocolError:
        return None  # answered with an error when a worker pulls it
    waited = max(0.0, now - entry_time(entry_id))
    if req.id in svc.control.cancelled:
        reason = "cancelled"
    elif req.timeout_s is not None and waited > req.timeout_s:
        reason = "timeout"
    else:
        return None
    return req.reply_to, done_entry(req.id, reason, prompt_tokens=0, completion_tokens=0, queue_s=waited,
                                    ttft_s=None, total_s=waited)
