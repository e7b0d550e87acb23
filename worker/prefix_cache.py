"""Prefix caching: full KV pages named by their content, found again by later requests.

A page is *full* once all ``page_size`` of its positions have K/V in the cache. Its name (a
hash) covers everything its K/V depend on: the hash of the page before it (which covers every
earlier token), its own token ids, and the request's ``cache_salt`` (in the first page's
parent, so it reaches every page). Causal attention makes a position's K/V a function of the
tokens up to it, in every layer, sliding-window layers included (tokenq keeps every
position's K/V, masking the window at attention time), so two sequences whose first ``n``
pages have the same names may share those pages.

A new sequence takes the longest run of cached pages matching its tokens and computes only
the rest. The last token is always computed, even when all of it is cached: the step needs
its logits to sample the next token. Pages are held by reference count in the allocator
(worker/cache.py); one nobody holds stays cached until an allocation needs it.
"""

from __future__ import annotations

import array
import hashlib

from worker.cache import BlockAllocator
from worker.sequence import Sequence


def _root(salt: str | None) -> bytes:
    return b"tokenq" if salt is None else b"tokenq-salt:" + salt.encode()


def page_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full page: chained from its parent's name and its token ids. 128 bits of
    blake2b, so two different prefixes never meet in practice (a collision would serve
    another prompt's K/V)."""
    return hashlib.blake2b(parent + array.array("q", tokens).tobytes(), digest_size=16).digest()


def chain_hashes(tokens: list[int], page_size: int, salt: str | None, num_pages: int, hashes: list[bytes] | None = None) -> list[bytes]:
    """Names of the first ``num_pages`` full pages of ``tokens``, extending ``hashes`` in place."""
    hashes = [] if hashes is None else hashes
    for i in range(len(hashes), num_pages):
        parent = hashes[-1] if hashes else _root(salt)
        hashes.append(page_hash(parent, tokens[i * page_size:(i + 1) * page_size]))
    return hashes


def _hashes(seq: Sequence, num_pages: int, page_size: int) -> list[bytes]:
    return chain_hashes(seq.token_ids, page_size, seq.params.cache_salt, num_pages, seq.page_hashes)


def match(seq: Sequence, alloc: BlockAllocator) -> list[int]:
    """The cached pages holding the longest run of ``seq``'s first pages, never its last token."""
    return lookup(seq.token_ids, seq.params.cache_salt, alloc, seq.page_hashes)


def lookup(tokens: list[int], salt: str | None, alloc: BlockAllocator, hashes: list[bytes] | None = None) -> list[int]:
    """``match`` for a token list (``hashes``: its page names so far, extended in place)."""
    ps = alloc.page_size
    limit = (len(tokens) - 1) // ps
    pages: list[int] = []
    if limit <= 0:
        return pages
    for h in chain_hashes(tokens, ps, salt, limit, hashes)[:limit]:
        p = alloc.lookup(h)
        if p is None:
            break
        pages.append(p)
    return pages


def held_hits(seq: Sequence, alloc: BlockAllocator) -> int:
    """Pages ``seq`` would share that somebody holds already: admitting it costs that many fewer."""
    return sum(1 for p in match(seq, alloc) if alloc.refs(p) > 0)


def computing(seq: Sequence, page_size: int) -> list[bytes]:
    """Names of the full pages of ``seq``'s known tokens that it has yet to compute: what its
    prefill will add to the cache."""
    full = seq.num_tokens // page_size
    start = seq.num_computed // page_size
    if start >= full:
        return []
    return _hashes(seq, full, page_size)[start:full]


def next_page(seq: Sequence, hits: int, page_size: int) -> bytes | None:
    """The name of the first page of ``seq``'s prefix past its ``hits`` cached pages (None: the
    cache could give it no more)."""
    if hits >= (seq.num_tokens - 1) // page_size:
        return None
    return _hashes(seq, hits + 1, page_size)[hits]


def commit(seq: Sequence, alloc: BlockAllocator) -> None:
    """Name the pages of ``seq`` that its computed tokens have filled since the last call."""
    ps = alloc.page_size
    full = seq.num_computed // ps
    if full <= seq.num_committed_pages:
        return
    hashes = _hashes(seq, full, ps)
    for i in range(seq.num_committed_pages, full):
        alloc.register(seq.block_table[i], hashes[i])
    seq.num_committed_pages = full
