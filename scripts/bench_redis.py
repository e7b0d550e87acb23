#!/usr/bin/env python
"""The Redis side of tokenq alone: the worker's own publish path (Outbox, Wire, the scripts;
on a cluster the fenced per-slot scripts) driven without a model, on one Redis and on a
3-master cluster, each started here on loopback.

Each simulated worker runs ``--batch`` requests at a time; each step it publishes one token
entry per request (as the worker does after engine.step()) and, every ``--tokens`` steps,
finishes the batch (final entry + XACK + XDEL) and takes the next (XADD by a producer,
XREADGROUP, on a cluster the fence take). ``--rate`` caps each worker's token entries per
second (0: as fast as it goes). P worker processes run side by side (``--workers 1,4``).

Reports token entries per second sustained, over all workers, and the step latency. With
this machine's cores shared, the client side (Python) is often the limit; a step's Redis
cost is in the per-step latency.

    flock /tmp/bench.lock python scripts/bench_redis.py --workers 1,2,4 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common.keys import Keys, fence_key  # noqa: E402
from common.protocol import done_entry, token_entry  # noqa: E402
from common.redis import connect  # noqa: E402
from worker.service.connection import ensure_groups  # noqa: E402
from worker.service.outbox import Finalize, Outbox, PublishTokens, Wire  # noqa: E402
from worker.service.scripts import Scripts  # noqa: E402


def worker(url: str, prefix: str, name: str, batch: int, tokens: int, rate: float, seconds: float,
           wait_ms: int, q: mp.Queue) -> None:
    r = connect(url)
    keys = Keys(prefix)
    scripts = Scripts(r)
    wire = Wire(scripts, keys, name, 1000, 600, wait_ms)
    stream = keys.requests("normal")
    outbox = Outbox()
    entries, steps, lat = 0, 0, []
    t0 = time.perf_counter()
    batch_ids: list[tuple[str, str]] = []
    while time.perf_counter() - t0 < seconds:
        if steps % tokens == 0:
            for rid, eid in batch_ids:
                outbox.add(Finalize(stream, eid, keys.result(rid), done_entry(rid, "length", prompt_tokens=1,
                                                                              completion_tokens=tokens, queue_s=0,
                                                                              ttft_s=0, total_s=0)))
            batch_ids = _take(r, keys, scripts, name, stream, batch)
        s = time.perf_counter()
        outbox.add(PublishTokens([(keys.result(rid), token_entry(steps % tokens, [7], "x")) for rid, _ in batch_ids]))
        outbox.flush(r, wire)
        lat.append(time.perf_counter() - s)
        entries += len(batch_ids)
        steps += 1
        if rate > 0:
            ahead = entries / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
    q.put((entries, time.perf_counter() - t0, lat))


def _take(r, keys: Keys, scripts: Scripts, name: str, stream: str, n: int) -> list[tuple[str, str]]:
    """n new requests: XADD (the producer's part), XREADGROUP, the fence on a cluster."""
    pipe = r.pipeline(transaction=False)
    for _ in range(n):
        pipe.xadd(stream, {"id": uuid.uuid4().hex[:12], "input_ids": "[1]"})
    pipe.execute()
    got = []
    for _, es in r.xreadgroup(keys.group, name, {stream: ">"}, count=n) or []:
        for eid, f in es:
            got.append((f[b"id"].decode(), eid.decode()))
    if scripts.cluster:
        pipe = r.pipeline(transaction=False)
        for rid, _ in got:
            scripts.fence_take(pipe, fence=fence_key(keys.result(rid)), reply_to=keys.result(rid), owner=name,
                               claim=False, ttl_s=600)
        pipe.execute()
    return got


def run(url: str, workers: int, a: argparse.Namespace) -> dict:
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    ensure_groups(connect(url), Keys(prefix))
    q: mp.Queue = mp.Queue()
    procs = [mp.Process(target=worker, args=(url, prefix, f"w{i}", a.batch, a.tokens, a.rate, a.seconds,
                                             a.replica_wait_ms, q)) for i in range(workers)]
    for p in procs:
        p.start()
    res = [q.get() for _ in procs]
    for p in procs:
        p.join()
    lat = sorted(x for _, _, ls in res for x in ls)
    return {"workers": workers, "entries_per_s": round(sum(e / t for e, t, _ in res)),
            "step_ms_p50": round(1000 * statistics.median(lat), 2), "step_ms_p99": round(1000 * lat[int(len(lat) * .99)], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker process counts")
    ap.add_argument("--batch", type=int, default=32, help="requests per worker step")
    ap.add_argument("--tokens", type=int, default=64, help="token entries per request")
    ap.add_argument("--rate", type=float, default=0.0, help="token entries/s per worker (0: unthrottled)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--replica-wait-ms", type=int, default=0, help="WAIT before acks (cluster)")
    ap.add_argument("--modes", default="single,cluster")
    a = ap.parse_args()
    from redis_cluster import LocalCluster

    from common.local_redis import LocalRedis
    rows = []
    for mode in a.modes.split(","):
        server = LocalRedis().start() if mode == "single" else LocalCluster().start()
        try:
            for n in map(int, a.workers.split(",")):
                row = {"mode": mode, **run(server.url, n, a)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            server.stop() if mode == "single" else server.cleanup()
    print("\n| mode | workers | token entries/s | step p50 ms | step p99 ms |\n|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['mode']} | {x['workers']} | {x['entries_per_s']} | {x['step_ms_p50']} | {x['step_ms_p99']} |")


if __name__ == "__main__":
    main()
