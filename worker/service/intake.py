"""Intake: pull request entries under the engine's budget, check them, hand them to the engine.

Aging (no starvation): ``high`` is strict. Between ``normal`` and ``low`` the worker pulls
by *virtual arrival time*, the entry's time plus ``aging_s`` per level below ``normal``:
a ``low`` entry that has waited ``aging_s`` ranks with ``normal`` entries arriving then,
and once it has waited that long it runs at ``normal`` priority in the engine (so
``normal`` work does not preempt it). Aging never lifts anything into ``high``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any

from common.errors import INVALID_REQUEST, ProtocolError
from common.keys import LEVELS, PRIORITIES, fence_key
from common.protocol import Request, parse_request
from worker.service import answers, recovery
from worker.service.answers import BadEntry
from worker.service.inflight import InFlight, entry_time, text

if TYPE_CHECKING:
    from worker.service.loop import Service

log = logging.getLogger("tokenq.service")
NORMAL = PRIORITIES["normal"]
CLUSTER_POLL_S = 0.05  # how often an idle worker on a cluster looks for new entries


def pull(svc: Service) -> None:
    """Read new entries, most urgent first, no more than the engine can admit soon.

    When nothing can be read and the engine is idle, block on all streams for one entry
    each (COUNT is per stream: a wake-up must not take a backlog).
    """
    if _pull_levels(svc) == 0 and not svc.engine.has_unfinished() and not svc.outbox:
        block_ms = int(min(svc.s.heartbeat_s, 1.0) * 1000)
        if svc.scripts.cluster:
            woken = _wait_cluster(svc, block_ms)
        else:
            reply = svc.r.xreadgroup(svc.keys.group, svc.name, {s: ">" for s in svc.keys.request_streams}, count=1,
                                     block=block_ms)
            take(svc, reply)
            woken = bool(reply)
            svc.doorbell.ring(*(text(stream) for stream, _ in reply or []))  # count 1: more may wait there
        if woken:
            # The rest of a burst, under the budget, before the first step: the step that follows
            # would otherwise prefill the one entry the wake-up took alone (64 requests sent at
            # once to an idle worker: a first step of one prompt, 34 ms on the tiny bench model,
            # before the other 63 were read).
            _pull_levels(svc, woken=True)


def _wait_cluster(svc: Service, block_ms: int) -> bool:
    """Idle on a cluster: the streams live in different slots, so one XREADGROUP cannot block
    on them all; poll them (one round trip per node) every CLUSTER_POLL_S until one has work.
    Whether one had."""
    until = time.monotonic() + block_ms / 1000
    while True:
        pipe = svc.r.pipeline(transaction=False)
        for stream in svc.keys.request_streams:
            pipe.xreadgroup(svc.keys.group, svc.name, {stream: ">"}, count=1)
        replies = pipe.execute()
        for stream, reply in zip(svc.keys.request_streams, replies):
            take(svc, reply)
            if reply:
                svc.doorbell.ring(stream)  # count 1: more may wait there
        if any(replies):
            return True
        if time.monotonic() >= until:
            return False
        time.sleep(CLUSTER_POLL_S)


def _room(svc: Service, prio: int, waiting: set[int], running: list[int]) -> int:
    """How many entries of priority ``prio`` the engine could start soon (``waiting`` and
    ``running``: the priorities the engine held when this pass began)."""
    if any(p <= prio for p in waiting):
        return 0  # we already hold work of this level that cannot start: leave the rest to others
    b = svc.engine.budget()
    n = min(b.free_seqs, int(b.free_tokens // max(1.0, svc.avg_request_tokens)))
    if n <= 0 and any(p > prio for p in running):
        n = 1  # the scheduler may evict less urgent work for it
    return n


def _pull_levels(svc: Service, woken: bool = False) -> int:
    """One non-blocking pass: ``high`` first (strict), then ``normal`` and ``low`` (aged).
    ``woken``: right after a wake-up of an idle engine, whose waiting work is then only what
    the wake-up took, which has not had a step to start in (the budget counts it)."""
    waiting = set() if woken else {s.priority for s in svc.engine.scheduler.waiting}
    running = [s.priority for s in svc.engine.scheduler.running]
    taken = 0
    for prio, level in enumerate(LEVELS):
        n = _room(svc, prio, waiting, running)
        if n <= 0:
            return taken
        if prio == NORMAL and svc.s.aging_s > 0:
            plan = _aging_plan(svc, n)
            for stream, count in plan.items():
                taken += _read(svc, stream, count)
            if any(plan.get(s) for s in svc.keys.level_streams("low")):
                return taken  # the low stream had its turn in this pass
            continue
        taken += _read_level(svc, level, n)
    return taken


def _read_level(svc: Service, level: str, n: int) -> int:
    """Up to ``n`` entries of one level, over its shards in turn: each pass starts one shard
    further on, so no shard waits behind another."""
    streams = svc.keys.level_streams(level)
    start = svc.shard_turn = (svc.shard_turn + 1) % len(streams)
    taken = 0
    for stream in streams[start:] + streams[:start]:
        if taken >= n:
            break
        if svc.doorbell.take(stream):
            taken += _read(svc, stream, n - taken)
    return taken


def _read(svc: Service, stream: str, count: int) -> int:
    """Up to ``count`` entries of a stream whose doorbell mark was just taken."""
    if count <= 0:
        return 0
    reply = svc.r.xreadgroup(svc.keys.group, svc.name, {stream: ">"}, count=count)
    got = sum(len(entries) for _, entries in reply or [])
    if got >= count:
        svc.doorbell.ring(stream)  # a full read: more may wait
    take(svc, reply)
    return got


def _aging_plan(svc: Service, n: int) -> dict[str, int]:
    """How many of the next ``n`` pulls go to ``normal`` and to ``low``, by virtual arrival
    time (entry time + aging_s per level below normal), oldest first."""
    streams = [(s, rank) for rank, level in enumerate(LEVELS[NORMAL:]) for s in svc.keys.level_streams(level)
               if svc.doorbell.take(s)]
    if not streams:
        return {}
    unread = svc.scripts.unread(svc.r, [s for s, _ in streams], group=svc.keys.group, count=n)
    ranked = sorted((entry_time(entry_id) + streams[i][1] * svc.s.aging_s, i) for i, ids in enumerate(unread)
                    for entry_id in ids)
    plan = dict.fromkeys((s for s, _ in streams), 0)
    for _, i in ranked[:n]:
        plan[streams[i][0]] += 1
    svc.doorbell.ring(*(s for (s, _), ids in zip(streams, unread) if len(ids) > plan[s]))  # left for later
    return plan


def _effective_priority(svc: Service, f: InFlight) -> int:
    """The engine priority: the level's, lifted one level per aging_s waited, never into high."""
    prio = f.req.priority
    if svc.s.aging_s > 0 and prio > NORMAL:
        waited = time.time() - f.enqueued_wall
        prio = max(NORMAL, prio - int(waited // svc.s.aging_s))
        if prio != f.req.priority:
            log.debug("event=aged id=%s waited_s=%.1f priority=%d", f.req.id, waited, prio)
    return prio


def take(svc: Service, reply: Any) -> None:
    """Accept every entry of an XREADGROUP reply. Whether each one's result stream already
    exists (a reused id: _refusal) is asked for all of them in one round trip: one EXISTS per
    entry cost a burst of 63 entries 17 ms before its first step."""
    parsed = []
    for stream, entries in reply or []:
        stream = text(stream)
        for entry_id, fields in entries:
            if fields is None:  # deleted while pending
                svc.r.xack(stream, svc.keys.group, entry_id)
                continue
            entry_id = text(entry_id)
            req = _parse(svc, stream, entry_id, fields)
            if req is not None:
                parsed.append((stream, entry_id, req))
    if not parsed:
        return
    pipe = svc.r.pipeline(transaction=False)
    for _, _, req in parsed:
        pipe.exists(req.reply_to)
    for (stream, entry_id, req), in_use in zip(parsed, pipe.execute()):
        _admit(svc, stream, entry_id, req, resume=False, in_use=bool(in_use))


def accept(svc: Service, stream: str, entry_id: str, fields: dict, resume: bool) -> None:
    """Parse one entry and start it in the engine, or answer it (error, cancelled, already done)."""
    req = _parse(svc, stream, entry_id, fields)
    if req is not None:
        _admit(svc, stream, entry_id, req, resume, in_use=None)


def _parse(svc: Service, stream: str, entry_id: str, fields: dict) -> Request | None:
    """The entry's request, or None once a malformed entry is answered with its error."""
    level = svc.keys.level_of_stream(stream) or "normal"
    try:
        return parse_request(fields, entry_id=entry_id, level=level, keys=svc.keys, limits=svc.s.limits)
    except ProtocolError as e:
        answers.answer_bad(svc, BadEntry(stream, entry_id, e.request_id, e.reply_to, e.code, e.message))
        return None


def _admit(svc: Service, stream: str, entry_id: str, req: Request, resume: bool, in_use: bool | None) -> None:
    """Start a parsed request in the engine, or answer it (``in_use``: whether its result stream
    exists, None to ask Redis)."""
    f = InFlight(req, stream, entry_id, entry_time(entry_id))
    why = _refusal(svc, f, resume, in_use)
    if why is not None:
        if why:
            answers.answer_bad(svc, BadEntry(stream, entry_id, req.id, None, INVALID_REQUEST, why))
        return
    if svc.scripts.cluster and not _fence(svc, f, resume):
        return
    if req.id in svc.control.cancelled:
        svc.inflight[req.id] = f
        answers.finish(svc, f, "cancelled", 0, 0, None, None)
        return
    try:
        ids = _tokenize(svc, req)
    except ValueError as e:
        answers.answer_bad(svc, BadEntry(stream, entry_id, req.id, req.reply_to, INVALID_REQUEST, str(e)))
        return
    _seed(req, stream, entry_id)
    _start(svc, f, ids, resume)


def _refusal(svc: Service, f: InFlight, resume: bool, in_use: bool | None) -> str | None:
    """Why an entry with a valid request is refused (``""``: it is already ours, say nothing)."""
    rid = f.req.id
    if rid in svc.inflight or rid in svc.engine:
        if svc.inflight.get(rid, f).entry_id == f.entry_id:
            return ""  # already ours (claimed back after a slow step)
        return f"request id {rid!r} is already in flight"
    if not resume and (svc.r.exists(f.req.reply_to) if in_use is None else in_use):
        # A second request with the same id (a producer's retried XADD, or a hostile one) would
        # write a second output and a second final entry into the first one's result stream.
        return f"request id {rid!r} is already in use (its result stream exists): send a new id"
    return None


def _fence(svc: Service, f: InFlight, resume: bool) -> bool:
    """On a cluster: make this worker the owner of the request's fence (a claim or resume
    always; a first take only if nobody owns it), before anything of it is read or written."""
    ok = svc.scripts.fence_take(svc.r, fence=fence_key(f.req.reply_to), reply_to=f.req.reply_to, owner=svc.name,
                                claim=resume, ttl_s=svc.s.result_ttl_s)
    if not ok:
        log.warning("event=lost_entry id=%s entry=%s why='its fence names another worker'", f.req.id, f.entry_id)
    return bool(ok)


def _seed(req: Request, stream: str, entry_id: str) -> None:
    if req.params.seed is None:
        # The same seed on whichever worker serves (or resumes) it: a resumed sampled
        # request continues its random stream, and a re-send is an exact duplicate.
        digest = hashlib.blake2b(f"{stream}/{entry_id}".encode(), digest_size=8).digest()
        req.params.seed = int.from_bytes(digest, "big") & (2**63 - 1)


def _start(svc: Service, f: InFlight, ids: list[int], resume: bool) -> None:
    """Add the request to the engine, carrying on from tokens a previous owner published."""
    req = f.req
    generated: list[int] = []
    choices: dict[int, list[int]] = {}
    ended: dict[int, str] = {}
    if resume:
        choices, ended, final = recovery.published(svc, req.reply_to)
        if final:
            answers.ack(svc, f)  # its final entry is out: the dead worker only missed the ack
            return
        generated = choices.get(0, [])
        f.resumed_tokens = sum(len(c) for c in choices.values())
    f.prompt_tokens = len(ids)
    svc.inflight[req.id] = f
    if req.params.n == 1 and generated and len(generated) >= req.params.max_tokens:
        answers.finish(svc, f, "length", len(ids), len(generated), None, None)
        return
    remaining = None
    if req.timeout_s is not None:
        remaining = req.timeout_s - (time.time() - f.enqueued_wall)
        if remaining <= 0 and not generated:
            answers.finish(svc, f, "timeout", len(ids), 0, None, None)
            return
    try:
        many = [choices.get(i, []) for i in range(req.params.n)] if req.params.n > 1 else generated
        svc.engine.add_request(req.id, ids, req.params, _effective_priority(svc, f),
                               timeout_s=None if f.resumed_tokens else remaining, generated_ids=many, ended=ended)
    except ValueError as e:
        del svc.inflight[req.id]
        answers.answer_bad(svc, BadEntry(f.stream, f.entry_id, req.id, req.reply_to, INVALID_REQUEST, str(e)))
        return
    # What it will cost the cache: its prompt less what the prefix cache holds of it (so a warm
    # worker pulls more), plus its output up front under 'reserve'.
    est = len(ids) - svc.engine.cached_tokens(ids, req.params.cache_salt)
    est += req.params.max_tokens if svc.engine.config.admission_policy == "reserve" else 0
    svc.avg_request_tokens = 0.9 * svc.avg_request_tokens + 0.1 * est
    log.debug("event=accepted id=%s prompt_tokens=%d resumed=%d", req.id, len(ids), f.resumed_tokens)


def _tokenize(svc: Service, req: Request) -> list[int]:
    if req.input_ids is not None:
        return req.input_ids
    tok = svc.tokenizer
    if tok is None:
        raise ValueError("this worker has no tokenizer: send input_ids")
    if req.messages is not None:
        if not getattr(tok, "chat_template", None):
            raise ValueError("the model has no chat template: send prompt or input_ids")
        try:
            ids = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as e:  # a template may raise on odd message sequences
            raise ValueError(f"chat template failed: {e}") from None
        return list(ids)
    assert req.prompt is not None
    return list(tok(req.prompt).input_ids)
