"""Shared fixtures: a real Redis server (never a fake), unique key prefixes, tiny models."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One math thread per process: tests run several processes (workers, clients) on 2 shared
# cores, where torch's default of one thread per core oversubscribes and slows all of them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU, Triton kernels (worker/gpu_attention.py) run on the CPU through Triton's
# interpreter (tests/test_gpu_attention.py). Triton reads this when it is imported: here, first.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common.local_redis import LocalRedis, ensure  # noqa: E402


@pytest.fixture(scope="session")
def redis_url():
    """The Redis the suite shares: TOKENQ_REDIS_URL / localhost:6379, or one started for the run."""
    url, server = ensure()
    yield url
    if server is not None:
        server.cleanup()


@pytest.fixture
def prefix(redis_url):
    """A key prefix of this test's own, so runs sharing a server never collide; keys removed after."""
    import redis

    p = f"tqtest-{uuid.uuid4().hex[:10]}"
    yield p
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{p}:*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture
def r(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def local_redis():
    """Factory for private redis-server processes (restart, AUTH, AOF tests)."""
    servers: list[LocalRedis] = []

    def make(**kw) -> LocalRedis:
        s = LocalRedis(**kw).start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.cleanup()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama (float32 weights) with a locally trained tokenizer, as a model directory."""
    from tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real default model (converted once into the user cache)."""
    from worker.models import smollm2_dir

    return str(smollm2_dir())


from hypothesis import HealthCheck, settings  # noqa: E402

# Shared 2-core machines: no per-example deadlines, no "too slow" failures.
settings.register_profile("tokenq", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("tokenq")



@pytest.fixture
def worker_factory(redis_url, tmp_path, tiny_model_dir):
    """Start real worker processes: ``worker_factory(prefix, model=..., args=[...], name=...)``.

    Defaults suit tests: the tiny model in float64 (so greedy output can be compared exactly),
    a small cache, fast heartbeats and claims. Every process is killed at the end.
    """
    from helpers import spawn_worker

    procs = []

    def start(prefix: str, **kw):
        kw.setdefault("model", tiny_model_dir)
        kw.setdefault("url", redis_url)
        w = spawn_worker(prefix, log_dir=tmp_path, **kw)
        procs.append(w)
        return w

    yield start
    for w in procs:
        w.kill()
