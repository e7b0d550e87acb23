"""Paged attention, registered in transformers' attention interface.

transformers calls ``paged_attention`` once per layer with this step's queries, keys and
values (RoPE already applied, grouped-query heads not repeated) for every token of the
packed batch. It writes the new K/V into their pages and attends over each sequence's
pages. The step's layout travels in the ``tokenq`` keyword argument (a :class:`StepMeta`),
which ``model(...)`` hands unchanged to every layer.

The packed batch holds decodes first (one query token each), then prefill chunks.
Decodes are attended together, page by page, reading the pool in place (see
:class:`StepMeta`); prefill chunks, a few per step, one SDPA call each.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools

import torch
import torch.nn.functional as F
import transformers
import transformers.masking_utils

from worker import fallback, gpu_attention, native, shared_pages

NAME = fallback.NAME
# a list while the start-up probe records the attention calls (worker/probe.py)
_recording: contextvars.ContextVar[list | None] = contextvars.ContextVar("tokenq_recording", default=None)


class StepMeta:
    """Where this step's tokens go in the cache and what each attends to (shared by all layers).

    Decode attention works page by page on a list of "decode pages": either the pool's
    pages in the spans ``dec_spans = [(lo, hi), ...]``, one after the other, in place
    (``dec_src`` is None: no copy at all; pages there that belong to no decoding sequence are
    masked out), or the decoding sequences' own pages gathered (``dec_src``: their page
    numbers), whichever touches less memory. For each
    decode page: the decode it belongs to (``dec_acc``; ``n_dec`` for none), and the position
    of each of its slots in that sequence (``dec_pos``). Pages several decodes share (a
    cached prefix) are not among them: ``dec_shared`` holds those, read once for all their
    holders (worker/shared_pages.py).

    With the native kernel (worker/native.py), none of that: ``dec_tables`` holds the decodes'
    block tables, where each starts, and each one's context length, and the kernel walks
    them. Likewise ``pre_tables`` for the native prefill kernel: the prefill chunks' block
    tables, where each starts, each chunk's cached prefix and its length. The GPU kernels
    (worker/gpu_attention.py) take the same from ``dec_gpu`` and ``pre_gpu``, the tables
    padded to one width.
    """

    __slots__ = ("k", "v", "write_pages", "write_offs", "n_dec", "dec_src", "dec_spans", "dec_acc", "dec_qrow", "dec_pos",
                 "dec_ctx", "prefills", "_masks", "dec_shared", "dec_tables", "pre_tables", "dec_gpu", "pre_gpu")

    def __init__(self, k, v, write_pages, write_offs, n_dec, dec_src, dec_spans, dec_acc, dec_pos, dec_ctx, prefills,
                 dec_shared=(), dec_tables=None, pre_tables=None, dec_gpu=None, pre_gpu=None):
        self.k, self.v = k, v  # [layers, pages, kv_heads, page_size, head_dim]
        self.write_pages, self.write_offs = write_pages, write_offs  # [T] each
        self.n_dec = n_dec
        self.dec_src = dec_src  # None (the pool's pages in dec_spans, in place) or [Np] page numbers to gather
        self.dec_spans = dec_spans
        self.dec_acc = dec_acc  # [Np] the decode each page belongs to (n_dec: none)
        self.dec_qrow = dec_acc.clamp(max=max(n_dec - 1, 0)) if n_dec else None  # query row to use for each page
        self.dec_pos = dec_pos  # [Np, page_size] position of each slot in its sequence
        self.dec_ctx = dec_ctx  # [Np] context length of the page's decode, its own token included (0: none)
        self.prefills = prefills  # [(first row, end row, tokens already cached, page tensor)]
        self._masks: dict[tuple, torch.Tensor] = {}
        self.dec_shared = dec_shared  # [shared_pages.SharedGroup]
        self.dec_tables = dec_tables  # None, or (tables, offsets, ctx) for the native kernel
        self.pre_tables = pre_tables  # None, or (tables, offsets, starts, lens) for the native prefill kernel
        self.dec_gpu = dec_gpu  # None, or (tables [n, width], ctx [n]) for the GPU decode kernel (worker/gpu_attention.py)
        self.pre_gpu = pre_gpu  # None, or (tables, starts, lens, rows, work) for the GPU prefill kernel

    def decode_bias(self, window: int | None, kvh: int, dtype: torch.dtype) -> torch.Tensor:
        """[Np * kvh, 1, page_size]: 0 where a decode page's slot is attended, -inf where not."""
        key = (window, kvh, dtype)
        b = self._masks.get(key)
        if b is None:
            ctx = self.dec_ctx[:, None]
            m = self.dec_pos < ctx
            if window is not None:
                m &= self.dec_pos > ctx - 1 - window
            b = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
            b = self._masks[key] = b[:, None, :].expand(-1, kvh, -1).reshape(-1, 1, m.shape[1])
        return b

    def prefill_mask(self, q_len: int, cached: int, window: int | None, device) -> torch.Tensor:
        """A prefill chunk's mask (see _prefill_mask), built once per step for all layers."""
        key = ("prefill", q_len, cached, window)
        m = self._masks.get(key)
        if m is None:
            m = self._masks[key] = _prefill_mask(q_len, cached, window, device)
        return m


def _prefill_mask(q_len: int, cached: int, window: int | None, device) -> torch.Tensor:
    """[q_len, cached + q_len] causal mask, offset by the cached prefix, with the sliding window."""
    q_pos = torch.arange(cached, cached + q_len, device=device)[:, None]
    k_pos = torch.arange(cached + q_len, device=device)[None, :]
    m = k_pos <= q_pos
    if window is not None:
        m &= k_pos > q_pos - window
    return m


def paged_attention(module, query, key, value, attention_mask, **kwargs):
    """The registered function. Inside an engine step (``tokenq`` given) it is paged attention;
    anywhere else the model's previous implementation, so the model stays usable on its own."""
    meta: StepMeta | None = kwargs.pop("tokenq", None) or fallback.step_meta()
    if meta is None:
        return fallback.attention(module)(module, query, key, value, attention_mask, **kwargs)
    calls = _recording.get()
    if calls is not None:  # the engine's start-up probe
        calls.append((module, query.shape, key.shape, value.shape, dict(kwargs)))
    return paged(module.layer_idx, query, key, value, meta, kwargs.get("scaling"), kwargs.get("sliding_window"),
                 kwargs.get("softcap"), kwargs.get("s_aux"))


def paged(layer: int, query, key, value, meta: StepMeta, scaling, window, softcap, sinks):
    """Layer ``layer``'s attention for the step: query [1, H, T, D], key/value [1, kvh, T, D]
    (RoPE applied) -> [1, T, H, D]. Also called by the compiled forward's op (worker/compiled.py)."""
    kc, vc = meta.k[layer], meta.v[layer]  # [pages, kv_heads, page_size, head_dim]
    _, H, T, D = query.shape
    kvh = key.shape[1]
    if scaling is None:
        scaling = D**-0.5
    # 1. The step's new K/V into their slots (page, offset).
    if meta.dec_tables is not None:  # the native kernel's steps
        native.write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), kc, vc, meta.write_pages, meta.write_offs)
    else:
        kc[meta.write_pages, :, meta.write_offs] = key[0].transpose(0, 1)
        vc[meta.write_pages, :, meta.write_offs] = value[0].transpose(0, 1)
    out = query.new_empty(T, H, D)
    q_all = query[0].transpose(0, 1)  # [T, H, D]

    # 2. Decodes: page by page over the decode pages (in place, or gathered when that is
    #    less memory), then a softmax across each sequence's pages (a segmented
    #    log-sum-exp). No K/V copy per sequence, no padding to the longest sequence.
    #    With the native kernel (fast path, CPU): each decode walks its own pages in C++.
    n = meta.n_dec
    if n and meta.dec_tables is not None:
        out[:n] = native.paged_decode(q_all[:n], kc, vc, *meta.dec_tables, scaling, window, softcap, sinks)
    elif n and meta.dec_gpu is not None:  # the engine takes this kernel only where it has no soft-cap or sinks
        gpu_attention.paged_decode(q_all[:n], kc, vc, *meta.dec_gpu, scaling, window, out=out[:n])
    elif n:
        out[:n] = _decode(q_all[:n], kc, vc, meta, window, scaling, softcap, sinks)

    # 3. Prefill chunks, each against its cached prefix plus itself: all in one call to the
    #    native kernel (fast path, AVX-512 or AVX2; it has no soft-cap) or the GPU kernel, else
    #    one SDPA call each.
    if meta.prefills and meta.pre_tables is not None and softcap is None:
        out[n:] = native.paged_prefill(q_all[n:], kc, vc, *meta.pre_tables, scaling, window, sinks)
        return out.unsqueeze(0), None
    if meta.prefills and meta.pre_gpu is not None:  # on CUDA: all chunks in one launch
        gpu_attention.paged_prefill(q_all[n:], kc, vc, *meta.pre_gpu, scaling, window, out=out[n:])
        return out.unsqueeze(0), None
    for a, b, cached, pages in meta.prefills:
        q = query[:, :, a:b]
        if cached == 0:
            k, v = key[:, :, a:b], value[:, :, a:b]
        else:
            ctx = cached + b - a
            k = kc.index_select(0, pages).transpose(0, 1).reshape(kvh, -1, D)[:, :ctx].unsqueeze(0)
            v = vc.index_select(0, pages).transpose(0, 1).reshape(kvh, -1, D)[:, :ctx].unsqueeze(0)
        if softcap is None and sinks is None:
            mask = None if cached == 0 and window is None else meta.prefill_mask(b - a, cached, window, query.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True)
        else:
            o = _prefill_eager(q, k, v, meta.prefill_mask(b - a, cached, window, query.device), scaling, softcap, sinks)
        out[a:b] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    # as transformers' eager paths: half-precision scores go through the softmax in float32
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _prefill_eager(q, k, v, mask, scaling, softcap, sinks) -> torch.Tensor:
    """What SDPA cannot do: scores soft-capped (tanh, before the mask) and/or attention sinks
    (one extra logit per head in the softmax's denominator). q [1, H, L, D], k/v [1, kvh, S, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1, dtype=_softmax_dtype(s.dtype)).to(v.dtype)
    if sinks is not None:
        p = p[..., :-1]
    return torch.matmul(p, v)


def _decode(q, kc, vc, meta: StepMeta, window, scaling, softcap=None, sinks=None) -> torch.Tensor:
    """q [n, H, D] -> [n, H, D]: each decode attends to the slots of its pages up to its position."""
    n, H, D = q.shape
    kvh, ps = kc.shape[1], kc.shape[2]
    g = H // kvh
    if meta.dec_src is None:  # views of the pool: nothing copied
        parts = [(kc[lo:hi].view(-1, ps, D), vc[lo:hi].view(-1, ps, D)) for lo, hi in meta.dec_spans]
    else:
        parts = [(kc.index_select(0, meta.dec_src).view(-1, ps, D), vc.index_select(0, meta.dec_src).view(-1, ps, D))]
    ends = list(itertools.accumulate(K.shape[0] for K, _ in parts))
    rows = [slice(b - K.shape[0], b) for b, (K, _) in zip(ends, parts)]  # each part's rows of the (page, kv head) list
    Np = meta.dec_acc.shape[0]
    acc = meta.dec_acc
    qp = q.reshape(n, kvh, g, D).index_select(0, meta.dec_qrow).view(Np * kvh, g, D)
    bias = meta.decode_bias(window, kvh, q.dtype)
    s = q.new_empty(Np * kvh, g, ps)
    for r, (K, _) in zip(rows, parts):
        if softcap is None:  # scores, scaled and masked in one call: bias + scaling * q k^T
            torch.baddbmm(bias[r], qp[r], K.transpose(1, 2), alpha=scaling, out=s[r])
        else:
            torch.bmm(qp[r], K.transpose(1, 2), out=s[r])
    if softcap is not None:  # soft-capped before the mask
        s = torch.tanh_(s.mul_(scaling / softcap)).mul_(softcap).add_(bias)
    # The softmax in float32 for half-precision scores (as transformers' eager paths do): also
    # faster on CPU, whose bf16 elementwise ops run at a fraction of float32's rate.
    work = _softmax_dtype(s.dtype)
    s = s.view(Np, kvh, g, ps).to(work)
    shared = []
    if meta.dec_shared:
        q4 = q.reshape(n, kvh, g, D).contiguous()  # gathered per holder: a strided gather is several times slower
        shared = [(grp, shared_pages.scores(q4, kc, grp, window, scaling, softcap).to(work)) for grp in meta.dec_shared]
    # softmax over each sequence's slots, across its pages: subtract the sequence's max
    m = s.new_full((n + 1, kvh, g), float("-inf"))
    if sinks is not None:  # a sink is one more logit of each head: in the max and the denominator
        sink = sinks.to(s.dtype).view(1, kvh, g)
        m[:n] = sink
    m.scatter_reduce_(0, acc[:, None, None].expand(Np, kvh, g), s.amax(-1), "amax")
    for grp, s2 in shared:
        m.scatter_reduce_(0, grp.acc[:, None, None].expand(-1, kvh, g), shared_pages.row_max(s2), "amax")
    e = torch.exp_(s.sub_(m.index_select(0, acc)[..., None]))  # pages of no decode: nan, summed into row n
    denom = s.new_zeros((n + 1, kvh, g)).index_add_(0, acc, e.sum(-1))
    if sinks is not None:
        denom[:n] += torch.exp(sink - m[:n])
    ev = e.view(Np * kvh, g, ps).to(kc.dtype)
    o = ev.new_empty(Np * kvh, g, D)
    for r, (_, V) in zip(rows, parts):
        torch.bmm(ev[r], V, out=o[r])
    o = o.view(Np, kvh, g, D)
    num = s.new_zeros((n + 1, kvh, g, D)).index_add_(0, acc, o.to(work))
    for grp, s2 in shared:
        total, o2 = shared_pages.weigh(s2, m, vc, grp)
        denom.index_add_(0, grp.acc, total)
        num.index_add_(0, grp.acc, o2)
    return num[:n].div_(denom[:n, ..., None]).view(n, H, D).to(q.dtype)


@contextlib.contextmanager
def recording():
    """Within the block, every paged attention call appends (module, q/k/v shapes, kwargs)."""
    calls: list = []
    token = _recording.set(calls)
    try:
        yield calls
    finally:
        _recording.reset(token)


def register() -> None:
    """Make ``attn_implementation="tokenq_paged"`` available to transformers (idempotent): the
    attention function, and a mask function that builds the previous implementation's masks
    outside engine steps (inside one, masks are the engine's own: none is built)."""
    transformers.AttentionInterface.register(NAME, paged_attention)
    transformers.masking_utils.AttentionMaskInterface.register(NAME, fallback.mask)
