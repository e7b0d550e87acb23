"""The scheduler: who runs this step, with how many tokens, and who is evicted to make room.

Every step it does, in this order:

1. **Impossible requests and deadlines.** A waiting request that can never run is
   REJECTed here, at once, whatever the free slots and token budget (it must neither wait
   for them nor wedge the queue). Waiting requests not started within their
   ``timeout_s`` end as ``timeout``.
2. **Make room for urgent work** (``optimistic`` policy only; ``reserve`` never preempts).
   Walking the waiting queue by urgency, a request that cannot be admitted (pages, or
   ``max_num_seqs``) evicts running sequences of *strictly* lower priority, least urgent
   first, while that makes room. Equal priorities never evict each other: no ping-pong.
3. **Advance the running sequences**, most urgent first: one token for each decoding
   sequence, the next chunk for each still-prefilling one. A sequence that needs a page
   when none is free evicts the least urgent running sequence (possibly itself).
4. **Admit** waiting requests in order while tokens, sequence slots and pages allow. The
   first DEFER stops the walk, so a less urgent request never overtakes a more urgent one
   that is waiting for room. The one exception is made for the prefix cache: a request
   whose next prompt page a running prefill is computing right now is passed over (the
   walk goes on past it) until that page is cached, a step or so.

Order is (priority, arrival). A preempted request keeps its arrival number, so it goes
back to its place in the queue rather than behind later arrivals of its priority.
Eviction frees the victim's pages: ``recompute`` re-prefills prompt + output later,
``swap`` copies its pages to a host pool and back.

With prefix caching (worker/prefix_cache.py) an admitted sequence first takes the cached
pages matching its prefix and computes only the rest; pages are shared by count, so
releasing a sequence frees only the pages nobody else holds, and its full pages stay cached
(free, evictable) for later requests, its own readmission after a recompute preemption
included.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from worker import prefix_cache
from worker.admission import Decision, Verdict, decide, pages_to_admit
from worker.cache import BlockAllocator, pages_for
from worker.config import EngineConfig
from worker.sequence import Sequence, Status

log = logging.getLogger("tokenq.scheduler")


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (= seq.num_computed before the step)
    num_tokens: int  # tokens computed this step
    sample: bool  # the chunk reaches the last known token: sample the next one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # device -> host pages
    swap_in: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # host -> device pages
    finished: list[Sequence] = field(default_factory=list)  # ended without running: rejected, timed out
    new_pages: list[int] = field(default_factory=list)  # pages handed out this step, to be cleared before use

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, cfg: EngineConfig, alloc: BlockAllocator, max_model_len: int, host_alloc: BlockAllocator | None = None):
        self.cfg = cfg
        self.alloc = alloc
        self.host_alloc = host_alloc
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by Sequence.order
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.admissions = {d: 0 for d in Decision}
        self.caching = cfg.enable_prefix_caching
        self.prefix_queries = 0  # tokens of sequences admitted while caching (vLLM's prefix-cache queries)
        self.prefix_hits = 0  # of those, tokens found in the cache

    # ------------------------------------------------------------------ bookkeeping

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for s in self.running:
            if s.request_id == request_id:
                return s
        for s in self.waiting:
            if s.request_id == request_id:
                return s
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the engine, freeing everything it holds."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        self.alloc.free(seq.block_table)
        seq.block_table = []
        seq.num_committed_pages = 0
        self.alloc.reserved -= seq.reserved_pages
        seq.reserved_pages = 0
        if seq.host_pages is not None:
            assert self.host_alloc is not None
            self.host_alloc.free(seq.host_pages)
            seq.host_pages = None

    def pages_waiting(self) -> int:
        """Pages the waiting queue will ask for when admitted (what the service must not overfill)."""
        return sum(pages_to_admit(s, self.cfg, self.alloc.page_size, self._held(s)) for s in self.waiting)

    # ------------------------------------------------------------------ prefix caching

    def _may_hit(self, seq: Sequence) -> bool:
        """Whether a waiting sequence would start from cached pages (not when swapped out: its
        own come back)."""
        if not self.caching or seq.host_pages is not None or seq.block_table:
            return False
        # a scored prompt needs every prompt position computed (as vLLM does)
        return seq.params.prompt_logprobs is None or bool(seq.num_output_tokens) or bool(seq.index)

    def _hits(self, seq: Sequence) -> list[int]:
        """Cached pages a waiting sequence would start from."""
        return prefix_cache.match(seq, self.alloc) if self._may_hit(seq) else []

    def _waits_for_prefix(self, seq: Sequence, computing: set[bytes]) -> bool:
        """Whether the next page of ``seq``'s prefix past its cached ones is being computed by a
        running prefill (``computing``): admitted a step or so later it finds that page, and
        what follows, in the cache instead of computing them a second time. Requests sharing
        a system prompt arrive together; without this, those admitted in the steps their
        prompt's first request is prefilled would all compute it."""
        if not self._may_hit(seq):
            return False
        name = prefix_cache.next_page(seq, len(self._hits(seq)), self.alloc.page_size)
        return name is not None and name in computing

    def _held(self, seq: Sequence) -> int:
        return sum(1 for p in self._hits(seq) if self.alloc.refs(p) > 0)

    def _take_hits(self, seq: Sequence) -> None:
        """Start an admitted sequence from its cached prefix pages; count the query and the hit."""
        if not self.caching or seq.host_pages is not None:
            return
        hits = self._hits(seq)
        self.alloc.share(hits)
        seq.block_table = hits
        seq.num_committed_pages = len(hits)
        seq.num_computed = len(hits) * self.alloc.page_size
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed
        if seq.cached_tokens is None:
            seq.cached_tokens = min(seq.num_computed, seq.num_prompt_tokens)

    def commit(self, seq: Sequence) -> None:
        """After a step computed ``seq``'s tokens: name its newly full pages for later matches."""
        if self.caching:
            prefix_cache.commit(seq, self.alloc)

    # ------------------------------------------------------------------ the step

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self._expire(now, out)
        preempted: set[int] = set()
        if self.cfg.admission_policy == "optimistic":
            self._make_room_for_urgent(out, preempted)
        budget = self.cfg.max_num_batched_tokens
        budget = self._advance_running(out, budget, preempted)
        self._admit(out, budget, preempted, now)
        if self.cfg.check_invariants:
            self.check(out)
        return out

    def _expire(self, now: float, out: SchedulerOutput) -> None:
        for seq in [s for s in self.waiting if s.first_scheduled_time is None]:
            verdict = self._decide(seq)
            if verdict.decision is Decision.REJECT:
                self._reject(seq, verdict, out)
            elif seq.timeout_s is not None and now - seq.arrival_time > seq.timeout_s:
                self.finish(seq, "timeout")
                out.finished.append(seq)

    def _reject(self, seq: Sequence, verdict: Verdict, out: SchedulerOutput) -> None:
        self.admissions[Decision.REJECT] += 1
        log.info("reject %s: %s", seq.request_id, verdict.reason)
        seq.error = (verdict.code or "invalid_request", verdict.reason)
        self.finish(seq, "error")
        out.finished.append(seq)

    def _decide(self, seq: Sequence, pending_pages: int = 0, pending_seqs: int = 0) -> Verdict:
        """Admission verdict, counting pages/slots promised earlier in this step as taken."""
        self.alloc.reserved += pending_pages  # borrow the reservation counter as "promised"
        try:
            return decide(seq, self.alloc, self.cfg, self.max_model_len, len(self.running) + pending_seqs, self._held(seq))
        finally:
            self.alloc.reserved -= pending_pages

    def _fits(self, seq: Sequence, pending_pages: int, pending_seqs: int) -> bool:
        """Would ``seq`` be admitted now, with these pages and sequence slots promised to others?"""
        v = self._decide(seq, pending_pages, pending_seqs)
        return v.decision is Decision.ADMIT and len(self.running) + pending_seqs < self.cfg.max_num_seqs

    def _make_room_for_urgent(self, out: SchedulerOutput, preempted: set[int]) -> None:
        promised_pages = promised_seqs = 0
        for w in list(self.waiting):
            victims = sorted((r for r in self.running if r.priority > w.priority), key=lambda s: s.order, reverse=True)
            verdict = self._decide(w, promised_pages, promised_seqs)
            if verdict.decision is Decision.REJECT:
                continue  # cannot happen: step 1 ended those
            if not self._fits(w, promised_pages, promised_seqs):
                # Evict only if evicting every strictly-lower-priority sequence would be enough:
                # partial evictions that still leave it waiting would only waste their work.
                # Pages others share, or that ``w`` would share itself, free nothing for it.
                freed = self.alloc.freed_by([v.block_table for v in victims], keep=set(self._hits(w)))
                if not victims or not self._fits(w, promised_pages - freed, promised_seqs - len(victims)):
                    return
                while victims and not self._fits(w, promised_pages, promised_seqs):
                    self._preempt(victims.pop(0), out, preempted, why=f"priority: {w.request_id} (p{w.priority}) waits")
                if not self._fits(w, promised_pages, promised_seqs):
                    return
            promised_pages += pages_to_admit(w, self.cfg, self.alloc.page_size, self._held(w))
            promised_seqs += 1

    def _advance_running(self, out: SchedulerOutput, budget: int, preempted: set[int]) -> int:
        self.running.sort(key=lambda s: s.order)
        # Decodes need one token each; keep that much budget for those not yet scheduled so a
        # long prefill chunk of an urgent sequence does not stall everyone's next token.
        decodes_left = sum(1 for s in self.running if len(s.token_ids) - s.num_computed == 1)
        # This loop runs once per running sequence per step (256 on a GPU): each one's counts read once.
        scheduled = out.scheduled
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # evicted earlier in this loop
                continue
            start, total = seq.num_computed, len(seq.token_ids)
            remaining = total - start
            if remaining == 1:
                decodes_left -= 1
                n = 1 if budget >= 1 else 0
            else:
                n = min(remaining, budget - decodes_left)
            if n <= 0:
                continue
            if not self._grow(seq, start + n, out, preempted):
                continue  # it was its own victim
            scheduled.append(ScheduledSeq(seq, start, n, start + n == total))
            budget -= n
        return budget

    def _grow(self, seq: Sequence, num_tokens: int, out: SchedulerOutput, preempted: set[int]) -> bool:
        """Give ``seq`` pages for ``num_tokens``, evicting the least urgent running sequences if needed."""
        extra = pages_for(num_tokens, self.alloc.page_size) - len(seq.block_table)
        if extra <= 0:
            return True
        while extra > self.alloc.num_available + seq.reserved_pages:
            victim = max(self.running, key=lambda s: s.order)
            self._preempt(victim, out, preempted, why=f"cache full: {seq.request_id} needs a page")
            if victim is seq:
                return False
        from_reserve = min(extra, seq.reserved_pages)
        seq.reserved_pages -= from_reserve
        self.alloc.reserved -= from_reserve
        pages = self.alloc.allocate(extra)
        seq.block_table.extend(pages)
        out.new_pages.extend(pages)
        return True

    def _admit(self, out: SchedulerOutput, budget: int, preempted: set[int], now: float) -> None:
        """Admit waiting sequences in order. One whose prefix a running prefill is computing
        is passed over for now (see _waits_for_prefix): it keeps its place in the queue, and
        those behind it may go first."""
        ps = self.alloc.page_size
        computing = set()
        if self.caching and self.waiting:
            for s in self.running:
                computing.update(prefix_cache.computing(s, ps))
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[i]
            if id(seq) in preempted:
                return  # evicted this very step: wait for the next
            verdict = self._decide(seq)
            if verdict.decision is Decision.REJECT:
                self._reject(seq, verdict, out)
                continue
            if verdict.decision is Decision.DEFER:
                self.admissions[Decision.DEFER] += 1
                log.debug("defer %s: %s", seq.request_id, verdict.reason)
                return
            if computing and self._waits_for_prefix(seq, computing):
                i += 1
                continue
            self.admissions[Decision.ADMIT] += 1
            self.waiting.pop(i)
            self._take_hits(seq)
            if self.cfg.admission_policy == "reserve":
                seq.reserved_pages = pages_to_admit(seq, self.cfg, ps, len(seq.block_table))
                self.alloc.reserved += seq.reserved_pages
            if seq.host_pages is not None:  # swapped out earlier: bring its pages back
                assert self.host_alloc is not None
                take = min(len(seq.host_pages), seq.reserved_pages)
                seq.reserved_pages -= take
                self.alloc.reserved -= take
                seq.block_table = self.alloc.allocate(len(seq.host_pages))
                out.swap_in[0].extend(seq.host_pages)
                out.swap_in[1].extend(seq.block_table)
                self.host_alloc.free(seq.host_pages)
                seq.host_pages = None
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            n = min(seq.num_tokens - seq.num_computed, budget)
            self._grow(seq, seq.num_computed + n, out, preempted)  # admission checked the pages are there
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
            budget -= n
            if self.caching:
                computing.update(prefix_cache.computing(seq, ps))
            log.debug("admit %s (p%d, %d tokens)", seq.request_id, seq.priority, seq.num_tokens)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, preempted: set[int], why: str) -> None:
        self.running.remove(seq)
        for i, s in enumerate(out.scheduled):  # undo its share of this step, if it had one
            if s.seq is seq:
                del out.scheduled[i]
                break
        host = self.host_alloc
        if self.cfg.preemption_mode == "swap" and host is not None and seq.num_computed > 0 and host.num_available >= len(seq.block_table):
            seq.host_pages = host.allocate(len(seq.block_table))
            out.swap_out[0].extend(seq.block_table)
            out.swap_out[1].extend(seq.host_pages)
            self.alloc.free(seq.block_table)
            seq.block_table = []
            seq.num_committed_pages = 0
            self.alloc.reserved -= seq.reserved_pages
            seq.reserved_pages = 0
            mode = "swap"
        else:
            self._release(seq)
            seq.num_computed = 0
            mode = "recompute"
        seq.num_preemptions += 1
        self.num_preemptions += 1
        preempted.add(id(seq))
        log.info("preempt %s (p%d, %d tokens, %s): %s", seq.request_id, seq.priority, seq.num_tokens, mode, why)
        self.add(seq)

    # ------------------------------------------------------------------ invariants

    def check(self, out: SchedulerOutput) -> None:
        cfg = self.cfg
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
        assert len(self.running) <= cfg.max_num_seqs, "too many running sequences"
        ps = self.alloc.page_size
        scheduled = {id(s.seq): s for s in out.scheduled}
        assert len(scheduled) == len(out.scheduled), "a sequence is scheduled twice"
        for seq in self.running:
            assert seq.status is Status.RUNNING
            s = scheduled.get(id(seq))
            upto = s.start + s.num_tokens if s else seq.num_computed
            # Exactly the pages its tokens need: never short, and waste below one page.
            assert len(seq.block_table) == pages_for(upto, ps), f"{seq.request_id}: {len(seq.block_table)} pages for {upto} tokens"
        for seq in self.waiting:
            assert seq.status is Status.WAITING and not seq.block_table, f"{seq.request_id}: waiting with pages"
        for s in out.scheduled:
            assert s.seq.status is Status.RUNNING and s.num_tokens > 0
        self.alloc.check([s.block_table for s in self.running])
        for seq in self.running:  # a named page holds what its name says: this sequence's tokens there
            for i, page in enumerate(seq.block_table[:seq.num_committed_pages]):
                h = self.alloc.hash_of(page)
                assert h is None or h == seq.page_hashes[i], f"{seq.request_id}: page {i} is named for other tokens"
        assert sum(s.reserved_pages for s in self.running) == self.alloc.reserved, "reservations do not add up"
        if self.host_alloc is not None:
            self.host_alloc.check([s.host_pages for s in self.waiting if s.host_pages is not None])
