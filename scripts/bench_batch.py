#!/usr/bin/env python
"""Batch jobs against direct queueing, with interactive traffic beside them.

One run, one worker process (the tests' tiny model), one gateway process, the same N requests
(default 1,000: /v1/completions bodies, random token-id prompts of 8-64 tokens, 8-32 output
tokens, greedy, EOS ignored) sent two ways:

  direct   every request XADDed at once to ``requests:low`` by the producer client, then all
           result streams read to their ends (what a client that floods the queue gets)
  batch    one JSONL file through ``POST /v1/files`` + ``POST /v1/batches`` (priority low),
           fed by the gateway under ``batch_feed_limit``, timed from create to ``completed``

Meanwhile a probe streams a ``high`` request (8 tokens) through the gateway every
``--probe-every`` seconds and takes its time to first token; the same probe on the idle
worker first gives the baseline. Printed:
output tokens/s of each way, the batch/direct ratio, probe TTFT (mean, p90) idle / during
direct / during batch. ``--repeat R`` alternates direct and batch R times and keeps each one's
best throughput (shared machines are noisy).

    flock /tmp/bench.lock python scripts/bench_batch.py [--requests 1000] [--repeat 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import httpx  # noqa: E402
import redis  # noqa: E402

from common.local_redis import free_port  # noqa: E402
from producer import Client  # noqa: E402


def workload(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"model": "tiny", "prompt": [rng.randrange(3, 500) for _ in range(rng.randint(8, 64))],
             "max_tokens": rng.randint(8, 32), "temperature": 0, "ignore_eos": True} for _ in range(n)]


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


class Probe(threading.Thread):
    """Interactive traffic: a streamed ``high`` /v1/completions request through the gateway every
    ``every`` s, each timed to its first token (so the gateway's own load counts too)."""

    def __init__(self, base: str, every: float):
        super().__init__(daemon=True)
        self.base, self.every = base, every
        self.ttft: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "stream": True, "priority": "high"}
        with httpx.Client(base_url=self.base, timeout=120) as h:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                first = None
                with h.stream("POST", "/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if first is None and line.startswith("data: {"):  # the first text (empty deltas are not sent)
                            first = time.perf_counter() - t0
                if first is not None:
                    self.ttft.append(first)
                self.stop.wait(max(0.0, self.every - (time.perf_counter() - t0)))

    def finish(self) -> list[float]:
        self.stop.set()
        self.join(180)
        return self.ttft


def run_direct(client: Client, bodies: list[dict]) -> tuple[float, int]:
    t0 = time.perf_counter()
    handles = client.submit_many([{"input_ids": b["prompt"], "max_tokens": b["max_tokens"], "temperature": 0,
                                   "ignore_eos": True, "priority": "low"} for b in bodies])
    r = client.redis
    last = {h.key: "0" for h in handles}
    tokens = 0
    while last:  # one XREAD over every open result stream, like the gateway's batch runner
        reply = r.xread(last, block=1000, count=1000)
        for key, entries in reply or []:
            key = key.decode()
            for eid, fields in entries:
                last[key] = eid
                typ = fields.get(b"type", b"").decode()
                if typ == "token":
                    tokens += len(json.loads(fields[b"ids"]))
                elif typ in ("done", "error"):
                    del last[key]
                    break
    return time.perf_counter() - t0, tokens


def run_batch(base: str, bodies: list[dict]) -> tuple[float, int]:
    lines = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": b}).encode()
                     + b"\n" for i, b in enumerate(bodies))
    with httpx.Client(base_url=base, timeout=120) as h:
        fid = h.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(lines))}, data={"purpose": "batch"}).json()["id"]
        t0 = time.perf_counter()
        bid = h.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                          "completion_window": "24h"}).json()["id"]
        while True:
            b = h.get(f"/v1/batches/{bid}").json()
            if b["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        if b["status"] != "completed" or b["request_counts"]["failed"]:
            raise SystemExit(f"the batch did not complete cleanly: {b}")
        out = h.get(f"/v1/files/{b['output_file_id']}/content").content.decode().splitlines()
    tokens = sum(json.loads(x)["response"]["body"]["usage"]["completion_tokens"] for x in out)
    return wall, tokens


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) of a process (this one when ``pid`` is None)."""
    if pid is None:
        return time.process_time()
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def stats(xs: list[float]) -> str:
    if not xs:
        return "—"
    p90 = sorted(xs)[max(0, int(0.9 * len(xs)) - 1)]
    return f"{statistics.mean(xs) * 1e3:,.0f} / {p90 * 1e3:,.0f} ms (n={len(xs)})"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis-url", default=os.environ.get("TOKENQ_REDIS_URL", "redis://localhost:6379/0"))
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--feed-limit", type=int, default=256, help="the gateway's batch_feed_limit")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--probe-every", type=float, default=0.5)
    ap.add_argument("--idle-probes", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    return ap.parse_args()


def measure(args: argparse.Namespace, client: Client, base: str, gateway_pid: int) -> dict:
    """The idle probe, then direct and batch ``--repeat`` times, alternating, each with a probe beside it."""
    bodies = workload(args.requests, args.seed)
    run_direct(client, bodies[:32])  # warm-up
    idle = Probe(base, 0.0)
    idle.start()
    wait_until(lambda: len(idle.ttft) >= args.idle_probes, 300, "the idle probes")
    figures: dict = {"idle_ttft": idle.finish(), "direct": [], "batch": []}
    for _ in range(args.repeat):
        for name, fn in (("direct", lambda: run_direct(client, bodies)), ("batch", lambda: run_batch(base, bodies))):
            probe = Probe(base, args.probe_every)
            probe.start()
            cpu0 = (cpu_s(), cpu_s(gateway_pid))
            wall, tokens = fn()
            cpu = (cpu_s() - cpu0[0], cpu_s(gateway_pid) - cpu0[1])
            figures[name].append({"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                                  "probe_ttft": probe.finish(), "client_cpu_s": cpu[0], "gateway_cpu_s": cpu[1]})
            print(f"{name}: {tokens} tokens in {wall:.2f} s = {tokens / wall:,.0f} tok/s", file=sys.stderr)
    return figures


def report(args: argparse.Namespace, figures: dict) -> float:
    best = {k: max(figures[k], key=lambda x: x["tok_s"]) for k in ("direct", "batch")}
    ratio = best["batch"]["tok_s"] / best["direct"]["tok_s"]
    print(f"\n{args.requests} requests, tiny model, 1 worker (max_num_seqs {args.max_num_seqs}), "
          f"batch_feed_limit {args.feed_limit}, best of {args.repeat}\n")
    print("| way | output tok/s | wall s | client / gateway CPU s | high-probe TTFT mean / p90 |")
    print("|---|---:|---:|---:|---|")
    print(f"| idle worker | — | — | — | {stats(figures['idle_ttft'])} |")
    for k in ("direct", "batch"):
        b = best[k]
        print(f"| {k} | {b['tok_s']:,.0f} | {b['wall_s']:.2f} | {b['client_cpu_s']:.1f} / {b['gateway_cpu_s']:.1f} "
              f"| {stats(b['probe_ttft'])} |")
    idle_mean = statistics.mean(figures["idle_ttft"])
    during = [x for f in figures["batch"] for x in f["probe_ttft"]]
    print(f"\nbatch / direct throughput: {ratio:.3f}; high TTFT during the batch / idle: "
          f"{statistics.mean(during) / idle_mean:.2f}x")
    return ratio


def main() -> int:
    args = parse_args()
    from tiny import save_tiny

    prefix = f"tqbench-batch-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(args.redis_url)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny(Path(tmp) / "tiny")
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs.append(start([sys.executable, "-m", "worker.main", "--model", model, "--redis-url", args.redis_url,
                            "--prefix", prefix, "--name", "bench", "--dtype", "float32", "--num-pages", "4096",
                            "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"], env,
                           Path(tmp) / "worker.log"))
        port = free_port()
        procs.append(start([sys.executable, "-m", "producer.cli", "gateway", "--port", str(port), "--redis-url",
                            args.redis_url, "--prefix", prefix, "--model-name", "tiny", "--log-level", "warning",
                            "--batch-feed-limit", str(args.feed_limit)], env, Path(tmp) / "gateway.log"))
        base = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: r.exists(f"{prefix}:worker:bench"), 300, "the worker")
            wait_until(lambda: _up(base + "/health"), 60, "the gateway")
            figures = measure(args, Client(args.redis_url, prefix), base, procs[1].pid)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
            left = list(r.scan_iter(match=f"{prefix}:*", count=1000))
            if left:
                r.delete(*left)
    ratio = report(args, figures)
    if args.json:
        Path(args.json).write_text(json.dumps({"ratio": ratio, **figures}, indent=2))
    return 0


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
