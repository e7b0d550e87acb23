"""Helpers for the producer tests: one real worker shared by the producer test files, the gateway
served by a real uvicorn in a thread, and a result-stream writer that speaks the protocol.

The writer (:func:`publish`) is only for Redis-level tests of reading, dedup and resume: it
XADDs entries made by ``common.protocol``'s encoders, exactly what a worker writes. Tests of
behaviour use the real ``tokenq-worker`` process.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import redis

from common.local_redis import free_port
from common.protocol import done_entry, error_entry, token_entry


def publish(r: redis.Redis, key: str, entries: list[dict[str, str]]) -> None:
    for e in entries:
        r.xadd(key, e)


def tokens(*chunks: tuple[int, list[int], str]) -> list[dict[str, str]]:
    return [token_entry(seq, ids, text) for seq, ids, text in chunks]


def done(rid: str, reason: str = "stop", prompt_tokens: int = 3, completion_tokens: int = 0) -> dict[str, str]:
    return done_entry(rid, reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      queue_s=0.01, ttft_s=0.02, total_s=0.05)


def error(rid: str, code: str = "internal", message: str = "boom") -> dict[str, str]:
    return error_entry(rid, code, message)


# ---------------------------------------------------------------------------- a shared real worker


def start_worker(tag: str, redis_url: str, model_dir: str, log_dir: Path):
    """(prefix, WorkerProcess): a real worker on a new prefix ``<tag>-<random>``."""
    from helpers import spawn_worker

    prefix = f"{tag}-{uuid.uuid4().hex[:8]}"
    return prefix, spawn_worker(prefix, model=str(model_dir), url=redis_url, log_dir=log_dir,
                                args=["--max-num-seqs", "16"])


def stop_worker(redis_url: str, prefix: str, w) -> None:
    """Kill a worker from start_worker and remove its prefix's keys."""
    w.kill()
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


def shared_worker(request, redis_url: str, model_dir: str, tmp_path_factory):
    """(prefix, WorkerProcess): one real worker on a prefix of its own, started once per pytest
    session for all producer test files (a worker takes ~10 s to start on these machines),
    killed and its keys removed when the session ends."""
    cfg = request.config
    cached = getattr(cfg, "_tokenq_producer_worker", None)
    if cached is not None and cached[1].proc.poll() is None:
        return cached
    prefix, w = start_worker("tqprod", redis_url, model_dir, Path(tmp_path_factory.mktemp("producer-worker")))
    cfg._tokenq_producer_worker = (prefix, w)
    cfg.add_cleanup(lambda: stop_worker(redis_url, prefix, w))
    return prefix, w


# ---------------------------------------------------------------------------- the gateway


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``tokenq`` in this process: (exit code, stdout, stderr)."""
    from producer.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@contextlib.contextmanager
def serve_gateway(settings, timeout: float = 20.0) -> Iterator[str]:
    """Serve ``create_app(settings)`` with a real uvicorn on a free port; yields the base URL."""
    import uvicorn

    from producer.gateway import create_app

    port = free_port()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    t = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not t.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)


def wait_for(cond, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)
