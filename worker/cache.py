"""The paged KV cache: a pool of fixed-size pages per layer, and the allocator that hands them out.

Layout of one layer's pool: ``[num_pages, kv_heads, page_size, head_dim]`` for K and for V.
A page holds ``page_size`` consecutive positions of one sequence for every KV head, so a
sequence's cache is the list of its pages (its block table) and nothing is ever moved when
sequences come and go. Waste is at most one partly filled page per sequence.
"""

from __future__ import annotations

import torch


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class BlockAllocator:
    """Free list of page numbers. Pure Python: the scheduler uses it without touching tensors.

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
        self._is_free = [True] * num_pages
        self.reserved = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Free pages not promised to anyone."""
        return len(self._free) - self.reserved

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} free")
        pages = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise AssertionError(f"page {p} freed twice")
            self._is_free[p] = True
        self._free.extend(reversed(pages))

    def check(self, tables: list[list[int]]) -> None:
        """Every page is either free or owned by exactly one table; free + used = total."""
        owned = [p for t in tables for p in t]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert not any(self._is_free[p] for p in owned), "a free page is owned"
        assert len(owned) + len(self._free) == self.num_pages, (
            f"pages leak: {len(owned)} owned + {len(self._free)} free != {self.num_pages}"
        )
        assert 0 <= self.reserved <= len(self._free), "more pages reserved than free"


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
    ):
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
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
