"""The outbox's typed operations and the scripts behind them, written to the real Redis."""

from __future__ import annotations

import json
import os

import pytest
import redis
import torch
from service_helpers import make_service

from common.keys import Keys
from common.local_redis import free_port
from common.protocol import done_entry, error_entry, token_entry
from worker.service.outbox import Ack, DeadLetter, Finalize, Outbox, Publish, PublishTokens, Wire
from worker.service.scripts import Scripts
from worker.tuning import spare_core


@pytest.fixture
def wire(r, prefix):
    return Wire(Scripts(r), Keys(prefix), "me", 100, 60)


def pending_entry(r, keys: Keys, consumer: str, level: str = "normal") -> tuple[str, str]:
    """(stream, entry id) of an entry read by ``consumer`` and not acknowledged."""
    stream = keys.requests(level)
    r.xgroup_create(stream, keys.group, id="0", mkstream=True)
    entry_id = r.xadd(stream, {"prompt": "x"}).decode()
    r.xreadgroup(keys.group, consumer, {stream: ">"}, count=1)
    return stream, entry_id


def done(rid: str) -> dict[str, str]:
    return done_entry(rid, "stop", prompt_tokens=1, completion_tokens=1, queue_s=0, ttft_s=None, total_s=0)


def test_a_dropped_request_leaves_the_step_script_of_the_others(r, prefix, wire):
    """A request dropped (its entry claimed by another worker) while its token entries still
    wait in the outbox: they come out of the step's one script call, the others' stay."""
    keys = [f"{prefix}:result:{n}" for n in ("a", "b", "c")]
    op = PublishTokens([(k, token_entry(0, [i + 1], f"t{i}")) for i, k in enumerate(keys)])
    assert Publish(keys[1], {}).without(keys[1]) is None
    assert op.without(f"{prefix}:result:other") is op
    kept = op.without(keys[1])
    assert len(kept.entries) == 2 and keys[1] not in [k for k, _ in kept.entries]
    assert kept.without(keys[0]).without(keys[2]) is None
    box = Outbox()
    box.add(op)
    box.drop(keys[1])
    box.flush(r, wire)
    assert len(box) == 0
    assert [r.xlen(k) for k in keys] == [1, 0, 1]
    assert r.xrange(keys[2])[0][1][b"text"] == b"t2" and 0 < r.ttl(keys[0]) <= 60


def test_a_step_script_stores_every_string_as_sent(r, prefix, wire):
    """The step's token entries reach the script as one JSON argument (decoded by the server):
    what the streams hold is the strings as the worker sent them, whatever they contain."""
    texts = ["plain", "", "caf\u00e9 \u65e5\u672c \U0001f600", "quote \" back \\ slash /", "nul \x00 tab \t nl \n",
             "\u2028\u2029 \x7f", "[1,2]", "null", "-0.5e3"]
    keys = [f"{prefix}:result:s{i}" for i in range(len(texts))]
    entries = [(k, token_entry(i, [i, 2**40], t, index=i, finish_reason="stop" if i % 2 else None))
               for i, (k, t) in enumerate(zip(keys, texts))]
    box = Outbox()
    box.add(PublishTokens(entries))
    box.flush(r, wire)
    for key, entry in entries:
        (_, got), = r.xrange(key)
        assert list(got.items()) == [(f.encode(), v.encode()) for f, v in entry.items()]
        assert 0 < r.ttl(key) <= 60


def test_finalize_only_while_the_entry_is_ours(r, prefix, wire, caplog):
    keys = Keys(prefix)
    stream, entry_id = pending_entry(r, keys, "other")
    reply = keys.result("f1")
    box = Outbox()
    box.add(Finalize(stream, entry_id, reply, done("f1")))
    box.flush(r, wire)  # owned by "other": nothing written, the entry stays pending
    assert r.xlen(reply) == 0 and r.xpending(stream, keys.group)["pending"] == 1
    assert "event=final_skipped" in caplog.text
    r.xclaim(stream, keys.group, "me", 0, [entry_id])
    box.add(Finalize(stream, entry_id, reply, done("f1")))
    box.add(Finalize(stream, entry_id, reply, done("f1")))  # a re-send (its reply was lost)
    box.flush(r, wire)
    assert r.xlen(reply) == 1 and r.xrange(reply)[0][1][b"type"] == b"done"
    assert r.xpending(stream, keys.group)["pending"] == 0 and r.xlen(stream) == 0
    assert 0 < r.ttl(reply) <= 60


def test_finalize_when_redis_lost_the_entry(r, prefix, wire):
    """Nobody owns the entry (Redis lost it) and no final entry exists: the answer still goes out."""
    keys = Keys(prefix)
    r.xgroup_create(keys.requests("high"), keys.group, id="0", mkstream=True)
    box = Outbox()
    box.add(Finalize(keys.requests("high"), "1-1", keys.result("gone"), done("gone")))
    box.flush(r, wire)
    assert r.xrange(keys.result("gone"))[0][1][b"type"] == b"done"


def test_ack_dead_letter_and_order(r, prefix, wire):
    keys = Keys(prefix)
    stream, entry_id = pending_entry(r, keys, "me")
    box = Outbox()
    box.add(Publish(keys.result("bad"), error_entry("bad", "invalid_request", "no")))
    box.add(DeadLetter({"id": "bad", "stream": stream, "entry_id": entry_id, "code": "internal", "message": "m"}))
    box.add(Ack(stream, entry_id))
    box.drop(keys.result("bad"))  # drops the error entry only
    assert [type(op) for op in box.ops] == [DeadLetter, Ack]
    box.flush(r, wire)
    assert r.xlen(keys.result("bad")) == 0 and r.xlen(keys.dead) == 1
    assert r.xlen(stream) == 0 and r.xpending(stream, keys.group)["pending"] == 0


def test_kept_while_redis_is_down_then_written_in_order(r, prefix, wire):
    keys = Keys(prefix)
    down = redis.Redis(port=free_port(), socket_connect_timeout=0.2)
    box = Outbox()
    box.add(PublishTokens([(keys.result("o"), token_entry(0, [1], "a"))]))
    box.add(Publish(keys.result("o"), token_entry(1, [2], "b")))
    with pytest.raises(redis.ConnectionError):
        box.flush(down, Wire(Scripts(down), keys, "me", 100, 60))
    assert len(box) == 2
    box.flush(r, wire)
    assert [e[1][b"seq"] for e in r.xrange(keys.result("o"))] == [b"0", b"1"] and len(box) == 0


def test_written_behind_in_order_and_kept_when_the_write_fails(r, prefix, wire):
    """The service's write in a thread of its own: writes go out one at a time, in order; a
    write that fails keeps what it did not write in front of what was added meanwhile, and
    the next flush raises that failure and writes it all."""
    keys = Keys(prefix)
    key = keys.result("wb")
    box = Outbox()
    for seq in range(3):  # each write waits for the one before
        box.add(PublishTokens([(key, token_entry(seq, [seq], str(seq)))]))
        box.write_behind(r, wire)
    box.wait()
    assert len(box) == 0 and [e[1][b"seq"] for e in r.xrange(key)] == [b"0", b"1", b"2"]

    down = redis.Redis(port=free_port(), socket_connect_timeout=0.2)
    box.add(PublishTokens([(key, token_entry(3, [3], "3"))]))
    box.write_behind(down, Wire(Scripts(down), keys, "me", 100, 60))
    box.add(Publish(key, token_entry(4, [4], "4")))  # added while the write is out
    assert len(box) == 2
    with pytest.raises(redis.ConnectionError):
        box.flush(r, wire)  # the writer's failure, raised once; nothing written by this call
    assert [type(op) for op in box.ops] == [PublishTokens, Publish] and r.xlen(key) == 3
    box.flush(r, wire)
    assert [e[1][b"seq"] for e in r.xrange(key)] == [b"0", b"1", b"2", b"3", b"4"] and len(box) == 0

    box.add(PublishTokens([(key, token_entry(5, [5], "5"))]))
    box.write_behind(down, Wire(Scripts(down), keys, "me", 100, 60))
    assert box.settle() is not None and box.settle() is None  # Redis answers again: re-send, no raise
    box.drop(key)  # a dropped request's writes leave the outbox, the failed write's included
    assert len(box) == 0


def test_a_flush_is_one_round_trip_and_rides_through_a_restarted_server(prefix):
    """The step's scripts run by EVALSHA alone (no SCRIPT EXISTS before each flush); a server
    that lost them (restarted, or SCRIPT FLUSH) refuses them with NOSCRIPT: the outbox loads
    them and re-sends what was refused (in its order), nothing lost."""
    from common.local_redis import LocalRedis

    server = LocalRedis().start()
    try:
        own = redis.Redis.from_url(server.url)
        keys = Keys(prefix)
        w = Wire(Scripts(own), keys, "me", 100, 60)
        box = Outbox()
        box.add(PublishTokens([(keys.result("o"), token_entry(0, [1], "a"))]))
        box.flush(own, w)
        own.config_resetstat()
        box.add(PublishTokens([(keys.result("o"), token_entry(1, [2], "b"))]))
        box.flush(own, w)
        stats = own.info("commandstats")
        assert "cmdstat_script|exists" not in stats and stats["cmdstat_evalsha"]["calls"] == 1, stats
        own.script_flush()
        box.add(PublishTokens([(keys.result("o"), token_entry(2, [3], "c"))]))
        box.add(Publish(keys.result("o"), token_entry(3, [4], "d")))
        box.add(PublishTokens([(keys.result("o"), token_entry(4, [5], "e"))]))
        box.flush(own, w)
        assert len(box) == 0
        seqs = [int(e[1][b"seq"]) for e in own.xrange(keys.result("o"))]
        assert sorted(seqs) == [0, 1, 2, 3, 4] and seqs[:2] == [0, 1], seqs
    finally:
        server.cleanup()


def test_a_worker_whose_threads_take_every_core_writes_between_steps(redis_url, r, prefix):
    """write_behind=False (a CPU worker whose math threads take every core, worker/tuning.py):
    each step's entries are in Redis when its loop iteration returns, no writer thread is ever
    started, and the result streams hold what the writer thread writes."""
    streams = {}
    for behind in (True, False):
        p = f"{prefix}:{'behind' if behind else 'between'}"
        svc = make_service(redis_url, p, write_behind=behind, stream_interval_ms=0)
        keys = Keys(p)
        for i in range(3):
            r.xadd(keys.requests("normal"), {"id": f"q{i}", "input_ids": json.dumps([5, 6, 7 + i] * (i + 1)),
                                             "max_tokens": str(6 + 3 * i), "temperature": "0", "ignore_eos": "1"})
        left = []  # operations not yet in Redis after each iteration that stepped
        while True:
            stepped = svc.engine.has_unfinished()
            svc.run_once()
            if stepped:
                left.append(len(svc.outbox))
            if left and not svc.inflight and not svc.outbox:
                break
        if behind:
            assert max(left) > 0  # the writer's share, still in flight as the iteration returns
        else:
            assert left and max(left) == 0 and svc.outbox._pool is None
        # every field but the times (queue_s, ttft_s, total_s)
        streams[behind] = [[{k.decode(): v.decode() for k, v in f.items() if not k.endswith(b"_s")}
                            for _, f in r.xrange(keys.result(f"q{i}"))] for i in range(3)]
        svc.r.close()
    assert streams[False] == streams[True]
    assert [sum(len(json.loads(e["ids"])) for e in es if e["type"] == "token") for es in streams[False]] == [6, 9, 12]


def test_spare_core_says_whether_the_math_threads_leave_a_core():
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        assert not spare_core("cpu")
        assert spare_core("cuda:0")  # a GPU worker's CPU mostly waits on the device
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert spare_core("cpu")
    finally:
        torch.set_num_threads(before)
