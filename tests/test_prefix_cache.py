"""Prefix caching: full prompt pages named by chained hashes, shared by count, kept after use.

Three levels: the page names alone; the allocator driven by a hypothesis state machine that
tracks what every page holds; and the engine on real tiny models (float64), where every
greedy output must equal transformers' generate on the prompt alone, however much of it
came from the cache.
"""

from __future__ import annotations

import functools
import random

import pytest
from engine_helpers import FAMILIES, drive, greedy, make_engine, model_pair, random_prompts, reference
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.protocol import SamplingParams
from worker.cache import BlockAllocator, pages_for
from worker.prefix_cache import chain_hashes, page_hash
from worker.sequence import Status


@functools.cache
def pair(family: str):
    return model_pair(family, seed=11)


@functools.cache
def ref_tokens(family: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return reference(pair(family)[1], list(prompt), max_tokens)


def check_exact(run, requests: dict[str, tuple[list[int], int]], family: str = "llama") -> None:
    for rid, (prompt, max_tokens) in requests.items():
        assert run.tokens(rid) == ref_tokens(family, tuple(prompt), max_tokens), rid
        assert run.reason(rid) == "length", rid


def cached(run, rid: str) -> int:
    return run.final(rid).cached_tokens


def add(reqs: dict, arrivals: dict, rid: str, prompt: list[int], max_tokens: int, step: int, priority: int = 1) -> None:
    """One greedy request arriving before ``step``, for drive() and check_exact()."""
    reqs[rid] = (prompt, max_tokens)
    arrivals.setdefault(step, []).append((rid, prompt, greedy(max_tokens), priority))


# ============================================================================ page names


def test_names_chain_over_pages_and_salt():
    toks = list(range(3, 23))  # 20 tokens: 5 full pages of 4
    h = chain_hashes(toks, 4, None, 5)
    assert len(h) == len(set(h)) == 5 and all(len(x) == 16 for x in h)
    assert chain_hashes(toks[:12] + [99] * 8, 4, None, 5)[:3] == h[:3]  # same first 3 pages: same names
    other = chain_hashes(toks[:5] + [99] + toks[6:], 4, None, 5)  # token 5 differs: page 1 and all after
    assert other[0] == h[0] and all(a != b for a, b in zip(other[1:], h[1:]))
    # the same page tokens after a different parent get a different name (a page is named by its prefix)
    assert chain_hashes(toks[4:8], 4, None, 1) != [h[1]]
    assert h[1] == page_hash(h[0], toks[4:8])
    salted = chain_hashes(toks, 4, "tenant-a", 5)
    assert not set(salted) & set(h) and salted != chain_hashes(toks, 4, "tenant-b", 5)
    assert chain_hashes(toks, 4, "tenant-a", 5) == salted
    part = chain_hashes(toks, 4, None, 2)
    assert chain_hashes(toks, 4, None, 5, part) is part and part == h  # extends in place


def test_allocator_shares_caches_and_evicts_oldest_first():
    a = BlockAllocator(6, 2)
    x = a.allocate(3)
    for i, p in enumerate(x):
        assert a.register(p, bytes([i]))
    assert not a.register(x[0], b"other") and not a.register(a.allocate(1)[0], bytes([0]))  # first name wins
    y = [a.lookup(bytes([i])) for i in range(3)]
    assert y == x
    a.share(y[:2])
    assert [a.refs(p) for p in x] == [2, 2, 1] and a.num_used == 4
    a.free(x)
    assert [a.refs(p) for p in x] == [1, 1, 0] and a.num_free == 3 and a.lookup(bytes([2])) == x[2]  # cached, free
    a.free(y[:2])
    assert a.num_free == 5 and a.num_cached == 3 and all(a.lookup(bytes([i])) == x[i] for i in range(3))
    # plain free pages go first, then cached ones: the deepest page of a table first
    got = a.allocate(3)
    assert x[2] in got and x[0] not in got and x[1] not in got and a.lookup(bytes([2])) is None
    assert a.lookup(bytes([0])) == x[0] and a.num_free == 2
    a.share([x[0]])  # a hit on a free cached page takes it out of the free pool
    assert a.num_free == 1 and a.refs(x[0]) == 1
    with pytest.raises(MemoryError):
        a.allocate(2)


class PageCacheMachine(RuleBasedStateMachine):
    """Sequences over a 3-token alphabet (so prefixes repeat) are admitted with their cached
    prefix, grow, register their full pages, and leave; allocation evicts. The model records
    what each page holds (the tokens written there after the prefix they extend)."""

    PS = 2

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(12, self.PS)
        self.content: dict[int, tuple[int, ...]] = {}  # page -> the whole prefix up to its end
        self.seqs: dict[int, tuple[list[int], list[int], list[bytes]]] = {}  # id -> (tokens, table, names)
        self.next_id = 0

    def _fill(self, tokens, table, names, upto):
        """Give pages for ``upto`` tokens (writing them) and name the full ones."""
        need = pages_for(upto, self.PS) - len(table)
        if need > self.alloc.num_free:
            return False
        for p in self.alloc.allocate(need):
            assert self.alloc.refs(p) == 1 and self.alloc.hash_of(p) is None
            table.append(p)
        for i in range(len(table)):
            if (i + 1) * self.PS <= upto:
                self.content[table[i]] = tuple(tokens[:(i + 1) * self.PS])
        chain_hashes(tokens, self.PS, None, upto // self.PS, names)
        for i in range(upto // self.PS):
            self.alloc.register(table[i], names[i])
        return True

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def admit(self, tokens):
        names = chain_hashes(tokens, self.PS, None, (len(tokens) - 1) // self.PS)
        hits = []
        for h in names:
            p = self.alloc.lookup(h)
            if p is None:
                break
            hits.append(p)
        for i, p in enumerate(hits):  # a hit holds exactly the prefix it is named for
            assert self.content[p] == tuple(tokens[:(i + 1) * self.PS])
        before = self.alloc.num_free
        self.alloc.share(hits)
        assert self.alloc.num_free == before - sum(1 for p in hits if self.alloc.refs(p) == 1)
        table = list(hits)
        if not self._fill(tokens, table, names, len(tokens)):
            self.alloc.free(table)
            return
        self.seqs[self.next_id] = (tokens, table, names)
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def grow(self, data, more):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, table, names = self.seqs[sid]
        tokens.extend(more)
        if not self._fill(tokens, table, names, len(tokens)):
            del tokens[-len(more):]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def leave(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        _, table, _ = self.seqs.pop(sid)
        still_held = {p for _, t, _ in self.seqs.values() for p in t}
        self.alloc.free(table)
        for p in table:  # a page somebody still holds is never freed
            assert (self.alloc.refs(p) > 0) == (p in still_held)

    @invariant()
    def counts_add_up_and_names_match(self):
        tables = [t for _, t, _ in self.seqs.values()]
        self.alloc.check(tables)
        held = sum(1 for p in range(self.alloc.num_pages) if self.alloc.refs(p) > 0)
        assert held == self.alloc.num_used == len({p for t in tables for p in t})
        for p in range(self.alloc.num_pages):
            h = self.alloc.hash_of(p)
            if h is not None:  # a named page holds the tokens its name was made from
                prefix = self.content[p]
                assert chain_hashes(list(prefix), self.PS, None, len(prefix) // self.PS)[-1] == h


TestPageCacheMachine = PageCacheMachine.TestCase
TestPageCacheMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# ============================================================================ the engine, exact


def _shared_prefix_workload(rng: random.Random, ps: int):
    """Three system prompts longer than the sliding windows, unique suffixes, a prompt sent
    twice, and one that is a whole number of pages sent twice (its last page is recomputed)."""
    systems = [random_prompts(rng, 1, (n, n))[0] for n in (37, 50, 64)]
    reqs: dict[str, tuple[list[int], int]] = {}
    arrivals: dict[int, list[tuple]] = {}
    for i, step in enumerate([0, 0, 1, 4, 6, 9, 20, 30, 45]):
        add(reqs, arrivals, f"s{i}", systems[i % 3] + random_prompts(rng, 1, (1, 12))[0], rng.randint(2, 8), step)
    whole = systems[2][:6 * ps]
    for rid, prompt, max_tokens, step in [("dup-a", reqs["s0"][0], 5, 2), ("dup-b", reqs["s0"][0], 5, 40),
                                          ("whole-a", whole, 4, 3), ("whole-b", whole, 4, 50)]:
        add(reqs, arrivals, rid, prompt, max_tokens, step)
    return reqs, arrivals


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefixes_are_exact_on_every_family(family):
    """Partial hits on running and finished sequences' pages, full-prompt hits, chunked prefill
    across the cached boundary (32-token steps), sliding-window layers (qwen3, mistral)."""
    model, _ = pair(family)
    ps = 8
    reqs, arrivals = _shared_prefix_workload(random.Random(3), ps)
    engine = make_engine(model, page_size=ps, num_pages=160, max_num_seqs=4, max_num_batched_tokens=32)
    run = drive(engine, arrivals)
    check_exact(run, reqs, family)
    whole = reqs["whole-a"][0]
    assert cached(run, "whole-b") == len(whole) - ps  # all but the last page: its last token is computed
    assert cached(run, "dup-b") == (len(reqs["dup-b"][0]) - 1) // ps * ps
    assert cached(run, "s6") >= 32 and cached(run, "s0") == 0
    st = engine.stats
    assert st.prefix_cache_hits == sum(cached(run, r) for r in reqs)  # nothing preempted here
    assert st.prefix_cache_queries == sum(len(p) for p, _ in reqs.values())
    assert 0 < st.prefix_cache_hit_rate < 1
    # a prefill that starts on the cached boundary and is chunked past it
    starts = {(rid, start) for s in run.steps for rid, start, n, _ in s.scheduled if n > 1}
    assert ("s6", cached(run, "s6")) in starts
    assert any(rid == "s6" and start > cached(run, "s6") for rid, start in starts) or len(reqs["s6"][0]) - cached(run, "s6") <= 32


def _chunked_long_prompt(**cfg):
    """A 90-token prompt, and an engine that prefills it in 16-token chunks over pages of 8."""
    model, _ = pair("llama")
    prompt = random_prompts(random.Random(4), 1, (90, 90))[0]
    return prompt, make_engine(model, page_size=8, num_pages=80, max_num_seqs=3, max_num_batched_tokens=16, **cfg)


def test_a_request_waits_for_the_page_a_running_prefill_is_computing():
    """One long prompt prefilled in 16-token chunks; a request with the same prompt waits for
    token budget, and when budget frees up (the step of the first one's last chunk) the next
    page of its prefix is the one that chunk is filling: it lets the request behind it go
    first (which finds every page of its own prefix cached), and is admitted a step later
    with all 11 pages cached instead of 10, not computing the 11th a second time."""
    prompt, engine = _chunked_long_prompt()
    reqs = {"a": (prompt, 6), "b": (prompt + [5], 6), "c": (prompt[:50] + [6, 7], 6)}
    run = drive(engine, {0: [(r, reqs[r][0], greedy(6)) for r in ("a", "b")], 3: [("c", reqs["c"][0], greedy(6))]})
    check_exact(run, reqs)
    assert (cached(run, "a"), cached(run, "b"), cached(run, "c")) == (0, 88, 48)
    assert run.steps[5].scheduled == [("a", 80, 10, True), ("c", 48, 4, True)] and run.steps[5].waiting == ["b"]
    assert ("b", 88, 3, True) in run.steps[6].scheduled


def test_with_caching_off_nobody_waits_for_a_running_prefill():
    prompt, engine = _chunked_long_prompt(enable_prefix_caching=False)
    reqs = {"a": (prompt, 6), "b": (prompt + [5], 6)}
    run = drive(engine, {0: [(r, reqs[r][0], greedy(6)) for r in ("a", "b")]})
    check_exact(run, reqs)
    assert ("b", 0, 6, False) in run.steps[5].scheduled


def test_eviction_is_least_recently_used_and_recomputes_exactly():
    model, _ = pair("llama")
    rng = random.Random(5)
    p, q, r = random_prompts(rng, 3, (41, 41))
    engine = make_engine(model, page_size=4, num_pages=26, max_num_seqs=1)
    # p then q, each leaving 10 cached pages (11 pages used while running); r needs 12 pages:
    # plain free pages first (4 + 2), then the oldest cached ones: p's
    reqs = {"p": (p, 3), "q": (q, 3), "r": (r, 4), "q2": (q, 3), "p2": (p, 3)}
    run = drive(engine, {0: [("p", p, greedy(3))], 5: [("q", q, greedy(3))], 10: [("r", r, greedy(4))],
                         16: [("q2", q, greedy(3))], 20: [("p2", p, greedy(3))]})
    check_exact(run, reqs)
    assert cached(run, "q2") == 40  # q's pages survived r
    assert cached(run, "p2") < 40  # p's were evicted (least recently used) and recomputed
    assert engine.allocator.num_free == engine.allocator.num_pages and engine.allocator.num_cached > 0


def test_preempted_sequences_find_their_pages_and_others_find_them_too():
    """A tight cache with mixed priorities: low-priority sequences are evicted (recompute) for
    urgent ones; readmitted, they start from their own cached pages (prompt and output)."""
    model, _ = pair("llama")
    rng = random.Random(6)
    system = random_prompts(rng, 1, (24, 24))[0]
    reqs, arrivals = {}, {}
    for i in range(4):
        add(reqs, arrivals, f"low{i}", system + random_prompts(rng, 1, (3, 9))[0], 26, 0, priority=2)
    for i in range(3):
        add(reqs, arrivals, f"hi{i}", random_prompts(rng, 1, (30, 40))[0], 6, 12 + 4 * i, priority=0)
    add(reqs, arrivals, "late", system + [9, 9], 5, 14)
    engine = make_engine(model, page_size=4, num_pages=40, max_num_seqs=6, max_num_batched_tokens=40)
    run = drive(engine, arrivals)
    check_exact(run, reqs)
    st = engine.stats
    assert st.num_preemptions > 0
    preempted = [r for r in reqs if run.final(r).metrics.num_preemptions]
    assert preempted and all(r.startswith("low") for r in preempted)
    # readmissions hit: the hits counted exceed what the requests' first admissions found
    assert st.prefix_cache_hits > sum(cached(run, r) for r in reqs)
    assert cached(run, "late") == 24


def test_swap_mode_with_shared_pages():
    """Swap preemption of sequences that share their prefix pages with running ones: the
    shared pages stay on device for their other holders, the victim's copy comes back."""
    model, _ = pair("qwen3")
    rng = random.Random(7)
    system = random_prompts(rng, 1, (30, 30))[0]
    reqs, arrivals = {}, {}
    for i in range(3):
        add(reqs, arrivals, f"low{i}", system + random_prompts(rng, 1, (2, 6))[0], 24, i, priority=2)
    for i in range(2):
        add(reqs, arrivals, f"hi{i}", system + random_prompts(rng, 1, (20, 30))[0], 8, 10 + 6 * i, priority=0)
    engine = make_engine(model, page_size=4, num_pages=36, max_num_seqs=5, max_num_batched_tokens=48,
                         preemption_mode="swap")
    run = drive(engine, arrivals)
    check_exact(run, reqs, "qwen3")
    assert engine.stats.num_preemptions > 0
    assert any(s.swapped_out for s in run.steps) and any(s.swapped_in for s in run.steps)
    assert all(cached(run, f"hi{i}") >= 28 for i in range(2))


def test_reserve_policy_counts_only_the_pages_it_adds():
    model, _ = pair("llama")
    rng = random.Random(8)
    system = random_prompts(rng, 1, (40, 40))[0]
    reqs = {f"r{i}": (system + [10 + i], 6) for i in range(4)}
    engine = make_engine(model, page_size=4, num_pages=30, max_num_seqs=4, admission_policy="reserve")
    # 12 pages each without sharing: only 2 fit at once; with 10 shared pages, 2 each: all run
    run = drive(engine, {0: [("r0", reqs["r0"][0], greedy(6))], 2: [(r, reqs[r][0], greedy(6)) for r in ("r1", "r2", "r3")]})
    check_exact(run, reqs)
    assert engine.stats.num_preemptions == 0
    assert max(len(s.running) for s in run.steps) == 4


def test_off_computes_everything_and_counts_nothing():
    model, _ = pair("llama")
    prompt = random_prompts(random.Random(9), 1, (30, 30))[0]
    engine = make_engine(model, page_size=4, num_pages=40, enable_prefix_caching=False)
    run = drive(engine, {0: [("a", prompt, greedy(4))], 3: [("b", prompt, greedy(4))]})
    check_exact(run, {"a": (prompt, 4), "b": (prompt, 4)})
    assert cached(run, "b") == 0 and engine.stats.prefix_cache_queries == engine.stats.prefix_cache_hits == 0
    assert engine.allocator.num_cached == 0


def test_cache_salt_keeps_tenants_apart():
    model, _ = pair("llama")
    prompt = random_prompts(random.Random(10), 1, (30, 30))[0]
    engine = make_engine(model, page_size=4, num_pages=60)
    salted = [greedy(4, cache_salt=s) for s in ("t1", "t2", "t1", None)]
    run = drive(engine, {i * 3: [(f"r{i}", prompt, p)] for i, p in enumerate(salted)})
    check_exact(run, {f"r{i}": (prompt, 4) for i in range(4)})
    assert [cached(run, f"r{i}") for i in range(4)] == [0, 0, 28, 0]


def test_budget_counts_cached_pages_as_free_and_shared_ones_once():
    model, _ = pair("llama")
    prompt = random_prompts(random.Random(12), 1, (40, 40))[0]
    engine = make_engine(model, page_size=4, num_pages=24, max_num_seqs=4)
    assert engine.cached_tokens(prompt) == 0
    drive(engine, {0: [("warm", prompt, greedy(2))]})
    assert engine.allocator.num_cached == 10 and engine.budget().free_tokens == 24 * 4  # cached pages are free
    assert engine.cached_tokens(prompt) == 36 and engine.cached_tokens(prompt + [1]) == 40  # never the last token
    assert engine.cached_tokens(prompt, cache_salt="other") == 0 and engine.cached_tokens(prompt[:3]) == 0
    engine.add_request("a", prompt + [7], greedy(8))
    engine.step()
    a = engine.scheduler.find("a")
    assert a.status is Status.RUNNING and a.cached_tokens == 40
    # "b" shares a's 10 pages: it needs 1, so the budget drops by one page, not 11
    before = engine.budget().free_tokens
    engine.add_request("b", prompt + [8], greedy(8))
    assert engine.budget().free_tokens == before - 4
    assert engine.scheduler.pages_waiting() == 1
    run = drive(engine)
    assert run.final("b").cached_tokens == 40 and run.reason("b") == "length"


def test_the_worker_setting_turns_it_off():
    from common.settings import Settings
    from worker.main import engine_config

    assert engine_config(Settings.from_env({}), "cpu").enable_prefix_caching is True
    assert engine_config(Settings.from_env({"TOKENQ_PREFIX_CACHING": "off"}), "cpu").enable_prefix_caching is False
    with pytest.raises(ValueError, match="TOKENQ_PREFIX_CACHING must be one of"):
        Settings.from_env({"TOKENQ_PREFIX_CACHING": "maybe"})


def _random_pool(seed: int):
    """A one-layer float64 KV pool of 64 pages of 4 slots, 2 kv heads of 8, filled at random."""
    import torch

    from worker.cache import KVCache

    torch.manual_seed(seed)
    cache = KVCache(num_layers=1, num_pages=64, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float64,
                    device=torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    return cache


def _decoding(tables: list[list[int]], cache):
    """A decode step over these block tables (decode i's last page holds 1 + i % ps positions), and
    its decode pages as the runner lays them out."""
    import torch

    from worker.runner import ModelRunner
    from worker.scheduler import ScheduledSeq
    from worker.sequence import Sequence

    ps = cache.page_size
    scheduled = []
    for i, table in enumerate(tables):
        ctx = (len(table) - 1) * ps + 1 + i % ps  # the last page partly filled
        seq = Sequence(f"d{i}", [3] * ctx, ctx - 1, SamplingParams(), 1, i, 0.0, 0)
        seq.block_table = table
        scheduled.append(ScheduledSeq(seq, ctx - 1, 1, True))
    return scheduled, ModelRunner(None, cache)._decode_pages(scheduled, torch.tensor([s.start + 1 for s in scheduled]))


def _assert_dense(scheduled, cache, dec, window, softcap):
    """Decode attention over the step's decode pages ``dec`` equals plain attention over each
    decode's own positions (float64)."""
    import torch

    from worker.attention import StepMeta, _decode

    kvh, D = cache.k.shape[2], cache.k.shape[4]
    g = 3
    n = len(scheduled)
    meta = StepMeta(cache.k, cache.v, None, None, n, *dec[:5], [], dec[5])
    q = torch.randn(n, kvh * g, D, dtype=torch.float64)
    got = _decode(q, cache.k[0], cache.v[0], meta, window, 0.3, softcap)
    for i, s in enumerate(scheduled):
        ctx = s.start + 1
        k = cache.k[0, s.seq.block_table].transpose(0, 1).reshape(kvh, -1, D)[:, :ctx]
        v = cache.v[0, s.seq.block_table].transpose(0, 1).reshape(kvh, -1, D)[:, :ctx]
        keep = torch.arange(ctx) > ctx - 1 - window if window else torch.ones(ctx, dtype=torch.bool)
        s = q[i].view(kvh, g, D) @ k.transpose(1, 2) * 0.3
        s = s if softcap is None else torch.tanh(s / softcap) * softcap
        w = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
        assert torch.allclose(got[i], (w @ v).reshape(kvh * g, D), atol=1e-12), f"decode {i}"


@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 2.0)])
def test_decode_attention_over_shared_pages_equals_dense_attention(window, softcap):
    """Decodes whose tables share prefix pages (1 to 5 holders, so padded groups of 2, 4 and 8),
    attended in one step: each equals plain attention over its own positions (float64)."""
    cache = _random_pool(0)
    prefixes = [[40, 41, 42], [50, 51], [60]]
    holders = [0, 0, 0, 0, 0, 1, 1, 2, None]  # which prefix each decode starts from (None: its own pages only)
    free = iter(range(30))
    tables = [(list(prefixes[pre]) if pre is not None else []) + [next(free) for _ in range(1 + i % 3)]
              for i, pre in enumerate(holders)]
    scheduled, dec = _decoding(tables, cache)
    assert sorted(grp.m for grp in dec[5]) == [2, 8]  # the 3-page prefix of 5 decodes, the 2-page one of 2
    _assert_dense(scheduled, cache, dec, window, softcap)


@pytest.mark.parametrize("window, softcap", [(None, None), (9, None), (None, 2.0)])
def test_shared_pages_of_a_prefix_tree_are_cut_into_segments_by_their_holders(window, softcap):
    """A prefix tree: 12 pages all 6 decodes hold (more than one segment), then branches of 3
    pages held by decodes 0-2 and of 2 pages held by 3-4; decode 5 goes on alone. Each set of
    holders gets segments of its own pages, and attention is still exact (float64), also with a
    non-finite leftover in a page nobody holds (segments are padded to 8 pages)."""
    from worker.shared_pages import SEGMENT_PAGES

    cache = _random_pool(2)
    cache.k[0, 0] = cache.v[0, 0] = float("inf")  # page 0: held by none of them
    trunk, left, right = list(range(20, 32)), [40, 41, 42], [50, 51]
    tables = [trunk + left + [1], trunk + left + [2, 3], trunk + left + [4], trunk + right + [5], trunk + right + [6, 7],
              trunk + [8]]
    scheduled, dec = _decoding(tables, cache)
    segs = sorted((grp.m, grp.src.shape[0]) for grp in dec[5])
    assert len(trunk) > SEGMENT_PAGES and segs == [(2, 1), (4, 1), (8, -(-len(trunk) // SEGMENT_PAGES))]
    _assert_dense(scheduled, cache, dec, window, softcap)


@pytest.mark.parametrize("window", [None, 5])
def test_decode_pages_high_in_the_pool_are_read_in_place_from_the_lowest(window):
    """With caching on, finished sequences' pages stay cached low in the pool while new ones
    are allocated above them. Decodes holding only pages 40-63 of 64 are read in place over
    [40, 64), not over [0, 64) and not gathered, and attention is still exact."""
    cache = _random_pool(1)
    pages = list(range(63, 39, -1))  # handed out from the top, and interleaved between sequences
    scheduled, dec = _decoding([pages[i::6] for i in range(6)], cache)
    assert dec[0] is None and dec[1] == [(40, 64)]  # in place, from the lowest page held
    _assert_dense(scheduled, cache, dec, window, None)


@pytest.mark.parametrize("window", [None, 5])
def test_decode_pages_in_runs_far_apart_are_read_in_place_as_spans(window):
    """Live pages in two runs with cached pages between them (prefix caching keeps finished
    sequences' pages): two spans in place, [2, 10) and [44, 52), not one span over the pages
    between and not a gather; attention is still exact."""
    cache = _random_pool(4)
    pages = list(range(2, 10)) + list(range(44, 52))  # a gap of 34 pages
    scheduled, dec = _decoding([pages[i::4] for i in range(4)], cache)
    assert dec[0] is None and dec[1] == [(2, 10), (44, 52)]
    _assert_dense(scheduled, cache, dec, window, None)


def test_spans_split_at_the_largest_gaps_only():
    from worker import runner

    assert runner.spans([41, 0, 2, 1, 40, 80, 90]) == [(0, 3), (40, 42), (80, 91)]  # a gap of 9 is read through
    many = [10 * k * (k + 1) for k in range(runner.MAX_SPANS + 3)]  # gaps growing: 19, 39, 59, ...
    got = runner.spans(many)  # the three smallest gaps are the ones read through
    assert len(got) == runner.MAX_SPANS and got[0] == (0, many[3] + 1) and got[1] == (many[4], many[4] + 1)
    assert runner.spans([]) == []
