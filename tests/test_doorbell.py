"""The doorbell (worker/service/doorbell.py) on a real Redis: a stream is marked when an entry
lands on it, a busy worker reads the request streams only then, and nothing is missed."""

from __future__ import annotations

import gc
import json
import threading
import time

import redis
from service_helpers import final_entry, make_service, run_until

from common.keys import Keys
from common.local_redis import free_port
from worker.service.doorbell import Doorbell


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_rings_where_an_entry_lands_and_only_there(redis_url, prefix, r):
    a, b = f"{prefix}:a", f"{prefix}:b"
    r.xadd(a, {"x": "old"})  # before the thread: covered by the start's marks
    bell = Doorbell([a, b], lambda: redis.Redis.from_url(redis_url))
    assert bell.take(a) and bell.take(b)  # every stream starts rung
    bell.start()
    wait_for(lambda: bell.rung(a) and bell.rung(b))  # the thread's start rings all once more
    assert bell.take(a) and bell.take(b) and not bell.take(a) and not bell.take(b)
    for _ in range(50):  # a burst: one mark
        r.xadd(b, {"x": "new"})
    wait_for(lambda: bell.rung(b))
    time.sleep(0.2)
    assert bell.take(b) and not bell.rung(a)
    r.xadd(b, {"x": "after the burst"})  # the thread skipped past the burst, not past this
    wait_for(lambda: bell.rung(b))
    bell.ring(a)
    assert bell.take(a)
    thread = bell._thread
    bell.stop()
    wait_for(lambda: not thread.is_alive(), 5.0)


def test_everything_rung_while_redis_is_away():
    def start_and_check() -> threading.Thread:
        s = "nowhere:stream"
        bell = Doorbell([s], lambda: redis.Redis(port=free_port(), socket_connect_timeout=0.2))
        bell.start()
        for _ in range(3):  # the thread cannot read: the loop must poll as before
            bell.take(s)
            wait_for(lambda: bell.rung(s), 15.0)
        return bell._thread

    thread = start_and_check()
    gc.collect()
    wait_for(lambda: not thread.is_alive(), 15.0)  # a dropped doorbell's thread ends by itself


def test_no_doorbell_means_always_rung():
    bell = Doorbell(["s"], None)  # a cluster: no thread, plain polling
    bell.start()
    assert bell.take("s") and bell.take("s") and bell._thread is None


def test_a_busy_worker_reads_the_request_streams_only_when_an_entry_lands(local_redis):
    """With a long request running and nothing new, the loop polls every few ms but sends no
    XREADGROUP; an entry that lands then is pulled at once and answered."""
    server = local_redis()
    r = redis.Redis.from_url(server.url)
    keys = Keys("bell")
    svc = make_service(server.url, "bell")
    try:
        fields = {"input_ids": json.dumps([5, 6, 7]), "temperature": "0", "ignore_eos": "1"}
        r.xadd(keys.requests("normal"), {"id": "long", **fields, "max_tokens": "400"})
        run_until(svc, lambda: "long" in svc.engine)
        run_until(svc, lambda: not any(svc.doorbell.rung(s) for s in keys.request_streams), timeout=5)

        def reads() -> int:
            return r.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0)

        before, steps = reads(), 0
        t = time.monotonic()
        while time.monotonic() - t < 0.3 and svc.engine.has_unfinished():
            svc.run_once()
            steps += 1
        assert steps > 5 and reads() == before  # no intake read among them
        r.xadd(keys.requests("high"), {"id": "urgent", **fields, "max_tokens": "3"})
        run_until(svc, lambda: "urgent" in svc.inflight, timeout=10)
        assert svc.engine.has_unfinished()  # pulled while the long one still runs
        run_until(svc, lambda: final_entry(r, keys.result("urgent")) is not None and not svc.outbox)
        assert final_entry(r, keys.result("urgent"))["completion_tokens"] == "3"
    finally:
        svc.doorbell.stop()
        svc.r.close()
