"""An in-process worker Service on a tiny real model and the real Redis, stepped by hand
(for the intake, outbox and recovery tests: they look at its state between loop iterations)."""

from __future__ import annotations

import time

import torch
from tiny import tiny_model, tiny_tokenizer

from common.settings import Settings
from worker.config import EngineConfig
from worker.engine import Engine
from worker.service import Service

torch.set_num_threads(1)


def make_service(redis_url: str, prefix: str, name: str = "svc-test", write_behind: bool = True, **settings) -> Service:
    model = tiny_model("llama", dtype=torch.float64)
    engine = Engine(model, tiny_tokenizer(), EngineConfig(num_pages=64, device="cpu", check_invariants=False))
    s = Settings(redis_url=redis_url, prefix=prefix, name=name, heartbeat_s=0.3, claim_idle_s=2.0, **settings)
    svc = Service(engine, s, model_name="tiny", device="cpu", write_behind=write_behind)
    assert svc._connect()
    return svc


def run_until(svc: Service, done, timeout: float = 60.0) -> None:
    """Loop iterations until ``done()`` holds."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        svc.run_once()


def final_entry(r, key: str) -> dict[str, str] | None:
    """The final (done/error) entry of a result stream, as text, or None."""
    for _, fields in r.xrange(key):
        f = {k.decode(): v.decode() for k, v in fields.items()}
        if f.get("type") in ("done", "error"):
            return f
    return None
