"""Recovery on an in-process worker and the real Redis: resuming its own entries, claiming a
dead worker's, dead-lettering a poison entry, dropping an entry another worker took, release."""

from __future__ import annotations

import json
import time

import pytest
from service_helpers import final_entry, make_service, run_until

from common.keys import Keys
from common.protocol import token_entry
from worker.service import recovery


@pytest.fixture
def svc(redis_url, prefix):
    s = make_service(redis_url, prefix)
    yield s
    s.r.close()


def request(r, keys: Keys, rid: str, max_tokens: int = 4) -> str:
    return r.xadd(keys.requests("normal"), {"id": rid, "input_ids": "[5, 6, 7]", "max_tokens": str(max_tokens),
                                            "temperature": "0", "ignore_eos": "1"}).decode()


def tokens_of(r, key: str) -> list[tuple[int, list[int]]]:
    out = []
    for _, f in r.xrange(key):
        if f[b"type"] == b"token":
            out.append((int(f[b"seq"]), json.loads(f[b"ids"])))
    return out


def test_resume_own_entries_from_the_published_tokens(redis_url, prefix, r):
    """A worker restarted under the same name resumes what its consumer held, after the tokens
    its earlier run published (no seq repeated, the total is max_tokens)."""
    keys = Keys(prefix)
    first = make_service(redis_url, prefix, name="same")
    request(r, keys, "res", max_tokens=5)
    run_until(first, lambda: tokens_of(r, keys.result("res")))
    first.r.close()  # the earlier run dies here, its entry still pending
    published = tokens_of(r, keys.result("res"))
    second = make_service(redis_url, prefix, name="same")
    assert "res" in second.inflight and second.inflight["res"].resumed_tokens == sum(len(i) for _, i in published)
    run_until(second, lambda: final_entry(r, keys.result("res")))
    final = final_entry(r, keys.result("res"))
    seqs = [s for s, _ in tokens_of(r, keys.result("res"))]
    assert final["type"] == "done" and final["completion_tokens"] == "5" and seqs == sorted(set(seqs))
    assert r.xpending(keys.requests("normal"), keys.group)["pending"] == 0


def test_claims_a_dead_workers_entry_and_dead_letters_a_poison_one(svc, r, prefix, caplog):
    keys = Keys(prefix)
    stream = keys.requests("normal")
    request(r, keys, "orphan", max_tokens=2)
    poison = request(r, keys, "poison", max_tokens=2)
    r.xreadgroup(keys.group, "dead-worker", {stream: ">"}, count=2)
    for _ in range(svc.s.max_attempts):  # delivered again and again: every worker serving it died
        r.xclaim(stream, keys.group, "dead-worker", 0, [poison])
    time.sleep(svc.s.claim_idle_s + 0.1)
    recovery.claim(svc)
    assert "orphan" in svc.inflight and "poison" not in svc.inflight and svc.counts["dead"] == 1
    run_until(svc, lambda: final_entry(r, keys.result("orphan")) and not svc.outbox)
    assert final_entry(r, keys.result("orphan"))["type"] == "done"
    err = final_entry(r, keys.result("poison"))
    assert err["code"] == "internal" and "deliveries" in err["message"]
    assert r.xrange(keys.dead)[0][1][b"id"] == b"poison" and "event=dead_letter" in caplog.text
    assert r.xlen(stream) == 0


def test_an_entry_another_worker_claimed_is_dropped_with_its_pending_writes(svc, r, prefix):
    keys = Keys(prefix)
    stream = keys.requests("normal")
    entry_id = request(r, keys, "taken", max_tokens=50)
    run_until(svc, lambda: "taken" in svc.inflight)
    svc.outbox.add(recovery.answers.PublishTokens([(keys.result("taken"), token_entry(99, [1], "x"))]))
    r.xclaim(stream, keys.group, "thief", 0, [entry_id])
    recovery.refresh(svc)
    assert "taken" not in svc.inflight and "taken" not in svc.engine and not svc.outbox
    assert r.xpending_range(stream, keys.group, "-", "+", 1)[0]["consumer"] == b"thief"


def test_release_hands_entries_back_long_idle(svc, r, prefix):
    keys = Keys(prefix)
    request(r, keys, "rel", max_tokens=50)
    run_until(svc, lambda: "rel" in svc.inflight)
    svc._release_all()
    assert not svc.inflight and not svc.engine.has_unfinished()
    p = r.xpending_range(keys.requests("normal"), keys.group, "-", "+", 1)[0]
    assert p["time_since_delivered"] > 10**8
