"""Paged attention, registered in transformers' attention interface.

transformers calls ``paged_attention`` once per layer with this step's queries, keys and
values (RoPE already applied, grouped-query heads not repeated) for every token of the
packed batch. It writes the new K/V into their pages and attends over each sequence's
pages. The step's layout travels in the ``tokenq`` keyword argument (a :class:`StepMeta`),
which ``model(...)`` hands unchanged to every layer.

The packed batch holds decodes first (one query token each), then prefill chunks.
Decodes are attended in one batched call per layer over their pages; prefill chunks, a
few per step, one call each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

NAME = "tokenq_paged"


class StepMeta:
    """Where this step's tokens go in the cache and what each attends to (shared by all layers)."""

    __slots__ = ("k", "v", "write_pages", "write_offs", "n_dec", "dec_pages", "dec_num_pages", "dec_ctx", "dec_valid", "prefills", "_masks")

    def __init__(self, k, v, write_pages, write_offs, n_dec, dec_pages, dec_num_pages, dec_ctx, prefills):
        self.k, self.v = k, v  # [layers, pages, kv_heads, page_size, head_dim]
        self.write_pages, self.write_offs = write_pages, write_offs  # [T] each
        self.n_dec = n_dec
        self.dec_pages = dec_pages  # [n_dec * dec_num_pages] page numbers (padding: page 0, masked)
        self.dec_num_pages = dec_num_pages
        self.dec_ctx = dec_ctx  # [n_dec] context length of each decode, its own token included
        self.prefills = prefills  # [(first row, end row, tokens already cached, page tensor)]
        span = torch.arange(dec_num_pages * k.shape[3], device=k.device)
        self.dec_valid = span[None, :] < dec_ctx[:, None] if n_dec else None  # [n_dec, L]
        self._masks: dict[int | None, torch.Tensor] = {}

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[n_dec, 1, 1, L]: True where a decode may attend (its positions, within the window)."""
        m = self._masks.get(window)
        if m is None:
            m = self.dec_valid
            if window is not None:
                span = torch.arange(m.shape[1], device=m.device)
                m = m & (span[None, :] > self.dec_ctx[:, None] - 1 - window)
            m = self._masks[window] = m[:, None, None, :]
        return m


def _prefill_mask(q_len: int, cached: int, window: int | None, device) -> torch.Tensor | None:
    """[q_len, cached + q_len] causal mask, offset by the cached prefix, with the sliding window."""
    if cached == 0 and window is None:
        return None  # plain causal: SDPA's is_causal
    q_pos = torch.arange(cached, cached + q_len, device=device)[:, None]
    k_pos = torch.arange(cached + q_len, device=device)[None, :]
    m = k_pos <= q_pos
    if window is not None:
        m &= k_pos > q_pos - window
    return m


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, tokenq=None, **kwargs):
    meta: StepMeta = tokenq
    if meta is None:
        raise RuntimeError("tokenq_paged attention runs only inside tokenq's engine (no step metadata was given)")
    layer = module.layer_idx
    kc, vc = meta.k[layer], meta.v[layer]  # [pages, kv_heads, page_size, head_dim]
    _, H, T, D = query.shape
    kvh = key.shape[1]
    g = H // kvh
    # 1. The step's new K/V into their slots (page, offset).
    kc[meta.write_pages, :, meta.write_offs] = key[0].transpose(0, 1)
    vc[meta.write_pages, :, meta.write_offs] = value[0].transpose(0, 1)
    out = query.new_empty(T, H, D)
    q_all = query[0].transpose(0, 1)  # [T, H, D]

    # 2. Decodes: one batched attention over their pages, page by page (no [n, L] copy of
    #    K/V beyond the gathered pages themselves).
    n = meta.n_dec
    if n:
        P, ps = meta.dec_num_pages, kc.shape[2]
        K = kc.index_select(0, meta.dec_pages).view(n, P, kvh, ps, D)
        V = vc.index_select(0, meta.dec_pages).view(n, P, kvh, ps, D)
        q = q_all[:n].reshape(n, 1, kvh, g, D)
        s = torch.matmul(q, K.transpose(-1, -2)).mul_(scaling)  # [n, P, kvh, g, ps]
        s = s.permute(0, 2, 3, 1, 4).reshape(n, kvh, g, P * ps)
        s.masked_fill_(~meta.decode_mask(sliding_window), float("-inf"))
        p = torch.softmax(s, dim=-1).view(n, kvh, g, P, ps).permute(0, 3, 1, 2, 4)
        out[:n] = torch.matmul(p, V).sum(1).reshape(n, H, D)

    # 3. Prefill chunks, each against its cached prefix plus itself.
    for a, b, cached, pages in meta.prefills:
        q = query[:, :, a:b]
        mask = _prefill_mask(b - a, cached, sliding_window, query.device)
        if cached == 0:
            k, v = key[:, :, a:b], value[:, :, a:b]
        else:
            ctx = cached + b - a
            k = kc.index_select(0, pages).transpose(0, 1).reshape(kvh, -1, D)[:, :ctx].unsqueeze(0)
            v = vc.index_select(0, pages).transpose(0, 1).reshape(kvh, -1, D)[:, :ctx].unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def register() -> None:
    """Make ``attn_implementation="tokenq_paged"`` available to transformers (idempotent)."""
    transformers.AttentionInterface.register(NAME, paged_attention)
