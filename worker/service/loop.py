"""The worker's Redis loop: pull requests under the engine's budget, step, publish results.

One iteration of :meth:`Service.run_once`:

1. on timers: heartbeat, refresh of in-flight entries, claims of dead workers' entries,
   the sweeps of unread entries (first, so a starting worker's heartbeat is out before its
   first read, which blocks up to a second when there is no work);
2. read control messages (cancellations) and apply them;
3. pull new requests, most urgent level first, only as many as the engine can admit soon
   (free sequence slots and free cache tokens); block on the streams only when idle;
4. one ``engine.step()``;
5. publish every output of the step in one MULTI/EXEC round trip: a token entry per
   request that produced tokens, a final ``done``/``error`` entry, and for finished
   requests the XACK + XDEL of their request entry (so an entry is acknowledged only
   together with its final result). Where a core is left over from the engine's math
   threads it is written by a thread of its own, on a client of its own, while the engine
   runs the next step, and the next flush waits for it; where the math threads take every
   core, between the steps (``write_behind``, worker/tuning.py's ``spare_core``).

If Redis goes away the engine keeps running: outputs wait in the outbox and are published,
in order, once Redis answers again. The service knows no tensors; the engine knows no Redis.
The protocol it serves is docs/protocol.md.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable

import redis

from common.keys import Keys
from common.redis import connect, redact_url
from common.settings import Settings
from worker.engine import Engine
from worker.outputs import RequestOutput
from worker.service import answers, control, heartbeat, intake, recovery, sweeps
from worker.service.connection import REDIS_TROUBLE, Connection, ensure_groups
from worker.service.control import Control
from worker.service.doorbell import Doorbell
from worker.service.heartbeat import TokenRate
from worker.service.inflight import InFlight
from worker.service.outbox import Outbox, Wire
from worker.service.scripts import Scripts

log = logging.getLogger("tokenq.service")
UNKNOWN_SWEEP_S = 5.0
# While the engine is busy, control and the request streams are read at most this often
# (each read is a round trip or more): a small model's steps take a few ms, and reading
# before every one of them cost it more than the steps' own Redis writes.
POLL_S = 0.005


class Service:
    def __init__(self, engine: Engine, settings: Settings, *, tokenizer=None, model_name: str = "", device: str = "",
                 write_behind: bool = True):
        self.engine = engine
        self.write_behind = write_behind  # a step's writes in the writer thread during the next step
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.s = settings
        self.keys = Keys(settings.prefix, settings.request_shards)
        self.name = settings.name or f"{socket.gethostname()}-{os.getpid()}"
        self.model_name, self.device = model_name, device
        self.r = connect(settings.redis_url, socket_timeout=max(5.0, settings.heartbeat_s * 2))
        self.writer_r = connect(settings.redis_url, socket_timeout=max(5.0, settings.heartbeat_s * 2))
        self.scripts = Scripts(self.r)
        self.doorbell = Doorbell(self.keys.request_streams + [self.keys.control],
                                 None if self.scripts.cluster else lambda: connect(settings.redis_url, socket_timeout=5.0))
        self.wire = Wire(self.scripts, self.keys, self.name, settings.result_maxlen, settings.result_ttl_s,
                         settings.replica_wait_ms)
        self.conn = Connection()
        self.inflight: dict[str, InFlight] = {}
        self.outbox = Outbox()
        self.control = Control()
        self.rate = TokenRate()
        self.pending: dict[tuple[str, int], list[RequestOutput]] = {}  # per (request, choice): outputs not published yet (answers.record)
        self.published = 0.0  # time.monotonic() of the last publication
        self.stopping = False
        self.stop_deadline = 0.0
        self.due: dict[str, float] = dict.fromkeys(("poll", "heartbeat", "claim", "unknown", "expiry"), 0.0)
        self.expiry_cursor: dict[str, str] = {}  # per stream: where the next sweep of unread entries starts
        self.shard_turn = 0  # the request shard each level's next read starts at
        self.avg_request_tokens = 256.0  # running estimate used to size pulls
        self.started = time.time()
        self.counts = {"served": 0, "errors": 0, "claimed": 0, "dead": 0}
        self.on_finished: Callable[[InFlight | None, RequestOutput | None, str], None] | None = None  # per final entry
        self.on_step: Callable[[list[RequestOutput]], None] | None = None  # after each engine step

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
        log.info("event=start worker=%s prefix=%s redis=%s writes=%s", self.name, self.s.prefix,
                 redact_url(self.s.redis_url), "behind" if self.write_behind else "between_steps")
        self._connect()
        while not (self.stopping and (not self.engine.has_unfinished() or time.monotonic() >= self.stop_deadline)):
            self.run_once()
        self._release_all()
        try:
            self.r.delete(self.keys.worker(self.name))
        except REDIS_TROUBLE:
            pass
        self.doorbell.stop()
        log.info("event=stopped served=%d", self.counts["served"])
        return 0

    # ------------------------------------------------------------------ the loop

    def run_once(self) -> None:
        now = time.monotonic()
        if self.conn.due(now):
            self._connect()
        if self.conn.connected:
            self._talk(now)
        if self.engine.has_unfinished():
            try:
                outputs = self.engine.step()
            except Exception:  # a bug or OOM in the model: retry what is in flight, keep serving
                log.exception("event=step_failed inflight=%d", len(self.inflight))
                outputs = self._release_all()
            answers.record(self, outputs)
            if self.on_step is not None:
                self.on_step(outputs)
            self._flush(behind=self.write_behind)
        elif not self.conn.connected:
            time.sleep(self.conn.wait_s())
        elif self.outbox:
            self._flush()

    def _talk(self, now: float) -> None:
        """Everything the loop reads from Redis: the timers first, then control and new entries."""
        try:
            self._timers(now)
            if now >= self.due["poll"] or not self.engine.has_unfinished():
                self.due["poll"] = now + POLL_S
                control.read(self)
                if not self.stopping:
                    intake.pull(self)
        except redis.ResponseError as e:
            if "NOGROUP" in str(e):  # Redis lost our groups: recreate them, say what was lost
                self.conn.reset()
                self._connect()
            else:  # Redis refused a command (OOM, READONLY, BUSY script...): back off, keep the engine going
                log.warning("event=redis_error error=%r", e)
                self._down(e)
        except REDIS_TROUBLE as e:
            self._down(e)

    def _timers(self, now: float) -> None:
        due = self.due
        if now >= due["heartbeat"] or not self.outbox.leased():  # a lapsed lease: woken from a freeze
            due["heartbeat"] = now + self.s.heartbeat_s
            heartbeat.beat(self)
            recovery.refresh(self)
        if now >= due["claim"] and not self.stopping:
            due["claim"] = now + max(0.5, min(self.s.claim_idle_s / 4, 5.0))
            recovery.claim(self)
        if now >= due["unknown"]:
            due["unknown"] = now + UNKNOWN_SWEEP_S
            sweeps.unknown_streams(self)
        if now >= due["expiry"] and not self.stopping:
            due["expiry"] = now + sweeps.SWEEP_S
            sweeps.expire_unread(self)

    # ------------------------------------------------------------------ Redis up and down

    def _connect(self) -> bool:
        """Make sure the groups exist and resume what our consumer still holds; False if Redis is down."""
        try:
            created = ensure_groups(self.r, self.keys)
            if created and self.conn.ever_connected:
                recovery.data_lost(self, created)
            self.control.start_from_recent()
            if not self.conn.connected:
                self.outbox.settle()  # a write that failed before Redis went down is re-sent whole
                # What was answered during the outage goes out before the resume: a request that
                # finished meanwhile is acknowledged by its final entry, not served twice, and one
                # still running resumes after everything it published. First the refresh: what
                # another worker claimed during a long outage is dropped, not written.
                recovery.refresh(self)
                self.outbox.flush(self.writer_r, self.wire)
                recovery.resume_own(self)
                self.doorbell.ring_all()
                self.doorbell.start()
            self.conn.up(len(self.outbox))
            return True
        except REDIS_TROUBLE as e:  # down, or refusing (OOM, READONLY, MISCONF): wait and retry, never crash
            self._down(e)
            return False

    def _down(self, e: Exception) -> None:
        self.conn.down(e, len(self.outbox))

    def _flush(self, behind: bool = False) -> None:
        """Write the outbox (``behind``: in the writer thread, while the engine steps)."""
        if not self.outbox or not self.conn.connected:
            return
        try:
            if behind:
                self.outbox.write_behind(self.writer_r, self.wire)
            else:
                self.outbox.flush(self.writer_r, self.wire)
        except REDIS_TROUBLE as e:  # nothing was written: the outbox keeps it all for the next try
            self._down(e)

    def _release_all(self) -> list[RequestOutput]:
        """Drop everything from the engine and hand the entries back (after a failed step, or
        on shutdown), so another worker (or this one) resumes them.

        They are marked long idle, so the next claim pass takes them again, counting one more
        delivery; an entry that keeps failing reaches ``max_attempts`` and is dead-lettered.
        Tokens already published are kept (resume).
        """
        answers.publish(self)  # what the clients have not seen yet, so a resume starts after it
        left = list(self.inflight.values())
        for f in left:
            self.engine.abort(f.req.id)
        self.engine.step()  # collect the aborts; they are not final for the clients
        self.inflight.clear()
        self._flush()
        recovery.release(self, left)
        self.due["claim"] = 0.0
        return []

    # ------------------------------------------------------------------ hooks

    def finished(self, f: InFlight | None, output: RequestOutput | None, reason: str) -> None:
        """A final entry was queued (``f`` None: for an entry that never ran)."""
        if self.on_finished is not None:
            self.on_finished(f, output, reason)

    @property
    def connected(self) -> bool:
        return self.conn.connected
