"""The paged KV cache: a pool of fixed-size pages per layer, and the allocator that hands them out.

Layout of one layer's pool: ``[num_pages, kv_heads, page_size, head_dim]`` for K and for V.
A page holds ``page_size`` consecutive positions of one sequence for every KV head, so a
sequence's cache is the list of its pages (its block table) and nothing is ever moved when
sequences come and go. Waste is at most one partly filled page per sequence.
"""

from __future__ import annotations

import torch

from worker.tuning import empty_on_huge_pages, zero_in_background, zeros_on_huge_pages


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class BlockAllocator:
    """Page numbers with reference counts. Pure Python: the scheduler uses it without touching tensors.

    A page is *used* while some block table holds it (its count is above zero); several tables
    may hold one page (a shared prompt prefix). A page whose count drops to zero is *free*: if
    it holds a full page of known content (``register`` gave it a hash, see
    worker/prefix_cache.py) it stays cached, findable by ``lookup``, until an allocation needs
    it, least recently freed first; other free pages are handed out before any cached one.

    ``reserved`` counts pages promised to running sequences (the 'reserve' admission policy)
    that they have not taken yet: they are free, but not available to anyone else.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError("the cache needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        # A stack: the most recently freed page is reused first (its memory is warm).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._cached: dict[int, None] = {}  # free pages with a hash, least recently freed first
        self._refs = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.reserved = 0

    @property
    def num_free(self) -> int:
        """Pages nobody holds, cached ones included (an allocation may evict those)."""
        return len(self._free) + len(self._cached)

    @property
    def num_available(self) -> int:
        """Free pages not promised to anyone."""
        return self.num_free - self.reserved

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages with a hash, held or free."""
        return len(self._hash_of)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """``n`` pages, each held once; plain free pages first, then cached ones, oldest first."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} pages, {self.num_free} free")
        k = min(n, len(self._free))
        # Popped one by one: the stack's top first. A table freed (last page first) and taken
        # again comes back in ascending order, so a sequence's pages lie at rising addresses and
        # the decode kernel streams them forward (worker/csrc/paged_attention.cpp).
        pages = self._free[len(self._free) - k:][::-1]
        del self._free[len(self._free) - k:]
        for _ in range(n - k):
            p = next(iter(self._cached))
            del self._cached[p]
            del self._page_of[self._hash_of.pop(p)]
            pages.append(p)
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Hold cached pages once more (a prefix hit); a free one leaves the free pool."""
        for p in pages:
            if self._refs[p] == 0:
                del self._cached[p]  # only hashed pages are found by lookup, so it is here
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one hold of each page. Last page first, so a table's deepest pages are evicted
        before the pages they extend (a page is of use only after its parent)."""
        for p in reversed(pages):
            if self._refs[p] == 0:
                raise AssertionError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._hash_of:
                    self._cached[p] = None
                else:
                    self._free.append(p)

    def register(self, page: int, page_hash: bytes) -> bool:
        """Mark a held page as holding the content ``page_hash`` names (first page wins)."""
        if page in self._hash_of or page_hash in self._page_of:
            return False
        self._hash_of[page] = page_hash
        self._page_of[page_hash] = page
        return True

    def lookup(self, page_hash: bytes) -> int | None:
        return self._page_of.get(page_hash)

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of.get(page)

    def freed_by(self, tables: list[list[int]], keep: set[int] = frozenset()) -> int:
        """Pages that would become free if these tables were released (pages in ``keep`` not counted)."""
        held: dict[int, int] = {}
        for t in tables:
            for p in t:
                held[p] = held.get(p, 0) + 1
        return sum(1 for p, n in held.items() if n == self._refs[p] and p not in keep)

    def check(self, tables: list[list[int]]) -> None:
        """Every page's count is the number of tables holding it; free pages are held by none;
        cached pages are exactly the hashed free ones; free + used = total."""
        held = [0] * self.num_pages
        for t in tables:
            for p in t:
                held[p] += 1
        free = set(self._free) | set(self._cached)
        assert len(free) == len(self._free) + len(self._cached), "a page is free twice"
        assert not any(held[p] for p in free), "a free page is owned"
        for p in range(self.num_pages):
            assert held[p] <= self._refs[p], f"page {p} owned twice (held {held[p]}, counted {self._refs[p]})"
            assert held[p] == self._refs[p], f"pages leak: page {p} counted {self._refs[p]}, held {held[p]}"
            assert (self._refs[p] == 0) == (p in free), f"page {p}: count {self._refs[p]} but free is {p in free}"
        assert all(p in self._hash_of for p in self._cached), "an unhashed page is cached"
        assert not any(p in self._hash_of for p in self._free), "a hashed page is plain free"
        assert all(self._page_of[h] == p for p, h in self._hash_of.items()), "the hash index disagrees"
        assert len(self._page_of) == len(self._hash_of), "the hash index disagrees"
        assert 0 <= self.reserved <= self.num_free, "more pages reserved than free"


def kv_heads_and_dim(config) -> tuple[int, int]:
    """(kv heads, head size) a (text) model config's layers cache: without num_key_value_heads
    every attention head has its own K/V; without head_dim it is hidden_size / heads."""
    num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return num_kv, head_dim


class KVCache:
    """The tensors: K and V pools for every layer, plus an optional host pool for swapping."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        host_pages: int = 0,
        zero_later: bool = False,
    ):
        """``zero_later`` (CPU): the pools' zeros are written by a thread of their own; call
        :meth:`ready` before the pools are used (the engine does, after its compile)."""
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        on_cpu = torch.device(device).type == "cpu"
        self._zeroing = None
        if on_cpu and zero_later:
            self.k, self.v = empty_on_huge_pages(shape, dtype), empty_on_huge_pages(shape, dtype)
            self._zeroing = zero_in_background(self.k, self.v)
        elif on_cpu:
            self.k, self.v = zeros_on_huge_pages(shape, dtype), zeros_on_huge_pages(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages
        self.host_k = self.host_v = None
        if host_pages:
            hshape = (num_layers, host_pages, num_kv_heads, page_size, head_dim)
            pin = device.type == "cuda"
            self.host_k = torch.zeros(hshape, dtype=dtype, pin_memory=pin)
            self.host_v = torch.zeros(hshape, dtype=dtype, pin_memory=pin)

    def ready(self) -> None:
        """Wait for the pools' zeros (see zero_later)."""
        if self._zeroing is not None:
            self._zeroing.join()
            self._zeroing = None

    @staticmethod
    def bytes_per_page(*, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def clear(self, pages: list[int]) -> None:
        idx = torch.tensor(pages, device=self.k.device)
        self.k.index_fill_(1, idx, 0)
        self.v.index_fill_(1, idx, 0)

    def swap_out(self, device_pages: list[int], host_pages: list[int]) -> None:
        src = torch.tensor(device_pages, device=self.k.device)
        dst = torch.tensor(host_pages)
        self.host_k[:, dst] = self.k[:, src].to("cpu", non_blocking=False)
        self.host_v[:, dst] = self.v[:, src].to("cpu", non_blocking=False)

    def swap_in(self, host_pages: list[int], device_pages: list[int]) -> None:
        src = torch.tensor(host_pages)
        dst = torch.tensor(device_pages, device=self.k.device)
        self.k[:, dst] = self.host_k[:, src].to(self.k.device)
        self.v[:, dst] = self.host_v[:, src].to(self.k.device)
