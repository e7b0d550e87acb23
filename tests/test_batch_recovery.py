"""Batch state lives in Redis: a gateway killed with SIGKILL mid-batch is replaced and the batch
completes with every line once and every request run once; gateways share batches; a runner
without the lease writes nothing. Also the feed bound, the batch's priority, cancel and expiry."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis
from batch_helpers import by_custom_id, chat_line, completion_line, lines_of, submit, wait_batch
from producer_helpers import (
    done,
    publish,
    serve_gateway,
    shared_worker,
    start_worker,
    stop_worker,
    tokens,
    wait_for,
)

from common.keys import Keys
from common.local_redis import free_port
from common.redis import connect_async
from common.settings import Settings
from producer.batch import carrier, runner
from producer.batch.carrier import Carrier, LeaseLost
from producer.batch.store import Store

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def worker(request, redis_url, tiny_model_dir, tmp_path_factory):
    return shared_worker(request, redis_url, tiny_model_dir, tmp_path_factory)


def _settings(redis_url: str, prefix: str, **kw) -> Settings:
    return Settings.from_env(redis_url=redis_url, prefix=prefix, model_name="tiny", batch_lease_s=1.0, **kw)


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def _served(r: redis.Redis, prefix: str, name: str) -> int:
    return int(r.hget(Keys(prefix).worker(name), "served") or 0)


# ---------------------------------------------------------------------------- the queue side (no worker)


def test_feed_bound_and_priority(redis_url, prefix, r):
    keys = Keys(prefix)
    with serve_gateway(_settings(redis_url, prefix, batch_feed_limit=5)) as base:
        oai = _client(base)
        low = submit(oai, [completion_line(f"c{i}", ["a", "b"]) for i in range(30)], endpoint="/v1/completions")
        wait_batch(oai, low.id, ("in_progress",))
        time.sleep(1.0)  # the runner has had time to feed more, were it not bounded
        assert r.xlen(keys.requests("low")) == 4  # lines of 2 prompts: a third would pass 5
        assert r.xlen(keys.requests("high")) == 0 and r.xlen(keys.requests("normal")) == 0
        high = submit(oai, [chat_line("h", "x")], extra_body={"priority": "high"})
        assert high.priority == "high"  # type: ignore[attr-defined]
        wait_for(lambda: r.xlen(keys.requests("high")) == 1, what="the high batch's request")
        (_, fields), = r.xrange(keys.requests("high"))
        assert fields[b"id"].decode() == f"{high.id}-0"


@pytest.mark.parametrize("n", [10_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_a_large_file_is_fed_under_the_bound(n, redis_url, prefix, r, monkeypatch):
    monkeypatch.setattr(carrier, "CANCEL_GRACE_S", 0.2)
    keys = Keys(prefix)
    with serve_gateway(_settings(redis_url, prefix, batch_feed_limit=10)) as base:
        oai = _client(base)
        t0 = time.monotonic()
        b = submit(oai, [chat_line(f"c{i}", f"prompt {i}") for i in range(n)])
        b = wait_batch(oai, b.id, ("in_progress",), timeout=120)
        assert b.request_counts.total == n
        time.sleep(0.5)
        assert r.xlen(keys.requests("low")) == 10 and r.hlen(keys.batch_inflight(b.id)) == 10
        print(f"{n} lines uploaded and validated in {time.monotonic() - t0:.1f} s")
        with pytest.raises(openai.APIStatusError) as e:  # its input cannot go while it runs
            oai.files.delete(b.input_file_id)
        assert e.value.status_code == 409
        oai.batches.cancel(b.id)
        assert wait_batch(oai, b.id).status == "cancelled"
        assert oai.files.delete(b.input_file_id).deleted


def test_cancel_of_queued_requests(redis_url, prefix, r, monkeypatch):
    monkeypatch.setattr(carrier, "CANCEL_GRACE_S", 0.5)
    keys = Keys(prefix)
    with serve_gateway(_settings(redis_url, prefix, batch_feed_limit=3)) as base:
        oai = _client(base)
        b = submit(oai, [chat_line(f"c{i}", "x") for i in range(10)])
        wait_batch(oai, b.id, ("in_progress",))
        wait_for(lambda: r.xlen(keys.requests("low")) == 3, what="3 queued requests")
        c = oai.batches.cancel(b.id)
        assert c.status == "cancelling" and c.cancelling_at
        b = wait_batch(oai, b.id)
        assert b.status == "cancelled" and b.cancelled_at and b.output_file_id is None
        cancelled = {fields[b"id"].decode() for _, fields in r.xrange(keys.control)}
        assert cancelled == {f"{b.id}-{i}" for i in range(3)}
        errors = by_custom_id(lines_of(oai, b.error_file_id))
        assert set(errors) == {"c0", "c1", "c2"} and all(x["error"]["code"] == "batch_cancelled"
                                                          for x in errors.values())
        assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (10, 0, 3)
        assert oai.batches.cancel(b.id).status == "cancelled"  # again: nothing changes


def test_expired_batch_accounts_for_every_line(redis_url, prefix, monkeypatch):
    monkeypatch.setattr(carrier, "CANCEL_GRACE_S", 0.5)
    with serve_gateway(_settings(redis_url, prefix, batch_feed_limit=2)) as base:
        oai = _client(base)
        fid = oai.files.create(file=("in.jsonl", b"\n".join(json.dumps(chat_line(f"c{i}", "x")).encode()
                                                            for i in range(6))), purpose="batch").id
        b = oai.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="2s")
        b = wait_batch(oai, b.id, timeout=30)
        assert b.status == "expired" and b.expired_at
        errors = by_custom_id(lines_of(oai, b.error_file_id))
        assert set(errors) == {f"c{i}" for i in range(6)}
        assert {x["error"]["code"] for x in errors.values()} == {"batch_expired"}
        assert b.request_counts.failed == 6


def test_a_batch_that_cannot_go_on_fails_rather_than_hangs(redis_url, prefix, r):
    """Its input vanished from Redis (flushed by hand, say): the runner fails it, with the reason."""
    keys = Keys(prefix)
    with serve_gateway(_settings(redis_url, prefix, batch_feed_limit=2)) as base:
        oai = _client(base)
        b = submit(oai, [chat_line(f"c{i}", "x") for i in range(10)])
        wait_batch(oai, b.id, ("in_progress",))
        wait_for(lambda: r.xlen(keys.requests("low")) == 2, what="2 queued requests")
        r.delete(keys.file_lines(b.input_file_id))
        for i in range(2):  # the two queued requests end (written as a worker writes them): room for more
            rid = f"{b.id}-{i}"
            publish(r, keys.result(rid), tokens((0, [5], "a")) + [done(rid, "length", 3, 1)])
        b = wait_batch(oai, b.id, timeout=30)
        assert b.status == "failed" and b.errors.data[0].code == "internal"
        assert "is gone" in b.errors.data[0].message and b.request_counts.completed >= 1


# ---------------------------------------------------------------------------- leases


def test_a_runner_without_the_lease_writes_nothing(redis_url, prefix, r):
    keys = Keys(prefix)
    s = _settings(redis_url, prefix)

    async def go() -> None:
        ar = connect_async(redis_url)
        store = Store.of(ar, s)
        f = await store.put_file(json.dumps(chat_line("a", "x")).encode(), filename="a", purpose="batch")
        b = await store.create_batch(input_file_id=f["id"], endpoint="/v1/chat/completions",
                                     completion_window="24h", metadata=None, priority="low")
        await ar.set(keys.batch_lease(b["id"]), "someone-else", px=60_000)
        br = runner.BatchRunner(ar, s)
        stale = Carrier(ar, keys, s, b["id"], "my-old-token", br.prepare, br.usage)
        with pytest.raises(LeaseLost):
            await stale.carry()
        assert (await store.get_batch(b["id"]))["status"] == "validating"
        # A runner leaves a leased batch alone, and takes it once the lease is gone.
        await br.scan()
        assert not br.carried
        await ar.delete(keys.batch_lease(b["id"]))
        await br.scan()
        assert b["id"] in br.carried
        for _ in range(100):
            if (await store.get_batch(b["id"]))["status"] == "in_progress":
                break
            await asyncio.sleep(0.05)
        assert (await ar.get(keys.batch_lease(b["id"]))).decode().startswith(br.name)
        await br.aclose()
        await ar.aclose()

    asyncio.run(go())


# ---------------------------------------------------------------------------- with a worker


def _spawn_gateway(redis_url: str, prefix: str, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "TOKENQ_BATCH_LEASE_S": "1", "TOKENQ_BATCH_FEED_LIMIT": "4", "TOKENQ_MODEL_NAME": "tiny",
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "producer.cli", "gateway", "--port", str(port), "--redis-url",
                             redis_url, "--prefix", prefix, "--log-level", "warning"], cwd=ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def test_sigkilled_gateway_is_replaced_without_loss_or_repeats(worker, redis_url, r, tmp_path):
    prefix, w = worker
    port = free_port()
    p = _spawn_gateway(redis_url, prefix, port, tmp_path / "gateway.log")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(base), 30, 0.1, "the gateway")
        oai = _client(base)
        served0 = _served(r, prefix, w.name)
        n = 30
        # Lines of different lengths finish at different steps, so some are always in flight
        # (the same length made all 4 fed lines end together: nothing in flight between feeds).
        lines = [chat_line(f"r{i}", f"number {i}", max_tokens=6 + i % 7) for i in range(n)]
        b = submit(oai, lines)
        inflight = Keys(prefix).batch_inflight(b.id)
        wait_for(lambda: oai.batches.retrieve(b.id).request_counts.completed >= 5 and r.hlen(inflight) > 0, 60, 0.01,
                 "5 lines done, others in flight")
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        done_at_kill = r.hget(Keys(prefix).batch(b.id), "completed")
        assert r.hlen(Keys(prefix).batch_inflight(b.id)) > 0  # the next gateway takes over lines in flight
        time.sleep(1.5)  # nobody carries the batch now
        assert r.hget(Keys(prefix).batch(b.id), "completed") == done_at_kill
    finally:
        if p.poll() is None:
            p.kill()
    with serve_gateway(_settings(redis_url, prefix, batch_feed_limit=4)) as base2:
        oai = _client(base2)
        assert oai.batches.retrieve(b.id).status == "in_progress"
        b = wait_batch(oai, b.id)
        assert b.status == "completed" and b.request_counts.completed == n and b.request_counts.failed == 0
        out = by_custom_id(lines_of(oai, b.output_file_id))
        assert set(out) == {f"r{i}" for i in range(n)}
        sync = httpx.post(base2 + "/v1/chat/completions", json=lines[7]["body"], timeout=60).json()
        assert out["r7"]["response"]["body"]["choices"] == sync["choices"]
    # Every request ran once: the worker served the batch's 30 and the one sync request, no more.
    wait_for(lambda: _served(r, prefix, w.name) >= served0 + n + 1, 10, 0.1, "the worker's count")
    time.sleep(1.0)
    assert _served(r, prefix, w.name) == served0 + n + 1
    assert not list(r.scan_iter(match=f"{prefix}:result:{b.id}-*"))  # no stray run left a result behind


def _ok(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def own_worker(redis_url, tiny_model_dir, tmp_path):
    """(prefix, WorkerProcess) on a prefix of this test's own. A gateway that an earlier test
    left running on the shared worker's prefix would carry batches too (seen once: a third
    runner held one of the leases)."""
    prefix, w = start_worker("tqshare", redis_url, tiny_model_dir, tmp_path)
    try:
        yield prefix, w
    finally:
        stop_worker(redis_url, prefix, w)


def test_gateways_share_batches(own_worker, redis_url, r, monkeypatch):
    monkeypatch.setattr(runner, "MAX_CARRIED", 2)
    prefix, _ = own_worker
    keys = Keys(prefix)
    s = _settings(redis_url, prefix, batch_feed_limit=2)
    with serve_gateway(s) as a, serve_gateway(s) as b:
        clients = [_client(a), _client(b)]
        ids = [submit(clients[i % 2], [chat_line(f"x{j}", "y", max_tokens=8) for j in range(6)]).id for i in range(4)]
        holders = set()

        def all_done() -> bool:
            for bid in ids:
                v = r.get(keys.batch_lease(bid))
                if v:
                    holders.add(v.decode().split(":", 1)[0])
            return all(clients[0].batches.retrieve(bid).status == "completed" for bid in ids)

        wait_for(all_done, 120, 0.05, "all four batches")
        assert len(holders) == 2  # both gateways carried batches
        for bid in ids:
            got = clients[1].batches.retrieve(bid)
            assert got.request_counts.completed == 6
            assert len(by_custom_id(lines_of(clients[0], got.output_file_id))) == 6
