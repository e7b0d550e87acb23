"""Carrying one batch, under its lease, from wherever it stands to its end.

``validating``: every line is checked (a bad line fails the batch with OpenAI's error list).
``in_progress``: lines are fed to the queue at the batch's priority, never more than
``batch_feed_limit`` requests of the batch waiting or running at once, and their result streams
are read (one XREAD for all of them) into output and error lines. ``finalizing``: the output
files are made. ``cancelling`` / past ``expires_at``: what is in flight is cancelled, and what
did not run becomes ``batch_cancelled`` / ``batch_expired`` error lines.

Nothing lives only in this object: the next line to feed, the lines in flight and every count
are in Redis, so a carrier that starts on a batch another process was carrying (it died, or lost
its lease) rebuilds its readers from the in-flight hash and goes on; line ids are fixed by the
line, so it reads the very requests the other one queued.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio

from common.keys import Keys
from common.settings import Settings
from producer.batch import scripts
from producer.batch.lines import (
    Line,
    Prepared,
    batch_error_line,
    check_line,
    prepare_line,
    request_ids,
    response_line,
)
from producer.batch.records import batch_error, decode_hash
from producer.types import CONTROL_MAXLEN, GenerationError, ResultReader, cancel_fields, stream_entries

log = logging.getLogger("tokenq.batch")

CHUNK = 1000  # lines read per LRANGE while validating
MAX_ERRORS = 100  # a failed batch lists at most this many bad lines
READ_BLOCK_MS = 200
READ_COUNT = 512
# Result streams are read at most this often: each read then brings a step or two of tokens of every
# request at once. Reading as fast as entries arrive would spend a core (and Redis's time) on
# reads of one entry each, taken from the worker, for answers nobody waits on to the millisecond.
READ_INTERVAL_S = 0.02
CANCEL_GRACE_S = 10.0  # cancelled requests get this long to end before they are written off
ENDED = {"cancelled": ("batch_cancelled", "the batch was cancelled before this request completed"),
         "expired": ("batch_expired", "this request could not be executed before the completion window expired")}


class LeaseLost(Exception):
    pass


class Carrier:
    def __init__(self, r: redis.asyncio.Redis, keys: Keys, settings: Settings, batch_id: str, token: str,
                 prepare: Callable[..., tuple[str, str, dict[str, str]]],
                 usage: Callable[[list[Any]], dict[str, int]]):
        self.r, self.keys, self.s, self.bid, self.token, self.prepare = r, keys, settings, batch_id, token, prepare
        self.usage = usage
        self.h: dict[str, str] = {}
        self.inflight: dict[int, tuple[Line, list[ResultReader]]] = {}
        self.loaded = False
        self.last_read = 0.0
        self.lost = False  # set by the lease keeper when a renewal fails

    # ------------------------------------------------------------ shorthands
    @property
    def chat(self) -> bool:
        return self.h["endpoint"] == "/v1/chat/completions"

    @property
    def model_name(self) -> str:
        return self.h.get("model") or self.s.model_name

    @property
    def input_key(self) -> str:
        return self.keys.file_lines(self.h["input_file_id"])

    def lines_key(self, kind: str) -> str:
        return self.keys.file_lines(self.h["out_file" if kind == "out" else "err_file"])

    def check(self, reply: int) -> int:
        if reply == scripts.LOST_LEASE or self.lost:
            self.lost = True
            raise LeaseLost(self.bid)
        return reply

    async def transition(self, statuses: tuple[str, ...], status: str, stamp: str, **fields: Any) -> bool:
        return self.check(await scripts.transition(self.r, self.keys, self.bid, self.token, statuses, status,
                                                   stamp, fields)) == 1

    # ------------------------------------------------------------ the states
    async def carry(self) -> None:
        """Run the batch to a final status (or until the lease is lost: LeaseLost)."""
        while not self.lost:
            self.h = decode_hash(await self.r.hgetall(self.keys.batch(self.bid)))
            status = self.h.get("status")
            if status == "validating":
                await self.validate()
            elif status == "in_progress":
                await self.progress()
            elif status == "finalizing":
                await self.finalize("completed", ("finalizing",))
            elif status == "cancelling":
                await self.wind_down("cancelled")
            else:
                return
        raise LeaseLost(self.bid)

    async def validate(self) -> None:
        if not await self.r.exists(self.keys.file(self.h["input_file_id"])):
            await self.transition(("validating",), "failed", "failed_at", errors=json.dumps(
                [batch_error("invalid_file", f"the input file {self.h['input_file_id']} no longer exists")]))
            return
        n = await self.r.llen(self.input_key)
        errors: list[dict[str, Any]] = []
        seen: set[str] = set()
        for start in range(0, n, CHUNK):
            for k, raw in enumerate(await self.r.lrange(self.input_key, start, start + CHUNK - 1)):
                line, err = check_line(raw, self.h["endpoint"])
                if err is not None:
                    errors.append(batch_error(err[0], err[1], start + k + 1, err[2]))
                elif line is not None:
                    if line.custom_id in seen:
                        errors.append(batch_error("duplicate_custom_id", f"custom_id {line.custom_id!r} is not "
                                                  "unique in the file", start + k + 1, "custom_id"))
                    seen.add(line.custom_id)
            if len(errors) >= MAX_ERRORS:
                break
        if not seen and not errors:
            errors.append(batch_error("empty_file", "the input file holds no requests"))
        if len(seen) > self.s.batch_max_requests:
            errors.append(batch_error("too_many_requests", f"the input file holds {len(seen)} requests; a batch "
                                      f"takes at most {self.s.batch_max_requests}"))
        if errors:
            await self.transition(("validating",), "failed", "failed_at", errors=json.dumps(errors[:MAX_ERRORS]))
        else:
            await self.transition(("validating",), "in_progress", "in_progress_at", total=len(seen), lines=n)

    async def progress(self) -> None:
        await self.load_inflight()
        nlines, expires = int(self.h["lines"]), int(self.h["expires_at"])
        while not self.lost:
            status, nxt = await self.r.hmget(self.keys.batch(self.bid), "status", "next")
            if status != b"in_progress":
                return
            if time.time() >= expires:
                await self.wind_down("expired")
                return
            nxt = int(nxt)
            room = self.s.batch_feed_limit - self.queued()
            # Refill in batches of an eighth of the bound (one LRANGE and one pipeline each), not a
            # line at a time: the queue still holds at least 7/8 of the bound.
            if nxt < nlines and room >= max(1, self.s.batch_feed_limit // 8):
                nxt = await self.top_up(nxt, nlines)
            if not self.inflight and nxt >= nlines:
                await self.transition(("in_progress",), "finalizing", "finalizing_at")
                return
            await self.collect(None)

    async def wind_down(self, final: str) -> None:
        """Cancel what is in flight, write off what did not run, end as ``final``."""
        code, message = ENDED[final]
        await self.load_inflight()
        pipe = self.r.pipeline(transaction=False)
        for _, readers in self.inflight.values():
            for x in readers:
                if not x.done:
                    pipe.xadd(self.keys.control, cancel_fields(x.request_id), maxlen=CONTROL_MAXLEN, approximate=True)
        await pipe.execute()
        deadline = time.monotonic() + CANCEL_GRACE_S
        while self.inflight and time.monotonic() < deadline and not self.lost:
            await self.collect(final)
        await self.write_lines([(i, "err", batch_error_line(self.bid, line, code, message))
                                for i, (line, _) in self.inflight.items()])
        if final == "expired":
            await self.write_off_unfed(code, message)
        await self.finalize(final, ("in_progress", "cancelling", "finalizing"))

    async def finalize(self, final: str, statuses: tuple[str, ...]) -> None:
        """Make the output and error files (those with lines), then move to ``final``."""
        h = decode_hash(await self.r.hgetall(self.keys.batch(self.bid)))
        pipe = self.r.pipeline(transaction=True)
        now = int(time.time())
        for kind, name in (("out", "output"), ("err", "error")):
            if int(h.get(f"{kind}_lines") or 0):
                fid = h["out_file" if kind == "out" else "err_file"]
                pipe.hset(self.keys.file(fid), mapping={
                    "id": fid, "filename": f"{self.bid}_{name}.jsonl", "purpose": "batch_output",
                    "bytes": h[f"{kind}_bytes"], "created_at": str(now), "expires_at": str(now + self.s.batch_ttl_s),
                    "eol": "1"})
                pipe.expire(self.keys.file(fid), self.s.batch_ttl_s)
                pipe.expire(self.keys.file_lines(fid), self.s.batch_ttl_s)
                pipe.zadd(self.keys.files, {fid: now})
        await pipe.execute()
        await self.transition(statuses, final, f"{final}_at")
        log.info("batch %s %s: %s completed, %s failed of %s", self.bid, final, h.get("completed"), h.get("failed"),
                 h.get("total"))

    # ------------------------------------------------------------ feeding
    def queued(self) -> int:
        return sum(len(readers) for _, readers in self.inflight.values())

    async def load_inflight(self) -> None:
        """Readers for the lines in flight, as Redis has them (after a takeover: the other runner's)."""
        if self.loaded:
            return
        held = {int(k): int(v) for k, v in (await self.r.hgetall(self.keys.batch_inflight(self.bid))).items()}
        for i, n in held.items():
            line, _ = check_line(await self.r.lindex(self.input_key, i), self.h["endpoint"])
            line.index = i
            self.inflight[i] = (line, self.readers(i, n))
        self.loaded = True
        if held:
            log.info("batch %s: carrying on with %d lines in flight", self.bid, len(held))

    def readers(self, index: int, n: int) -> list[ResultReader]:
        return [ResultReader(rid, self.keys.result(rid)) for rid in request_ids(self.bid, index, n)]

    async def top_up(self, nxt: int, nlines: int) -> int:
        """Feed lines from ``nxt`` while the batch has room in the queue; the next line left to feed."""
        room = self.s.batch_feed_limit - self.queued()
        raws = await self.r.lrange(self.input_key, nxt, nxt + room - 1)
        if not raws:  # the runner fails the batch with this, rather than wait on lines that are gone
            raise RuntimeError(f"the input file {self.h['input_file_id']} is gone")
        batch: list[Prepared | None] = []
        for k, raw in enumerate(raws):
            line, _ = check_line(raw, self.h["endpoint"])
            if line is None:
                batch.append(None)  # a blank line
                continue
            line.index = nxt + k
            p = prepare_line(line, batch_id=self.bid, chat=self.chat, priority=self.h["priority"],
                             model_name=self.model_name, prepare=self.prepare)
            if len(p.requests) > room and (self.inflight or any(x and x.requests for x in batch)):
                break  # it waits for room (a line of more prompts than the bound goes alone)
            batch.append(p)
            room -= len(p.requests)
            if room <= 0:
                break
        pipe = self.r.pipeline(transaction=False)
        for k, p in enumerate(batch):
            kind = "skip" if p is None else ("err" if p.error_line is not None else "req")
            payload = "" if p is None else (p.error_line if kind == "err" else json.dumps(
                [[x for kv in fields.items() for x in kv] for _, _, fields in p.requests]))
            await self.feed_call(pipe, nxt + k, kind, payload)
        replies = await pipe.execute()
        assert len(replies) == len(batch)
        for k, (p, reply) in enumerate(zip(batch, replies)):
            if self.check(reply) != scripts.OK:
                return nxt + k  # the status changed (a cancel) or another runner moved on: look again
            if p is not None and p.requests:
                self.inflight[nxt + k] = (p.line, self.readers(nxt + k, len(p.requests)))
        return nxt + len(batch)

    async def feed_call(self, pipe: Any, index: int, kind: str, payload: str,
                  statuses: tuple[str, ...] = ("in_progress",)) -> None:
        await scripts.run(self.r, scripts.FEED,
                    [self.keys.batch_lease(self.bid), self.keys.batch(self.bid), self.keys.batch_inflight(self.bid),
                     self.lines_key("err"), self.keys.requests(self.h["priority"])],
                    [self.token, index, kind, self.s.batch_ttl_s, ",".join(statuses), payload], client=pipe)

    async def write_off_unfed(self, code: str, message: str) -> None:
        """Error lines for the lines never fed (an expired batch accounts for every request)."""
        nxt = int(await self.r.hget(self.keys.batch(self.bid), "next"))
        nlines = int(self.h["lines"])
        while nxt < nlines and not self.lost:
            raws = await self.r.lrange(self.input_key, nxt, nxt + CHUNK - 1)
            pipe = self.r.pipeline(transaction=False)
            for k, raw in enumerate(raws):
                line, _ = check_line(raw, self.h["endpoint"])
                if line is None:
                    await self.feed_call(pipe, nxt + k, "skip", "", ("in_progress", "cancelling"))
                else:
                    line.index = nxt + k
                    await self.feed_call(pipe, nxt + k, "err", batch_error_line(self.bid, line, code, message),
                                   ("in_progress", "cancelling"))
            for reply in await pipe.execute():
                if self.check(reply) != scripts.OK:
                    return
            nxt += len(raws)

    # ------------------------------------------------------------ collecting
    async def collect(self, ending: str | None) -> None:
        """Read every in-flight result stream once (blocking briefly); write the lines that ended."""
        by_key = {x.key: x for _, readers in self.inflight.values() for x in readers if not x.done}
        if by_key:
            wait = self.last_read + READ_INTERVAL_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.last_read = time.monotonic()
            reply = await self.r.xread({k: x.last_id for k, x in by_key.items()}, count=READ_COUNT,
                                       block=READ_BLOCK_MS)
            for k, entries in (reply.items() if isinstance(reply, dict) else reply or []):
                name = k.decode() if isinstance(k, bytes) else k
                if name in by_key:
                    by_key[name].feed(stream_entries({k: entries}, name))
        else:
            await asyncio.sleep(0.05)  # nothing to read (lines about to be written): no busy loop
        ended = []
        for i, (line, readers) in self.inflight.items():
            if all(x.done for x in readers):
                ended.append((i, *self.output(line, readers, ending)))
        await self.write_lines(ended)

    def output(self, line: Line, readers: list[ResultReader], ending: str | None) -> tuple[str, str]:
        ends: list[Any] = []
        for x in readers:
            try:
                ends.append(x.result())
            except GenerationError as e:
                ends.append(e)
        if ending is not None and any(getattr(e, "finish_reason", None) == "cancelled" for e in ends):
            return "err", batch_error_line(self.bid, line, *ENDED[ending])
        ok, text = response_line(self.bid, line, ends, chat=self.chat, model_name=self.model_name,
                                 usage=self.usage)
        return ("out" if ok else "err"), text

    async def write_lines(self, ended: list[tuple[int, str, str]]) -> None:
        if not ended:
            return
        pipe = self.r.pipeline(transaction=False)
        for i, kind, text in ended:
            _, readers = self.inflight[i]
            await scripts.run(self.r, scripts.FINISH,
                        [self.keys.batch_lease(self.bid), self.keys.batch(self.bid),
                         self.keys.batch_inflight(self.bid), self.lines_key(kind), *(x.key for x in readers)],
                        [self.token, i, kind, text, self.s.batch_ttl_s], client=pipe)
        replies = await pipe.execute()
        for (i, _, _), reply in zip(ended, replies):
            self.check(reply)
            self.inflight.pop(i, None)
