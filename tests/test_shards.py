"""Sharded request streams (``request_shards`` N per level) on the real Redis: producers spread
entries over the shards, a worker reads every shard, fairly, and priorities hold across them."""

from __future__ import annotations

from collections import Counter

import torch
from service_helpers import final_entry, run_until
from tiny import tiny_model, tiny_tokenizer

from common.keys import Keys
from common.settings import Settings
from producer import Client
from worker.config import EngineConfig
from worker.engine import Engine
from worker.service import Service, intake

FIELDS = {"input_ids": "[5, 6, 7]", "max_tokens": "3", "temperature": "0", "ignore_eos": "1"}


def service(redis_url: str, prefix: str, max_num_seqs: int = 64) -> Service:
    engine = Engine(tiny_model("llama", dtype=torch.float64), tiny_tokenizer(),
                    EngineConfig(num_pages=64, device="cpu", max_num_seqs=max_num_seqs, check_invariants=False))
    s = Settings(redis_url=redis_url, prefix=prefix, name="shards", heartbeat_s=0.3, claim_idle_s=2.0,
                 request_shards=3, aging_s=0)
    svc = Service(engine, s, model_name="tiny", device="cpu")
    assert svc._connect()
    return svc


def test_key_names_and_levels_of_shards():
    keys = Keys("p", 3)
    assert keys.level_streams("high") == ["p:requests:high", "p:requests:high:1", "p:requests:high:2"]
    assert keys.level_of_stream("p:requests:low:2") == "low" and keys.level_of_stream("p:requests:low:3") is None
    assert Keys("p").request_streams == ["p:requests:high", "p:requests:normal", "p:requests:low"]
    assert Counter(keys.submit_stream("normal") for _ in range(300)).keys() == set(keys.level_streams("normal"))


def test_a_worker_serves_every_shard_and_the_client_spreads(redis_url, prefix, r, monkeypatch):
    svc = service(redis_url, prefix)
    keys = svc.keys
    for shard in range(3):
        for i in range(2):
            r.xadd(keys.requests("normal", shard), {"id": f"s{shard}-{i}", **FIELDS})
    monkeypatch.setenv("TOKENQ_REQUEST_SHARDS", "3")
    with Client(redis_url, prefix) as c:
        handles = [c.submit(input_ids=[5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True) for _ in range(9)]
        ids = [f"s{s}-{i}" for s in range(3) for i in range(2)] + [h.id for h in handles]
        run_until(svc, lambda: all(final_entry(r, keys.result(i)) for i in ids) and not svc.outbox)
        outs = {tuple(h.result(timeout=30).token_ids) for h in handles}
    assert all(final_entry(r, keys.result(i))["type"] == "done" for i in ids) and len(outs) == 1
    assert all(r.xlen(s) == 0 for s in keys.request_streams)
    svc.r.close()


def test_priorities_hold_across_shards_and_shards_take_turns(redis_url, prefix, r):
    svc = service(redis_url, prefix, max_num_seqs=2)
    keys = svc.keys
    for i in range(3):
        r.xadd(keys.requests("normal", 0), {"id": f"n{i}", **FIELDS})
    for i in range(2):
        r.xadd(keys.requests("high", 2), {"id": f"h{i}", **FIELDS})
    intake.pull(svc)  # room for two: the high entries, though they sit on the last shard
    assert set(svc.inflight) == {"h0", "h1"}
    run_until(svc, lambda: not svc.inflight and not svc.outbox)
    for shard in range(3):
        r.xadd(keys.requests("normal", shard), {"id": f"m{shard}", **FIELDS})
    seen = []
    for _ in range(3):  # room for one entry a pass: each pass starts at the next shard
        # Every shard rung, as once the doorbell thread has seen the entries land (it runs on its
        # own time: left to it, the loop's own pulls raced this one and the test was flaky).
        svc.doorbell.ring_all()
        before = set(svc.inflight)
        assert intake._read_level(svc, "normal", 1) == 1
        seen += [svc.inflight[i].stream for i in set(svc.inflight) - before]
    assert sorted(seen) == sorted(keys.level_streams("normal")), seen
    run_until(svc, lambda: not svc.inflight and not svc.outbox)
    svc.r.close()
