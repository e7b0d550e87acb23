"""Intake on an in-process worker and the real Redis, driven with raw redis-py commands:
what it accepts, how it answers a bad entry, and the flat fields beside a msgpack payload."""

from __future__ import annotations

import json
import threading
import time

import msgpack
import pytest
from service_helpers import final_entry, make_service, run_until

from common.keys import Keys
from worker.service import intake


@pytest.fixture
def svc(redis_url, prefix):
    s = make_service(redis_url, prefix)
    yield s
    s.r.close()


def test_accepts_within_the_budget_and_answers(svc, r, prefix):
    keys = Keys(prefix)
    for i in range(3):
        r.xadd(keys.requests("normal"), {"id": f"ok{i}", "input_ids": json.dumps([5, 6, 7]), "max_tokens": "3",
                                         "temperature": "0", "ignore_eos": "1"})
    intake.pull(svc)
    assert sorted(svc.inflight) == ["ok0", "ok1", "ok2"] and all(f"ok{i}" in svc.engine for i in range(3))
    run_until(svc, lambda: not svc.inflight and not svc.outbox)
    for i in range(3):
        final = final_entry(r, keys.result(f"ok{i}"))
        assert final["type"] == "done" and final["completion_tokens"] == "3"
    assert r.xlen(keys.requests("normal")) == 0


def test_a_burst_that_wakes_an_idle_worker_is_taken_before_its_first_step(svc, r, prefix):
    """The wake-up reads one entry a stream (it cannot know the budget); the rest of the burst
    is pulled under the budget at once, not after a first step that prefills the one alone."""
    keys = Keys(prefix)
    intake.pull(svc)  # nothing yet: the streams' first marks are taken

    def burst():
        time.sleep(0.1)  # while the worker blocks on the streams
        pipe = r.pipeline(transaction=False)
        for i in range(5):
            pipe.xadd(keys.requests("normal"), {"id": f"w{i}", "input_ids": json.dumps([5, 6, 7]), "max_tokens": "2"})
        pipe.execute()

    sender = threading.Thread(target=burst)
    sender.start()
    intake.pull(svc)  # blocks until the burst lands
    sender.join()
    assert sorted(svc.inflight) == [f"w{i}" for i in range(5)]
    assert not svc.engine.scheduler.running  # not a step yet: all five start in the first one


def test_a_bad_entry_gets_an_error_or_a_dead_letter_and_is_acknowledged(svc, r, prefix):
    keys = Keys(prefix)
    stream = keys.requests("high")
    r.xadd(stream, {"id": "bad1", "prompt": "x", "max_tokens": "ten"})
    r.xadd(stream, {"id": "bad2", "prompt": "x", "reply_to": "elsewhere:key"})
    intake.pull(svc)
    assert not svc.inflight
    run_until(svc, lambda: not svc.outbox)
    err = final_entry(r, keys.result("bad1"))
    assert err["type"] == "error" and err["code"] == "invalid_request" and "max_tokens" in err["message"]
    dead = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(keys.dead)]
    assert [d["id"] for d in dead] == ["bad2"] and "reply_to" in dead[0]["message"]
    assert r.xlen(stream) == 0 and r.xpending(stream, keys.group)["pending"] == 0
    assert svc.counts["errors"] == 2


def test_payload_and_flat_fields_merge(svc, r, prefix):
    """The payload bug: flat ``id`` / ``reply_to`` beside a msgpack payload used to be dropped
    silently (the result went to a stream the client did not read)."""
    keys = Keys(prefix)
    packed = msgpack.packb({"input_ids": [9, 10, 11], "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    r.xadd(keys.requests("normal"), {"payload": packed, "id": "flat-id"})
    r.xadd(keys.requests("normal"), {"payload": packed, "id": "p2", "reply_to": keys.result("mine")})
    same = msgpack.packb({"id": "p3", "input_ids": [4], "max_tokens": 2, "ignore_eos": True})
    r.xadd(keys.requests("normal"), {"payload": same, "id": "p3", "max_tokens": "2"})  # equal values: fine
    run_until(svc, lambda: all(final_entry(r, keys.result(k)) for k in ("flat-id", "mine", "p3")))
    for key, rid in (("flat-id", "flat-id"), ("mine", "p2"), ("p3", "p3")):
        final = final_entry(r, keys.result(key))
        assert final["type"] == "done" and final["id"] == rid and final["completion_tokens"] == "2"
    assert not r.exists(keys.result("p2"))


def test_payload_and_flat_field_conflict_is_an_error(svc, r, prefix):
    keys = Keys(prefix)
    packed = msgpack.packb({"id": "packed-id", "input_ids": [9, 10], "max_tokens": 2})
    r.xadd(keys.requests("normal"), {"payload": packed, "id": "flat-id"})
    r.xadd(keys.requests("normal"), {"payload": msgpack.packb({"input_ids": [1], "max_tokens": 3}), "id": "c2",
                                     "max_tokens": "4"})
    run_until(svc, lambda: final_entry(r, keys.result("flat-id")) and final_entry(r, keys.result("c2")))
    err = final_entry(r, keys.result("flat-id"))
    assert err["type"] == "error" and err["code"] == "invalid_request"
    assert "id is given both as a field and in the payload" in err["message"]
    assert "max_tokens is given both" in final_entry(r, keys.result("c2"))["message"]
    assert not r.exists(keys.result("packed-id"))


def test_high_is_pulled_before_normal_and_low(svc, r, prefix):
    keys = Keys(prefix)
    for level in ("low", "normal", "high"):
        r.xadd(keys.requests(level), {"id": level, "input_ids": "[3, 4]", "max_tokens": "2"})
    intake.pull(svc)  # one pass: high first, then normal and low by virtual arrival time
    assert list(svc.inflight) == ["high", "normal", "low"]
    assert [svc.engine.scheduler.waiting[i].priority for i in range(3)] == [0, 1, 2]
    run_until(svc, lambda: not svc.inflight and not svc.outbox)
    assert all(final_entry(r, keys.result(level))["type"] == "done" for level in ("high", "normal", "low"))
