"""The worker's Redis loop: pull requests under the engine's budget, step, publish results.

One iteration of :meth:`Service.run_once`:

1. read control messages (cancellations) and apply them;
2. pull new requests, most urgent level first, only as many as the engine can admit soon
   (free sequence slots and free cache tokens); block on the streams only when idle;
3. one ``engine.step()``;
4. publish every output of the step in one MULTI/EXEC round trip: a token entry per
   request that produced tokens, a final ``done``/``error`` entry, and for finished
   requests the XACK + XDEL of their request entry (so an entry is acknowledged only
   together with its final result);
5. on timers: heartbeat hash, refresh of in-flight entries (so they never look idle),
   claiming entries of dead workers (XAUTOCLAIM), dead-lettering poison entries, and
   answering entries whose ``timeout_s`` passed (or that were cancelled) while still unread.

Ownership: a worker publishes a request's final entry (and acknowledges it) only while its
consumer still owns the entry (a Lua script checks and publishes atomically), and its
refresh never takes back an entry another worker claimed: a worker frozen past
``claim_idle_s`` (GC pause, SIGSTOP, a stalled VM) drops the requests it lost, so every
request gets exactly one final entry. Unseeded sampling is seeded from the entry id, so a
request resumed elsewhere continues the same random stream.

Aging (no starvation): ``high`` is strict. Between ``normal`` and ``low`` the worker pulls
by *virtual arrival time*, the entry's time plus ``aging_s`` per level below ``normal``:
a ``low`` entry that has waited ``aging_s`` ranks with ``normal`` entries arriving then,
and once it has waited that long it runs at ``normal`` priority in the engine (so
``normal`` work does not preempt it). Aging never lifts anything into ``high``.

If Redis goes away the engine keeps running: outputs wait in an outbox and are published,
in order, once Redis answers again. The service knows no tensors; the engine knows no Redis.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import redis

from common.errors import INTERNAL, INVALID_REQUEST, ProtocolError
from common.keys import LEVELS, PRIORITIES, Keys
from common.protocol import (
    Request,
    decode_result,
    done_entry,
    error_entry,
    parse_control,
    parse_request,
    reply_key_for,
    token_entry,
)
from common.redis import connect, xautoclaim_entries
from common.settings import Settings
from worker.engine import Engine, RequestOutput

log = logging.getLogger("tokenq.service")

_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
SWEEP_S = 1.0  # how often (one worker at a time) unread entries are checked for expired deadlines
SWEEP_COUNT = 500  # unread entries looked at per stream per sweep (a cursor walks deeper backlogs)


# ---------------------------------------------------------------------------- Lua scripts
# Each runs atomically in Redis, so no other worker can act on the same entry in between.

# Publish a request's final entry, XACK and XDEL its request entry, only while this worker
# still owns the entry, or when nobody does and the result stream has no final entry yet
# (Redis lost the entry: the request still gets its answer). A worker frozen past
# claim_idle_s whose entry another worker claimed (and may have finished) publishes no
# second final entry; nor does a transaction re-sent after its reply was lost.
# KEYS: request stream, result stream. ARGV: group, entry id, consumer, maxlen, ttl, fields...
_FINALIZE = """
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if ok and p[1] then
  if p[1][2] ~= ARGV[3] then return 0 end
else
  for _, e in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
    local f = e[2]
    for i = 1, #f, 2 do
      if f[i] == 'type' and (f[i + 1] == 'done' or f[i + 1] == 'error') then return 0 end
    end
  end
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[2], ARGV[5])
if ok then redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) end
pcall(redis.call, 'XDEL', KEYS[1], ARGV[2])
return 1
"""

# Append one entry to each of several result streams and refresh their TTL: a whole step's
# token entries in one command. KEYS: result streams. ARGV: maxlen, ttl, then per stream: the
# number of field/value strings, the strings.
_PUBLISH_TOKENS = """
local i = 3
for _, key in ipairs(KEYS) do
  local n = tonumber(ARGV[i])
  redis.call('XADD', key, 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, i + 1, i + n))
  redis.call('EXPIRE', key, ARGV[2])
  i = i + 1 + n
end
return #KEYS
"""

# Reset the idle time of entries this consumer owns (IDLE ARGV[3] ms when given: a release),
# never taking one another consumer owns. Returns {ids owned by someone else, ids nobody owns}.
# KEYS: request stream. ARGV: group, consumer, idle ms or '', entry ids...
_TOUCH = """
local lost, gone = {}, {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if ok and p[1] then
    if p[1][2] ~= ARGV[2] then
      lost[#lost + 1] = id
    elseif ARGV[3] == '' then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'IDLE', ARGV[3], 'JUSTID')
    end
  else
    gone[#gone + 1] = id
  end
end
return {lost, gone}
"""

_LAST_DELIVERED = """
local function last_delivered(key, group)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', key)
  if not ok then return nil end
  for _, g in ipairs(groups) do
    local name, last
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then last = g[j + 1] end
    end
    if name == group then return last end
  end
  return nil
end
"""

# The ids of the first ARGV[2] entries no worker has read yet, per stream (for aging).
# KEYS: request streams. ARGV: group, count.
_UNREAD = _LAST_DELIVERED + """
local out = {}
for i, key in ipairs(KEYS) do
  local last = last_delivered(key, ARGV[1])
  local ids = {}
  if last then
    for _, e in ipairs(redis.call('XRANGE', key, '(' .. last, '+', 'COUNT', ARGV[2])) do ids[#ids + 1] = e[1] end
  end
  out[i] = ids
end
return out
"""

# Answer entries that expired (or were cancelled) while unread: XDEL each one that no worker
# has read (its id is past the group's last-delivered id) and publish its final entry. One
# whose result stream exists already (a reused id) is left for the pull path to refuse.
# KEYS: request stream, then one result stream per entry. ARGV: group, maxlen, ttl, then per
# entry: its id, the number of field values, the field values. Returns the ids answered.
_EXPIRE_UNREAD = _LAST_DELIVERED + """
local function after(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if not am or not bm then return false end
  if #am ~= #bm then return #am > #bm end
  if am ~= bm then return am > bm end
  if #as ~= #bs then return #as > #bs end
  return as > bs
end
local last = last_delivered(KEYS[1], ARGV[1])
if not last then return {} end
local done, i, k = {}, 4, 2
while i <= #ARGV do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  if after(id, last) and redis.call('EXISTS', KEYS[k]) == 0 and redis.call('XDEL', KEYS[1], id) == 1 then
    redis.call('XADD', KEYS[k], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, i + 2, i + 1 + n))
    redis.call('EXPIRE', KEYS[k], ARGV[3])
    done[#done + 1] = id
  end
  i = i + 2 + n
  k = k + 1
end
return done
"""


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


@dataclass
class Outbox:
    """Commands waiting to be published in order (kept across Redis outages)."""

    ops: list[tuple[str, tuple, dict]] = field(default_factory=list)

    def add(self, op: str, *args: Any, **kwargs: Any) -> None:
        self.ops.append((op, args, kwargs))


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def entry_time(entry_id: str) -> float:
    """Wall time (s) at which Redis appended an entry, from its id."""
    try:
        return int(entry_id.split("-", 1)[0]) / 1000.0
    except ValueError:
        return time.time()


class Service:
    def __init__(self, engine: Engine, settings: Settings, *, tokenizer=None, model_name: str = "", device: str = ""):
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.s = settings
        self.keys = Keys(settings.prefix)
        self.name = settings.name or f"{socket.gethostname()}-{os.getpid()}"
        self.model_name = model_name
        self.device = device
        self.r = connect(settings.redis_url, socket_timeout=max(5.0, settings.heartbeat_s * 2))
        self.inflight: dict[str, InFlight] = {}
        self.outbox = Outbox()
        self.cancelled: OrderedDict[str, float] = OrderedDict()  # ids cancelled before we pulled them
        self.control_last = "$"
        self.stopping = False
        self.stop_deadline = 0.0
        self.connected = False
        self.retry_at = 0.0
        self.backoff = 0.1
        self.next_heartbeat = 0.0
        self.next_claim = 0.0
        self.next_sweep = 0.0
        self.next_expiry = 0.0
        self.expiry_cursor: dict[str, str] = {}  # per stream: where the next sweep of unread entries starts
        self.ever_connected = False
        self.avg_request_tokens = 256.0  # running estimate used to size pulls
        self.tokens_window: list[tuple[float, int]] = []
        self.started = time.time()
        self.counts = {"served": 0, "errors": 0, "claimed": 0, "dead": 0}
        self.on_finished = None  # optional hook(inflight | None, output | None, reason) per final entry, for metrics
        self.on_step = None  # optional hook(outputs) after each engine step, for metrics

    # ------------------------------------------------------------------ lifecycle

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop())
        signal.signal(signal.SIGINT, lambda *_: self.request_stop())

    def request_stop(self) -> None:
        if not self.stopping:
            log.info("event=stopping grace_s=%.1f running=%d", self.s.grace_s, len(self.inflight))
            self.stopping = True
            self.stop_deadline = time.monotonic() + self.s.grace_s

    def run(self) -> int:
        log.info("event=start worker=%s prefix=%s redis=%s", self.name, self.s.prefix, _redact(self.s.redis_url))
        self._connect()
        while True:
            if self.stopping and (not self.engine.has_unfinished() or time.monotonic() >= self.stop_deadline):
                break
            self.run_once()
        self._shutdown()
        return 0

    def _connect(self) -> bool:
        """Make sure the groups exist and resume what our consumer still holds; False if Redis is down."""
        try:
            self.r.ping()
            created = []
            for stream in self.keys.request_streams:
                try:
                    self.r.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
                    created.append(stream)
                except redis.ResponseError as e:
                    if "BUSYGROUP" not in str(e):
                        raise
            if created and self.ever_connected:
                self._data_lost(created)
            if self.control_last == "$":
                # Cancels sent in the last 10 minutes still apply to entries we may pull.
                self.control_last = f"{int(time.time() * 1000) - 600_000}-0"
            if not self.connected:
                self._resume_own_pending()
                if self.retry_at:
                    log.warning("event=redis_up buffered=%d", len(self.outbox.ops))
            self.connected = True
            self.ever_connected = True
            self.backoff = 0.1
            return True
        except _REDIS_DOWN as e:
            self._redis_down(e)
            return False
        except redis.ResponseError as e:  # e.g. OOM, READONLY, MISCONF: wait and retry, never crash
            self._redis_down(e)
            return False

    def _data_lost(self, streams: list[str]) -> None:
        """Redis came back without our consumer groups (restarted without persistence, or the
        keys were deleted): say what is lost. Requests running here continue and are answered."""
        ids = sorted(self.inflight)
        log.error("event=redis_data_lost streams=%s inflight=%d inflight_ids=%s lost='entries waiting in Redis, "
                  "other workers' in-flight entries and result entries written before the loss'; "
                  "note='groups recreated; in-flight requests here continue'",
                  ",".join(streams), len(ids), ",".join(ids[:50]))
        self.counts["data_lost"] = self.counts.get("data_lost", 0) + 1

    def _redis_down(self, e: Exception) -> None:
        if self.connected:
            log.warning("event=redis_down error=%r buffered=%d", e, len(self.outbox.ops))
        self.connected = False
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, 1.0)

    def _shutdown(self) -> None:
        """Release what is still running so other workers resume it, then say goodbye."""
        left = list(self.inflight.values())
        for f in left:
            self.engine.abort(f.req.id)
        self.engine.step()  # drop the aborted outputs: they are not final for the clients
        self.inflight.clear()
        self._flush()
        self._release(left)
        try:
            self.r.delete(self.keys.worker(self.name))
        except _REDIS_DOWN:
            pass
        log.info("event=stopped served=%d", self.counts["served"])

    # ------------------------------------------------------------------ the loop

    def run_once(self) -> None:
        now = time.monotonic()
        if not self.connected and now >= self.retry_at:
            self._connect()
        if self.connected:
            try:
                self._read_control()
                if not self.stopping:
                    self._pull()
                self._timers(now)
            except _REDIS_DOWN as e:
                self._redis_down(e)
            except redis.ResponseError as e:
                if "NOGROUP" in str(e):
                    self._regroup()
                else:  # Redis refused a command (OOM, READONLY, BUSY script...): back off, keep the engine going
                    log.warning("event=redis_error error=%r", e)
                    self._redis_down(e)
        if self.engine.has_unfinished():
            try:
                outputs = self.engine.step()
            except Exception:  # a bug or OOM in the model: retry what is in flight, keep serving
                log.exception("event=step_failed inflight=%d", len(self.inflight))
                outputs = self._release_all()
            self._record(outputs)
            if self.on_step is not None:
                self.on_step(outputs)
            self._flush()
        elif not self.connected:
            time.sleep(min(0.5, max(0.0, self.retry_at - time.monotonic())))
        elif self.outbox.ops:
            self._flush()

    # ------------------------------------------------------------------ pulling

    def _pull(self) -> None:
        """Read new entries, most urgent first, no more than the engine can admit soon.

        When nothing can be read and the engine is idle, block on all streams for one entry
        each (COUNT is per stream: a wake-up must not take a backlog).
        """
        eng = self.engine
        if self._pull_levels() == 0 and not eng.has_unfinished() and not self.outbox.ops:
            block_ms = int(min(self.s.heartbeat_s, 1.0) * 1000)
            reply = self.r.xreadgroup(self.keys.group, self.name, {s: ">" for s in self.keys.request_streams}, count=1, block=block_ms)
            self._take(reply)

    def _pull_levels(self) -> int:
        """One non-blocking pass: ``high`` first (strict), then ``normal`` and ``low`` (aged)."""
        eng = self.engine
        waiting = {s.priority for s in eng.scheduler.waiting}
        running = [s.priority for s in eng.scheduler.running]
        taken = 0

        def room(prio: int) -> int:
            if any(p <= prio for p in waiting):
                return 0  # we already hold work of this level that cannot start: leave the rest to others
            b = eng.budget()
            n = min(b.free_seqs, int(b.free_tokens // max(1.0, self.avg_request_tokens)))
            if n <= 0 and any(p > prio for p in running):
                n = 1  # the scheduler may evict less urgent work for it
            return n

        for prio, level in enumerate(LEVELS):
            n = room(prio)
            if n <= 0:
                return taken
            if prio == PRIORITIES["normal"] and self.s.aging_s > 0:
                plan = self._aging_plan(n)
                for stream, count in plan.items():
                    taken += self._read(stream, count)
                if plan.get(self.keys.requests("low")):
                    return taken  # the low stream had its turn in this pass
                continue
            taken += self._read(self.keys.requests(level), n)
        return taken

    def _read(self, stream: str, count: int) -> int:
        if count <= 0:
            return 0
        reply = self.r.xreadgroup(self.keys.group, self.name, {stream: ">"}, count=count)
        self._take(reply)
        return sum(len(entries) for _, entries in reply or [])

    def _aging_plan(self, n: int) -> dict[str, int]:
        """How many of the next ``n`` pulls go to ``normal`` and to ``low``, by virtual arrival
        time (entry time + aging_s per level below normal), oldest first."""
        levels = LEVELS[PRIORITIES["normal"]:]
        streams = [self.keys.requests(level) for level in levels]
        unread = self.r.eval(_UNREAD, len(streams), *streams, self.keys.group, n)
        ranked = []
        for i, ids in enumerate(unread or []):
            for entry_id in ids:
                ranked.append((entry_time(_s(entry_id)) + i * self.s.aging_s, i))
        ranked.sort()
        plan = dict.fromkeys(streams, 0)
        for _, i in ranked[:n]:
            plan[streams[i]] += 1
        return plan

    def _effective_priority(self, req: Request, f: InFlight) -> int:
        """The engine priority: the level's, lifted one level per aging_s waited, never into high."""
        prio = req.priority
        if self.s.aging_s > 0 and prio > PRIORITIES["normal"]:
            waited = time.time() - f.enqueued_wall
            prio = max(PRIORITIES["normal"], prio - int(waited // self.s.aging_s))
            if prio != req.priority:
                log.debug("event=aged id=%s waited_s=%.1f priority=%d", req.id, waited, prio)
        return prio

    def _take(self, reply, claimed: bool = False) -> None:
        for stream, entries in reply or []:
            stream = _s(stream)
            for entry_id, fields in entries:
                if fields is None:  # deleted while pending
                    self.r.xack(stream, self.keys.group, entry_id)
                    continue
                self._accept(stream, _s(entry_id), fields, claimed)

    def _accept(self, stream: str, entry_id: str, fields: dict, resume: bool) -> None:
        level = self.keys.level_of_stream(stream) or "normal"
        try:
            req = parse_request(fields, entry_id=entry_id, level=level, keys=self.keys, limits=self.s.limits)
        except ProtocolError as e:
            self._reject(stream, entry_id, e.request_id, e.reply_to, e.code, e.message, fields)
            return
        f = InFlight(req, stream, entry_id, entry_time(entry_id))
        if req.id in self.inflight or req.id in self.engine:
            if self.inflight.get(req.id, f).entry_id == entry_id:
                return  # already ours (claimed back after a slow step)
            self._reject(stream, entry_id, req.id, None, INVALID_REQUEST, f"request id {req.id!r} is already in flight", fields)
            return
        if not resume and self.r.exists(req.reply_to):
            # A second request with the same id (a producer's retried XADD, or a hostile one) would
            # write a second output and a second final entry into the first one's result stream.
            self._reject(stream, entry_id, req.id, None, INVALID_REQUEST,
                         f"request id {req.id!r} is already in use (its result stream exists): send a new id", fields)
            return
        if req.id in self.cancelled:
            self.inflight[req.id] = f
            self._finish(f, "cancelled", 0, 0, None, None)
            return
        try:
            ids = self._tokenize(req)
        except ValueError as e:
            self._reject(stream, entry_id, req.id, req.reply_to, INVALID_REQUEST, str(e), fields)
            return
        if req.params.seed is None:
            # The same seed on whichever worker serves (or resumes) it: a resumed sampled
            # request continues its random stream, and a re-send is an exact duplicate.
            digest = hashlib.blake2b(f"{stream}/{entry_id}".encode(), digest_size=8).digest()
            req.params.seed = int.from_bytes(digest, "big") & (2**63 - 1)
        generated: list[int] = []
        choices: dict[int, list[int]] = {}
        ended: dict[int, str] = {}
        if resume:
            choices, ended, final = self._published(req.reply_to)
            if final:
                self._ack(f)  # its final entry is out: the dead worker only missed the ack
                return
            generated = choices.get(0, [])
            f.resumed_tokens = sum(len(c) for c in choices.values())
        f.prompt_tokens = len(ids)
        if req.params.n == 1 and generated and len(generated) >= req.params.max_tokens:
            self.inflight[req.id] = f
            self._finish(f, "length", len(ids), len(generated), None, None)
            return
        remaining = None
        if req.timeout_s is not None:
            remaining = req.timeout_s - (time.time() - f.enqueued_wall)
            if remaining <= 0 and not generated:
                self.inflight[req.id] = f
                self._finish(f, "timeout", len(ids), 0, None, None)
                return
        try:
            many = [choices.get(i, []) for i in range(req.params.n)] if req.params.n > 1 else generated
            self.engine.add_request(req.id, ids, req.params, self._effective_priority(req, f),
                                    timeout_s=None if f.resumed_tokens else remaining, generated_ids=many, ended=ended)
        except ValueError as e:
            self._reject(stream, entry_id, req.id, req.reply_to, INVALID_REQUEST, str(e), fields)
            return
        self.inflight[req.id] = f
        est = len(ids) + (req.params.max_tokens if self.engine.config.admission_policy == "reserve" else 0)
        self.avg_request_tokens = 0.9 * self.avg_request_tokens + 0.1 * est
        log.debug("event=accepted id=%s level=%s prompt_tokens=%d resumed=%d", req.id, level, len(ids), len(generated))

    def _tokenize(self, req: Request) -> list[int]:
        if req.input_ids is not None:
            return req.input_ids
        if self.tokenizer is None:
            raise ValueError("this worker has no tokenizer: send input_ids")
        if req.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("the model has no chat template: send prompt or input_ids")
            try:
                ids = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as e:  # a template may raise on odd message sequences
                raise ValueError(f"chat template failed: {e}") from None
            return list(ids)
        assert req.prompt is not None
        return list(self.tokenizer(req.prompt).input_ids)

    def _published(self, reply_to: str) -> tuple[dict[int, list[int]], dict[int, str], bool]:
        """What a previous owner already published: per choice its tokens (contiguous from seq 0),
        the choices it ended (n > 1: index -> finish_reason), and whether the request finished."""
        by_seq: dict[int, dict[int, tuple[list[int], str | None]]] = {}
        final = False
        for _, fields in self.r.xrange(reply_to):
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

    # ------------------------------------------------------------------ control

    def _read_control(self) -> None:
        reply = self.r.xread({self.keys.control: self.control_last}, count=1000)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self.control_last = _s(entry_id)
                msg = parse_control(fields)
                if msg is None:
                    continue
                _, rid = msg
                if self.engine.abort(rid):
                    self.inflight[rid].cancelled = True
                    log.info("event=cancel id=%s", rid)
                else:
                    self.cancelled[rid] = time.monotonic()
        while self.cancelled and next(iter(self.cancelled.values())) < time.monotonic() - 600:
            self.cancelled.popitem(last=False)

    # ------------------------------------------------------------------ results

    def _record(self, outputs: list[RequestOutput]) -> None:
        """Queue one result entry per request per step (plus its final entry and ack).

        The step's token entries go out as one script call (one command instead of an XADD
        and an EXPIRE per request), queued before any final entry of the same step.
        """
        now = time.time()
        mono = time.monotonic()
        keys: list[str] = []
        args: list[Any] = [self.s.result_maxlen, self.s.result_ttl_s]
        finished = []
        for o in outputs:
            f = self.inflight.get(o.request_id)
            if f is None:
                continue
            if o.new_token_ids or o.text:
                entry = self._token_entry(f.req.params.n, o)
                keys.append(f.req.reply_to)
                args.append(2 * len(entry))
                for kv in entry.items():
                    args.extend(kv)
                self.tokens_window.append((mono, len(o.new_token_ids)))
            if o.finished:
                finished.append((f, o))
        if keys:
            self.outbox.add("eval", _PUBLISH_TOKENS, len(keys), *keys, *args)
        for f, o in finished:
            if o.error is not None:
                self._error(f, o.error[0], o.error[1])
                continue
            m = o.metrics
            wall = lambda t: None if t is None else now - (mono - t)  # noqa: E731
            started, first = (wall(m.first_scheduled_time), wall(m.first_token_time)) if m else (None, None)
            self._finish(f, o.finish_reason or "stop", o.num_prompt_tokens, o.num_output_tokens, started, first, o)

    def _token_entry(self, n: int, o: RequestOutput) -> dict[str, str]:
        text = self.engine.token_text
        wire = lambda lps: None if lps is None else [lp.wire(text) for lp in lps]  # noqa: E731
        return token_entry(o.seq, o.new_token_ids, o.text, index=o.index if n > 1 else None,
                           finish_reason=o.choice_finish_reason if n > 1 else None,
                           logprobs=wire(o.logprobs), prompt_logprobs=wire(o.prompt_logprobs))

    def _publish(self, key: str, entry: dict[str, str]) -> None:
        self.outbox.add("xadd", key, entry, maxlen=self.s.result_maxlen, approximate=True)
        self.outbox.add("expire", key, self.s.result_ttl_s)

    def _finish(self, f: InFlight, reason: str, prompt_tokens: int, completion_tokens: int,
                started: float | None, first: float | None, output: RequestOutput | None = None) -> None:
        now = time.time()
        self._publish_final(f, done_entry(
            f.req.id, reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            queue_s=max(0.0, (started or now) - f.enqueued_wall),
            ttft_s=None if first is None else max(0.0, first - f.enqueued_wall),
            total_s=max(0.0, now - f.enqueued_wall),
            finish_reasons=output.finish_reasons if output is not None and f.req.params.n > 1 else None,
        ))
        self.counts["served"] += 1
        log.info("event=done id=%s reason=%s prompt_tokens=%d completion_tokens=%d", f.req.id, reason, prompt_tokens, completion_tokens)
        if self.on_finished is not None:
            self.on_finished(f, output, reason)

    def _error(self, f: InFlight, code: str, message: str) -> None:
        self._publish_final(f, error_entry(f.req.id, code, message))
        self.counts["errors"] += 1
        log.warning("event=error id=%s code=%s message=%r", f.req.id, code, message)
        if self.on_finished is not None:
            self.on_finished(f, None, "error:" + code)

    def _publish_final(self, f: InFlight, entry: dict[str, str]) -> None:
        """Final entry + XACK + XDEL as one script, done only while the entry is still ours."""
        argv: list[Any] = [self.keys.group, f.entry_id, self.name, self.s.result_maxlen, self.s.result_ttl_s]
        for k, v in entry.items():
            argv += [k, v]
        self.outbox.add("eval", _FINALIZE, 2, f.stream, f.req.reply_to, *argv)
        self.inflight.pop(f.req.id, None)

    def _ack(self, f: InFlight) -> None:
        self.outbox.add("xack", f.stream, self.keys.group, f.entry_id)
        self.outbox.add("xdel", f.stream, f.entry_id)
        self.inflight.pop(f.req.id, None)

    def _reject(self, stream: str, entry_id: str, rid: str | None, reply_to: str | None, code: str, message: str, fields: dict) -> None:
        """A bad entry: error on its result stream (or the dead-letter stream), then acknowledged."""
        log.warning("event=rejected entry=%s id=%s code=%s message=%r", entry_id, rid, code, message)
        self.counts["errors"] += 1
        if reply_to is not None:
            self._publish(reply_to, error_entry(rid, code, message))
        else:
            self.outbox.add("xadd", self.keys.dead, {"id": rid or "", "stream": stream, "entry_id": entry_id, "code": code,
                                                   "message": message[:1000]}, maxlen=100_000, approximate=True)
        if self.on_finished is not None:
            self.on_finished(None, None, "error:" + code)
        self.outbox.add("xack", stream, self.keys.group, entry_id)
        self.outbox.add("xdel", stream, entry_id)

    def _release_all(self) -> list[RequestOutput]:
        """After a failed step: drop everything from the engine and hand the entries back.

        They are marked long idle, so the next claim pass (ours or another worker's) takes
        them again, counting one more delivery; an entry that keeps failing reaches
        ``max_attempts`` and is dead-lettered. Tokens already published are kept (resume).
        """
        left = list(self.inflight.values())
        for f in left:
            self.engine.abort(f.req.id)
        self.engine.step()  # collect the aborts; they are not final for the clients
        self.inflight.clear()
        self._flush()
        self._release(left)
        self.next_claim = 0.0
        return []

    def _release(self, left: list[InFlight]) -> None:
        if not left or not self.connected:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            for f in left:
                # Mark them long idle: the next XAUTOCLAIM of a live worker takes them at once.
                pipe.eval(_TOUCH, 1, f.stream, self.keys.group, self.name, 10**9, f.entry_id)
            pipe.execute()
            log.info("event=released count=%d", len(left))
        except _REDIS_DOWN as e:
            log.warning("event=release_failed error=%r", e)

    def _flush(self) -> None:
        if not self.outbox.ops or not self.connected:
            return
        ops = self.outbox.ops
        try:
            pipe = self.r.pipeline(transaction=True)
            for op, args, kwargs in ops:
                getattr(pipe, op)(*args, **kwargs)
            results = pipe.execute(raise_on_error=False)
        except _REDIS_DOWN as e:
            self._redis_down(e)
            return
        except redis.ResponseError as e:  # the whole transaction refused (e.g. OOM): keep it, retry later
            log.warning("event=publish_failed ops=%d error=%r", len(ops), e)
            self._redis_down(e)
            return
        self.outbox.ops = []
        for (op, args, _), res in zip(ops, results):
            if isinstance(res, Exception):
                log.warning("event=publish_failed op=%s key=%s error=%r", op, args[3] if op == "eval" else args[0], res)
            elif op == "eval" and args[0] is _FINALIZE and res == 0:
                log.warning("event=final_skipped entry=%s key=%s reason='entry owned by another worker or already answered'",
                            args[5], args[3])

    # ------------------------------------------------------------------ timers

    def _timers(self, now: float) -> None:
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + self.s.heartbeat_s
            self._heartbeat()
            self._refresh()
        if now >= self.next_claim and not self.stopping:
            self.next_claim = now + max(0.5, min(self.s.claim_idle_s / 4, 5.0))
            self._claim()
        if now >= self.next_sweep:
            self.next_sweep = now + 5.0
            self._sweep_unknown_streams()
        if now >= self.next_expiry and not self.stopping:
            self.next_expiry = now + SWEEP_S
            self._expire_unread()

    def _heartbeat(self) -> None:
        st = self.engine.stats
        mono = time.monotonic()
        self.tokens_window = [(t, n) for t, n in self.tokens_window if t > mono - 10.0]
        span = min(10.0, max(1e-3, mono - (self.tokens_window[0][0] if self.tokens_window else mono)))
        rate = sum(n for _, n in self.tokens_window) / span if self.tokens_window else 0.0
        key = self.keys.worker(self.name)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(key, mapping={
            "name": self.name, "model": self.model_name, "device": self.device, "pid": os.getpid(),
            "pages_total": st.num_total_pages, "pages_free": st.num_free_pages, "running": st.num_running,
            "waiting": st.num_waiting, "tokens_per_s": f"{rate:.1f}", "last_step_s": f"{st.last_step_s:.4f}",
            "last_step": f"{time.time():.3f}", "steps": st.num_steps, "preemptions": st.num_preemptions,
            "served": self.counts["served"], "started": f"{self.started:.3f}", "stopping": int(self.stopping),
        })
        pipe.expire(key, max(10, int(self.s.heartbeat_s * 5)))
        pipe.execute()

    def _refresh(self) -> None:
        """Reset the idle time of our in-flight entries, so no live request looks abandoned.

        Only entries our consumer still owns: one another worker claimed (we were frozen
        past claim_idle_s) is dropped here, not taken back, so two workers never serve it.
        """
        by_stream: dict[str, list[InFlight]] = {}
        for f in self.inflight.values():
            by_stream.setdefault(f.stream, []).append(f)
        if not by_stream:
            return
        pipe = self.r.pipeline(transaction=False)
        for stream, fs in by_stream.items():
            pipe.eval(_TOUCH, 1, stream, self.keys.group, self.name, "", *[f.entry_id for f in fs])
        for fs, (lost, gone) in zip(by_stream.values(), pipe.execute()):
            lost, gone = {_s(i) for i in lost}, {_s(i) for i in gone}
            for f in fs:
                if f.entry_id in lost or (f.entry_id in gone and self._published(f.req.reply_to)[1]):
                    self._drop(f, "claimed by another worker" if f.entry_id in lost else "answered by another worker")

    def _drop(self, f: InFlight, why: str) -> None:
        """Stop serving a request that is no longer ours; publish nothing more for it."""
        if self.inflight.get(f.req.id) is not f:
            return
        self.engine.abort(f.req.id)
        del self.inflight[f.req.id]
        self.outbox.ops = [kept for op in self.outbox.ops if (kept := _without(op, f.req.reply_to)) is not None]
        log.warning("event=lost_entry id=%s entry=%s why=%r", f.req.id, f.entry_id, why)

    def _claim(self) -> None:
        """Take over entries idle past claim_idle_s (their worker died), most urgent level first."""
        idle_ms = int(self.s.claim_idle_s * 1000)
        for level in LEVELS:
            b = self.engine.budget()
            n = min(b.free_seqs, 16)
            if n <= 0:
                return
            stream = self.keys.requests(level)
            reply = self.r.xautoclaim(stream, self.keys.group, self.name, idle_ms, "0-0", count=n)
            _, entries = xautoclaim_entries(reply)
            for entry_id, fields in entries:
                entry_id = _s(entry_id)
                delivered = self._times_delivered(stream, entry_id)
                self.counts["claimed"] += 1
                log.warning("event=claimed stream=%s entry=%s deliveries=%d", stream, entry_id, delivered)
                if delivered > self.s.max_attempts:
                    self._dead_letter(stream, entry_id, fields, delivered)
                else:
                    self._accept(stream, entry_id, fields, resume=True)

    def _times_delivered(self, stream: str, entry_id: str) -> int:
        info = self.r.xpending_range(stream, self.keys.group, min=entry_id, max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 1

    def _dead_letter(self, stream: str, entry_id: str, fields: dict, delivered: int) -> None:
        rid, reply = reply_key_for(fields, entry_id, self.keys)
        message = f"gave up after {delivered} deliveries (the worker serving it failed each time)"
        self.counts["dead"] += 1
        if self.on_finished is not None:
            self.on_finished(None, None, "error:" + INTERNAL)
        if reply is not None:
            self._publish(reply, error_entry(rid, INTERNAL, message))
        self.outbox.add("xadd", self.keys.dead, {"id": rid or "", "stream": stream, "entry_id": entry_id, "code": INTERNAL,
                                               "message": message}, maxlen=100_000, approximate=True)
        self.outbox.add("xack", stream, self.keys.group, entry_id)
        self.outbox.add("xdel", stream, entry_id)
        log.error("event=dead_letter stream=%s entry=%s id=%s deliveries=%d", stream, entry_id, rid, delivered)

    def _regroup(self) -> None:
        """Redis lost our groups (restarted without persistence): recreate them and say what was lost.

        Requests in flight here keep running and their results are still published; their
        entries are gone, so only entries never pulled by any worker were lost with Redis.
        """
        self.connected = False
        self.retry_at = 0.0
        self._connect()

    def _resume_own_pending(self) -> None:
        """Entries our consumer name still holds from an earlier run: resume them."""
        for stream in self.keys.request_streams:
            reply = self.r.xreadgroup(self.keys.group, self.name, {stream: "0"}, count=1000)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    entry_id = _s(entry_id)
                    if fields is None:
                        self.r.xack(stream, self.keys.group, entry_id)
                    elif not any(f.entry_id == entry_id for f in self.inflight.values()):
                        self._accept(stream, entry_id, fields, resume=True)

    def _sweep_unknown_streams(self) -> None:
        """Answer entries sent to a priority stream that does not exist (e.g. requests:urgent)."""
        for key in self.r.scan_iter(match=f"{self.keys.prefix}:requests:*", count=100, _type="stream"):
            key = _s(key)
            if self.keys.level_of_stream(key) is not None:
                continue
            for entry_id, fields in self.r.xrange(key, count=100):
                entry_id = _s(entry_id)
                if not self.r.xdel(key, entry_id):
                    continue  # another worker answered it
                rid, reply = reply_key_for(fields, entry_id, self.keys)
                message = f"unknown priority stream {key!r}: send to {', '.join(self.keys.request_streams)}"
                log.warning("event=rejected entry=%s id=%s code=%s message=%r", entry_id, rid, INVALID_REQUEST, message)
                self.counts["errors"] += 1
                if self.on_finished is not None:
                    self.on_finished(None, None, "error:" + INVALID_REQUEST)
                if reply is not None:
                    self._publish(reply, error_entry(rid, INVALID_REQUEST, message))
                else:
                    self.outbox.add("xadd", self.keys.dead, {"id": rid or "", "stream": key, "entry_id": entry_id,
                                                           "code": INVALID_REQUEST, "message": message}, maxlen=100_000, approximate=True)

    def _expire_unread(self) -> None:
        """Answer entries still unread in Redis whose ``timeout_s`` passed, or that were cancelled.

        A worker sees the deadline of an entry only once it pulls it; in a backlog an entry
        could wait far past its deadline. One worker at a time (a lock of SWEEP_S) walks the
        unread part of each stream; a script deletes each expired entry only if no worker has
        read it yet and publishes its final entry in the same step, so no worker can be
        serving it and it is answered exactly once.
        """
        if not self.r.set(f"{self.keys.prefix}:sweep", self.name, nx=True, px=int(SWEEP_S * 1000)):
            return
        now = time.time()
        for stream in self.keys.request_streams:
            try:
                groups = self.r.xinfo_groups(stream)
            except redis.ResponseError:
                continue
            last = next((_s(g["last-delivered-id"]) for g in groups if _s(g["name"]) == self.keys.group), None)
            if last is None:
                continue
            start = self.expiry_cursor.get(stream)
            if start is None or _id_key(start) < _id_key(last):
                start = last
            entries = self.r.xrange(stream, min="(" + start, count=SWEEP_COUNT)
            self.expiry_cursor[stream] = _s(entries[-1][0]) if len(entries) == SWEEP_COUNT else last
            keys: list[str] = []
            argv: list[Any] = [self.keys.group, self.s.result_maxlen, self.s.result_ttl_s]
            for entry_id, fields in entries:
                entry_id = _s(entry_id)
                final = self._unread_final(stream, entry_id, fields, now)
                if final is not None:
                    keys.append(final[0])
                    values = [x for kv in final[1].items() for x in kv]
                    argv += [entry_id, len(values), *values]
            if keys:
                done = self.r.eval(_EXPIRE_UNREAD, 1 + len(keys), stream, *keys, *argv)
                for entry_id in done or []:
                    self.counts["served"] += 1
                    log.info("event=expired_unread stream=%s entry=%s", stream, _s(entry_id))

    def _unread_final(self, stream: str, entry_id: str, fields: dict, now: float) -> tuple[str, dict[str, str]] | None:
        """(result key, final entry) for an unread entry that is past its deadline or cancelled."""
        has_timeout = b"timeout_s" in fields or "timeout_s" in fields or b"payload" in fields or "payload" in fields
        if not has_timeout and not self.cancelled:
            return None
        level = self.keys.level_of_stream(stream) or "normal"
        try:
            req = parse_request(fields, entry_id=entry_id, level=level, keys=self.keys, limits=self.s.limits)
        except ProtocolError:
            return None  # answered with an error when a worker pulls it
        waited = max(0.0, now - entry_time(entry_id))
        if req.id in self.cancelled:
            reason = "cancelled"
        elif req.timeout_s is not None and waited > req.timeout_s:
            reason = "timeout"
        else:
            return None
        return req.reply_to, done_entry(req.id, reason, prompt_tokens=0, completion_tokens=0, queue_s=waited,
                                        ttft_s=None, total_s=waited)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return (0, 0)


def _without(op: tuple[str, tuple, dict], key: str) -> tuple[str, tuple, dict] | None:
    """An outbox operation minus what it writes to ``key`` (the result stream of a request we
    dropped), or None when nothing is left. A step's token script carries many streams: only
    the dropped one's entry comes out of it."""
    name, args, kwargs = op
    if name in ("xadd", "expire"):
        return None if args and args[0] == key else op
    if name != "eval" or args[0] is not _PUBLISH_TOKENS or key not in args[2:2 + args[1]]:
        return op
    n = args[1]
    keys, head, per = args[2:2 + n], args[2 + n:4 + n], args[4 + n:]
    kept_keys, kept = [], []
    i = 0
    for k in keys:
        chunk = per[i:i + 1 + per[i]]
        i += len(chunk)
        if k != key:
            kept_keys.append(k)
            kept.extend(chunk)
    return ("eval", (_PUBLISH_TOKENS, len(kept_keys), *kept_keys, *head, *kept), kwargs) if kept_keys else None


def _redact(url: str) -> str:
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
