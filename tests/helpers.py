"""Test helpers: real worker processes and raw result-stream readers (no tokenq client code)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent


def thp_mode() -> str | None:
    """Linux's transparent huge page mode ('always', 'madvise', 'never'; None where it has none)."""
    try:
        return open("/sys/kernel/mm/transparent_hugepage/enabled").read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


class WorkerProcess:
    """A real ``tokenq-worker`` process (python -m worker.main) serving one prefix."""

    def __init__(self, proc: subprocess.Popen, name: str, log_path: Path, redis_url: str, prefix: str):
        self.proc, self.name, self.log_path, self.redis_url, self.prefix = proc, name, log_path, redis_url, prefix

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> WorkerProcess:
        r = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout
        while not r.exists(f"{self.prefix}:worker:{self.name}"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker not ready:\n{self.log[-3000:]}")
            time.sleep(0.1)
        return self

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait: the graceful path."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def spawn_worker(prefix: str, *, model: str, url: str, log_dir: Path, args: list[str] | None = None,
                 name: str | None = None, ready: bool = True, env: dict | None = None) -> WorkerProcess:
    """Defaults suit tests: float64 (exact greedy), a small cache, fast heartbeats and claims."""
    name = name or f"w-{uuid.uuid4().hex[:6]}"
    log_path = Path(log_dir) / f"{name}.log"
    cmd = [sys.executable, "-m", "worker.main", "--model", model, "--redis-url", url, "--prefix", prefix, "--name", name,
           "--dtype", "float64", "--num-pages", "256", "--heartbeat-s", "0.3", "--claim-idle-s", "2", "--grace-s", "20",
           *(args or [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    w = WorkerProcess(proc, name, log_path, url, prefix)
    return w.wait_ready() if ready else w


def _str(d: dict) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode("utf-8", "replace") if isinstance(v, bytes) else v) for k, v in d.items()}


def read_result(r: redis.Redis, key: str, timeout: float = 60.0) -> tuple[list[int], str, dict[str, str], list[dict]]:
    """Read a result stream like a client: XREAD until the final entry, dropping seqs already seen.

    Returns (token ids, text, final entry, all raw entries).
    """
    last, ids, text, raw = "0", [], "", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = r.xread({key: last}, block=500, count=100)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                e = _str(fields)
                raw.append(e)
                if e["type"] == "token":
                    seq = int(e["seq"])
                    assert seq <= len(ids), f"{key}: gap before seq {seq} (have {len(ids)})"
                    if seq == len(ids):
                        new = json.loads(e["ids"])
                        ids.extend(new)
                        text += e["text"]
                else:
                    return ids, text, e, raw
    raise TimeoutError(f"no final entry on {key} after {timeout}s; got {raw[-3:]}")


def drop_rq_queue(r: redis.Redis, name: str) -> None:
    """Remove an rq queue a test made: the queue, its name in rq's set of queues, its
    registries and every job that passed through it."""
    from rq import Queue  # here: most tests never load rq

    q = Queue(name, connection=r)
    ids = set(q.job_ids)
    for reg in (q.finished_job_registry, q.failed_job_registry, q.deferred_job_registry, q.started_job_registry):
        ids.update(reg.get_job_ids())
    q.delete(delete_jobs=True)
    keys = [k for pattern in [f"rq:*{name}*", *(f"rq:*{i}*" for i in ids)] for k in r.scan_iter(match=pattern)]
    if keys:
        r.delete(*keys)
