"""Decode attention over KV pages that several decoding sequences share (a cached prefix).

The decode path (worker/attention.py) scores each decode page against the one query of the
sequence it belongs to. A page in the tables of ``c`` decodes (prefix caching shares full
prompt pages) would have to be listed ``c`` times, its K/V gathered ``c`` times over. Here it
is read once and scored against all ``c`` queries in one matmul: pages are grouped by how
many decodes hold them (rounded up to a power of two, so padding at most doubles the
work), and each (page, holder) pair joins the step's segmented softmax as one more
"decode page" of its holder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SharedGroup:
    """Pages held by up to ``m`` decodes each; slot ``j`` of page ``i`` is one holder (or padding)."""

    src: torch.Tensor  # [Np] pool page numbers
    m: int
    acc: torch.Tensor  # [Np * m] the decode of each (page, slot); n_dec for padding
    qrow: torch.Tensor  # [Np * m] query row of each (page, slot)
    pos: torch.Tensor  # [Np, page_size] position of each slot of the page in its holders (a prefix: the same in all)
    ctx: torch.Tensor  # [Np, m] context length of each holder (0 for padding)
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        """[Np, 1, m, 1, ps]: True where a holder attends to the page's slot."""
        b = self._masks.get(window)
        if b is None:
            pos, ctx = self.pos[:, None, :], self.ctx[:, :, None]
            m = pos < ctx
            if window is not None:
                m &= pos > ctx - 1 - window
            b = self._masks[window] = m[:, None, :, None, :]
        return b


def split(flat: torch.Tensor, acc: torch.Tensor, rank: torch.Tensor, ctx: torch.Tensor, n: int, page_size: int,
          device) -> tuple[torch.Tensor, list[SharedGroup]]:
    """Decode pages listed as (page ``flat``, decode ``acc``, index in its table ``rank``), on CPU.

    Returns a mask of the entries whose page only one decode holds (the plain path takes
    those) and the groups of the others."""
    holders = torch.bincount(flat)[flat]
    keep = holders == 1
    sh = (~keep).nonzero().squeeze(1)
    order = sh[torch.argsort(flat[sh], stable=True)]  # shared entries, grouped by page
    pages, per = torch.unique_consecutive(flat[order], return_counts=True)
    slot = torch.arange(len(order)) - torch.repeat_interleave(torch.cumsum(per, 0) - per, per)
    page_of = torch.repeat_interleave(torch.arange(len(pages)), per)
    width = 2 ** torch.ceil(torch.log2(per.double())).long()  # slots per page: holders, rounded up
    ctx_n = torch.cat([ctx, ctx.new_zeros(1)])
    groups = []
    for m in sorted(set(width.tolist())):
        members = (width == m).nonzero().squeeze(1)
        local = torch.full((len(pages),), -1, dtype=torch.long)
        local[members] = torch.arange(len(members))
        ent = width[page_of] == m
        row = local[page_of[ent]]
        accm = torch.full((len(members), m), n, dtype=torch.long)
        accm[row, slot[ent]] = acc[order[ent]]
        rk = torch.zeros(len(members), dtype=torch.long)
        rk[row] = rank[order[ent]]
        pos = rk[:, None] * page_size + torch.arange(page_size)[None, :]
        groups.append(SharedGroup(pages[members].to(device), m, accm.view(-1).to(device),
                                  accm.clamp(max=max(n - 1, 0)).view(-1).to(device), pos.to(device), ctx_n[accm].to(device)))
    return keep, groups


def scores(q: torch.Tensor, kc: torch.Tensor, grp: SharedGroup, window: int | None, scaling: float,
           softcap: float | None = None) -> torch.Tensor:
    """q [n, kvh, g, D] -> [Np * m, kvh, g, ps]: each holder's scores on each page, (soft-capped and) masked."""
    Np, m = grp.ctx.shape
    _, kvh, g, D = q.shape
    ps = kc.shape[2]
    K = kc.index_select(0, grp.src).reshape(Np * kvh, ps, D)
    qp = q.index_select(0, grp.qrow).view(Np, m, kvh, g, D).transpose(1, 2).reshape(Np * kvh, m * g, D)
    s = torch.bmm(qp, K.transpose(1, 2)).view(Np, kvh, m, g, ps)
    if softcap is None:
        s.mul_(scaling)
    else:  # as the plain decode path: tanh-capped before the mask
        s = torch.tanh_(s.mul_(scaling / softcap)).mul_(softcap)
    s.masked_fill_(~grp.mask(window), float("-inf"))
    return s.transpose(1, 2).reshape(Np * m, kvh, g, ps)


def outputs(e: torch.Tensor, vc: torch.Tensor, grp: SharedGroup) -> torch.Tensor:
    """Softmax weights [Np * m, kvh, g, ps] -> weighted values [Np * m, kvh, g, D]."""
    Np, m = grp.ctx.shape
    _, kvh, g, ps = e.shape
    D = vc.shape[-1]
    V = vc.index_select(0, grp.src).reshape(Np * kvh, ps, D)
    w = e.view(Np, m, kvh, g, ps).transpose(1, 2).reshape(Np * kvh, m * g, ps)
    return torch.bmm(w, V).view(Np, kvh, m, g, D).transpose(1, 2).reshape(Np * m, kvh, g, D)
