"""tokenq on a real Redis Cluster (3 masters, 3 replicas on loopback, tests/redis_cluster.py):
workers, the raw protocol and the Client given one node's URL; a worker SIGKILLed mid-generation
resumed by another; a master SIGKILLed and failed over to its replica mid-run. Every request
ends with exactly one final entry, a client sees each seq once and in order, greedy outputs
equal transformers' own generate (float64 tiny model)."""

from __future__ import annotations

import json
import shutil
import time
import uuid

import pytest
from redis.crc import key_slot
from redis_cluster import LocalCluster
from reliability import (
    WORKER_ENV,
    Reference,
    Tally,
    check_stream,
    mixed_requests,
    pending_total,
    submit,
    wait_until,
)

from common.keys import Keys
from common.redis import connect, is_cluster
from producer import Client

pytestmark = pytest.mark.skipif(not shutil.which("redis-server") or not shutil.which("redis-cli"),
                                reason="redis-server and redis-cli are needed for a local cluster")
ARGS = ["--max-num-seqs", "8", "--claim-idle-s", "2"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return Reference(tiny_model_dir)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster().start()
    yield c
    c.cleanup()


@pytest.fixture
def cprefix():
    return f"tqc-{uuid.uuid4().hex[:8]}"


def start_worker(worker_factory, cluster, prefix, rc, **kw):
    w = worker_factory(prefix, url=cluster.url, args=ARGS + kw.pop("args", []), env=WORKER_ENV, ready=False, **kw)
    deadline = time.monotonic() + 300
    while not rc.exists(Keys(prefix).worker(w.name)):  # helpers' wait_ready uses a plain client
        assert w.proc.poll() is None, w.log[-3000:]
        assert time.monotonic() < deadline, w.log[-3000:]
        time.sleep(0.1)
    return w


def check_all(rc, prefix, specs, reference, timeout=120.0) -> Tally:
    tally = Tally()
    for s in specs:
        check_stream(rc, Keys(prefix).result(s.id), tally, reference(s.input_ids, s.max_tokens), timeout=timeout)
    return tally


def test_key_layout_each_script_in_one_slot():
    """A result stream and its fence share a slot; key names are those of a single Redis."""
    keys = Keys("tokenq")
    assert keys.result("abc") == "tokenq:result:abc" and keys.requests("high") == "tokenq:requests:high"
    for rid in ("abc", "x-1.2:3", "Z" * 128):
        assert key_slot(keys.result(rid).encode()) == key_slot(keys.fence(rid).encode())
    tagged = Keys("{tenant}")
    assert key_slot(tagged.result("a").encode()) == key_slot(tagged.fence("a").encode()) == key_slot(b"tenant")


def test_raw_and_client_requests_served_on_a_cluster(cluster, cprefix, worker_factory, reference, capsys):
    rc = connect(cluster.url)
    assert is_cluster(rc)
    specs = mixed_requests(6, seed=3, tag="raw", max_tokens=(2, 20))
    for s in specs:
        reference(s.input_ids, s.max_tokens)
    start_worker(worker_factory, cluster, cprefix, rc)
    for s in specs:
        submit(rc, cprefix, s)
    with Client(cluster.url, prefix=cprefix) as client:
        assert is_cluster(client.redis)
        res = client.generate(input_ids=[7, 8, 9, 10], max_tokens=12, temperature=0, ignore_eos=True, timeout=120)
    assert res.token_ids == reference([7, 8, 9, 10], 12) and res.finish_reason == "length"
    _other_producers(cluster.url, cprefix, res.text, capsys)
    _two_choices(rc, cprefix, reference)
    tally = check_all(rc, cprefix, specs, reference)
    assert tally.ok and tally.done == len(specs) and tally.raw_resends == 0, tally
    wait_until(lambda: pending_total(rc, cprefix) == 0, 10, "pending lists to empty")


def _two_choices(rc, prefix: str, reference) -> None:
    """n=2 on a cluster: each choice counts its own seqs in the fence, so neither is refused
    as a re-sent entry of the other; greedy choices both equal the reference."""
    from helpers import _str

    rc.xadd(Keys(prefix).requests("normal"), {"id": "two", "input_ids": "[7, 8, 9, 10]", "max_tokens": "9", "n": "2",
                                              "temperature": "0", "ignore_eos": "true"})
    key = Keys(prefix).result("two")
    wait_until(lambda: any(f[b"type"] == b"done" for _, f in rc.xrange(key)), 60, "the n=2 request")
    got: dict[str, list[int]] = {"0": [], "1": []}
    for _, f in rc.xrange(key):
        e = _str(f)
        if e["type"] == "token":
            assert int(e["seq"]) == len(got[e["index"]]), e
            got[e["index"]] += json.loads(e["ids"])
    assert got["0"] == got["1"] == reference([7, 8, 9, 10], 9), got


def test_stream_reads_and_scripts_ask_no_server_for_their_keys(cluster):
    """XREAD / XREADGROUP name their keys after STREAMS, EVAL / EVALSHA after the script;
    redis-py would ask the default node (COMMAND GETKEYS) for each, one more round trip per
    read and per script in a pipeline (the step's publishing ran 3-4x slower for it), and one
    that fails while that node is a dead master. common.redis reads the keys itself."""
    rc = connect(cluster.url)

    def getkeys() -> int:
        stats = [rc.info("commandstats", target_nodes=n) for n in rc.get_primaries()]
        return sum(s.get("cmdstat_command|getkeys", {}).get("calls", 0) for s in stats)

    before = getkeys()
    for i in range(5):
        rc.xadd(f"tq-keys-{i}", {"a": "1"})
        assert rc.xread({f"tq-keys-{i}": "0"}, count=1)
    pipe = rc.pipeline(transaction=False)
    for i in range(5):
        pipe.execute_command("EVAL", "return redis.call('XLEN', KEYS[1])", 1, f"tq-keys-{i}")
    assert pipe.execute() == [1] * 5
    assert getkeys() == before


def _other_producers(url: str, prefix: str, text: str, capsys) -> None:
    """AsyncClient, the CLI, the gateway (openai client) and the RQ job function, each given
    the cluster's URL, get the same greedy answer as the Client."""
    import asyncio

    import openai
    from producer_helpers import serve_gateway

    from common.settings import Settings
    from producer import AsyncClient
    from producer.cli import main
    from producer.jobs import generate

    greedy = dict(input_ids=[7, 8, 9, 10], max_tokens=12, temperature=0, ignore_eos=True)

    async def aio() -> str:
        async with AsyncClient(url, prefix=prefix) as c:
            assert is_cluster(c.redis)
            return (await c.generate(timeout=120, **greedy)).text

    assert asyncio.run(aio()) == text
    assert generate(redis_url=url, prefix=prefix, wait_s=120, **greedy)["text"] == text
    capsys.readouterr()
    assert main(["submit", "--input-ids", "[7, 8, 9, 10]", "--max-tokens", "12", "--temperature", "0",
                 "--ignore-eos", "--redis-url", url, "--prefix", prefix]) == 0
    assert capsys.readouterr().out == text + "\n"
    with serve_gateway(Settings.from_env(redis_url=url, prefix=prefix, model_name="tiny")) as base:
        oai = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = oai.completions.create(model="tiny", prompt=[7, 8, 9, 10], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert out.choices[0].text == text
        import httpx

        refused = httpx.post(base + "/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/completions",
                                                          "completion_window": "24h"}, timeout=30)
        assert refused.status_code == 501 and refused.json()["error"]["code"] == "cluster_unsupported", refused.text
    assert main(["batch", "list", "--redis-url", url, "--prefix", prefix]) == 2
    assert "single Redis server" in capsys.readouterr().err


def _final(rc, key: str) -> bool:
    """Whether a result stream holds its final (done/error) entry."""
    return any(f.get(b"type") in (b"done", b"error") for _, f in rc.xrange(key))


def test_a_worker_killed_mid_generation_is_resumed_by_another(cluster, cprefix, worker_factory, reference):
    rc = connect(cluster.url)
    # Long enough that the kill lands mid-generation: the first worker takes all three at once
    # (a burst is pulled before its first step) and ran 40-50 tokens each to the end within the
    # wait's 0.1 s poll.
    specs = mixed_requests(3, seed=5, tag="kill", max_tokens=(160, 200))
    for s in specs:
        reference(s.input_ids, s.max_tokens)
    first = start_worker(worker_factory, cluster, cprefix, rc)
    for s in specs:
        submit(rc, cprefix, s)
    keys = Keys(cprefix)
    wait_until(lambda: any(rc.xlen(keys.result(s.id)) >= 3 for s in specs if rc.exists(keys.result(s.id))), 60,
               "tokens on a result stream", interval=0.01)
    first.kill()
    assert not all(_final(rc, keys.result(s.id)) for s in specs), "the first worker finished before the kill"
    second = start_worker(worker_factory, cluster, cprefix, rc)
    tally = check_all(rc, cprefix, specs, reference)
    assert tally.ok and tally.done == len(specs), tally
    assert "event=claimed" in second.log
    wait_until(lambda: pending_total(rc, cprefix) == 0, 10, "pending lists to empty")


def _service_reference(prompt: list[int], n: int) -> list[int]:
    """Greedy generate of the in-process services' model (tests/tiny.py, float64)."""
    import torch
    from engine_helpers import reference
    from tiny import tiny_model

    return reference(tiny_model("llama", dtype=torch.float64), prompt, n)


def _request(rc, keys: Keys, rid: str, max_tokens: int) -> str:
    return rc.xadd(keys.requests("normal"), {"id": rid, "input_ids": "[5, 6, 7]", "max_tokens": str(max_tokens),
                                             "temperature": "0", "ignore_eos": "1"}).decode()


def test_a_frozen_worker_is_fenced_off_after_its_entry_was_claimed(cluster, cprefix, caplog):
    """Worker a stops (frozen past claim_idle_s) with writes still to send; b claims the entry.
    When a wakes, its lapsed lease holds the writes back; one already on its way when it froze
    is refused by the fence (in the result stream's slot) refuses its token and final entries:
    b's run is the only one the client sees, exactly one final entry, no seq twice."""
    from service_helpers import final_entry, make_service, run_until

    from common.protocol import done_entry, token_entry
    from worker.service import recovery
    from worker.service.outbox import Finalize, PublishTokens

    rc, keys = connect(cluster.url), Keys(cprefix)
    a = make_service(cluster.url, cprefix, name="a")
    entry_id = _request(rc, keys, "frozen", max_tokens=20)
    key = keys.result("frozen")
    run_until(a, lambda: rc.xlen(key) >= 2 if rc.exists(key) else False)
    b = make_service(cluster.url, cprefix, name="b")
    time.sleep(b.s.claim_idle_s + 0.2)
    recovery.claim(b)
    assert "frozen" in b.inflight and rc.hget(keys.fence("frozen"), "owner") == b"b"
    before = rc.xlen(key)
    nxt = int(rc.hget(keys.fence("frozen"), "next"))
    a.outbox.add(PublishTokens([(key, token_entry(nxt, [1], "x"))]))  # what a still had to send
    a.outbox.add(Finalize(keys.requests("normal"), entry_id, key, done_entry("frozen", "length", prompt_tokens=3,
                                                                            completion_tokens=20, queue_s=0,
                                                                            ttft_s=0, total_s=0)))
    a._flush()  # its lease lapsed while it was frozen: nothing goes out before a refresh
    assert len(a.outbox) == 2 and rc.xlen(key) == before
    a.outbox.lease_until = float("inf")  # as for writes already on their way when it froze: the fence
    a._flush()
    assert not a.outbox and rc.xlen(key) == before and final_entry(rc, key) is None
    assert "event=final_skipped" in caplog.text
    run_until(b, lambda: final_entry(rc, key) is not None and not b.outbox)
    tally = Tally()
    check_stream(rc, key, tally, _service_reference([5, 6, 7], 20))
    assert tally.ok and tally.done == 1 and tally.raw_resends == 0, tally
    assert rc.xpending(keys.requests("normal"), keys.group)["pending"] == 0


def test_token_entries_a_failover_lost_are_sent_again_before_what_follows(cluster, cprefix, caplog):
    """A replica promoted before it had a master's last writes holds a stream (and its fence,
    written in the same script) a few entries short. Simulated here by taking the last entry
    off both: the next token entry is refused for the gap and the outbox re-sends what was
    lost first; a final entry waits for the entries it follows. The client reads every seq once,
    in order."""
    from common.keys import fence_key
    from common.protocol import done_entry, token_entry
    from worker.service.outbox import Finalize, Outbox, PublishTokens, Wire
    from worker.service.scripts import Scripts

    rc, keys = connect(cluster.url), Keys(cprefix)
    key, fence = keys.result("lag"), fence_key(keys.result("lag"))
    w = Wire(Scripts(rc), keys, "me", 100, 60)
    assert w.scripts.fence_take(rc, fence=fence, reply_to=key, owner="me", claim=False, ttl_s=60) == 1
    box = Outbox()

    def lose_last() -> None:  # what the promoted replica misses: the stream's last entry, the fence's advance
        last_id, last = rc.xrevrange(key, count=1)[0]
        rc.xdel(key, last_id)
        rc.hset(fence, "next", int(last[b"seq"]))

    for seq in range(3):
        box.add(PublishTokens([(key, token_entry(seq, [10 + seq], "t"))]))
        box.flush(rc, w)
    lose_last()
    box.add(PublishTokens([(key, token_entry(3, [13], "t"))]))
    box.flush(rc, w)
    assert [int(f[b"seq"]) for _, f in rc.xrange(key)] == [0, 1, 2, 3]
    lose_last()
    lose_last()
    box.add(Finalize(keys.requests("normal"), "1-0", key, done_entry("lag", "length", prompt_tokens=1,
                                                                    completion_tokens=4, queue_s=0, ttft_s=0,
                                                                    total_s=0)))
    box.flush(rc, w)
    types = [(f[b"type"], f.get(b"seq")) for _, f in rc.xrange(key)]
    assert types == [(b"token", b"0"), (b"token", b"1"), (b"token", b"2"), (b"token", b"3"), (b"done", None)], types
    assert not box.sent and "event=result_refill" in caplog.text and "event=result_gap" not in caplog.text
    tally = Tally()
    check_stream(rc, key, tally, [10, 11, 12, 13])
    assert tally.ok and tally.done == 1, tally


def test_a_crash_between_final_entry_and_ack_is_acknowledged_without_a_rerun(cluster, cprefix):
    """The final entry is written (result stream's slot), the worker dies before the XACK +
    XDEL (request stream's slot): the claimer finds the final entry and only acknowledges."""
    from service_helpers import final_entry, make_service, run_until

    from common.keys import fence_key
    from common.protocol import done_entry
    from worker.service import recovery

    rc, keys = connect(cluster.url), Keys(cprefix)
    a = make_service(cluster.url, cprefix, name="a")
    _request(rc, keys, "half", max_tokens=50)
    key = keys.result("half")
    run_until(a, lambda: "half" in a.inflight)
    entry = done_entry("half", "length", prompt_tokens=3, completion_tokens=0, queue_s=0, ttft_s=0, total_s=0)
    assert a.scripts.fenced_final(rc, reply_to=key, fence=fence_key(key), owner="a", maxlen=100, ttl_s=60,
                                  entry=entry) == 1  # step one; a dies before step two
    b = make_service(cluster.url, cprefix, name="b")
    time.sleep(b.s.claim_idle_s + 0.2)
    recovery.claim(b)
    run_until(b, lambda: not b.outbox)
    assert "half" not in b.inflight and final_entry(rc, key)["completion_tokens"] == "0"
    assert sum(1 for _, f in rc.xrange(key) if f[b"type"] in (b"done", b"error")) == 1
    assert rc.xpending(keys.requests("normal"), keys.group)["pending"] == 0 and rc.xlen(keys.requests("normal")) == 0


def failover_run(worker_factory, reference, n: int, workers: int) -> tuple[Tally, str]:
    """``n`` requests; once tokens flow, SIGKILL the master serving the first one's result
    stream; count what the failover lost."""
    c = LocalCluster().start()
    try:
        prefix = f"tqf-{uuid.uuid4().hex[:8]}"
        rc = connect(c.url)
        specs = mixed_requests(n, seed=9, tag="fo", max_tokens=(30, 60))
        for s in specs:
            reference(s.input_ids, s.max_tokens)
        fleet = [start_worker(worker_factory, c, prefix, rc) for _ in range(workers)]
        for s in specs:
            submit(rc, prefix, s)
        victim_key = Keys(prefix).result(specs[0].id)
        wait_until(lambda: rc.xlen(victim_key) >= 2, 60, "tokens on the victim's result stream")
        c.kill_master(victim_key)
        tally = check_all(rc, prefix, specs, reference, timeout=90)
        logs = "".join(w.log for w in fleet)
        assert all(w.proc.poll() is None for w in fleet), logs[-3000:]
        return tally, logs
    finally:
        c.cleanup()


def test_a_master_killed_mid_run_fails_over(worker_factory, reference):
    """Workers and readers ride through the failover; every request completes. Asynchronous
    replication may lose the last writes the dead master took: lost token entries are sent
    again (event=result_refill); what is still lost is counted (a final entry lost after its
    request entry was acknowledged, with --replica-wait-ms off) and stays small."""
    tally, logs = failover_run(worker_factory, reference, n=8, workers=1)
    gaps = logs.count("event=result_gap")
    print(f"\nfailover: {tally}, refills={logs.count('event=result_refill')}, result gaps logged={gaps}")
    assert tally.finals_extra == 0 and tally.duplicate_tokens_seen == 0 and tally.mismatched_resends == 0, tally
    assert tally.requests == 8 and tally.lost <= 1 and gaps == 0, (tally, logs[-3000:])
    assert tally.wrong_output <= tally.lost, tally


@pytest.mark.slow
def test_a_master_killed_under_load_fails_over(worker_factory, reference):
    tally, logs = failover_run(worker_factory, reference, n=40, workers=2)
    print(f"\nfailover (long): {tally}, refills={logs.count('event=result_refill')}, "
          f"result gaps logged={logs.count('event=result_gap')}")
    assert tally.finals_extra == 0 and tally.duplicate_tokens_seen == 0 and tally.mismatched_resends == 0, tally
    assert tally.lost <= 2 and tally.done + tally.errors + tally.lost == 40, tally
