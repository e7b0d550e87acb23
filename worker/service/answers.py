"""How the worker answers: a step's token entries, a request's final entry, a bad entry.

Every answer goes into the outbox (written in order once Redis takes it). A request's final
entry is written with the XACK + XDEL of its request entry by one script, only while the
entry is still this worker's, so each request gets exactly one final entry.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.protocol import dead_entry, done_entry, error_entry, token_entry
from worker.outputs import RequestOutput
from worker.service.inflight import InFlight
from worker.service.outbox import Ack, DeadLetter, Finalize, Publish, PublishTokens

if TYPE_CHECKING:
    from worker.service.loop import Service

log = logging.getLogger("tokenq.service")


def record(svc: Service, outputs: list[RequestOutput]) -> None:
    """Queue a step's result entries: token entries (one per request per publication), final
    entries and acks.

    A request's new tokens are held back while the last publication is younger than
    ``stream_interval_ms`` and go out together, in one entry: a small model steps every few
    ms, and an entry per request per step was most of the Redis side's cost (redis-server's
    XADDs, the clients' reads; tiny model through Redis 0.81 of the engine alone, 0.95+ at
    20 ms). A step with a request's first token or a request's end publishes at once
    (everything held included), so neither time to first token nor the final entry waits.
    """
    mono = time.monotonic()
    urgent = False
    for o in outputs:
        if o.request_id not in svc.inflight:
            continue
        if o.new_token_ids:
            svc.rate.add(mono, len(o.new_token_ids))
        svc.pending.setdefault((o.request_id, o.index), []).append(o)
        urgent = urgent or o.finished or o.choice_finish_reason is not None or (o.seq == 0 and bool(o.new_token_ids))
    if urgent or mono - svc.published >= svc.s.stream_interval_ms / 1000:
        publish(svc)


def publish(svc: Service) -> None:
    """Queue everything held: the token entries as one script call (one command instead of an
    XADD and an EXPIRE per request), before any final entry of the same step."""
    if not svc.pending:
        return
    now, mono = time.time(), time.monotonic()
    svc.published = mono
    held, svc.pending = [_joined(outs) for outs in svc.pending.values()], {}
    tokens = PublishTokens()
    finished = []
    for o in held:
        f = svc.inflight.get(o.request_id)
        if f is None:
            continue
        if o.new_token_ids or o.text:
            tokens.entries.append((f.req.reply_to, _token_entry(svc, f.req.params.n, o)))
        if o.finished:
            finished.append((f, o))
    if tokens.entries:
        svc.outbox.add(tokens)
    for f, o in finished:
        if o.error is not None:
            error(svc, f, o.error[0], o.error[1])
            continue
        m = o.metrics
        wall = lambda t: None if t is None else now - (mono - t)  # noqa: E731
        started, first = (wall(m.first_scheduled_time), wall(m.first_token_time)) if m else (None, None)
        finish(svc, f, o.finish_reason or "stop", o.num_prompt_tokens, o.num_output_tokens, started, first, o)


def _joined(outs: list[RequestOutput]) -> RequestOutput:
    """One output for consecutive ones of the same request and choice, in order (joined once,
    at publication, not step by step)."""
    if len(outs) == 1:
        return outs[0]
    with_ids = [o for o in outs if o.new_token_ids]
    lps = [lp for o in outs for lp in o.logprobs or []] if any(o.logprobs is not None for o in outs) else None
    return dataclasses.replace(outs[-1], new_token_ids=[t for o in outs for t in o.new_token_ids],
                               seq=(with_ids[0] if with_ids else outs[-1]).seq, text="".join(o.text for o in outs), logprobs=lps,
                               prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs), None))


def _token_entry(svc: Service, n: int, o: RequestOutput) -> dict[str, str]:
    text = svc.engine.token_text
    wire = lambda lps: None if lps is None else [lp.wire(text) for lp in lps]  # noqa: E731
    return token_entry(o.seq, o.new_token_ids, o.text, index=o.index if n > 1 else None,
                       finish_reason=o.choice_finish_reason if n > 1 else None,
                       logprobs=wire(o.logprobs), prompt_logprobs=wire(o.prompt_logprobs))


def finish(svc: Service, f: InFlight, reason: str, prompt_tokens: int, completion_tokens: int,
           started: float | None, first: float | None, output: RequestOutput | None = None) -> None:
    """The request's ``done`` entry (times measured from its entry id)."""
    now = time.time()
    _final(svc, f, done_entry(
        f.req.id, reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        queue_s=max(0.0, (started or now) - f.enqueued_wall),
        ttft_s=None if first is None else max(0.0, first - f.enqueued_wall),
        total_s=max(0.0, now - f.enqueued_wall),
        finish_reasons=output.finish_reasons if output is not None and f.req.params.n > 1 else None,
        cached_tokens=output.cached_tokens if output is not None else 0,
    ))
    svc.counts["served"] += 1
    log.info("event=done id=%s reason=%s prompt_tokens=%d completion_tokens=%d", f.req.id, reason, prompt_tokens,
             completion_tokens)
    svc.finished(f, output, reason)


def error(svc: Service, f: InFlight, code: str, message: str) -> None:
    """The request's ``error`` entry (the engine refused or failed it)."""
    _final(svc, f, error_entry(f.req.id, code, message))
    svc.counts["errors"] += 1
    log.warning("event=error id=%s code=%s message=%r", f.req.id, code, message)
    svc.finished(f, None, "error:" + code)


def _final(svc: Service, f: InFlight, entry: dict[str, str]) -> None:
    svc.outbox.add(Finalize(f.stream, f.entry_id, f.req.reply_to, entry))
    svc.inflight.pop(f.req.id, None)


def ack(svc: Service, f: InFlight) -> None:
    """Acknowledge a request whose final entry is already out (a resumed one)."""
    svc.outbox.add(Ack(f.stream, f.entry_id))
    svc.inflight.pop(f.req.id, None)


@dataclass
class BadEntry:
    """A request entry the worker will not serve, and how to answer it."""

    stream: str
    entry_id: str
    request_id: str | None
    reply_to: str | None  # None: no safe result stream, the answer goes to the dead-letter stream
    code: str
    message: str
    dead_letter: bool = False  # also record it in the dead-letter stream (it gave up after retries)
    acked: bool = True  # XACK + XDEL it (False: already deleted, never in the group)


def answer_bad(svc: Service, bad: BadEntry) -> None:
    """Count and log a bad entry, publish its error (or dead letter), acknowledge it."""
    if bad.dead_letter:
        svc.counts["dead"] += 1
        log.error("event=dead_letter stream=%s entry=%s id=%s message=%r", bad.stream, bad.entry_id, bad.request_id,
                  bad.message)
    else:
        svc.counts["errors"] += 1
        log.warning("event=rejected entry=%s id=%s code=%s message=%r", bad.entry_id, bad.request_id, bad.code,
                    bad.message)
    svc.finished(None, None, "error:" + bad.code)
    if bad.reply_to is not None:
        svc.outbox.add(Publish(bad.reply_to, error_entry(bad.request_id, bad.code, bad.message)))
    if bad.reply_to is None or bad.dead_letter:
        svc.outbox.add(DeadLetter(dead_entry(bad.request_id, bad.stream, bad.entry_id, bad.code, bad.message)))
    if bad.acked:
        svc.outbox.add(Ack(bad.stream, bad.entry_id))
