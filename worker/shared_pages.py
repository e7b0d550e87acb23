"""Decode attention over KV pages that several decoding sequences share (a cached prefix).

The decode path (worker/attention.py) scores each decode page against the one query of the
sequence it belongs to. A page in the tables of ``c`` decodes (prefix caching shares full
prompt pages) would have to be listed ``c`` times, its K/V gathered ``c`` times over. Here it
is read once and scored against all ``c`` queries together.

Pages with the same holders (the decodes whose tables hold them: a system prompt's pages are
held by every request that started from it) are cut into *segments* of up to
``SEGMENT_PAGES`` pages. Each segment is one matrix product: its holders' queries (``m * g``
rows: holders times query heads per kv head) against all its slots (``SEGMENT_PAGES *
page_size`` columns). Products that size run near the machine's GEMM rate; one product per
page (``m * g`` by ``page_size``) ran at a tenth of it, and made half of a decode step of a
shared-prefix workload. Segments are grouped by how many holders they have, rounded up to
a power of two (padding at most doubles the rows). Each (segment, holder) pair joins the
step's segmented softmax as one more "decode page" of its holder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Pages per segment: 128 slots at the default page size. Longer segments make larger
# products; the last segment of a run is padded, so longer ones also waste more.
SEGMENT_PAGES = 8
_PAD_POS = 1 << 40  # position of a padding slot: past every context, so masked for every holder


@dataclass
class SharedGroup:
    """Segments held by up to ``m`` decodes each; holder slot ``j`` of segment ``i`` is one decode (or padding)."""

    src: torch.Tensor  # [Ns, R] pool page numbers of each segment (padding: its first page again, masked)
    m: int
    acc: torch.Tensor  # [Ns * m] the decode of each (segment, holder); n_dec for padding
    qrow: torch.Tensor  # [Ns * m] query row of each (segment, holder)
    pos: torch.Tensor  # [Ns, R * page_size] position of each slot in its holders (a prefix: the same in all)
    ctx: torch.Tensor  # [Ns, m] context length of each holder (0 for padding)
    _memo: dict = field(default_factory=dict)  # built once per step, used by every layer

    def rows(self, kvh: int) -> torch.Tensor:
        """[Ns * kvh * R] the (page, kv head) blocks of a layer's pool viewed as [pages * kvh, ps, D],
        in (segment, head, page) order."""
        r = self._memo.get(("rows", kvh))
        if r is None:
            heads = torch.arange(kvh, device=self.src.device)
            r = self._memo[("rows", kvh)] = (self.src[:, None, :] * kvh + heads[None, :, None]).view(-1)
        return r

    def mask(self, window: int | None) -> torch.Tensor:
        """[Ns, 1, m, 1, R * ps]: True where a holder attends to the segment's slot."""
        b = self._memo.get(("mask", window))
        if b is None:
            pos, ctx = self.pos[:, None, :], self.ctx[:, :, None]
            m = pos < ctx
            if window is not None:
                m &= pos > ctx - 1 - window
            b = self._memo[("mask", window)] = m[:, None, :, None, :]
        return b


def split(flat: torch.Tensor, acc: torch.Tensor, rank: torch.Tensor, ctx: torch.Tensor, n: int, page_size: int,
          device) -> tuple[torch.Tensor, list[SharedGroup]]:
    """Decode pages listed as (page ``flat``, decode ``acc``, index in its table ``rank``), on CPU.

    Returns a mask of the entries whose page only one decode holds (the plain path takes
    those) and the groups of the others. A shared page is at the same index in every table
    that holds it (its name chains from the first page), so its slots' positions are the
    same for all its holders."""
    holders = torch.bincount(flat)[flat]
    keep = holders == 1
    sh = (~keep).nonzero().squeeze(1)
    order = sh[torch.argsort(flat[sh] * (n + 1) + acc[sh])]  # shared entries by page, holders ascending
    pages, per = torch.unique_consecutive(flat[order], return_counts=True)
    first = torch.cumsum(per, 0) - per
    runs: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # holders -> [(page, rank)]
    held = acc[order].tolist()
    for p, c, a, r in zip(pages.tolist(), per.tolist(), first.tolist(), rank[order[first]].tolist()):
        runs.setdefault(tuple(held[a:a + c]), []).append((p, r))
    by_width: dict[int, list[tuple[tuple[int, ...], list[tuple[int, int]]]]] = {}
    for who, run in runs.items():
        m = 1 << (len(who) - 1).bit_length()  # holders, rounded up to a power of two
        for i in range(0, len(run), SEGMENT_PAGES):
            by_width.setdefault(m, []).append((who, run[i:i + SEGMENT_PAGES]))
    ctx_n = torch.cat([ctx, ctx.new_zeros(1)])
    slot = torch.arange(page_size)
    groups = []
    for m in sorted(by_width):
        segs = by_width[m]
        src = torch.zeros(len(segs), SEGMENT_PAGES, dtype=torch.long)
        rk = torch.full((len(segs), SEGMENT_PAGES), -1, dtype=torch.long)
        hold = torch.full((len(segs), m), n, dtype=torch.long)
        for i, (who, seg) in enumerate(segs):
            # padding repeats the segment's first page: its slots are masked, and its values are
            # the holders' own (a page of another sequence could hold a non-finite leftover: 0 * inf)
            src[i] = seg[0][0]
            src[i, :len(seg)] = torch.tensor([p for p, _ in seg])
            rk[i, :len(seg)] = torch.tensor([r for _, r in seg])
            hold[i, :len(who)] = torch.tensor(who)
        pos = (rk[:, :, None] * page_size + slot).masked_fill_((rk < 0)[:, :, None], _PAD_POS).view(len(segs), -1)
        groups.append(SharedGroup(src.to(device), m, hold.view(-1).to(device), hold.clamp(max=max(n - 1, 0)).view(-1).to(device),
                                  pos.to(device), ctx_n[hold].to(device)))
    return keep, groups


def _slots(cache: torch.Tensor, grp: SharedGroup) -> torch.Tensor:
    """[Ns * kvh, R * ps, D]: the segments' K (or V), each kv head's slots in one row block."""
    Ns, R = grp.src.shape
    _, kvh, ps, D = cache.shape
    # one gather of (page, head) blocks, already in (segment, head, page) order: no transposing copy after it
    return cache.view(-1, ps, D).index_select(0, grp.rows(kvh)).view(Ns * kvh, R * ps, D)


def scores(q: torch.Tensor, kc: torch.Tensor, grp: SharedGroup, window: int | None, scaling: float,
           softcap: float | None = None) -> torch.Tensor:
    """q [n, kvh, g, D] (contiguous) -> [Ns, kvh, m, g, R * ps]: each holder's scores on each
    slot of each segment, (soft-capped and) masked."""
    Ns, m = grp.ctx.shape
    _, kvh, g, D = q.shape
    qp = q.index_select(0, grp.qrow).view(Ns, m, kvh, g, D).transpose(1, 2).reshape(Ns * kvh, m * g, D)
    s = torch.bmm(qp, _slots(kc, grp).transpose(1, 2)).view(Ns, kvh, m, g, -1)
    if softcap is None:
        s.mul_(scaling)
    else:  # as the plain decode path: tanh-capped before the mask
        s = torch.tanh_(s.mul_(scaling / softcap)).mul_(softcap)
    return s.masked_fill_(~grp.mask(window), float("-inf"))


def row_max(s: torch.Tensor) -> torch.Tensor:
    """Scores [Ns, kvh, m, g, slots] -> [Ns * m, kvh, g]: each (segment, holder)'s max, rows as ``acc``."""
    Ns, kvh, m, g, _ = s.shape
    return s.amax(-1).transpose(1, 2).reshape(Ns * m, kvh, g)


def weigh(s: torch.Tensor, mx: torch.Tensor, vc: torch.Tensor, grp: SharedGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and each decode's max ``mx`` [n + 1, kvh, g] -> (sum of exp(s - max) [Ns * m, kvh, g],
    the weighted values [Ns * m, kvh, g, D]), rows as ``acc``, in the dtype of ``s`` (the values
    are multiplied in the cache's). ``s`` is overwritten."""
    Ns, kvh, m, g, slots = s.shape
    e = torch.exp_(s.sub_(mx.index_select(0, grp.acc).view(Ns, m, kvh, g).transpose(1, 2)[..., None]))
    total = e.sum(-1).transpose(1, 2).reshape(Ns * m, kvh, g)
    o = torch.bmm(e.view(Ns * kvh, m * g, slots).to(vc.dtype), _slots(vc, grp)).to(e.dtype)
    return total, o.view(Ns, kvh, m, g, -1).transpose(1, 2).reshape(Ns * m, kvh, g, -1)
