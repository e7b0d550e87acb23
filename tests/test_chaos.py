"""Worker crashes: three workers on one queue, a chaos loop SIGKILLs one at random and starts a
replacement, several times, while a few hundred greedy requests of mixed priority and length
run. Every request ends with exactly one final entry, a client sees each seq once and in order,
greedy outputs equal transformers' own generate, and nothing is left pending.

The default run is a short version (~1-2 minutes on 2 cores); ``-m slow`` runs the long one.
"""

from __future__ import annotations

import pytest
from reliability import (
    Fleet,
    Reference,
    backlog,
    env_int,
    mixed_requests,
    pending_total,
    run_chaos,
    wait_until,
)

# Chaos kills are not the request's fault: allow many deliveries so no innocent request is
# dead-lettered because the workers serving it were killed more than max_attempts times.
WORKER_ARGS = ["--max-attempts", "50", "--max-num-seqs", "16", "--claim-idle-s", "2"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return Reference(tiny_model_dir)


def chaos(r, prefix, tiny_model_dir, redis_url, tmp_path, reference, n, kills, kill_every, seed):
    specs = mixed_requests(n, seed=seed, tag="c", max_tokens=(2, 60))
    for s in specs:  # references first: the workers must not share the CPU with this
        reference(s.input_ids, s.max_tokens)
    fleet = Fleet(prefix, tiny_model_dir, redis_url, tmp_path, args=WORKER_ARGS, seed=seed)
    try:
        fleet.start(3, ready=True)
        tally = run_chaos(r, fleet, specs, reference, kills=kills, kill_every=kill_every)
        assert not fleet.crashes(), fleet.crashes()
        assert tally.ok and tally.done == n and tally.errors == 0, (tally, fleet.logs()[-6000:])
        assert tally.reasons == {"length": n}
        assert len(fleet.killed) == kills
        assert fleet.hits >= kills, "the kills did not hit workers holding requests"
        assert fleet.grep("event=claimed") >= kills
        print(f"\nchaos: {tally}, held by the killed={fleet.hits}, claimed={fleet.grep('event=claimed')}")
        wait_until(lambda: pending_total(r, prefix) == 0, 10, "pending lists to empty")
        assert backlog(r, prefix) == 0
        return tally
    finally:
        fleet.close()


def test_chaos_short(r, prefix, tiny_model_dir, redis_url, tmp_path, reference):
    chaos(r, prefix, tiny_model_dir, redis_url, tmp_path, reference, n=env_int("TOKENQ_CHAOS_N", 60), kills=3,
          kill_every=4.0, seed=1)


@pytest.mark.slow
def test_chaos_long(r, prefix, tiny_model_dir, redis_url, tmp_path, reference):
    chaos(r, prefix, tiny_model_dir, redis_url, tmp_path, reference, n=env_int("TOKENQ_CHAOS_N_LONG", 300), kills=10,
          kill_every=5.0, seed=2)


def test_frozen_worker_gives_up_what_was_claimed(r, prefix, worker_factory, reference):
    """A worker frozen (SIGSTOP: a GC pause, a stalled VM) past claim_idle_s loses its requests to
    another worker. When it wakes it must not take them back nor publish a second final entry."""
    import json
    import signal

    from helpers import read_result
    from reliability import WORKER_ENV, Tally, check_stream

    args = ["--claim-idle-s", "1.5", "--max-num-seqs", "4"]
    a = worker_factory(prefix, name="sleeper", args=args, env=WORKER_ENV)
    prompts = {f"z{i}": [7 + i, 8, 9, 10 + i] for i in range(3)}
    for rid, ids in prompts.items():
        r.xadd(f"{prefix}:requests:normal", {"id": rid, "input_ids": json.dumps(ids), "max_tokens": "400",
                                             "temperature": "0", "ignore_eos": "true"})
    wait_until(lambda: all(r.xlen(f"{prefix}:result:{rid}") >= 3 for rid in prompts), 60, "first tokens")
    a.proc.send_signal(signal.SIGSTOP)
    try:
        b = worker_factory(prefix, name="rescuer", args=args, env=WORKER_ENV)
        wait_until(lambda: b.log.count("event=claimed") >= len(prompts), 60, "the rescuer to claim")
    finally:
        a.proc.send_signal(signal.SIGCONT)  # wakes while the rescuer is still generating
    tally = Tally()
    for rid, ids in prompts.items():
        check_stream(r, f"{prefix}:result:{rid}", tally, reference(ids, 400))
    assert tally.ok and tally.done == len(prompts), tally
    wait_until(lambda: a.log.count("event=lost_entry") + a.log.count("event=final_skipped") >= 1, 10, "the sleeper to notice")
    assert a.proc.poll() is None and b.proc.poll() is None
    # the sleeper still serves new work
    r.xadd(f"{prefix}:requests:high", {"id": "after", "prompt": "still there?", "max_tokens": "3"})
    assert read_result(r, f"{prefix}:result:after")[2]["type"] == "done"
    wait_until(lambda: pending_total(r, prefix) == 0, 10, "pending lists to empty")


@pytest.mark.slow  # test_service.py::test_sigterm_finishes_or_releases covers release in the default run
def test_sigterm_releases_to_a_peer(r, prefix, worker_factory, reference):
    """Graceful stop with a short grace: what is still running is released (marked long idle) and
    a peer resumes it at once from the tokens already published: one final entry, exact output."""
    import json

    from reliability import WORKER_ENV, Tally, check_stream

    a = worker_factory(prefix, name="leaving", args=["--grace-s", "0.1", "--max-num-seqs", "4"], env=WORKER_ENV)
    prompts = {f"s{i}": [20 + i, 21, 22] for i in range(3)}
    for rid, ids in prompts.items():
        r.xadd(f"{prefix}:requests:normal", {"id": rid, "input_ids": json.dumps(ids), "max_tokens": "600",
                                             "temperature": "0", "ignore_eos": "true"})
    wait_until(lambda: all(r.xlen(f"{prefix}:result:{rid}") >= 5 for rid in prompts), 60, "first tokens")
    assert a.stop() == 0
    assert "event=released count=3" in a.log, a.log[-2000:]
    b = worker_factory(prefix, name="peer", args=["--claim-idle-s", "30"], env=WORKER_ENV)  # claims them long before 30 s
    tally = Tally()
    for rid, ids in prompts.items():
        check_stream(r, f"{prefix}:result:{rid}", tally, reference(ids, 600), timeout=120)
    assert tally.ok and tally.done == len(prompts), tally
    assert b.log.count("event=claimed") == len(prompts)
    wait_until(lambda: pending_total(r, prefix) == 0, 10, "pending lists to empty")
