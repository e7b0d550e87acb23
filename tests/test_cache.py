"""The paged KV cache: the page allocator's invariants and the host swap pool."""

from __future__ import annotations

import pytest
import torch
from helpers import thp_mode
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from worker.cache import BlockAllocator, KVCache, pages_for


def test_pages_for():
    assert [pages_for(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert pages_for(16, 16) == 1 and pages_for(17, 16) == 2


def test_allocate_free_counts():
    a = BlockAllocator(8, 4)
    assert (a.num_free, a.num_used, a.num_available) == (8, 0, 8)
    x = a.allocate(3)
    y = a.allocate(5)
    assert len(set(x) | set(y)) == 8 and set(x).isdisjoint(y)
    assert set(x) | set(y) == set(range(8))
    assert (a.num_free, a.num_used) == (0, 8)
    a.check([x, y])
    with pytest.raises(MemoryError):
        a.allocate(1)
    a.free(x)
    assert (a.num_free, a.num_used) == (3, 5)
    a.check([y])
    # the most recently freed pages are reused first
    assert sorted(a.allocate(3)) == sorted(x)
    assert a.allocate(0) == []


def test_a_table_gets_ascending_pages_and_gets_them_again_once_freed():
    """The decode kernel streams a sequence's pages forward: an allocation hands them out in
    ascending order, and a table freed and taken again (the warm pages first) comes back so."""
    a = BlockAllocator(16, 4)
    x, y = a.allocate(5), a.allocate(3)
    assert x == [0, 1, 2, 3, 4] and y == [5, 6, 7]
    a.free(x)
    assert a.allocate(5) == x
    a.free(y)
    assert a.allocate(4) == [5, 6, 7, 8]


def test_double_free_and_bad_tables_are_caught():
    a = BlockAllocator(4, 2)
    x = a.allocate(2)
    a.free(x)
    with pytest.raises(AssertionError, match="freed twice"):
        a.free(x[:1])
    y = a.allocate(2)
    with pytest.raises(AssertionError, match="owned twice"):
        a.check([y, y[:1]])
    with pytest.raises(AssertionError, match="leak"):
        a.check([y[:1]])  # a page that is neither free nor owned
    with pytest.raises(AssertionError, match="free page is owned"):
        a.check([y, [a._free[0]]])
    a.reserved = 3  # more promised than free
    with pytest.raises(AssertionError, match="reserved"):
        a.check([y])


def test_needs_a_page():
    with pytest.raises(ValueError):
        BlockAllocator(0, 16)


class AllocatorMachine(RuleBasedStateMachine):
    """Sequences come, grow token by token or in chunks, and leave; the allocator must stay exact."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.page_size = 4
        self.alloc = BlockAllocator(24, self.page_size)
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, int] = {}
        self.next_id = 0

    def _grow(self, sid: int, n: int) -> bool:
        need = pages_for(self.tokens[sid] + n, self.page_size) - len(self.tables[sid])
        if need > self.alloc.num_free:
            with pytest.raises(MemoryError):
                self.alloc.allocate(need)
            return False
        self.tables[sid].extend(self.alloc.allocate(need))
        self.tokens[sid] += n
        return True

    @rule(target=seqs, n=st.integers(1, 40))
    def add(self, n):
        sid = self.next_id
        self.next_id += 1
        self.tables[sid], self.tokens[sid] = [], 0
        if not self._grow(sid, n):
            del self.tables[sid], self.tokens[sid]
            return -1
        return sid

    @rule(sid=seqs, n=st.integers(1, 9))
    def append(self, sid, n):
        if sid in self.tables:
            self._grow(sid, n)

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid in self.tables:
            before = self.alloc.num_free
            self.alloc.free(self.tables.pop(sid))
            assert self.alloc.num_free == before + pages_for(self.tokens.pop(sid), self.page_size)

    @invariant()
    def pages_are_exact(self):
        tables = list(self.tables.values())
        self.alloc.check(tables)  # no page owned twice, free + used = total
        owned = [p for t in tables for p in t]
        assert all(0 <= p < self.alloc.num_pages for p in owned)
        assert self.alloc.num_free + self.alloc.num_used == self.alloc.num_pages
        assert self.alloc.num_used == len(owned)
        for sid, t in self.tables.items():
            # waste at most one partly filled page per sequence
            assert 0 <= len(t) * self.page_size - self.tokens[sid] < self.page_size


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def _cache(host_pages=0):
    return KVCache(num_layers=2, num_pages=6, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                   device=torch.device("cpu"), host_pages=host_pages)


def test_kv_cache_layout_and_size():
    c = _cache()
    assert c.k.shape == c.v.shape == (2, 6, 2, 4, 8)
    assert c.host_k is None
    assert KVCache.bytes_per_page(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32) == 2 * 2 * 4 * 2 * 8 * 4
    assert KVCache.bytes_per_page(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16) == 2 * 2 * 4 * 2 * 8 * 2


def test_swap_round_trip_moves_only_the_named_pages():
    c = _cache(host_pages=3)
    torch.manual_seed(0)
    c.k.normal_()
    c.v.normal_()
    k0, v0 = c.k.clone(), c.v.clone()
    c.swap_out([4, 1], [2, 0])
    assert torch.equal(c.host_k[:, 2], k0[:, 4]) and torch.equal(c.host_v[:, 0], v0[:, 1])
    c.k.zero_()
    c.v.zero_()
    c.swap_in([2, 0], [0, 5])  # back into different device pages
    assert torch.equal(c.k[:, 0], k0[:, 4]) and torch.equal(c.v[:, 0], v0[:, 4])
    assert torch.equal(c.k[:, 5], k0[:, 1]) and torch.equal(c.v[:, 5], v0[:, 1])
    for p in (1, 2, 3, 4):
        assert not c.k[:, p].any() and not c.v[:, p].any()


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (kB) of this process's mappings that overlap ``t``'s memory."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
def test_cpu_pools_lie_on_huge_pages():
    """Decode attention reads pool pages anywhere in the pool; the pools ask Linux for huge
    pages (worker/tuning.zeros_on_huge_pages), which it grants on request in 'madvise' mode."""
    c = KVCache(num_layers=4, num_pages=2048, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                device=torch.device("cpu"))  # 64 MiB a pool: past malloc's mmap threshold, fresh memory
    for pool in (c.k, c.v):
        assert int(pool.abs().sum()) == 0
        assert _huge_kib(pool) >= 2048


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
def test_pools_zeroed_in_the_background_lie_on_huge_pages_too():
    """The engine's pools are zeroed by a thread beside its compile (zero_later)."""
    c = KVCache(num_layers=4, num_pages=2048, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                device=torch.device("cpu"), zero_later=True)
    c.ready()
    for pool in (c.k, c.v):
        assert int(pool.abs().sum()) == 0
        assert _huge_kib(pool) >= 2048


def test_zero_in_background_overwrites_what_was_there():
    from worker.tuning import zero_in_background

    ts = [torch.full((1000, 37), float("nan")), torch.full((3, 5), 7, dtype=torch.bfloat16)]
    zero_in_background(*ts).join()
    assert all(bool((t == 0).all()) for t in ts)
    with pytest.raises(ValueError, match="contiguous"):
        zero_in_background(torch.zeros(4, 4).t())  # memset would write the wrong bytes
