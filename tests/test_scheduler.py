"""Admission control, priorities, preemption (recompute and swap), deadlines and aborts.

Two levels: the Scheduler alone, driven with Sequence objects and a simulated runner that
tracks what each cache page holds (so a wrong swap or a stale prefix is caught without a
model), and the Engine end to end on a tiny real model, where outputs must equal
transformers' generate however often a request was preempted.
"""

from __future__ import annotations

import functools
import itertools
import random
import time
import zlib

import pytest
from engine_helpers import drive, greedy, make_engine, model_pair, random_prompts, reference
from hypothesis import given, settings, target
from hypothesis import strategies as st

from common.errors import TOO_LONG
from common.protocol import SamplingParams
from worker.admission import Decision, decide, pages_to_admit
from worker.cache import BlockAllocator, pages_for
from worker.config import EngineConfig
from worker.scheduler import Scheduler
from worker.sequence import Sequence, Status

MODES = ["recompute", "swap"]


@functools.cache
def pair(family: str = "llama"):
    return model_pair(family, seed=7)


@functools.cache
def ref_tokens(prompt: tuple[int, ...], max_tokens: int, family: str = "llama") -> list[int]:
    return reference(pair(family)[1], list(prompt), max_tokens)


def check_exact(run, requests: dict[str, tuple[list[int], int]], family: str = "llama") -> None:
    for rid, (prompt, max_tokens) in requests.items():
        assert run.tokens(rid) == ref_tokens(tuple(prompt), max_tokens, family), rid
        assert run.reason(rid) == "length", rid


# ============================================================================ the scheduler alone


def make_seq(rid: str, prompt_len: int, max_tokens: int, priority: int = 1, arrival: int = 0, *,
             timeout_s: float | None = None, arrival_time: float = 0.0) -> Sequence:
    # a token of its own per request: prompts share no prefix (one sequence would wait for another's pages)
    token = 3 + zlib.crc32(rid.encode()) % 30000
    return Sequence(rid, [token] * prompt_len, prompt_len, SamplingParams(max_tokens=max_tokens), priority, arrival,
                    arrival_time, seed=0, timeout_s=timeout_s)


class Sim:
    """The scheduler with a simulated runner. Each device and host page slot remembers which
    (request, position) was written there, so every scheduled chunk can check that the prefix
    it claims is cached really is in its pages, after any number of swaps and recomputes."""

    def __init__(self, **cfg):
        cfg.setdefault("check_invariants", True)
        self.cfg = EngineConfig(**cfg)
        c = self.cfg
        self.alloc = BlockAllocator(c.num_pages, c.page_size)
        host_pages = (c.swap_pages if c.swap_pages is not None else c.num_pages) if c.preemption_mode == "swap" else 0
        self.host = BlockAllocator(host_pages, c.page_size) if host_pages else None
        self.max_model_len = min(c.max_model_len or 10**9, c.num_pages * c.page_size)
        self.sched = Scheduler(c, self.alloc, self.max_model_len, self.host)
        self.dev: dict[tuple[int, int], tuple[str, int]] = {}
        self.hst: dict[tuple[int, int], tuple[str, int]] = {}
        self.arrivals = itertools.count()
        self.seqs: dict[str, Sequence] = {}
        self.ended: dict[str, str] = {}  # request id -> finish reason
        self.outputs: dict[str, list[int]] = {}  # output indices emitted, in order
        self.now = 0.0

    def add(self, rid: str, prompt_len: int, max_tokens: int, priority: int = 1, timeout_s: float | None = None) -> Sequence:
        seq = make_seq(rid, prompt_len, max_tokens, priority, next(self.arrivals), timeout_s=timeout_s, arrival_time=self.now)
        self.seqs[rid] = seq
        self.outputs[rid] = []
        self.sched.add(seq)
        return seq

    def abort(self, rid: str) -> None:
        seq = self.seqs[rid]
        if seq.status is not Status.FINISHED:
            self.sched.finish(seq, "cancelled")
            self.ended[rid] = "cancelled"

    def step(self):
        ps = self.cfg.page_size
        out = self.sched.schedule(self.now)
        self.now += 1.0
        for seq in out.finished:
            self.ended[seq.request_id] = seq.finish_reason
        # the runner: swaps first (out, then in), then the forward pass writes the new K/V
        snap = {(p, o): self.dev.get((p, o)) for p in out.swap_out[0] for o in range(ps)}
        for d, h in zip(*out.swap_out):
            for o in range(ps):
                self.hst[(h, o)] = snap[(d, o)]
        for h, d in zip(*out.swap_in):
            for o in range(ps):
                self.dev[(d, o)] = self.hst.get((h, o))
        for s in out.scheduled:
            seq, table, rid = s.seq, s.seq.block_table, s.seq.request_id
            assert s.start == seq.num_computed
            assert s.start + s.num_tokens <= seq.num_tokens
            assert len(table) == pages_for(s.start + s.num_tokens, ps)
            for pos in range(s.start):
                assert self.dev.get((table[pos // ps], pos % ps)) == (rid, pos), f"{rid}: cached position {pos} lost"
            for pos in range(s.start, s.start + s.num_tokens):
                self.dev[(table[pos // ps], pos % ps)] = (rid, pos)
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed = s.start + s.num_tokens
            if s.sample:
                self.outputs[seq.request_id].append(seq.num_output_tokens)
                seq.token_ids.append(4)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.finish(seq, "length")
                    self.ended[seq.request_id] = "length"
        return out

    def run(self, max_steps: int = 5000):
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "the scheduler does not finish"

    def assert_idle(self):
        assert not self.sched.running and not self.sched.waiting
        assert self.alloc.num_free == self.alloc.num_pages and self.alloc.reserved == 0
        if self.host is not None:
            assert self.host.num_free == self.host.num_pages


# ---------------------------------------------------------------------------- admission decisions


def test_reject_too_long_with_a_clear_reason():
    cfg = EngineConfig(page_size=4, num_pages=10)
    alloc = BlockAllocator(10, 4)
    v = decide(make_seq("a", 30, 11), alloc, cfg, 40, 0)
    assert v.decision is Decision.REJECT and v.code == TOO_LONG
    assert "30" in v.reason and "11" in v.reason and "40" in v.reason
    assert decide(make_seq("a", 30, 10), alloc, cfg, 40, 0).decision is Decision.ADMIT
    # prompt alone beyond the whole cache (the engine caps max_model_len by the cache)
    v = decide(make_seq("b", 41, 1), alloc, cfg, 40, 3)
    assert v.decision is Decision.REJECT and v.code == TOO_LONG


def test_defer_when_pages_are_not_free():
    cfg = EngineConfig(page_size=4, num_pages=10, soft_limit=1.0)
    alloc = BlockAllocator(10, 4)
    alloc.allocate(8)
    v = decide(make_seq("a", 9, 4), alloc, cfg, 40, 1)  # 3 pages, 2 free
    assert v.decision is Decision.DEFER and "free" in v.reason
    assert decide(make_seq("a", 8, 4), alloc, cfg, 40, 1).decision is Decision.ADMIT
    alloc.reserved = 1  # pages promised to others do not count as free
    assert decide(make_seq("a", 8, 4), alloc, cfg, 40, 1).decision is Decision.DEFER


def test_soft_limit_keeps_headroom_for_the_most_urgent():
    cfg = EngineConfig(page_size=4, num_pages=10)  # default soft limit 0.9
    assert cfg.soft_limit == 0.9
    alloc = BlockAllocator(10, 4)
    alloc.allocate(7)
    assert decide(make_seq("a", 8, 1, priority=1), alloc, cfg, 40, 1).decision is Decision.ADMIT  # 9 of 10 pages
    v = decide(make_seq("b", 9, 1, priority=1), alloc, cfg, 40, 1)  # 10 of 10: past 90%
    assert v.decision is Decision.DEFER and "soft limit" in v.reason
    assert decide(make_seq("b", 9, 1, priority=2), alloc, cfg, 40, 1).decision is Decision.DEFER
    assert decide(make_seq("c", 9, 1, priority=0), alloc, cfg, 40, 1).decision is Decision.ADMIT
    # an idle engine admits whatever fits: headroom rules never stall progress
    assert decide(make_seq("b", 9, 1, priority=2), alloc, cfg, 40, 0).decision is Decision.ADMIT


def test_policies_optimistic_and_reserve():
    opt = EngineConfig(page_size=4, num_pages=10, watermark=0.2)  # 2 pages of watermark
    res = EngineConfig(page_size=4, num_pages=10, admission_policy="reserve")
    s = make_seq("a", 5, 20)
    assert pages_to_admit(s, opt, 4) == 2 and pages_to_admit(s, res, 4) == 7
    s.token_ids += [4, 4, 4, 4]  # output kept across a preemption counts for optimistic
    assert pages_to_admit(s, opt, 4) == 3 and pages_to_admit(s, res, 4) == 7
    alloc = BlockAllocator(10, 4)
    alloc.allocate(5)
    s = make_seq("b", 5, 20)
    assert decide(s, alloc, opt, 40, 1).decision is Decision.ADMIT  # 2 + 2 <= 5
    assert decide(s, alloc, res, 40, 1).decision is Decision.DEFER  # 7 > 5
    alloc.allocate(2)
    assert decide(s, alloc, opt, 40, 1).decision is Decision.DEFER  # 2 + 2 watermark > 3


# ---------------------------------------------------------------------------- order and preemption, scheduler alone


def test_waiting_order_and_a_preempted_request_keeps_its_place():
    sim = Sim(page_size=4, num_pages=4, max_num_seqs=4, max_num_batched_tokens=64, watermark=0, soft_limit=1.0)
    a = sim.add("a", 8, 8)
    b = sim.add("b", 7, 8)
    sim.step()
    assert [s.request_id for s in sim.sched.running] == ["a", "b"]  # 2 + 2 pages: cache full
    c = sim.add("c", 2, 3)
    sim.add("d", 2, 3, priority=2)
    sim.add("e", 2, 3, priority=1)
    out = sim.step()  # a needs a third page: the least urgent running one (b) is evicted
    assert b.status is Status.WAITING and b.num_preemptions == 1 and sim.sched.num_preemptions == 1
    assert [s.request_id for s in sim.sched.waiting] == ["b", "c", "e", "d"]  # (priority, arrival)
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    # c is small and would fit before b does, but never overtakes it
    while b.status is Status.WAITING:
        assert c.status is Status.WAITING
        sim.step()
    sim.run()
    assert sim.ended == {r: "length" for r in "abcde"}
    assert a.num_preemptions == 0
    sim.assert_idle()


@pytest.mark.parametrize("mode", MODES)
def test_priority_preemption_strictly_higher_only(mode):
    def setup(priority):
        sim = Sim(page_size=4, num_pages=12, max_num_seqs=8, max_num_batched_tokens=64, watermark=0, soft_limit=1.0,
                  preemption_mode=mode)
        low = [sim.add(f"low{i}", 15, 2, priority=2) for i in range(3)]  # 4 pages each, never more
        sim.step()
        assert all(s.status is Status.RUNNING for s in low) and sim.alloc.num_free == 0
        new = sim.add("new", 8, 4, priority=priority)
        return sim, low, new

    sim, low, new = setup(0)
    out = sim.step()
    assert sim.sched.num_preemptions >= 1
    assert low[2].num_preemptions == 1 and low[0].num_preemptions == 0  # most recent low first
    assert new.status is Status.RUNNING and any(s.seq is new for s in out.scheduled)
    if mode == "swap":
        assert out.swap_out[0] and low[2].host_pages is not None
    sim.run()
    assert set(sim.ended.values()) == {"length"}
    sim.assert_idle()

    sim, low, new = setup(2)  # equal priority: waits, evicts nobody
    sim.run()
    assert sim.sched.num_preemptions == 0 and all(s.num_preemptions == 0 for s in low)
    assert set(sim.ended.values()) == {"length"}


@pytest.mark.parametrize("mode", MODES)
def test_priority_preemption_when_sequence_slots_are_full(mode):
    sim = Sim(page_size=4, num_pages=100, max_num_seqs=2, max_num_batched_tokens=64, preemption_mode=mode)
    lo = [sim.add(f"lo{i}", 5, 30, priority=2) for i in range(2)]
    sim.step()
    sim.step()
    mid = sim.add("mid", 5, 3, priority=2)  # equal: waits for a slot
    sim.step()
    assert mid.status is Status.WAITING and sim.sched.num_preemptions == 0
    hi = sim.add("hi", 5, 3, priority=1)  # strictly higher: takes a slot now
    out = sim.step()
    assert hi.status is Status.RUNNING and any(s.seq is hi for s in out.scheduled)
    assert lo[1].num_preemptions == 1 and lo[0].num_preemptions == 0 and sim.sched.num_preemptions == 1
    sim.run()
    assert set(sim.ended.values()) == {"length"}
    sim.assert_idle()


def test_reserve_never_preempts_and_reserves_up_front():
    sim = Sim(page_size=4, num_pages=12, max_num_seqs=8, max_num_batched_tokens=64, admission_policy="reserve", soft_limit=1.0)
    a = sim.add("a", 4, 20, priority=2)  # 6 pages promised
    b = sim.add("b", 4, 20, priority=2)  # 6 more: the whole cache
    sim.step()
    assert a.status is Status.RUNNING and b.status is Status.RUNNING
    assert sim.alloc.reserved == 10 and sim.alloc.num_available == 0  # 2 pages taken, 10 promised
    c = sim.add("c", 4, 4, priority=0)  # urgent, but nothing is evicted for it
    for _ in range(5):
        sim.step()
        assert c.status is Status.WAITING and sim.alloc.num_available == 0
    sim.run()
    assert sim.sched.num_preemptions == 0
    assert set(sim.ended.values()) == {"length"}
    sim.assert_idle()


def test_timeout_and_abort_free_pages_within_one_step():
    sim = Sim(page_size=4, num_pages=8, max_num_seqs=1, max_num_batched_tokens=64, preemption_mode="swap")
    run = sim.add("run", 8, 20)
    sim.step()
    late = sim.add("late", 4, 4, timeout_s=0.5)
    patient = sim.add("patient", 4, 4, timeout_s=100.0)
    sim.step()  # waited 0 s of its 0.5 s
    assert late.status is Status.WAITING
    sim.step()  # 1 s
    assert sim.ended.get("late") == "timeout" and late.status is Status.FINISHED
    assert patient.status is Status.WAITING
    used = sim.alloc.num_used
    assert used == len(run.block_table) > 0
    sim.abort("run")  # running: its pages come back at once
    assert sim.alloc.num_free == sim.alloc.num_pages
    sim.step()
    assert patient.status is Status.RUNNING
    sim.abort("patient")
    sim.run()
    sim.assert_idle()
    # a swapped-out (waiting) sequence gives its host pages back when aborted
    sim = Sim(page_size=4, num_pages=8, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode="swap")
    sim.add("low", 12, 20, priority=2)
    sim.step()
    sim.add("hi", 24, 4, priority=0)
    sim.step()
    low = sim.seqs["low"]
    assert low.status is Status.WAITING and low.host_pages and sim.host.num_used == len(low.host_pages)
    sim.abort("low")
    assert sim.host.num_free == sim.host.num_pages
    sim.run()
    sim.assert_idle()


def test_a_started_request_never_times_out():
    """The deadline is for starting: once a request has produced output, waiting again after a
    preemption does not end it as timeout."""
    sim = Sim(page_size=4, num_pages=8, max_num_seqs=1, max_num_batched_tokens=64)
    low = sim.add("low", 4, 10, priority=2, timeout_s=1.5)
    sim.step()
    sim.add("hi", 4, 20, priority=0)
    sim.step()
    assert low.status is Status.WAITING and low.num_preemptions == 1
    for _ in range(5):  # low waits far past its timeout
        sim.step()
    assert low.status is Status.WAITING
    sim.run()
    assert sim.ended == {"low": "length", "hi": "length"}


# ---------------------------------------------------------------------------- property test, scheduler alone


def sometimes(strategy):
    """None three times in four: most requests run to the end, some are aborted or time out."""
    return st.one_of(st.none(), st.none(), st.none(), strategy)


request_st = st.tuples(
    st.integers(0, 25),  # arrival step
    st.integers(1, 60),  # prompt tokens
    st.integers(1, 40),  # max tokens
    st.integers(0, 2),  # priority
    sometimes(st.integers(0, 60)),  # abort after this many steps
    sometimes(st.floats(0.0, 20.0)),  # timeout (one step = 1 s)
)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=150, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 8]),
    cache_tokens=st.integers(16, 160),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 64),
    policy=st.sampled_from(["optimistic", "optimistic", "reserve"]),
    swap_pages=st.one_of(st.none(), st.integers(1, 20)),
    soft_limit=st.sampled_from([0.5, 0.9, 1.0]),
    watermark=st.sampled_from([0.0, 0.01, 0.1]),
    requests=st.lists(request_st, min_size=1, max_size=14),
)
def test_scheduler_invariants_property(page_size, cache_tokens, max_num_seqs, max_num_batched_tokens, policy, mode,
                                       swap_pages, soft_limit, watermark, requests):
    num_pages = max(2, cache_tokens // page_size)
    sim = Sim(page_size=page_size, num_pages=num_pages, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              admission_policy=policy, preemption_mode=mode, swap_pages=swap_pages, soft_limit=soft_limit, watermark=watermark)
    by_step: dict[int, list] = {}
    for i, r in enumerate(requests):
        by_step.setdefault(r[0], []).append((f"r{i}", *r[1:]))
    step = 0
    aborts: dict[int, list[str]] = {}
    while sim.sched.has_unfinished() or any(k >= step for k in by_step):
        for rid, prompt, max_tokens, priority, abort_at, timeout in by_step.pop(step, []):
            sim.add(rid, prompt, max_tokens, priority, timeout_s=timeout)
            if abort_at is not None:
                aborts.setdefault(step + abort_at, []).append(rid)
        for rid in aborts.pop(step, []):
            sim.abort(rid)
        sim.step()  # Scheduler.check runs inside: budget, max_num_seqs, pages, ownership, reservations
        step += 1
        assert step < 5000, "the scheduler does not finish"
        if policy == "reserve":
            assert sim.sched.num_preemptions == 0
    sim.assert_idle()
    target(float(sim.sched.num_preemptions), label="preemptions")  # steer generation to busy caches
    for i, (_, prompt, max_tokens, _, _, _) in enumerate(requests):
        rid = f"r{i}"
        reason = sim.ended[rid]
        outs = sim.outputs[rid]
        assert outs == list(range(len(outs)))  # every output index once, in order
        if reason == "cancelled":
            assert requests[i][4] is not None
        elif reason == "timeout":
            assert requests[i][5] is not None and not outs and sim.seqs[rid].first_scheduled_time is None
        elif prompt + max_tokens > sim.max_model_len:
            assert reason == "error" and not outs and sim.seqs[rid].error[0] == TOO_LONG
        else:
            assert reason == "length" and len(outs) == max_tokens


# ============================================================================ the engine end to end


def test_reject_never_wedges_the_queue():
    model, _ = pair()
    engine = make_engine(model, page_size=4, num_pages=16, max_num_seqs=2, max_model_len=48)
    rng = random.Random(1)
    ok = random_prompts(rng, 3, (3, 20))
    run = drive(engine, {0: [
        ("beyond-cache", [5] * 70, greedy(1), 0),  # the prompt alone is beyond the whole cache
        ("too-long", [5] * 30, greedy(20), 0),  # prompt + max_tokens > max_model_len
        ("a", ok[0], greedy(10), 1),
        ("b", ok[1], greedy(12), 1),
    ], 3: [("late-too-long", [6] * 40, greedy(9), 0), ("c", ok[2], greedy(8), 2)]})
    for rid in ("beyond-cache", "too-long", "late-too-long"):
        final = run.final(rid)
        assert final.finished and final.finish_reason == "error" and final.error[0] == TOO_LONG
        assert "exceeds" in final.error[1] and not run.tokens(rid)
    assert run.finish_step["beyond-cache"] == 0 and run.finish_step["too-long"] == 0 and run.finish_step["late-too-long"] == 3
    check_exact(run, {"a": (ok[0], 10), "b": (ok[1], 12), "c": (ok[2], 8)})
    assert engine.stats.admissions["reject"] == 3


def test_defer_then_admit_and_soft_limit():
    model, _ = pair()
    rng = random.Random(2)
    big = random_prompts(rng, 1, (28, 28))[0]
    small = random_prompts(rng, 1, (5, 5))[0]
    # soft limit 0.9: with 7 of 10 pages used, a normal request of 3 pages waits, an urgent one does not;
    # one step later "big" has 8 pages and the 2 pages of "small" would pass the limit too
    engine = make_engine(model, page_size=4, num_pages=10, max_num_seqs=4)
    engine.add_request("big", big, greedy(3), priority=0)
    engine.step()
    assert engine.can_admit(9, 2, priority=1) is Decision.DEFER
    assert engine.can_admit(9, 2, priority=0) is Decision.ADMIT
    assert engine.can_admit(5, 2, priority=1) is Decision.ADMIT
    assert engine.can_admit(41, 1, priority=0) is Decision.REJECT
    engine.add_request("small", small, greedy(4), priority=1)
    outs = engine.step()
    assert [o.request_id for o in outs] == ["big"] and engine.stats.admissions["defer"] >= 1
    run = drive(engine)
    assert run.tokens("small") == ref_tokens(tuple(small), 4)
    # the same with no soft limit: admitted at once
    engine = make_engine(model, page_size=4, num_pages=10, max_num_seqs=4, soft_limit=1.0)
    engine.add_request("big", big, greedy(3), priority=0)
    engine.step()
    engine.add_request("small", small, greedy(4), priority=1)
    assert {o.request_id for o in engine.step()} == {"big", "small"}


def test_budget_and_can_admit():
    model, _ = pair()
    engine = make_engine(model, page_size=4, num_pages=20, max_num_seqs=3)
    b = engine.budget()
    assert (b.free_tokens, b.free_seqs) == (80, 3)
    engine.add_request("a", [5] * 10, greedy(4))  # waiting: 3 pages wanted
    b = engine.budget()
    assert (b.free_tokens, b.free_seqs) == (80 - 12, 2)
    engine.step()
    b = engine.budget()
    assert (b.free_tokens, b.free_seqs) == (80 - 12, 2)  # 3 pages in use
    assert engine.can_admit(10, 4) is Decision.ADMIT
    assert engine.can_admit(60, 21) is Decision.REJECT
    assert engine.can_admit(69, 1, priority=0) is Decision.DEFER  # 18 pages, 17 free
    assert engine.can_admit(68, 1, priority=0) is Decision.ADMIT
    engine.abort("a")
    assert engine.budget().free_tokens == 80
    # reserve: the budget counts max_tokens too
    engine = make_engine(model, page_size=4, num_pages=20, admission_policy="reserve")
    engine.add_request("a", [5] * 10, greedy(10))
    assert engine.budget().free_tokens == 80 - 20
    engine.step()
    assert engine.budget().free_tokens == 80 - 20
    assert engine.can_admit(10, 54, priority=0) is Decision.DEFER  # 16 pages, 15 neither used nor promised
    assert engine.can_admit(10, 50, priority=0) is Decision.ADMIT


def test_waiting_order_is_priority_then_arrival():
    model, _ = pair()
    engine = make_engine(model, num_pages=64, max_num_seqs=1)
    spec = [("a", 2), ("b", 1), ("c", 0), ("d", 1), ("e", 0), ("f", 2), ("g", 1)]
    rng = random.Random(3)
    run = drive(engine, {0: [(rid, random_prompts(rng, 1, (2, 10))[0], greedy(3), p) for rid, p in spec]})
    order = sorted(run.first_token_step, key=run.first_token_step.get)
    assert order == ["c", "e", "b", "d", "g", "a", "f"]


def _pressure_workload(rng, n=8, max_len=56):
    reqs = {}
    arrivals: dict[int, list[tuple]] = {}
    for i in range(n):
        prompt = random_prompts(rng, 1, (3, 24))[0]
        m = rng.randint(18, max_len - len(prompt))
        reqs[f"r{i}"] = (prompt, m)
        arrivals.setdefault(rng.choice([0, 0, 0, 2, 5, 9]), []).append((f"r{i}", prompt, greedy(m), rng.randint(0, 2)))
    return reqs, arrivals


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window of 32 < 56 tokens
@pytest.mark.parametrize("mode", MODES)
def test_exact_after_many_preemptions(mode, family):
    """A cache of 14 pages of 4 tokens for 8 long requests of mixed priority: many preemptions,
    by cache pressure and by priority, and every output still equals generate alone."""
    model, _ = pair(family)
    reqs, arrivals = _pressure_workload(random.Random(11))
    engine = make_engine(model, page_size=4, num_pages=14, max_num_seqs=6, max_num_batched_tokens=24,
                         preemption_mode=mode, swap_pages=8)
    run = drive(engine, arrivals)
    check_exact(run, reqs, family)
    n = engine.stats.num_preemptions
    assert n >= 5, n
    assert n == sum(run.final(r).metrics.num_preemptions for r in reqs)
    if mode == "swap":
        assert sum(s.swapped_out for s in run.steps) > 0 and sum(s.swapped_in for s in run.steps) > 0
    else:
        assert sum(s.swapped_out for s in run.steps) == 0


@pytest.mark.parametrize("mode", MODES)
def test_seeded_sampling_is_the_same_with_and_without_preemption(mode):
    model, _ = pair()
    rng = random.Random(12)
    reqs, arrivals = _pressure_workload(rng)
    sampled = {t: [(rid, prompt, SamplingParams(max_tokens=reqs[rid][1], temperature=1.0, top_p=0.9, seed=i, ignore_eos=True), p)
                   for i, (rid, prompt, _, p) in enumerate(v)] for t, v in arrivals.items()}
    roomy = drive(make_engine(model, num_pages=200), dict(sampled))
    tight_engine = make_engine(model, page_size=4, num_pages=14, max_num_seqs=6, max_num_batched_tokens=24, preemption_mode=mode)
    tight = drive(tight_engine, dict(sampled))
    assert tight_engine.stats.num_preemptions >= 5
    for rid in reqs:
        assert tight.tokens(rid) == roomy.tokens(rid), rid


@pytest.mark.parametrize("mode", MODES)
def test_priority_holds(mode):
    """Cache for about two full sequences, six long low-priority ones running; three urgent ones
    arrive: they start within a step or two, finish before the low ones that were running, and
    the low ones still finish, exact."""
    model, _ = pair()
    rng = random.Random(21)
    low = {f"low{i}": (p, 40) for i, p in enumerate(random_prompts(rng, 6, (6, 10)))}
    high = {f"high{i}": (p, 8) for i, p in enumerate(random_prompts(rng, 3, (6, 10)))}
    engine = make_engine(model, page_size=4, num_pages=24, max_num_seqs=8, max_num_batched_tokens=64, preemption_mode=mode)
    arrive = 6
    arrivals = {0: [(r, p, greedy(m), 2) for r, (p, m) in low.items()],
                arrive: [(r, p, greedy(m), 0) for r, (p, m) in high.items()]}
    run = drive(engine, arrivals)
    running_then = set(run.steps[arrive - 1].running)
    assert running_then and running_then <= set(low)
    for h in high:
        assert run.first_token_step[h] <= arrive + 1, (h, run.first_token_step[h])
        for lo in running_then:
            assert run.finish_step[h] < run.finish_step[lo], (h, lo)
    check_exact(run, {**low, **high})
    assert engine.stats.num_preemptions > 0
    assert all(run.final(h).metrics.num_preemptions == 0 for h in high)


def test_reserve_policy_end_to_end_never_preempts():
    model, _ = pair()
    reqs, arrivals = _pressure_workload(random.Random(11))
    engine = make_engine(model, page_size=4, num_pages=14, max_num_seqs=6, max_num_batched_tokens=24,
                         admission_policy="reserve")
    run = drive(engine, arrivals)
    check_exact(run, reqs)
    assert engine.stats.num_preemptions == 0


def test_timeout_of_a_waiting_request():
    model, _ = pair()
    engine = make_engine(model, num_pages=64, max_num_seqs=1)
    engine.add_request("busy", [5, 6, 7], greedy(10))
    engine.step()
    now = time.monotonic()
    engine.add_request("late", [8, 9], greedy(5), timeout_s=1.0, arrival_time=now - 5)  # waited too long already
    engine.add_request("fine", [8, 9], greedy(5), timeout_s=60.0)
    outs = engine.step()
    late = [o for o in outs if o.request_id == "late"]
    assert len(late) == 1 and late[0].finished and late[0].finish_reason == "timeout" and late[0].new_token_ids == []
    assert "late" not in engine and engine.stats.num_waiting == 1
    # a request that started in time is not timed out while it runs
    engine.add_request("started", [10, 11], greedy(5), priority=0, timeout_s=0.3, arrival_time=time.monotonic() - 0.2)
    run = drive(engine)
    assert run.reason("started") == "length" and run.reason("fine") == "length" and run.reason("busy") == "length"


@pytest.mark.parametrize("mode", MODES)
def test_abort_waiting_running_and_preempted(mode):
    model, _ = pair()
    rng = random.Random(5)
    prompts = random_prompts(rng, 4, (10, 14))
    prompts[2] = random_prompts(rng, 1, (20, 20))[0]  # 5 pages: only fits if "low" goes
    engine = make_engine(model, page_size=4, num_pages=12, max_num_seqs=4, preemption_mode=mode)
    engine.add_request("low", prompts[0], greedy(30), priority=2)
    engine.add_request("keep", prompts[1], greedy(12), priority=1)
    for _ in range(3):
        engine.step()
    engine.add_request("hi", prompts[2], greedy(20), priority=0)
    engine.add_request("queued", prompts[3], greedy(5), priority=2)
    engine.step()
    low = engine.scheduler.find("low")
    assert low.status is Status.WAITING and low.num_preemptions == 1  # evicted for "hi"
    if mode == "swap":
        assert low.host_pages and engine.scheduler.host_alloc.num_used == len(low.host_pages)
    hi_pages = len(engine.scheduler.find("hi").block_table)
    free = engine.stats.num_free_pages
    assert engine.abort("low") and engine.abort("queued")
    if mode == "swap":
        assert engine.scheduler.host_alloc.num_free == engine.scheduler.host_alloc.num_pages
    assert engine.stats.num_free_pages == free
    assert engine.abort("hi")
    assert engine.stats.num_free_pages == free + hi_pages  # running: freed at once
    outs = engine.step()
    cancelled = {o.request_id for o in outs if o.finish_reason == "cancelled"}
    assert cancelled == {"low", "queued", "hi"}
    run = drive(engine)
    assert run.tokens("keep")  # still runs, and exactly
    assert engine.stats.num_free_pages == 12


# ---------------------------------------------------------------------------- property test, end to end


POOL = random_prompts(random.Random(99), 10, (1, 24))
POOL[0] = POOL[0][:1]  # a one-token prompt
POOL_MAX = 24


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=25, deadline=None)
@given(
    page_size=st.sampled_from([2, 4, 8]),
    cache_tokens=st.integers(24, 96),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(4, 48),
    policy=st.sampled_from(["optimistic", "optimistic", "reserve"]),
    soft_limit=st.sampled_from([0.9, 1.0]),
    requests=st.lists(st.tuples(
        st.integers(0, 5),  # arrival step
        st.integers(0, len(POOL) - 1),  # prompt
        st.integers(4, POOL_MAX),  # max tokens
        st.integers(0, 2),  # priority
        sometimes(st.integers(0, 20)),  # abort after
    ), min_size=2, max_size=8),
)
def test_engine_invariants_property(page_size, cache_tokens, max_num_seqs, max_num_batched_tokens, policy, mode, soft_limit,
                                    requests):
    """Random arrivals, priorities, lengths and aborts on a real model with check_invariants on:
    every request ends once, streams are contiguous, unaborted greedy outputs are exact, aborted
    ones are a prefix of it, impossible ones are rejected, and every page comes back."""
    model, _ = pair()
    engine = make_engine(model, page_size=page_size, num_pages=cache_tokens // page_size, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, admission_policy=policy, preemption_mode=mode,
                         soft_limit=soft_limit)
    arrivals: dict[int, list[tuple]] = {}
    aborts: dict[int, list[str]] = {}
    for i, (at, pi, m, prio, abort_after) in enumerate(requests):
        arrivals.setdefault(at, []).append((f"r{i}", POOL[pi], greedy(m), prio))
        if abort_after is not None:
            aborts.setdefault(at + abort_after, []).append(f"r{i}")
    run = drive(engine, arrivals, aborts)  # checks streams and that every page is free at the end
    target(float(engine.stats.num_preemptions), label="preemptions")
    for i, (_, pi, m, _, abort_after) in enumerate(requests):
        rid = f"r{i}"
        expected = ref_tokens(tuple(POOL[pi]), POOL_MAX)[:m]
        got, reason = run.tokens(rid), run.reason(rid)
        if reason == "cancelled":
            assert abort_after is not None and got == expected[:len(got)]
        elif len(POOL[pi]) + m > engine.max_model_len:
            assert reason == "error" and not got
        else:
            assert reason == "length" and got == expected, rid
    if policy == "reserve":
        assert engine.stats.num_preemptions == 0
